"""Rule evaluation over a stored run: once (`tripwire check`) or following it live (`tripwire watch`).

The same `RuleEngine` the training process uses, reading through the store.
Rows (worker, mode, step) are evaluated in step order, each exactly once.

The watcher outlives storage hiccups: every read and write of the store is
retried briefly; an outage longer than that is waited out with backoff (a
warning says so) and only after `give_up_s` of failing does it give up
(`StoreUnavailable`, exit 2). It refreshes `watcher/heartbeat.json` in the
run so that the training process can tell that a watcher is attached. It
ends when the run's status is final (finished, stopped, failed), or when
every writer is gone without closing (status crashed or unknown) and
nothing new arrived for `ended_after_s`.
"""

from __future__ import annotations

import logging
import time

from .config import load_config
from .errors import StoreUnavailable, TripwireError
from .naming import collection_of
from .rules.engine import RuleEngine
from .store import FINAL_STATES, sealed_json, verdict_key_of, verdict_name
from .watcher import Heartbeat, heartbeat_every

log = logging.getLogger("tripwire")
GONE = ("crashed", "unknown")  # a writer vanished without closing: ended once nothing new arrives for a while


class Evaluator:
    def __init__(self, run, config=None, source: str = "check", trust_run: bool = False):
        """config: the user's own rule config; None evaluates the config stored with the run, whose custom rules
        are imported only with `trust_run` (a run this user wrote: the watcher a training process spawns)."""
        self.run = run
        if config is None:
            self.config = load_config(_without_actions(run.info.get("config")), imports=trust_run)
            if self.config.left_out:
                log.warning("tripwire: the run's config names custom rules that are not evaluated here: %s. Code a "
                            "run names is not imported; pass your own rule file with --config, or --trust-run for "
                            "a run you wrote yourself.", ", ".join(self.config.left_out))
        else:
            self.config = load_config(config)
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

    def evaluate_new(self, on_verdict=None, tick=None) -> list:
        """Evaluate every new row; returns (and passes to on_verdict) the new verdicts. `tick()` is called
        after each row (the watcher keeps its heartbeat through a long backlog)."""
        new = []
        for step, mode, worker in self.step_rows():
            # As in training, a rule is judged only at the steps that hold some of the collections it reads: a
            # rule that reads gradients is not asked about a step that stored only the loss.
            captured = {collection_of(name) for name in self.run.tensor_names(step=step, mode=mode, worker=worker)}
            for verdict in self.engine.evaluate(self.run, step, mode, worker, captured):
                new.append(verdict)
                self.verdicts.append(verdict)  # kept even if a later row fails on a storage error
                if on_verdict:
                    on_verdict(verdict)
            self.done[(worker, mode)] = step
            if tick:
                tick()
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


def _without_actions(config: dict | None) -> dict | None:
    """A stored config without its actions: the training process acts on verdicts, never check or watch, so
    nothing they name (e.g. a `call:` module) has to be importable here."""
    if not isinstance(config, dict) or not isinstance(config.get("rules"), list):
        return config
    return {**config, "rules": [{**r, "actions": []} if isinstance(r, dict) else r for r in config["rules"]]}


def check(run, config=None, on_verdict=None, trust_run: bool = False) -> list:
    evaluator = Evaluator(run, config, source="check", trust_run=trust_run)
    evaluator.evaluate_new(on_verdict)
    evaluator.finish(on_verdict)
    return evaluator.verdicts


class RetryingStore:
    """The watcher's access to the store: a failing call is retried a few times within a second, then raised
    as `StoreUnavailable` (which the watcher waits out). A missing object is an answer, not a failure."""

    DELAYS_S = (0.05, 0.2, 0.5)

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):  # url, fs, url_of, …
        return getattr(self._store, name)

    def _call(self, method: str, *args):
        for delay in (*self.DELAYS_S, None):
            try:
                return getattr(self._store, method)(*args)
            except (FileNotFoundError, TripwireError):
                raise
            except Exception as exc:  # noqa: BLE001 - any other failure of the store is treated as transient
                if delay is None:
                    raise StoreUnavailable(f"{self._store.url}: {method} failed: {type(exc).__name__}: {exc}") \
                        from exc
                time.sleep(delay)

    def get(self, rel, start=None, end=None) -> bytes:
        return self._call("get", rel, start, end)

    def list(self, folder) -> dict:
        return self._call("list", folder)

    def exists(self, rel) -> bool:
        return self._call("exists", rel)

    def put(self, rel, data) -> None:
        self._call("put", rel, data)

    def get_json(self, rel, required: bool = False):
        return self._call("get_json", rel, required)

    def put_json(self, rel, obj) -> None:
        self._call("put_json", rel, obj)

    def create(self, rel, data) -> bool:
        return self._call("create", rel, data)


