"""The rule engine: one for the training process, `tripwire watch` and `tripwire check`.

It evaluates each rule at the steps of the modes the rule looks at, through
a view scoped to that step, mode and worker. A rule reports each of its
findings once per worker (a finding names what the verdict is about: the
tensor, the side of the threshold, the severity), so a first verdict does
not silence a later, different one (NaN after a huge update), and a
condition that keeps holding is not reported at every step; a rule reports
at most MAX_FINDINGS findings per worker. A rule that raises anything
(SystemExit and KeyboardInterrupt from its code included) gives one `error`
verdict and is disabled for the rest of the run; so does, in the training
process, a rule whose evaluations take more than `budget` of the time
training has run, once they took a second (a slow custom rule must not slow
training down unseen): training goes on. The time Python's garbage collector
runs during an evaluation is not the rule's: a full collection in a large
training process takes a second and more, and falls on whichever code
allocated last. An outage of the store (`StoreUnavailable`) is not the
rule's fault: it propagates to `tripwire watch`, which retries. At the end, a
rule that never saw the data it requires gives a `no_data` verdict instead of
passing silently.
"""

from __future__ import annotations

import gc
import logging
import time
import traceback
from dataclasses import replace

from ..errors import RunDamaged, StoreUnavailable
from ..naming import collection_of
from ..verdict import Verdict
from .base import NotApplicable

log = logging.getLogger("tripwire")
MAX_FINDINGS = 20  # per rule and worker
BUDGET_FLOOR_S = 1.0  # a rule that has cost less than this in all has slowed no training down


class _CollectorClock:
    """Seconds the garbage collector ran while it was listening (gc.callbacks: it is called at each collection's
    start and stop, in whichever thread collects)."""

    def __init__(self):
        self.seconds = 0.0
        self._began = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self._began = None

    def __enter__(self):
        gc.callbacks.append(self)  # only while a rule runs: every other collection of training costs nothing more
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


class _Slot:
    def __init__(self, spec):
        self.spec = spec
        self.rule = spec.create()
        self.needs = self.rule.needs()
        self.findings: dict[int, set] = {}  # worker -> {(finding, severity)} reported
        self.not_applicable: dict[int, str] = {}  # worker -> why the data was not the rule's kind
        self.failed = False
        self.evaluated = False
        self.seconds = 0.0  # spent in its evaluations
        self.evaluations = 0

    def done(self, worker: int) -> bool:
        """Disabled, or out of findings to report for this worker."""
        return self.failed or len(self.findings.get(worker, ())) >= MAX_FINDINGS


