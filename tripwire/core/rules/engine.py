"""The rule engine: one for the training process, `tripwire watch` and `tripwire check`.

It evaluates each rule at the steps of the modes the rule looks at, through
a view scoped to that step, mode and worker. A rule reports each of its
findings once per worker (a finding names what the verdict is about: the
tensor, the side of the threshold, the severity), so a first verdict does
not silence a later, different one (NaN after a huge update), and a
condition that keeps holding is not reported at every step; a rule reports
at most MAX_FINDINGS findings per worker. A rule that raises
gives one `error` verdict and is disabled for the rest of the run; training
goes on. An outage of the store (`StoreUnavailable`) is not the rule's fault:
it propagates to `tripwire watch`, which retries. At the end, a rule that
never saw the data it requires gives a `no_data` verdict instead of passing
silently.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import replace

from ..errors import StoreUnavailable
from ..naming import collection_of
from ..verdict import Verdict
from .base import NotApplicable

log = logging.getLogger("tripwire")
MAX_FINDINGS = 20  # per rule and worker


class _Slot:
    def __init__(self, spec):
        self.spec = spec
        self.rule = spec.create()
        self.needs = self.rule.needs()
        self.findings: dict[int, set] = {}  # worker -> {(finding, severity)} reported
        self.not_applicable: dict[int, str] = {}  # worker -> why the data was not the rule's kind
        self.failed = False
        self.evaluated = False

    def done(self, worker: int) -> bool:
        """Disabled, or out of findings to report for this worker."""
        return self.failed or len(self.findings.get(worker, ())) >= MAX_FINDINGS


class RuleEngine:
    def __init__(self, specs, source: str = "in_process"):
        self.slots = [_Slot(spec) for spec in specs]
        self.source = source

    @property
    def history(self) -> int:
        """How many samples per series the rules look back over."""
        return max([s.rule.history for s in self.slots] + [1])

    @property
    def tensor_history(self) -> int:
        needs = [s.rule.history for s in self.slots if any(r.save_tensors for r in s.rule.requires())]
        return max(needs + [1])

    def evaluate(self, view, step: int, mode: str, worker: int, captured: set | None = None) -> list[Verdict]:
        """New verdicts at this step (fired or error).

        captured: the collections recorded at this step, where known (in the training process). A rule that
        requires collections, none of them among these, is not evaluated: its data did not change since it
        last was (e.g. the loss-only steps of the default config)."""
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
        try:
            verdict = check()
        except StoreUnavailable:  # the store did not answer: the rule is not at fault; the watcher retries
            raise
        except NotApplicable as why:
            slot.not_applicable[worker] = str(why)
            return
        except Exception as exc:  # noqa: BLE001 - a failing rule must never stop training
            slot.failed = True
            out.append(Verdict(rule=slot.spec.id, step=step, mode=mode, worker=worker, status="error",
                               source=self.source,
                               message=f"the rule raised {type(exc).__name__}: {exc}; it is disabled for the "
                                       "rest of the run.",
                               evidence={"traceback": traceback.format_exc(limit=5)}))
            return
        reported = slot.findings.setdefault(worker, set())
        for found in ([] if verdict is None else verdict if isinstance(verdict, list) else [verdict]):
            key = (found.finding, found.severity)
            if key in reported or len(reported) >= MAX_FINDINGS:
                continue
            reported.add(key)
            out.append(replace(found, rule=slot.spec.id, mode=mode, worker=worker, source=self.source,
                               hint=found.hint or slot.rule.hint))

    @property
    def has_idle_rules(self) -> bool:
        return any(slot.rule.idle for slot in self.slots)

    def finish(self, view, step: int, worker: int = 0) -> list[Verdict]:
        """`no_data` verdicts for rules that never fired and never had the data they require, or found it was not
        the kind of data they judge (`NotApplicable`)."""
        out = []
        collections = {collection_of(n) for n in view.tensor_names()}
        for slot in self.slots:
            if slot.failed or any(slot.findings.values()) or slot.rule.idle:  # the clock is never missing
                continue
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