def watch(run, config=None, on_verdict=None, poll_s: float = 0.2, idle_timeout_s: float | None = None,
          give_up_s: float = 300.0, ended_after_s: float = 30.0, trust_run: bool = False) -> list:
    """Follow a live run until it ends; store each verdict in the run as it is found.

    Returns when the run's status is final; when every writer is gone without closing (crashed, unknown)
    and nothing new arrived for `ended_after_s`; or, with idle_timeout_s, after that long with nothing new.
    Storage errors are retried with backoff; after `give_up_s` of nothing but errors it raises
    `StoreUnavailable`. config and trust_run: as for `Evaluator`."""
    run.store = store = RetryingStore(run.store)
    pending: list[tuple[str, bytes]] = []  # verdicts found but not stored yet (the store may be down)
    stored: set[str] = set()  # Verdict.key of those the run holds: found again (a restarted watcher), not stored
    evaluator = beat = None

    def keep(verdict):
        if verdict.key not in stored:
            stored.add(verdict.key)
            pending.append((verdict_name(verdict), sealed_json(verdict.to_dict())))
        if on_verdict:
            on_verdict(verdict)

    def store_pending():
        while pending:
            store.create(*pending[0])
            pending.pop(0)

    outage_since = None
    backoff = poll_s
    idle_since = time.monotonic()
    gone_since = None
    try:
        while True:
            try:
                if evaluator is None:
                    stored.update(key for key in map(verdict_key_of, store.list("verdicts")) if key)
                    evaluator = Evaluator(run, config, source="side_process", trust_run=trust_run)
                    beat = Heartbeat(store._store, heartbeat_every(run.info.get("config")))
                beat.tick()
                store_pending()
                status = run.info["status"]  # read before the refresh: nothing written before the end is missed
                fresh = bool(run.refresh() or evaluator.step_rows())
                if fresh:
                    evaluator.evaluate_new(keep, beat.tick)
                    store_pending()
                    idle_since = time.monotonic()
                    gone_since = None
                    ended = False
                else:
                    ended = _ended(run, status, idle_since, gone_since, idle_timeout_s, ended_after_s)
                    gone_since = (gone_since or time.monotonic()) if status in GONE else None
                    if not ended:
                        evaluator.idle(keep)
                        store_pending()
            except (StoreUnavailable, OSError) as exc:
                now = time.monotonic()
                if outage_since is None:
                    outage_since = now
                    log.warning("tripwire watch: the store of %s fails (%s); retrying, for up to %gs.", run.url,
                                exc, give_up_s)
                elif now - outage_since > give_up_s:
                    raise StoreUnavailable(f"gave up on {run.url} after {give_up_s:g}s of storage errors; last: "
                                           f"{exc}. Rerun `tripwire watch` once the store answers again; it "
                                           "evaluates the run from the start.") from exc
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            if outage_since is not None:
                log.warning("tripwire watch: the store of %s answers again after %.1fs.", run.url,
                            time.monotonic() - outage_since)
                outage_since, backoff = None, poll_s
            if ended:
                break
            if not fresh:
                time.sleep(poll_s)
        evaluator.finish(keep)  # no_data verdicts: judged from what was read, no I/O
        while pending:  # stored through the same retries
            try:
                store_pending()
            except (StoreUnavailable, OSError) as exc:
                outage_since = outage_since or time.monotonic()
                if time.monotonic() - outage_since > give_up_s:
                    raise StoreUnavailable(f"could not store the last verdicts in {run.url}: {exc}") from exc
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
    finally:
        if beat is not None:
            beat.tick("exited")
    return evaluator.verdicts


def _ended(run, status, idle_since, gone_since, idle_timeout_s, ended_after_s) -> bool:
    now = time.monotonic()
    if status in FINAL_STATES:
        return True
    if status in GONE and gone_since is not None and now - max(gone_since, idle_since) >= ended_after_s:
        log.warning("tripwire watch: %s is %s (its writers are gone without closing the run) and nothing new "
                    "arrived for %gs; treating it as ended.", run.url, status, ended_after_s)
        return True
    if idle_timeout_s is not None and now - idle_since > idle_timeout_s:
        log.warning("tripwire: nothing new in %s for %ss; stopping the watch.", run.url, idle_timeout_s)
        return True
    return False
