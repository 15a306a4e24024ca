"""The recorder: what a plugin talks to. One per training process (worker).

A plugin asks `recorder.plan.at(mode, step)` whether anything is sampled, and
if so gathers and reduces the tensors and calls `record()`. The recorder
queues the sample for the writer thread, evaluates the rules in-process (or,
with `evaluation.where: side_process`, picks up the watcher's verdicts), runs
the actions it can run itself, and hands back a `Decision` for the rest.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time

from .. import __version__
from .actions import Decision, apply
from .config import Config, load_config
from .history import History
from .model import ModelInfo
from .naming import collection_of
from .rules.engine import RuleEngine
from .store import FORMAT_VERSION, MANIFEST, SHARD_RE, Store, new_run_id, output_url
from .verdict import Verdict
from .watcher import WatcherLink
from .writer import Sample, Writer

log = logging.getLogger("tripwire")


def make_run_url(config: Config, out_dir=None) -> str:
    """Where a new run goes: `out_dir` if given, else the config's `output` with a fresh {run_id}."""
    return output_url(str(out_dir) if out_dir is not None else config.output, new_run_id()).rstrip("/")


def prepare_storage(config: Config, out_dir=None, storage_options: dict | None = None) -> None:
    """Import fsspec and make the run's filesystem now, when a callback is made: the first time costs tens of
    milliseconds (more where Python compiles fsspec from source), which training would otherwise pay when it
    starts. Best effort: a URL that cannot be opened fails where it always did, when the run opens."""
    import fsspec

    try:
        fsspec.core.url_to_fs(str(out_dir) if out_dir is not None else config.output,
                              **{**config.storage_options, **(storage_options or {})})
    except Exception:  # noqa: BLE001 - reported by the Recorder when training starts
        pass


