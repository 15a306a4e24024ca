"""Rule evaluation over a stored run: once (`tripwire check`) or following it live (`tripwire watch`).

The same `RuleEngine` the training process uses, reading through the store.
Rows (worker, mode, step) are evaluated in step order, each exactly once.
"""

from __future__ import annotations

import logging
import time

from .config import load_config
from .rules.engine import RuleEngine
from .store import verdict_name

log = logging.getLogger("tripwire")
FINAL = ("finished", "stopped", "failed", "crashed")


class Evaluator:
    def __init__(self, run, config=None, source: str = "check"):
        self.run = run
        self.config = load_config(config if config is not None else run.info.get("config"))
        self.engine = RuleEngine(self.config.rules, source=source)
        self.done: dict[tuple, int] = {}  # (worker, mode) -> last step evaluated
        self.verdicts: list = []

    def step_rows(self) -> list[tuple[int, str, int]]:
        """(step, mode, worker) rows not evaluated yet, in order."""
        rows = []
        for worker in self.run.workers():
            for mode in self.run.modes():
                last = self.done.get((worker, mode), -1)
                rows += [(s, mode, worker) for s in self.run.steps(mode=mode, worker=worker) if s > last]
        return sorted(rows)

    def evaluate_new(self, on_verdict=None) -> list:
        """Evaluate every new row; returns (and passes to on_verdict) the new verdicts."""
        new = []
        for step, mode, worker in self.step_rows():
            for verdict in self.engine.evaluate(self.run, step, mode, worker):
                new.append(verdict)
                if on_verdict:
                    on_verdict(verdict)
            self.done[(worker, mode)] = step
        self.verdicts += new
        return new

    def idle(self, on_verdict=None) -> list:
        """Judge the clock-based rules against each running worker's time of last capture."""
        if not self.engine.has_idle_rules:
            return []
        out = []
        now = time.time()
        for worker, status in self.run.info["workers"].items():
            if status.get("state") == "running":
                last_data = float(status.get("last_data") or status.get("started") or now)
                out += self.engine.idle(now, last_data, int(status.get("last_step") or 0), int(worker))
        for verdict in out:
            if on_verdict:
                on_verdict(verdict)
        self.verdicts += out
        return out

    def finish(self, on_verdict=None) -> list:
        last = max(self.done.values(), default=0)
        out = self.engine.finish(self.run, last)
        for verdict in out:
            if on_verdict:
                on_verdict(verdict)
        self.verdicts += out
        return out


def check(run, config=None, on_verdict=None) -> list:
    evaluator = Evaluator(run, config, source="check")
    evaluator.evaluate_new(on_verdict)
    evaluator.finish(on_verdict)
    return evaluator.verdicts


def watch(run, config=None, on_verdict=None, poll_s: float = 0.2, idle_timeout_s: float | None = None) -> list:
    """Follow a live run until it ends; store each verdict in the run as it is found.

    Returns when the run's status is final (or, with idle_timeout_s, after that long with nothing new)."""
    evaluator = Evaluator(run, config, source="side_process")

    def store(verdict):
        run.store.put_json(verdict_name(verdict.worker, verdict.step, verdict.rule), verdict.to_dict())
        if on_verdict:
            on_verdict(verdict)

    idle_since = time.monotonic()
    while True:
        status = run.info["status"]  # read before the refresh: nothing written before the end is missed
        if run.refresh() or evaluator.step_rows():
            evaluator.evaluate_new(store)
            idle_since = time.monotonic()
        elif status in FINAL:
            break
        elif idle_timeout_s is not None and time.monotonic() - idle_since > idle_timeout_s:
            log.warning("tripwire: nothing new in %s for %ss; stopping the watch.", run.url, idle_timeout_s)
            break
        else:
            evaluator.idle(store)
            time.sleep(poll_s)
    evaluator.finish(store)
    return evaluator.verdicts
