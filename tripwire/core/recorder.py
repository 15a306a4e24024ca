"""The recorder: what a plugin talks to. One per training process (worker).

A plugin asks `recorder.plan.at(mode, step)` whether anything is sampled, and
if so gathers and reduces the tensors and calls `record()`. The recorder
queues the sample for the writer thread, evaluates the rules in-process (or,
with `evaluation.where: side_process`, picks up the watcher's verdicts), runs
the actions it can run itself, and hands back a `Decision` for the rest.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import sys
import threading
import time

from .. import __version__
from .actions import Decision, apply
from .config import Config, load_config
from .console import show_on_console
from .diagnosis import explained_by, summary
from .history import History
from .model import ModelInfo
from .naming import collection_of
from .rules.engine import RuleEngine
from .sample import Sample, TensorBudget
from .store import (FORMAT_VERSION, MANIFEST, Store, check_run_url, first_step_name, new_run_id, output_url,
                    sealed_json)
from .verdict import Verdict
from .watcher import WatcherLink
from .writer import Writer

log = logging.getLogger("tripwire")
OPEN_WAIT_S = 3.0  # how long starting waits for the run to open before training goes on without waiting
MAX_RUNS_BESIDE = 10_000  # out_dir-1 … out_dir-N: the runs a fixed out_dir can hold side by side
# the recorders started and not finished, closed at exit; held here, as a plugin dropped after its training
# raised (a Keras callback made in the call to fit) leaves its writer holding what it did not flush
_OPEN: set = set()


@atexit.register
def _close_at_exit() -> None:
    """Close every run still open as the interpreter exits, so that nothing it captured is lost: the writer thread
    is a daemon, and what it holds since its last flush (up to `writer.flush_every_s`, often the steps just before
    an error) would die with it. A run is still open where its training raised past a framework that runs no hook
    after an exception (Keras' fit, xgb.train) or a probe was never closed. Closed as `stopped` where a verdict's
    `raise` ends the process, `failed` where another exception does, else as the plugin says
    (`Recorder.exit_state`)."""
    from .errors import RuleFired

    ending = getattr(sys, "last_value", None)  # set by the interpreter for the exception it is exiting on
    for recorder in [r for r in _OPEN if r.pid == os.getpid()]:  # a forked child's copies are its parent's
        state = "stopped" if isinstance(ending, RuleFired) else "failed" if ending is not None else \
            recorder.exit_state
        log.warning("tripwire: the run at %s was still open as Python exited; closed as %s.", recorder.run_url,
                    state)
        try:
            recorder.finish(state)
        except Exception as exc:  # noqa: BLE001 - the exit must go on
            log.warning("tripwire: could not close the run at %s: %s: %s", recorder.run_url, type(exc).__name__, exc)


def make_run_url(config: Config, out_dir=None) -> str:
    """Where a new run goes: `out_dir` if given, else the config's `output` with a fresh {run_id}; ValueError for
    one that names no folder of its own (check_run_url)."""
    return check_run_url(output_url(str(out_dir) if out_dir is not None else config.output, new_run_id())).rstrip("/")


def prepare_storage(config: Config, out_dir=None, storage_options: dict | None = None) -> None:
    """When a callback is made: refuse an `out_dir` (or `output`) that names no folder of its own (ValueError),
    then import fsspec and make the run's filesystem now: the first time costs tens of milliseconds (more where
    Python compiles fsspec from source), which training would otherwise pay when it starts. Best effort: a URL
    that cannot be opened fails where it always did, when the run opens."""
    import fsspec

    make_run_url(config, out_dir)
    try:
        fsspec.core.url_to_fs(str(out_dir) if out_dir is not None else config.output,
                              **{**config.storage_options, **(storage_options or {})})
    except Exception:  # noqa: BLE001 - reported by the Recorder when training starts
        pass


class Recorder:
    def __init__(self, config=None, *, run_url: str, framework: str, framework_version: str = "", worker: int = 0,
                 world_size: int = 1, storage_options: dict | None = None, info: dict | None = None,
                 provides: set | None = None, model: ModelInfo | None = None, append: bool = False):
        """provides: the collections the plugin can capture, if not all; rules needing others are left out.
        model: the model's structure, stored in the run's manifest and read by the rules.
        append: add to the run at run_url (a resumed training); else worker 0 makes a new run there, or beside it
        (run_url-1, -2, …) where one is already, and `run_url` says which once `start()` returned."""
        self.config = load_config(config)
        if provides is not None:
            self.config = _applicable(self.config, provides, framework)
        self.plan = self.config.plan()
        self.run_url, self.worker, self.world_size, self.append = run_url, worker, world_size, append
        self.framework, self.framework_version = framework, framework_version
        self.storage_options = {**self.config.storage_options, **(storage_options or {})}
        self.info = {**(info or {}), **({"model": model.to_dict()} if model is not None else {})}
        in_process = self.config.evaluation.where == "in_process"
        # None: the side process evaluates
        self.engine = RuleEngine(self.config.rules, budget=self.config.evaluation.rule_budget) if in_process else None
        self.history = History(self.engine.history, self.engine.tensor_history,
                               self.engine.tensor_collections) if in_process else None
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
        self._report = None  # report.BackgroundReport, once the `report` action ran
        self._budget: TensorBudget | None = None  # of the step being captured
        self._tensorboard = None  # export.TensorBoardSink, with `tensorboard: {dir}`
        self.sinks: list = []  # the user's loggers that verdicts also go to (core.sinks)
        self._nonfinite_loss = False  # check_loss recorded a NaN/Inf loss already
        # rules that judge a series at every step (loss_spike: the training loss; gradient_spike: the gradient
        # norm): fed in step order, here in the training process wherever the rules are evaluated; what they find
        # is recorded as a sample of its own
        self._streams = [(spec.id, rule.streamed, stream) for spec in self.config.rules
                         if (stream := (rule := spec.create()).stream()) is not None]
        self.streamed = {series for _, series, _ in self._streams}  # the series a plugin computes for them alone
        self._handed: set = set()  # (collection, mode) of the series handed over at every step (scalars): captured
        self._held: Decision | None = None  # actions on what they found between the plugin's calls, for poll()
        self._streaming = False  # recording what one found
        self._objective_starts: list = []  # the steps from which another objective is trained (new_objective)
        self._stopping = False  # a verdict stopped training: later ones (its last validation) only log
        # the state a run still open at the interpreter's exit is closed in, unless an exception ends the process
        # (_close_at_exit): a plugin whose training call returns through its end hook is open there only after an
        # exception it did not see (Keras' fit, xgb.train)
        self.exit_state = "failed"
        self.pid: int | None = None  # the process that started it

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the writer thread, which opens the run (creates it, or appends to it when resuming): storage
        that is missing, failing or slow never holds training up for more than OPEN_WAIT_S, nor raises."""
        if self.writer is not None:
            return
        _OPEN.add(self)
        self.pid = os.getpid()
        show_on_console()
        self.store = Store(self.run_url, self.storage_options)
        side = self.config.evaluation.where == "side_process"
        ticks = side or self.engine.has_idle_rules
        self.writer = Writer(self.store, self.worker, self.config.writer, opening=self._claim,
                             poll=self._tick if ticks else None, poll_s=self.config.evaluation.poll_s,
                             status={"world_size": self.world_size})
        self.writer.tried.wait(OPEN_WAIT_S)  # storage that refuses at once has said so (the writer warns)
        if not self.writer.opened.is_set() and self.writer.error is None:
            log.warning("tripwire: storage at %s has not answered within %gs; training starts, and what it captures "
                        "waits (within writer.max_queue_mb) until storage answers.", self.run_url, OPEN_WAIT_S)
        if self.config.loggers:
            from .sinks import active_mlflow_sink

            self.add_sinks([active_mlflow_sink()])
        if self.config.tensorboard.get("dir"):
            from .export import TensorBoardSink

            self._tensorboard = TensorBoardSink(self.config.tensorboard["dir"], self.run_url, self.worker,
                                                self.verdicts)

    def _claim(self) -> Store:
        """Writer thread, before anything is written: make the run this training writes (worker 0), or find the
        one it appends to. A fixed out_dir that already holds a run gets a new run beside it, never a merge;
        the claim is exclusive on a local disk, so two trainings started at once get two runs."""
        store = self.store
        if self.worker == 0 and not self.append:
            base = store.url
            for n in range(MAX_RUNS_BESIDE):
                if n:
                    store = Store(f"{base}-{n}", self.storage_options)
                if store.create(MANIFEST, self._manifest(store.url)):
                    break
            else:
                raise FileExistsError(f"{base} and {MAX_RUNS_BESIDE - 1} runs beside it exist already")
            if n:
                log.warning("tripwire: %s holds a run already; this training is stored beside it, in %s (to add "
                            "to that run instead, pass append=True).", base, store.url)
        elif self.worker == 0 and not store.exists(MANIFEST):  # appending to a run that is not there (yet)
            store.put(MANIFEST, self._manifest(store.url))
        self.store, self.run_url = store, store.url
        if self.config.evaluation.where == "side_process" and self.worker == 0:
            self._watcher = WatcherLink(store, self.run_url, self.config.evaluation.watcher_timeout_s)
            if self.config.evaluation.spawn:
                self._watcher.spawn(self.storage_options)
        return store

    def _manifest(self, url: str) -> bytes:
        return sealed_json({
            "format_version": FORMAT_VERSION, "run_id": url.rsplit("/", 1)[-1], "framework": self.framework,
            "framework_version": self.framework_version, "tripwire_version": __version__, "created": time.time(),
            "world_size": self.world_size, "config": self.config.to_dict(), **self.info})

    def finish(self, state: str = "finished") -> None:
        """Final verdicts (no_data), the last shard, the index, the final status; then the report if asked for."""
        _OPEN.discard(self)
        if self.writer is None:
            return
        if self.engine is not None:
            for verdict in self.engine.finish(self.history, self.last_step or 0, self.worker, self._handed):
                self.verdicts.append(verdict)
                self.writer.put_verdict(verdict)
                if verdict.status == "error":
                    log.warning("tripwire: %s", verdict.describe(with_hint=False))
        self._log_summary()
        writer = self.writer
        try:
            closed = writer.close(state)
        finally:
            self.writer = None
            if self._watcher is not None:
                self._watcher.stop()
            if self._tensorboard is not None:
                self._tensorboard.close(self.config.writer.close_timeout_s)
        if not closed or not writer.opened.is_set():
            self._close_sinks(state, with_report=False)
            return  # storage did not answer in time: no report either, the process must not wait on it
        if any(a.name == "report" for actions in self._actions.values() for a in actions):
            self.write_report()  # after the close: the final report sees everything stored
        if self._report is not None:
            self._report.wait(self.config.writer.close_timeout_s)
        self._close_sinks(state)

    def add_sinks(self, sinks) -> None:
        """Loggers of the user's that verdicts also go to (core.sinks): told of the run now, of each fired verdict,
        and of the end. None of them where the config says `loggers: false`."""
        if self.config.loggers:
            for sink in (s for s in sinks if s is not None):
                self.sinks.append(sink)
                self._tell([sink], lambda it: it.start(self.run_url))

    def _tell(self, sinks, call) -> None:
        """Tell these sinks something; one that fails is said once and dropped."""
        for sink in list(sinks):
            try:
                call(sink)
            except Exception as exc:  # noqa: BLE001 - a logger never hurts training
                log.warning("tripwire: %s does not take tripwire's verdicts (%s: %s); they stay in the log and the "
                            "run.", sink.name, type(exc).__name__, exc)
                if sink in self.sinks:
                    self.sinks.remove(sink)

    def _close_sinks(self, state: str, with_report: bool = True) -> None:
        if not self.sinks:
            return
        from .sinks import local_report

        report = local_report(self.store) if with_report and self.worker == 0 else None
        text = summary(self.verdicts)
        self._tell(self.sinks, lambda sink: sink.close(self.run_url, state, text, report))

    def _log_summary(self) -> None:
        """At the end of training, one block per diagnosis (WARNING); or one line that says what was checked, that
        nothing fired, and which rules never had the data they judge (INFO)."""
        fired = [v for v in self.verdicts if v.fired]
        if any(v.counts for v in fired):
            log.warning("tripwire: %s at step %s of %s:\n%s", "training ended" if self.engine is not None else
                        "the watcher's verdicts", self.last_step, self.run_url, summary(self.verdicts))
        elif self.engine is not None and self.engine.slots and self.last_step is None:
            log.info("tripwire: %d rule(s) had nothing to check in %s: this training recorded no step of anything "
                     "the config captures.", len(self.engine.slots), self.run_url)
        elif self.engine is not None and self.engine.slots:
            idle = sorted({v.rule for v in self.verdicts if v.status == "no_data"})
            log.info("tripwire: %d rule(s) checked %s up to step %s; no warning or error%s%s.",
                     len(self.engine.slots), self.run_url, self.last_step,
                     f" ({len(fired)} at info)" if fired else "",
                     f"; without the data they judge: {', '.join(idle)}" if idle else "")

    # -- per step -------------------------------------------------------------------------------------------------
    def alive(self) -> None:
        """A training step ran: steps between samples count as progress for the rules judged by the clock, so a
        run whose samples are an hour apart is not stalled."""
        self._last_data = time.time()
        if self.writer is not None:
            self.writer.alive_at = self._last_data

    def tensor_budget(self) -> TensorBudget:
        """What the plugin may copy of the full tensors of the step it begins capturing (see TensorBudget)."""
        self._budget = TensorBudget(self.writer.room() if self.writer is not None else 0)
        return self._budget

    def record(self, step: int, mode: str, values: dict, tensors: dict | None = None,
               loss: float | None = None) -> Decision:
        """Store one sample ({name: {reduction: float}}, {name: array}) and evaluate the rules on it.

        loss: the step's training loss, where the sample does not hold it (a step sampled for other collections):
        a NaN or Inf one joins the sample, as an unsampled step's does (check_loss); a finite one is stored
        beside it, not judged, as the loss of the steps between samples is (scalars)."""
        if loss is not None and "losses/train" not in values:
            value = self._first_nonfinite(loss)
            if value is not None:
                values = {**values, "losses/train": {"value": value}}
            else:
                self._store_loss(step, mode, loss)
        elif mode == "train" and not self._streaming:
            self._stream(step, values)
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        self._last_data = time.time()
        if self._budget is not None and self._budget.left_out:
            self.writer.left_out(step, self._budget.left_out, self._budget.asked)
        self._budget = None
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

    def scalars(self, step: int, mode: str, values: dict) -> None:
        """Scalars the framework hands over at a step whether or not it is sampled ({name: {"value": float}}: a
        loss Keras logs, the loss a Lightning step returned): stored in their series, so that a series has every
        step, but as no row of the run (run.steps() lists the sampled steps) and not judged, so that the rules
        read what their thresholds were set on, the sampled steps, here, in the side process and offline alike
        (View.at). One queued sample, no I/O, no rule."""
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        if self.writer is None or not values:
            return
        self.writer.put(Sample(step, mode, values, row=False))
        self._handed.update((collection_of(name), mode) for name in values)
        if mode == "train":
            self._stream(step, values)
        if self._tensorboard is not None:
            self._tensorboard.put(step, mode, values, None)

    def _store_loss(self, step: int, mode: str, loss) -> None:
        """A finite loss of a step whose sample does not hold it, stored (scalars) where the config captures
        losses."""
        if "losses" not in self.plan.collections:
            return
        try:
            value = float(loss)
        except (TypeError, ValueError, RuntimeError, NotImplementedError):  # None, not one number, several
            return
        if math.isfinite(value):
            self.scalars(step, mode, {"losses/train": {"value": value}})

    def new_objective(self, step: int) -> None:
        """From this step on the training loss is another objective's: other optimizers step than at the step before
        (a layer trained after another, as forward-forward training trains them). The rules that judge a series at
        every step (loss_spike) judge it afresh from there; the steps before it may still be on their way."""
        self._objective_starts.append(step)

    def _stream(self, step: int, values: dict) -> None:
        """A training step's values, the finite value of each streamed series handed to the rules that judge it at
        every step (loss_spike, gradient_spike); what one finds is recorded at this step, with the value, as
        `spikes/<rule id>` ({fact: value}), for the rule to judge (as a NaN loss between samples is: a sample of
        its own)."""
        while self._objective_starts and step >= self._objective_starts[0]:
            self._objective_starts.pop(0)
            for _, _, stream in self._streams:
                restart = getattr(stream, "restart", None)  # a user's rule's stream may have none
                if restart is not None:
                    restart()
        for rule_id, series, stream in list(self._streams):
            value = values.get(series, {}).get("value")
            if value is None:
                continue
            try:
                found = stream.see(step, float(value))
            except Exception as exc:  # noqa: BLE001 - a rule's own stream (a user's rule) must not stop training
                self._streams.remove((rule_id, series, stream))
                log.warning("tripwire: rule %s could not judge %s of step %s (%s: %s); it no longer reads it at every "
                            "step in this run", rule_id, series, step, type(exc).__name__, exc)
                continue
            if found:
                self._streaming = True  # the value recorded with it is not handed over again
                try:
                    decision = self.record(step, "train", {series: {"value": float(value)},
                                                           f"spikes/{rule_id}": found})
                finally:
                    self._streaming = False
                self._held = decision if self._held is None else self._held.merge(decision)

    def first_step(self, facts) -> None:
        """What the plugin saw of the training at its first step (tripwire.core.firststep.FirstStep): stored in the
        run once, and handed to the rules that judge the setup."""
        if self.history is not None:
            self.history.first_steps[self.worker] = facts
        self.writer.put_object(first_step_name(self.worker), sealed_json(facts.to_dict()))

    def check_loss(self, step: int, loss: float | None, origin: dict | None = None) -> Decision | None:
        """The training loss of a step that is not sampled, already on the host: a NaN or Inf is recorded at once,
        as a sample of its own, so that the rules (exploding_tensor) judge it at the step it appeared rather than
        at the next sampled step. One such sample per run: what follows the first NaN is NaN too. None where the
        loss is finite (the cost of an unsampled step: one comparison). origin: where the plugin found the NaN
        began ({`origin/<module>`: facts}), recorded with it."""
        value = self._first_nonfinite(loss)
        if value is None:
            return None
        return self.record(step, "train", {"losses/train": {"value": value}, **(origin or {})})

    def check_relation(self, step: int, relation: str, broken: int) -> Decision | None:
        """A relation (tripwire.core.rules.relations) a plugin saw broken at a step that is not sampled, where it
        can tell at no cost: recorded at once, as a sample of its own, so that it is judged at the step it broke.
        The plugin tells each relation once; None where the config captures no relations."""
        return self.fact(step, f"relations/{relation}", {"value": float(broken)})

    def fact(self, step: int, name: str, reductions: dict) -> Decision | None:
        """A fact a plugin learned at a step that is not sampled ({reduction: float}), recorded at once as a sample
        of its own; None where the config does not capture its collection."""
        if collection_of(name) not in self.plan.collections:
            return None
        return self.record(step, "train", {name: reductions})

    def _first_nonfinite(self, loss) -> float | None:
        """The loss as a number, where it is the run's first NaN/Inf loss (and the config captures losses); None
        for a finite loss, or what is not one number."""
        try:
            value = float(loss)
        except (TypeError, ValueError, RuntimeError, NotImplementedError):  # None, not one number, several
            return None
        if math.isfinite(value) or self._nonfinite_loss or "losses" not in self.plan.collections:
            return None
        self._nonfinite_loss = True
        return value

    def poll(self) -> Decision:
        """Actions for verdicts the side process wrote since the last call, and for those found on the losses of
        the steps between samples (cheap: no I/O here)."""
        decision, self._held = self._held or Decision(), None
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

    def save_checkpoint(self, rel: str, data: bytes) -> None:
        """A checkpoint the plugin made in memory (or on a local disk), written into the run by the writer thread:
        storage that is slow or hangs never holds a training step up. Said in the log once it is written."""
        self.writer.put_object(rel, bytes(data), exclusive=False, done=f"checkpoint written to {self.store.url_of(rel)}")

    def write_report(self) -> None:
        """report.json, and report.html on worker 0, in a background thread (drawing takes seconds, and storage
        may hang): training goes on."""
        from .report import BackgroundReport

        self._report = self._report or BackgroundReport(self.store, html=self.worker == 0)
        self._report.request(self.verdicts)

    # -- internals ------------------------------------------------------------------------------------------------
    def _act(self, verdict: Verdict) -> Decision:
        if not verdict.fired:
            log.log(logging.WARNING if verdict.status == "error" else logging.INFO, "tripwire: %s",
                    verdict.describe(with_hint=False))
            return Decision(verdicts=[verdict])
        cause = explained_by(verdict, [v for v in self.verdicts if v is not verdict])
        decision = apply(verdict, self._actions.get(verdict.rule, ()), self.write_report, cause, self._stopping)
        self._stopping |= decision.stop
        fired = sum(v.fired for v in self.verdicts)
        self._tell(self.sinks, lambda sink: sink.verdict(verdict, fired))
        return decision

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
                verdict = Verdict.from_dict(self.store.get_json(f"verdicts/{name}"))
            except (OSError, ValueError, TypeError):
                continue  # not complete yet or not ours; looked at again next time
            self._seen_verdicts.add(name)
            with self._inbox_lock:
                self._inbox.append(verdict)


def _applicable(config: Config, provides: set, framework: str) -> Config:
    """The config without the rules that need data this framework never has (the default rules.yaml carries
    neural-network rules an XGBoost run cannot feed); said once, as a warning where the user chose them (the
    packaged default carries rules for every framework: leaving some out is no news)."""
    kept, left = [], []
    for spec in config.rules:
        needs = spec.create().needs()
        anything = "*" in needs  # a rule over every captured collection applies to whatever is captured
        (kept if anything or needs <= provides else left).append((spec, needs - provides - {"*"}))
    if left:
        chosen = not config.source.endswith("(packaged default)")
        log.log(logging.WARNING if chosen else logging.DEBUG,
                "tripwire: %s capture no %s, so these rules are not evaluated: %s.", framework,
                ", ".join(sorted(set().union(*(m for _, m in left)))), ", ".join(s.id for s, _ in left))
    return dataclasses.replace(config, rules=tuple(s for s, _ in kept))
