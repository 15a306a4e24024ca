"""A verdict: what a rule found, where, why, and what to try."""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field, fields

from .naming import MODE_RE

STATUSES = ("fired", "no_data", "error")
# How bad a fired verdict is. error: the run is broken (NaN, every unit dead, nothing learns); warning: likely a
# problem; info: worth a look. The default `stop` acts on errors; `tripwire check` exits 1 on warnings and errors.
SEVERITIES = ("error", "warning", "info")
_FIELD_TYPES = {"rule": (str,), "step": (int,), "message": (str,), "mode": (str,), "worker": (int,),
                "evidence": (dict,), "hint": (str,), "source": (str,), "time": (float, int), "severity": (str,),
                "finding": (str,), "onset": (int,)}


@dataclass(frozen=True)
class Verdict:
    """One rule's finding at one step.

    status: "fired" (the condition held), "no_data" (the rule never saw the data it needs),
    "error" (the rule raised; it was disabled for the rest of the run).
    severity: of a fired verdict, one of SEVERITIES.
    finding: what the verdict is about, within its rule (e.g. a tensor and the side of a threshold): a rule
    reports each finding once per worker and severity, however often its condition holds again.
    onset: the step its condition began to hold (the first of the samples it was judged over, where a rule waits
    for several); `step` where it was judged on one. The diagnosis orders causes by it.
    """

    rule: str
    step: int
    message: str
    mode: str = "train"
    worker: int = 0
    evidence: dict = field(default_factory=dict)
    hint: str = ""
    status: str = "fired"
    source: str = "in_process"  # in_process | side_process | check
    time: float = field(default_factory=time.time)
    severity: str = "warning"
    finding: str = ""
    onset: int | None = None

    @property
    def began(self) -> int:
        """The step the finding began at: its onset where the rule knows it, else the step it fired."""
        return self.step if self.onset is None else min(self.onset, self.step)

    @property
    def fired(self) -> bool:
        return self.status == "fired"

    @property
    def counts(self) -> bool:
        """A fired warning or error: what `tripwire check` exits 1 on (an info verdict is only worth a look)."""
        return self.fired and self.severity in ("error", "warning")

    @property
    def key(self) -> str:
        """What the verdict is about (rule, finding, severity, status, mode, worker), as 12 hex digits: a rule
        reports each once, so one key is one verdict however often, and by whom, it is found again."""
        about = json.dumps([self.rule, self.finding, self.severity, self.status, self.mode, self.worker])
        return hashlib.sha1(about.encode()).hexdigest()[:12]

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}  # not asdict: it copies evidence as it is
        out["evidence"] = jsonable(self.evidence)
        if self.onset is None:  # not known: absent, never null
            del out["onset"]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Verdict":
        """A verdict from its stored form; TypeError or ValueError if a field has the wrong type (a foreign file)."""
        if not isinstance(data, dict):
            raise TypeError(f"a verdict is a mapping, not a {type(data).__name__}")
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        for key, types in _FIELD_TYPES.items():
            if key in known and (not isinstance(known[key], types) or isinstance(known[key], bool)):
                raise TypeError(f"verdict field {key!r} is {known[key]!r:.60}, not {types[0].__name__}")
        if known.get("status", "fired") not in STATUSES:
            raise ValueError(f"verdict status {known['status']!r:.60} is not one of {', '.join(STATUSES)}")
        if "mode" in known and not MODE_RE.fullmatch(known["mode"]) or known.get("worker", 0) < 0:
            raise ValueError(f"verdict mode {known.get('mode')!r:.40} or worker {known.get('worker')!r} is not one a "
                             "run holds")
        if known.get("severity", "warning") not in SEVERITIES:
            raise ValueError(f"verdict severity {known['severity']!r:.60} is not one of {', '.join(SEVERITIES)}")
        return cls(**known)

    def describe(self, with_hint: bool = True) -> str:
        """The verdict as the lines a user reads on a terminal."""
        label = {"fired": self.severity, "no_data": "has no data", "error": "failed"}[self.status]
        text = f"[{self.rule}] {label} at step {self.step} ({self.mode}, worker {self.worker}): {self.message}"
        if with_hint and self.hint:
            text += "\n    hint: " + self.hint.strip().replace("\n", "\n          ")
        return text


MAX_DEPTH = 32  # evidence nested deeper (or holding itself) is kept as text from there on


def jsonable(value, depth: int = 0):
    """Evidence as plain JSON data, whatever a rule put in it: numpy scalars and arrays to numbers and lists, NaN and
    ±Inf to strings, tuples and sets to lists, anything else (and anything nested past MAX_DEPTH, such as a
    structure that holds itself) to its text. A verdict is stored whole: its evidence can never make it fail to
    write (that would read as a storage failure)."""
    if depth > MAX_DEPTH:
        return f"<nested deeper than {MAX_DEPTH}>"
    if isinstance(value, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((jsonable(v, depth + 1) for v in value), key=str)
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return jsonable(value.tolist(), depth + 1)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
