"""The rule base class. Built-in and custom rules are the same kind of object.

A rule is a small (usually dataclass) class: its fields are its parameters,
`requires()` declares the collections and reductions it reads (enabling the
rule turns that capture on), and `check(run, step)` looks at the run as of
`step` and returns a Verdict, a list of them (one per finding), or None. `run` is a read view scoped to the
mode and worker being evaluated, the same interface as `tripwire.open_run`,
backed by recent memory in the training process or by the store elsewhere.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from typing import ClassVar

from ..firststep import not_a_fit
from ..ranges import ANY, AT_LEAST_0, Range
from ..reductions import MIN_BATCH
from ..model import role_of
from ..naming import MODES
from ..verdict import Verdict


@dataclasses.dataclass(frozen=True)
class Requirement:
    """Data a rule reads: a collection ("*" = every tensor collection captured), its reductions, full tensors;
    for a collection that would otherwise capture everything, which tensors (`include` patterns); and steps
    that must be sampled beyond the configured schedule (e.g. the first steps of training). An `optional` one is
    captured where the framework has it, and the rule judges without it elsewhere (the learning rate, which a
    booster has not)."""

    collection: str
    reductions: tuple = ()
    save_tensors: bool = False
    include: tuple = ()
    steps: tuple = ()
    optional: bool = False


_NO_DEFAULT = object()


class NotApplicable(Exception):
    """Raised by `check` when the data is not of the kind the rule judges (a regressor's labels for a classifier's
    rule): not a verdict, not a failure. The rule keeps being evaluated; if it never finds anything, the run
    ends with a `no_data` verdict that gives this reason."""


class ParamError(ValueError):
    """Raised by a rule's constructor for parameters it cannot use, each problem at its key: `problems` holds
    (key path under `params`, message) pairs, e.g. (("invariants", 3, "low"), "expected a finite number"), which
    loading a config reports at their lines, all at once, as it reports every other mistake."""

    def __init__(self, problems: list):
        self.problems = list(problems)
        super().__init__("; ".join(f"{'.'.join(map(str, key))}: {message}" for key, message in self.problems))


class Rule:
    name: ClassVar[str] = ""
    condition: ClassVar[str] = ""  # the exact condition, one or two sentences
    hint: ClassVar[str] = ""  # likely causes and what to try
    source: ClassVar[str] = ""  # where the condition and defaults come from
    modes: ClassVar[tuple] = ("train",)  # the modes whose steps the rule is evaluated at
    history: ClassVar[int] = 1  # samples per series the rule looks back over
    idle: ClassVar[bool] = False  # judged by the clock through check_idle, not at steps
    severity: ClassVar[str] = "warning"  # of its verdicts unless `fire` is told otherwise
    required: ClassVar[tuple] = ()  # parameters a config must give (beyond those without a default)
    # parameter -> the Range of its valid values, where it is not the default one (see `ranges`); a subclass's
    # entries add to its bases'
    limits: ClassVar[dict] = {}
    streamed: ClassVar[str] = "losses/train"  # the series whose every value `stream()` sees
    id: str | None = None  # the config's name for this instance (RuleSpec.create); None: the rule's own name

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

    @classmethod
    def ranges(cls) -> dict[str, Range]:
        """Numeric parameter -> the Range a config's value must lie in: as `limits` declares it (a percentage,
        a share, a count of at least 1), else at least 0 where the default is at least 0 (thresholds, counts and
        steps are), any finite number otherwise. Loading a config enforces them; the docs show them."""
        declared: dict = {}
        for klass in reversed(cls.__mro__):
            declared.update(vars(klass).get("limits", {}))
        return {name: declared.get(name) or (AT_LEAST_0 if default >= 0 else ANY)
                for name, default in cls.parameters().items()
                if name in declared or isinstance(default, (int, float)) and not isinstance(default, bool)}

    @property
    def params(self) -> dict:
        return {name: getattr(self, name, None) for name in self.parameters()}

    @classmethod
    def rule_name(cls) -> str:
        return cls.name or cls.__name__

    def requires(self) -> list[Requirement]:
        return []

    def needs(self) -> set[str]:
        """The collections the rule cannot judge without (its requirements that are not optional)."""
        return {r.collection for r in self.requires() if not r.optional}

    def check(self, run, step: int) -> Verdict | None:
        raise NotImplementedError

    def check_idle(self, now: float, last_data: float, step: int) -> Verdict | None:
        """For `idle` rules: called periodically with the time of the last captured sample."""
        return None

    def stream(self):
        """For rules that judge a series at every step the plugin hands it over, not only at the sampled ones (the
        training loss, the gradient norm: `streamed`): an object whose `see(step, value)` the recorder calls with
        each finite value of that series (in step order), and which returns {fact: value} to record at that step
        where something is to be judged there, else None. None (the default): the rule reads the sampled steps
        alone."""
        return None

    def fire(self, step: int, message: str, *, severity: str | None = None, finding: str = "",
             hint: str = "", onset: int | None = None, **evidence) -> Verdict:
        """A fired verdict for this rule; the engine fills in the rule id, mode and worker.

        finding: what it is about (a tensor, a side of a threshold): reported once per worker and severity.
        hint: a hint for this finding, in place of the rule's own.
        onset: the step the condition began to hold, where the rule judged it over several samples."""
        return Verdict(rule=self.rule_name(), step=int(step), message=message, evidence=evidence,
                       hint=hint or self.hint, severity=severity or self.severity, finding=finding,
                       onset=None if onset is None else int(onset))


def of_roles(run, values: dict, roles, trainable_only: bool = True) -> dict:
    """The entries of {tensor name: value} about a parameter of one of these roles (tripwire.core.model.ROLES)
    that trains (or, without `trainable_only`, that was captured at all: requires_grad, but held by no optimizer),
    in the model's structure where the run recorded it (`run.model`), else by collection (`role_of`). A rule judges
    kernels as kernels, and leaves normalisation scales, embedding tables and frozen layers to the rules about
    them."""
    model = run.model
    out = {}
    for name, value in values.items():
        parameter = model.of(name) if model is not None else None
        if parameter is None:
            if role_of(model, name) in roles:
                out[name] = value
        elif parameter.role in roles and (parameter.trainable or not trainable_only) and parameter.tied_to is None:
            out[name] = value
    return out


def held(run, name: str, reduction: str, count: int, step: int, condition) -> int | None:
    """The first of the newest `count` samples of a tensor's reduction, the newest being `step`, where
    `condition(value)` held at each of them (a single-batch measurement is judged over several samples, not one);
    None where it did not."""
    steps, values = run.tensor(name).tail(reduction, count)
    if len(steps) == count and steps[-1] == step and all(condition(v) for v in values):
        return int(steps[0])
    return None


def warming_up(run, since: int) -> bool:
    """Whether the first parameter group's learning rate rose since step `since` (a warmup is under way)."""
    if "optimizer/lr" not in run.tensor_names("optimizer", mode="train"):
        return False
    steps, rates = run.tensor("optimizer/lr").series(mode="train")
    earlier = rates[steps <= since]
    return len(earlier) > 0 and rates[-1] > earlier[-1]