class Recorder:
    def __init__(self, config=None, *, run_url: str, framework: str, framework_version: str = "", worker: int = 0,
                 world_size: int = 1, storage_options: dict | None = None, info: dict | None = None,
                 provides: set | None = None, model: ModelInfo | None = None):
        """provides: the collections the plugin can capture, if not all; rules needing others are left out.
        model: the model's structure, stored in the run's manifest and read by the rules."""
        self.config = load_config(config)
        if provides is not None:
            self.config = _applicable(self.config, provides, framework)
        self.plan = self.config.plan()
        self.run_url, self.worker, self.world_size = run_url, worker, world_size
        self.framework, self.framework_version = framework, framework_version
        self.storage_options = {**self.config.storage_options, **(storage_options or {})}
        self.info = {**(info or {}), **({"model": model.to_dict()} if model is not None else {})}
        in_process = self.config.evaluation.where == "in_process"
        self.engine = RuleEngine(self.config.rules) if in_process else None  # None: the side process evaluates
        self.history = History(self.engine.history, self.engine.tensor_history) if in_process else None
        if self.history is not None:
            self.history.model = model
        self.verdicts: list[Verdict] = []
        self.store: Store | None = None
        self.writer: Writer | None = None
        self.last_step: int | None = None
        self._last_data: float | None = None
        self._actions = {spec.id: spec.actions for spec in self.config.rules}
        # a rule judges the time since the last step (stalled_training, here or in the side process): the plugin
        # calls `alive()` at every step
        self.clock = any(spec.create().idle for spec in self.config.rules)
        self._inbox: list[Verdict] = []
        self._inbox_lock = threading.Lock()
        self._seen_verdicts: set[str] | None = None
        self._watcher: WatcherLink | None = None  # side_process, worker 0: the link to `tripwire watch`
        self._html_report = None  # report_html.BackgroundReport, once the `report` action ran
        self._tensorboard = None  # export.TensorBoardSink, with `tensorboard: {dir}`

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Open the run (create it, or append to it when resuming) and start the writer thread."""
        if self.writer is not None:
            return
        self.store = Store(self.run_url, self.storage_options)
        if self.worker == 0 and not self.store.exists(MANIFEST):
            self.store.put_json(MANIFEST, {
                "format_version": FORMAT_VERSION, "run_id": self.run_url.rsplit("/", 1)[-1],
                "framework": self.framework, "framework_version": self.framework_version,
                "tripwire_version": __version__, "created": time.time(), "world_size": self.world_size,
                "config": self.config.to_dict(), **self.info})
        seqs = [int(m.group(2)) for m in map(SHARD_RE.match, self.store.list("shards"))
                if m and int(m.group(1)) == self.worker]
        side = self.config.evaluation.where == "side_process"
        ticks = side or self.engine.has_idle_rules
        if side and self.worker == 0:
            self._watcher = WatcherLink(self.store, self.run_url, self.config.evaluation.watcher_timeout_s)
        self.writer = Writer(self.store, self.worker, self.config.writer, first_seq=max(seqs, default=-1) + 1,
                             poll=self._tick if ticks else None, poll_s=self.config.evaluation.poll_s,
                             status={"world_size": self.world_size})
        if self._watcher is not None and self.config.evaluation.spawn:
            self._watcher.spawn(self.storage_options)
        if self.config.tensorboard.get("dir"):
            from .export import TensorBoardSink

            self._tensorboard = TensorBoardSink(self.config.tensorboard["dir"], self.run_url, self.worker,
                                                self.verdicts)

    def finish(self, state: str = "finished") -> None:
        """Final verdicts (no_data), the last shard, the index, the final status; then the report if asked for."""
        if self.writer is None:
            return
        if self.engine is not None:
            for verdict in self.engine.finish(self.history, self.last_step or 0, self.worker):
                self.verdicts.append(verdict)
                self.writer.put_verdict(verdict)
                log.warning("tripwire: %s", verdict.describe(with_hint=False))
        try:
            self.writer.close(state)
        finally:
            self.writer = None
            if self._watcher is not None:
                self._watcher.stop()
            if self._tensorboard is not None:
                self._tensorboard.close()
        if any(a.name == "report" for actions in self._actions.values() for a in actions):
            self.write_report()  # after the close: the final report sees everything stored
        if self._html_report is not None:
            self._html_report.wait()

    # -- per step -------------------------------------------------------------------------------------------------
    def alive(self) -> None:
        """A training step ran: steps between samples count as progress for the rules judged by the clock, so a
        run whose samples are an hour apart is not stalled."""
        self._last_data = time.time()
        if self.writer is not None:
            self.writer.alive_at = self._last_data

    def record(self, step: int, mode: str, values: dict, tensors: dict | None = None) -> Decision:
        """Store one sample ({name: {reduction: float}}, {name: array}) and evaluate the rules on it."""
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        self._last_data = time.time()
        self.writer.put(Sample(step, mode, values, tensors or {}))
        if self._tensorboard is not None:
            self._tensorboard.put(step, mode, values, tensors)
        decision = self.poll()
        if self.engine is None or not self.engine.slots:  # no rules: nothing would read the history
            return decision
        self.history.add(self.worker, mode, step, values, tensors)
        captured = {collection_of(name) for name in values} | {collection_of(name) for name in tensors or ()}
        for verdict in self.engine.evaluate(self.history, step, mode, self.worker, captured):
            self.verdicts.append(verdict)
            self.writer.put_verdict(verdict)
            decision.merge(self._act(verdict))
        return decision

    def poll(self) -> Decision:
        """Actions for verdicts the side process wrote since the last call (cheap: no I/O here)."""
        decision = Decision()
        if not self._inbox:
            if self._watcher is not None:
                self._watcher.check_spawned()
            return decision
        with self._inbox_lock:
            verdicts, self._inbox = self._inbox, []
        for verdict in verdicts:
            self.verdicts.append(verdict)
            decision.merge(self._act(verdict))
        return decision

    def checkpoint_url(self, verdict: Verdict, suffix: str) -> str:
        safe = "".join(c if c.isalnum() or c in "_.-" else "_" for c in verdict.rule)
        return self.store.url_of(f"checkpoints/{safe}-step{verdict.step}-worker{verdict.worker}{suffix}")

    def write_report(self) -> None:
        """report.json now; report.html in a background thread (drawing it takes seconds), on worker 0 only."""
        from .report import write_json_report

        try:
            write_json_report(self.store, self.verdicts)
        except Exception as exc:  # noqa: BLE001 - a report must not stop training
            log.warning("tripwire: could not write the report: %s", exc)
        if self.worker == 0:
            from .report_html import BackgroundReport

            self._html_report = self._html_report or BackgroundReport(self.store)
            self._html_report.request(self.verdicts)

    # -- internals ------------------------------------------------------------------------------------------------
    def _act(self, verdict: Verdict) -> Decision:
        if not verdict.fired:
            log.warning("tripwire: %s", verdict.describe(with_hint=False))
            return Decision(verdicts=[verdict])
        return apply(verdict, self._actions.get(verdict.rule, ()), self.write_report)

    def _tick(self) -> None:
        """Writer thread, every poll_s: pick up the watcher's verdicts, or judge the clock-based rules."""
        if self.engine is None:
            self._poll_store()
            if self._watcher is not None:
                self._watcher.check_heartbeat()
        elif self._last_data is not None:
            for verdict in self.engine.idle(time.time(), self._last_data, self.last_step or 0, self.worker):
                self.writer.put_verdict(verdict)
                with self._inbox_lock:
                    self._inbox.append(verdict)

    def _poll_store(self) -> None:
        """Writer thread: read verdicts the watcher stored that this process has not seen. Each worker takes
        only the verdicts about its own data (the name starts with the worker): under `workers: all` a
        verdict's `call` and `checkpoint` actions run once, on its rank, and `stop`/`raise` reach the
        other ranks through the plugin's collective decision."""
        mine = f"{self.worker:05d}-"
        names = {n for n in self.store.list("verdicts") if n.startswith(mine)}
        if self._seen_verdicts is None:  # what was there before this process started is not news
            self._seen_verdicts = set(names)
            return
        fresh = sorted(names - self._seen_verdicts)
        for name in fresh:
            try:
                verdict = Verdict.from_dict(json.loads(self.store.get(f"verdicts/{name}")))
            except (OSError, ValueError, TypeError):
                continue  # not complete yet or not ours; looked at again next time
            self._seen_verdicts.add(name)
            with self._inbox_lock:
                self._inbox.append(verdict)


def _applicable(config: Config, provides: set, framework: str) -> Config:
    """The config without the rules that need data this framework never has (the default rules.yaml carries
    neural-network rules an XGBoost run cannot feed); said once, as a warning where the user chose them."""
    kept, left = [], []
    for spec in config.rules:
        needs = spec.create().needs()
        anything = "*" in needs  # a rule over every captured collection applies to whatever is captured
        (kept if anything or needs <= provides else left).append((spec, needs - provides - {"*"}))
    if left:
        chosen = not config.source.endswith("(packaged default)")
        log.log(logging.WARNING if chosen else logging.INFO,
                "tripwire: %s capture no %s, so these rules are not evaluated: %s.", framework,
                ", ".join(sorted(set().union(*(m for _, m in left)))), ", ".join(s.id for s, _ in left))
    return dataclasses.replace(config, rules=tuple(s for s, _ in kept))