class RuleEngine:
    def __init__(self, specs, source: str = "in_process", budget: float | None = None):
        """budget: the share of the time since the engine started that one rule's evaluations may take (None: no
        limit, as in `tripwire check` and `watch`, where no training waits for them)."""
        self.slots = [_Slot(spec) for spec in specs]
        self.source, self.budget = source, budget
        self.started = time.perf_counter()

    @property
    def history(self) -> int:
        """How many samples per series the rules look back over."""
        return max([s.rule.history for s in self.slots] + [1])

    @property
    def tensor_history(self) -> int:
        needs = [s.rule.history for s in self.slots if any(r.save_tensors for r in s.rule.requires())]
        return max(needs + [1])

    @property
    def tensor_collections(self) -> set[str] | None:
        """The collections whose full values a rule reads (the history keeps no others); None: any."""
        needed = {r.collection for s in self.slots for r in s.rule.requires() if r.save_tensors}
        return None if "*" in needed else needed

    def evaluate(self, view, step: int, mode: str, worker: int, captured: set | None = None) -> list[Verdict]:
        """New verdicts at this step (fired or error).

        captured: the collections recorded at this step (in the training process; offline, those stored there). A
        rule that requires collections, none of them among these, is not evaluated: its data did not change since
        it last was (e.g. the loss-only steps of the default config)."""
        out = []
        scoped = None
        for slot in self.slots:
            if slot.done(worker) or mode not in slot.rule.modes:
                continue
            if captured is not None and slot.needs and "*" not in slot.needs and not slot.needs & captured:
                continue
            scoped = scoped or view.at(step, mode, worker)
            self._run(slot, lambda: slot.rule.check(scoped, step), step, mode, worker, out)
        return out

    def idle(self, now: float, last_data: float, step: int, worker: int = 0) -> list[Verdict]:
        """Verdicts of the rules judged by the clock (e.g. stalled_training)."""
        out = []
        for slot in self.slots:
            if slot.rule.idle and not slot.done(worker):
                self._run(slot, lambda: slot.rule.check_idle(now, last_data, step), step, "train", worker, out)
        return out

    def _run(self, slot, check, step, mode, worker, out) -> None:
        slot.evaluated = True
        began, collector = time.perf_counter(), _CollectorClock()
        try:
            with collector:
                verdicts = _returned(check())
        except (StoreUnavailable, RunDamaged):  # not the rule's fault: the watcher retries, check names the file
            if self.source != "in_process":  # in training, the view is memory: such an error is the rule's own
                raise
            slot.failed = True
            out.append(self._failed(slot, step, mode, worker, "the rule raised a storage error, reading memory",
                                    traceback=traceback.format_exc(limit=5)))
            return
        except NotApplicable as why:
            slot.not_applicable[worker] = str(why)
            return
        except BaseException as exc:  # noqa: BLE001 - a failing rule must never stop training, whatever it raises
            slot.failed = True
            out.append(self._failed(slot, step, mode, worker, f"the rule raised {type(exc).__name__}: {exc}",
                                    traceback=traceback.format_exc(limit=5)))
            return
        finally:
            slot.seconds += max(0.0, time.perf_counter() - began - collector.seconds)
            slot.evaluations += 1
        if self._over_budget(slot):
            slot.failed = True
            elapsed = time.perf_counter() - self.started
            out.append(self._failed(slot, step, mode, worker, f"its {slot.evaluations} evaluations took "
                                    f"{slot.seconds:.3g} s ({1000 * slot.seconds / slot.evaluations:.3g} ms each), "
                                    f"{slot.seconds / elapsed:.0%} of the {elapsed:.3g} s training has run; the "
                                    f"budget is {self.budget:.0%} (evaluation.rule_budget)", seconds=slot.seconds,
                                    evaluations=slot.evaluations))
        reported = slot.findings.setdefault(worker, set())
        for found in verdicts:
            key = (found.finding, found.severity)
            if key in reported or len(reported) >= MAX_FINDINGS:
                continue
            reported.add(key)
            out.append(replace(found, rule=slot.spec.id, mode=mode, worker=worker, source=self.source,
                               hint=found.hint or slot.rule.hint))

    def _over_budget(self, slot) -> bool:
        if self.budget is None or slot.seconds < BUDGET_FLOOR_S:
            return False
        return slot.seconds > self.budget * (time.perf_counter() - self.started)

    def _failed(self, slot, step, mode, worker, why: str, **evidence) -> Verdict:
        """The `error` verdict of a rule disabled for the rest of the run."""
        return Verdict(rule=slot.spec.id, step=step, mode=mode, worker=worker, status="error", source=self.source,
                       message=f"{why}; it is disabled for the rest of the run.", evidence=evidence)

    @property
    def has_idle_rules(self) -> bool:
        return any(slot.rule.idle for slot in self.slots)

    def finish(self, view, step: int, worker: int = 0, handed=()) -> list[Verdict]:
        """`no_data` verdicts for rules that never fired and never had the data they require, or found it was not
        the kind of data they judge (`NotApplicable`). handed: (collection, mode) of series the plugin handed over
        at every step, outside the samples the view holds (the gradient norms a spike rule reads)."""
        out = []
        captured = {collection_of(n) for n in view.tensor_names()}
        for slot in self.slots:
            if slot.failed or any(slot.findings.values()) or slot.rule.idle:  # the clock is never missing
                continue
            collections = captured | {c for c, mode in handed if mode in slot.rule.modes}
            needs = sorted(slot.needs)
            # a rule over every captured collection has data as soon as anything was captured
            missing = [] if "*" in needs and collections else [c for c in needs if c not in collections]
            if missing or not slot.evaluated:
                what = f"collections {', '.join(missing)} were never captured" if missing else \
                    f"it was never evaluated (no step of mode {', '.join(slot.rule.modes)} was sampled)"
                message = (f"the rule could not check anything: {what}. Check that the framework provides them "
                           "and that their steps are sampled.")
            elif worker in slot.not_applicable:
                message = f"the rule does not apply to this run: {slot.not_applicable[worker]}."
            else:
                continue
            out.append(Verdict(rule=slot.spec.id, step=step, worker=worker, status="no_data", source=self.source,
                               hint=slot.rule.hint, message=message))
        return out


def _returned(result) -> list[Verdict]:
    """What a rule's check returned, as verdicts: None, a Verdict, or a list of them, each with fields of the
    right types (its evidence is made JSON on writing). TypeError or ValueError otherwise, which fails the rule."""
    found = [] if result is None else result if isinstance(result, list) else [result]
    for verdict in found:
        if not isinstance(verdict, Verdict):
            raise TypeError(f"check() returned a {type(verdict).__name__}, not a Verdict (nor a list of them, nor "
                            "None); make verdicts with self.fire(step, message)")
        Verdict.from_dict({k: v for k, v in vars(verdict).items() if k != "evidence" and v is not None})
    return found