SCHEDULE_END = 1e-3  # a learning rate below this share of the largest so far: a schedule brought it to about 0


def schedule_ended(rate: float | None, peaks: dict, worker) -> bool:
    """Whether a learning rate is below SCHEDULE_END of the largest the worker has had so far, kept in `peaks`: the
    end of a schedule (a decay run its course, a plateau cut again and again), where the weights are meant to stop
    moving."""
    if rate is None:
        return False
    peaks[worker] = max(peaks.get(worker, 0.0), rate)
    return rate < SCHEDULE_END * peaks[worker]


def learning_rates(run, step: int) -> list[float] | None:
    """The learning rates recorded at this step (`optimizer/lr`, `optimizer/lr.1`, … one per parameter group),
    or None where the run holds none."""
    rates = values_at(run, step, "value", ["optimizer"], r"^optimizer/lr(\.[0-9.]+)?$")
    return list(rates.values()) or None


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


def loss_fell_below(run, step: int, first: dict, share: float, untrained: float | None = None) -> bool:
    """Whether the training loss at this step is below `share` of the first one seen (kept in `first` per worker),
    and of `untrained` where given (what a model that learned nothing scores: a loss that starts far above it has
    learned nothing yet at half its start): a model that has learned, whose small or zero gradients are
    convergence, not a fault. The loss is the newest stored, the step's own where it is stored: the gradients
    judged come from the same batch (one sample fit exactly, at batch size 1, passes back no gradient at all).
    False where the run holds no training loss."""
    if "losses/train" not in run.tensor_names("losses"):
        return False
    steps, values = run.tensor("losses/train").tail(None, 1)
    if not steps or steps[-1] > step:
        return False
    loss = float(values[-1])
    initial = first.setdefault(run.default_worker, loss)
    return abs(loss) < share * min(abs(initial), abs(untrained) if untrained is not None else math.inf)


# The training forward passes per step, as the torch probe counted them over the first steps (where the config
# captures relations: the default's training_relations does), recorded once where they took several numbers
# ({"value": how many different numbers, "min": …, "max": …}).
FORWARDS = "relations/forwards_per_step"


def loss_not_a_fit(run) -> str | None:
    """Why the training loss says nothing of how well the model fits, where the run shows it; None otherwise. The
    rules that judge its course (loss_not_decreasing, loss_spike, gradient_spike) raise NotApplicable with it.

    A GAN's step trains objectives against each other, a policy gradient weighs the log-probabilities of the model's
    own samples, a DQN's targets come from its own target network (what the
    first step showed); a reinforcement-learning episode adds up one loss term per action, so its loss grows with
    the episode's length as the agent learns (the forward passes per step took several numbers)."""
    why = not_a_fit(run.first_step)
    if why:
        return why
    if FORWARDS not in run.tensor_names("relations"):
        return None
    tensor = run.tensor(FORWARDS)
    low, high = (float(tensor.series(reduction)[1][-1]) for reduction in ("min", "max"))
    return (f"the loss adds up over a number of forward passes that changes from step to step ({low:.0f} to "
            f"{high:.0f} in the first steps: an episode of reinforcement learning, a sequence unrolled one forward "
            "at a time): its size follows that number, not how well the model fits")


FIRST_LABELS = Requirement("labels", save_tensors=True, steps=(0,), optional=True)  # the first batch's targets
# ‖update‖ / ‖weight‖ of a kernel at a healthy optimizer step: about 0.1 % (a rate to suggest aims at 0.1-1 %)
HEALTHY_STEP = 1e-3


def few_samples(run) -> bool:
    """Whether the first training batch held fewer than MIN_BATCH samples (as its targets show). In such a batch
    one sample can leave a kernel with no gradient by itself — a sample of zeros, sparse features, every unit off
    for it — and, without momentum, its step with no update: an exact zero there says nothing of the model. False
    where the plugin saw no targets."""
    first = run.first_step
    sizes = [use.labels.shape[0] for use in (first.losses if first is not None else ())
             if use.labels is not None and use.labels.shape]
    return bool(sizes) and min(sizes) < MIN_BATCH


def checked_mode(mode: str) -> str:
    """A rule parameter naming a mode (`train`, `eval`, …), refused where it is none."""
    if mode not in MODES:
        raise ValueError(f"mode '{mode}' is not one of {', '.join(MODES)}")
    return mode
