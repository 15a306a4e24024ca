"""Run zoo cases with tripwire attached and judge what it said.

Each case runs under two configs: the packaged default `rules.yaml`, and every
built-in rule at its default parameters (`all_rules`, sampled more often, so
that every rule sees many samples). A verdict counts when it fired at
severity warning or error: on a healthy case that is a false alarm, under
either config; on a faulty case it is a detection, by the right rule when the
case names it, required with every rule on. A risk judged at info (raw
inputs, a badly scaled start) detects a fault where its diagnosis counts: the
warnings it explains came.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from .case import Attach, Case

COUNTED = ("warning", "error")  # severities that count: info verdicts are neither alarms nor detections
NEEDS_PARAMS = ("similar_across_runs", "learned_invariants")  # rules that cannot run without parameters of the user's


def all_rules(framework: str) -> dict:
    """Every built-in rule that runs without parameters, at its defaults; sampled every 10 steps (every round for
    XGBoost), so the rules judge many samples of a short run."""
    from tripwire.core.rules.registry import rule_names

    every = 1 if framework == "xgboost" else 10
    return {"sampling": {"every": every},
            "rules": [{"rule": name, "actions": ["log"]} for name in rule_names() if name not in NEEDS_PARAMS]}


CONFIGS = {"default": lambda framework: None, "all_rules": all_rules}


@dataclass
class Result:
    """One case under one config."""

    case: Case
    config: str
    learned: bool
    score: str
    steps: int
    seconds: float
    counted: list = field(default_factory=list)  # verdicts at warning or error
    quiet: list = field(default_factory=list)  # info verdicts, no_data and rule errors
    status: str = ""  # the run's stored status
    enabled: tuple = ()  # the rules the config turns on
    backend: str = ""  # Keras' backend

    def to_dict(self) -> dict:
        """As plain data, for a run of the zoo in another process (Keras on another backend)."""
        return {"case": self.case.id, "config": self.config, "learned": self.learned, "score": self.score,
                "steps": self.steps, "seconds": self.seconds, "status": self.status, "enabled": list(self.enabled),
                "backend": self.backend, "counted": [v.to_dict() for v in self.counted],
                "quiet": [v.to_dict() for v in self.quiet]}

    @classmethod
    def from_dict(cls, data: dict, case: Case) -> Result:
        from tripwire.core.verdict import Verdict

        return cls(case, data["config"], data["learned"], data["score"], data["steps"], data["seconds"],
                   [Verdict.from_dict(v) for v in data["counted"]], [Verdict.from_dict(v) for v in data["quiet"]],
                   data["status"], tuple(data["enabled"]), data["backend"])

    @property
    def expected(self) -> bool:
        """Whether the fault must be caught here: with every rule on. The default config samples every 100 steps,
        so its trend rules need more steps than a short run has; what it catches is shown, not required."""
        return not self.case.healthy and self.config == "all_rules" and \
            any(rule in self.enabled for rule in self.case.catch)

    @property
    def rules(self) -> list[str]:
        return list(dict.fromkeys(v.rule for v in self.counted))

    @property
    def false_alarm(self) -> bool:
        return self.case.healthy and bool(self.counted)

    @property
    def caught(self) -> bool:
        return not self.case.healthy and bool(self.counted)

    @property
    def diagnoses(self) -> list:
        """The diagnoses that count (tripwire.core.diagnosis): a risk seen at info (raw inputs, a badly scaled
        start) is the primary cause of the warnings it explains."""
        from tripwire.core.diagnosis import diagnose

        fired = [v for v in (*self.counted, *self.quiet) if v.fired]
        return [d for d in diagnose(fired) if d.counts]

    @property
    def detections(self) -> list:
        """(rule, step) of what caught the fault: each counted verdict, and each counting diagnosis's primary
        cause at the step its first warning came."""
        found = [(v.rule, v.step) for v in self.counted]
        for d in self.diagnoses:
            found.append((d.primary.rule, min(v.step for v in d.verdicts if v in self.counted)))
        return found

    @property
    def right_rule(self) -> bool:
        return any(rule in self.case.catch for rule, _ in self.detections)

    @property
    def primary(self):
        """The primary cause of the first diagnosis at warning or error (its verdict), or None."""
        found = self.diagnoses
        return found[0].primary if found else None

    @property
    def names_fault(self) -> bool:
        """Whether the first diagnosis's primary cause is a verdict of a rule that names the fault."""
        return self.primary is not None and self.primary.rule in self.case.causes

    @property
    def delay(self) -> int | None:
        """Steps from the fault's onset to the first verdict of a rule that names it."""
        steps = [step for rule, step in self.detections if rule in self.case.catch]
        return min(steps) - self.case.onset if steps else None

    @property
    def failures(self) -> list[str]:
        """What is wrong with this result, in words; empty when the case passes."""
        out = []
        if self.case.healthy:
            if not self.learned:
                out.append(f"the healthy model did not learn with tripwire attached ({self.score})")
            out += [f"false alarm: {v.describe(with_hint=False)}" for v in self.counted]
            if self.status == "stopped":
                out.append("tripwire stopped a healthy run")
        elif self.expected and not self.right_rule:
            named = ", ".join(self.case.catch)
            out.append(f"fault '{self.case.fault}' not caught by {named}; fired: {', '.join(self.rules) or 'nothing'}")
        out += [f"rule error: {v.describe(with_hint=False)}" for v in self.quiet if v.status == "error"]
        return out


def run_case(case: Case, config: str, long: bool = False, root: str | None = None) -> Result:
    """Train the case with tripwire under the named config; the result with the run's verdicts."""
    import tripwire

    folder = tempfile.mkdtemp(prefix="zoo-", dir=root)
    try:
        attach = Attach(CONFIGS[config](case.framework), f"{folder}/run")
        started = time.perf_counter()
        outcome = case.train(attach, long)
        seconds = time.perf_counter() - started
        run = tripwire.open_run(attach.run_url)
        verdicts = run.verdicts()
        counted = [v for v in verdicts if v.fired and _severity(v) in COUNTED]
        quiet = [v for v in verdicts if v not in counted]
        enabled = tuple(spec.rule for spec in tripwire.load_config(attach.config).rules)
        backend = os.environ.get("KERAS_BACKEND", "tensorflow") if case.framework == "keras" else ""
        return Result(case, config, outcome.learned, outcome.score, outcome.steps, seconds, counted, quiet,
                      run.info.get("status", ""), enabled, backend)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _severity(verdict) -> str:
    return getattr(verdict, "severity", "warning")
