"""The rule base class. Built-in and custom rules are the same kind of object.

A rule is a small (usually dataclass) class: its fields are its parameters,
`requires()` declares the collections and reductions it reads (enabling the
rule turns that capture on), and `check(run, step)` looks at the run as of
`step` and returns a Verdict or None. `run` is a read view scoped to the
mode and worker being evaluated, the same interface as `tripwire.open_run`,
backed by recent memory in the training process or by the store elsewhere.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import ClassVar

from ..verdict import Verdict


@dataclasses.dataclass(frozen=True)
class Requirement:
    """Data a rule reads: a collection ("*" = every tensor collection captured), its reductions, full tensors;
    for a collection that would otherwise capture everything, which tensors (`include` patterns); and steps
    that must be sampled beyond the configured schedule (e.g. the first steps of training)."""

    collection: str
    reductions: tuple = ()
    save_tensors: bool = False
    include: tuple = ()
    steps: tuple = ()


_NO_DEFAULT = object()


class Rule:
    name: ClassVar[str] = ""
    condition: ClassVar[str] = ""  # the exact condition, one or two sentences
    hint: ClassVar[str] = ""  # likely causes and what to try
    source: ClassVar[str] = ""  # where the condition and defaults come from
    modes: ClassVar[tuple] = ("train",)  # the modes whose steps the rule is evaluated at
    history: ClassVar[int] = 1  # samples per series the rule looks back over
    idle: ClassVar[bool] = False  # judged by the clock through check_idle, not at steps
    required: ClassVar[tuple] = ()  # parameters a config must give (beyond those without a default)

    @classmethod
    def _declared(cls) -> dict:
        """Parameter name -> default, or _NO_DEFAULT, from the constructor's signature."""
        if dataclasses.is_dataclass(cls):
            return {f.name: (f.default if f.default is not dataclasses.MISSING else
                             f.default_factory() if f.default_factory is not dataclasses.MISSING else _NO_DEFAULT)
                    for f in dataclasses.fields(cls) if f.init}
        if cls.__init__ is object.__init__:
            return {}
        params = inspect.signature(cls).parameters.values()
        return {p.name: (_NO_DEFAULT if p.default is p.empty else p.default) for p in params
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    @classmethod
    def parameters(cls) -> dict:
        """Parameter name -> default (None where there is none), from the constructor's signature."""
        return {name: (None if default is _NO_DEFAULT else default) for name, default in cls._declared().items()}

    @classmethod
    def required_parameters(cls) -> list:
        """Parameters a config must give: those named in `required`, and those without a default."""
        missing = [name for name, default in cls._declared().items() if default is _NO_DEFAULT]
        return list(dict.fromkeys([*cls.required, *missing]))

    @property
    def params(self) -> dict:
        return {name: getattr(self, name, None) for name in self.parameters()}

    @classmethod
    def rule_name(cls) -> str:
        return cls.name or cls.__name__

    def requires(self) -> list[Requirement]:
        return []

    def check(self, run, step: int) -> Verdict | None:
        raise NotImplementedError

    def check_idle(self, now: float, last_data: float, step: int) -> Verdict | None:
        """For `idle` rules: called periodically with the time of the last captured sample."""
        return None

    def fire(self, step: int, message: str, **evidence) -> Verdict:
        """A fired verdict for this rule; the engine fills in the rule id, mode and worker."""
        return Verdict(rule=self.rule_name(), step=int(step), message=message, evidence=evidence, hint=self.hint)


def values_at(run, step: int, reduction: str, collections=(), regex: str = "") -> dict[str, float]:
    """{tensor name: its `reduction` at `step`} over the tensors of `collections` (all if empty) matching `regex`,
    skipping tensors that lack the reduction or the step."""
    recorded = reductions_at(run, step, collections, regex)
    if recorded is not None:
        return {name: values[reduction] for name, values in recorded.items() if reduction in values}
    pattern = re.compile(regex) if regex else None
    out = {}
    for name in run.tensor_names(step=step):
        if collections and name.split("/", 1)[0] not in collections or (pattern and not pattern.search(name)):
            continue
        tensor = run.tensor(name)
        if reduction not in tensor.reductions():
            continue
        try:
            out[name] = tensor.reduction(step, reduction)
        except LookupError:
            continue
    return out


def reductions_at(run, step: int, collections=(), regex: str = "") -> dict[str, dict[str, float]] | None:
    """{tensor name: {reduction: value}} recorded at `step`, of `collections` (all if empty) matching `regex`,
    where the view holds the step's sample at hand (in the training process, the step just recorded); None
    where it does not, and the tensors must be read one by one."""
    grouped = run._recorded(step)
    if grouped is None:
        return None
    out = {}
    for group in ([grouped[c] for c in collections if c in grouped] if collections else grouped.values()):
        out.update(group)
    if regex:
        pattern = re.compile(regex)
        out = {name: values for name, values in out.items() if pattern.search(name)}
    return out
