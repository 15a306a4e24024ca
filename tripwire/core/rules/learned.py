"""Invariants learned from healthy runs (`tripwire learn`), and the rule that judges a new run by them.

An invariant says: at these steps, in this mode, this reduction of these tensors stayed within [low, high] in every
sampled step of every healthy run it was learned from. The tensors are named by what the run's model structure
says of them (`run.info["model"]`), not by their names: the gradients of Linear kernels, the weights of LayerNorm
scales, the outputs of the activations after Dense layers, so that a renamed or deeper model of the same kind is
judged too. A tensor the structure knows nothing of (the loss, a metric, the learning rate, a tree statistic) is
named by its own name, which is the same in every run of a pipeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import listing
from ..model import ROLES
from ..naming import COLLECTIONS, MODES, VALUE, collection_of, path_of
from ..reductions import REDUCTIONS
from .base import ParamError, Requirement, Rule, reductions_at

PARAMETER_COLLECTIONS = ("weights", "biases", "gradients", "updates")
# The roles of a layer's output captured as an activation: the output of the activation function that follows
# a layer ("activation": a ReLU module after a Linear, a Dense layer's own relu), or of the layer itself.
OUTPUT_ROLES = ("activation", "output")
KIND_KEYS = ("collection", "layer_class", "role")
PLURALS = {"kernel": "kernels", "recurrent_kernel": "recurrent kernels", "bias": "biases", "norm_scale": "norm scales",
           "norm_shift": "norm shifts", "embedding": "embedding tables", "other": "other parameters"}


def kind_of(run, name: str) -> dict:
    """What an invariant calls a tensor of `run`: {collection, layer_class, role} where the model's structure knows
    the parameter or layer behind it, else {tensor: its name}.

    The activation after a layer is known by that layer's class (View.input_layer), since the structure records
    the layers with parameters, not the class of a ReLU module."""
    model, collection, path = run.model, collection_of(name), path_of(name)
    if model is not None and collection in PARAMETER_COLLECTIONS:
        parameter = model.of(name)
        if parameter is not None:
            return {"collection": collection, "layer_class": parameter.layer_class, "role": parameter.role}
    if model is not None and collection == "activations":
        before = run.input_layer(path)
        parameters = model.layer_parameters(before or path)
        if parameters:
            role = "activation" if before is not None else "output"
            return {"collection": collection, "layer_class": parameters[0].layer_class, "role": role}
    return {"tensor": name}


def describe_kind(kind: dict) -> str:
    """The tensors of a kind, in words: 'gradients of Linear kernels', 'activations after Dense layers'."""
    if "tensor" in kind:
        return kind["tensor"]
    role = kind["role"]
    if role == "activation":
        return f"activations after {kind['layer_class']} layers"
    if role == "output":
        return f"outputs of {kind['layer_class']} layers"
    return f"{kind['collection']} of {kind['layer_class']} {PLURALS[role]}"


@dataclass(frozen=True)
class Invariant:
    """One learned range. kind: see `kind_of`. steps: (first, last), the steps it was seen at and is judged at.
    seen: (smallest, largest) value the healthy runs showed; low, high: the bounds judged, `seen` widened by
    `tripwire learn`'s margin (tripwire.core.learn); None where a side has no bound."""

    kind: tuple  # sorted (key, value) pairs of kind_of's mapping
    mode: str
    steps: tuple
    reduction: str
    seen: tuple
    low: float | None = None
    high: float | None = None

    def holds(self, value: float) -> bool:
        """Whether a value is within the bounds (a NaN or ±Inf never is: every healthy value was finite)."""
        return math.isfinite(value) and (self.low is None or value >= self.low) and \
            (self.high is None or value <= self.high)

    def expected(self) -> str:
        """The bounds in words."""
        if self.low is not None and self.low == self.high:
            return f"exactly {self.low:.4g}"
        if self.high is None:
            return "never negative" if self.low == 0 else f"at least {self.low:.4g}"
        if self.low is None:
            return "never positive" if self.high == 0 else f"at most {self.high:.4g}"
        return f"{self.low:.4g} to {self.high:.4g}"

    def to_dict(self) -> dict:
        bounds = {k: v for k, v in (("low", self.low), ("high", self.high)) if v is not None}
        return {**dict(self.kind), "mode": self.mode, "steps": list(self.steps), "reduction": self.reduction,
                "seen": list(self.seen), **bounds}


ENTRY_KEYS = ("tensor", *KIND_KEYS, "mode", "steps", "reduction", "seen", "low", "high")


def parse(entry, at: tuple) -> tuple[Invariant | None, list]:
    """An invariant from its written form, or None and the problems found: [(key path under params, message)]."""
    if not isinstance(entry, dict):
        return None, [(at, f"expected a mapping with keys {', '.join(ENTRY_KEYS)}; got {type(entry).__name__}.")]
    problems = [(at + (key,), f"unknown key '{key}'. Allowed here: {', '.join(ENTRY_KEYS)}.")
                for key in entry if key not in ENTRY_KEYS]

    def bad(key, message):
        problems.append((at + (key,), message))

    if "tensor" in entry:
        kind = {"tensor": entry["tensor"]}
        if any(key in entry for key in KIND_KEYS):
            bad("tensor", f"name tensors either by `tensor` or by {', '.join(KIND_KEYS)}, not both.")
        elif not isinstance(kind["tensor"], str) or collection_of(kind["tensor"]) not in COLLECTIONS:
            bad("tensor", f"expected a tensor name 'collection/path' of a collection ({', '.join(COLLECTIONS)}); "
                          f"got {entry['tensor']!r}.")
    else:
        kind = {key: entry.get(key) for key in KIND_KEYS}
        missing = [key for key in KIND_KEYS if key not in entry]
        if missing:
            problems.append((at, f"an invariant names its tensors by `tensor`, or by {', '.join(KIND_KEYS)}; "
                                 f"{', '.join(missing)} missing."))
        else:
            roles = OUTPUT_ROLES if kind["collection"] == "activations" else ROLES
            if kind["collection"] not in (*PARAMETER_COLLECTIONS, "activations"):
                bad("collection", f"'{kind['collection']}' is not one of {', '.join(PARAMETER_COLLECTIONS)}, "
                                  "activations (the collections whose tensors the model's structure knows).")
            elif kind["role"] not in roles:
                bad("role", f"'{kind['role']}' is not a role of {kind['collection']}: {', '.join(roles)}.")
            if not isinstance(kind["layer_class"], str) or not kind["layer_class"]:
                bad("layer_class", f"expected a layer class name such as Linear or Dense; got "
                                   f"{kind['layer_class']!r}.")
    mode = entry.get("mode", "train")
    if mode not in MODES:
        bad("mode", f"'{mode}' is not one of {', '.join(MODES)}.")
    reduction = entry.get("reduction")
    if reduction not in (*REDUCTIONS, VALUE):
        bad("reduction", f"expected one of {', '.join((*REDUCTIONS, VALUE))}; got {reduction!r}.")
    steps = _pair(entry.get("steps"), int, "steps", "first and last step (integers, at least 0)", bad)
    if steps is not None and steps[0] < 0:
        bad("steps", f"steps must be at least 0; got {list(steps)}.")
    seen = _pair(entry.get("seen"), float, "seen", "the smallest and largest value seen (finite numbers)", bad)
    bounds = {}
    for key in ("low", "high"):
        if key in entry:
            value = entry[key]
            if not _number(value, float):
                bad(key, f"expected a finite number; got {value!r}.")
            else:
                bounds[key] = float(value)
    if not bounds and not any(key in entry for key in ("low", "high")):
        problems.append((at, "an invariant needs `low`, `high` or both: the bounds it judges."))
    if seen is not None and ("low" in bounds and bounds["low"] > seen[0] or "high" in bounds
                             and bounds["high"] < seen[1]):
        bad("seen", f"the values seen, {list(seen)}, must lie within the bounds low {bounds.get('low')}, high "
                    f"{bounds.get('high')}: the healthy runs held them.")
    if problems:
        return None, problems
    return Invariant(tuple(sorted(kind.items())), mode, steps, reduction, seen, bounds.get("low"),
                     bounds.get("high")), []


def _pair(value, kind, key: str, what: str, bad) -> tuple | None:
    """[a, b] with a <= b, both numbers of `kind` (int: integers), as a tuple; None (and a problem) otherwise."""
    if not (isinstance(value, list) and len(value) == 2 and all(_number(v, kind) for v in value)):
        bad(key, f"expected [a, b], {what}; got {value!r}.")
        return None
    if value[0] > value[1]:
        bad(key, f"expected [a, b] with a <= b; got {value!r}.")
        return None
    return kind(value[0]), kind(value[1])


def _number(value, kind) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        return False
    return math.isfinite(value)


@dataclass
class LearnedInvariants(Rule):
    """Ranges every healthy run of this pipeline stayed within, learned by `tripwire learn`, left by this run."""

    invariants: list | None = None  # written by `tripwire learn` (required)
    learned_from: list = field(default_factory=list)  # the runs they were learned from, named in verdicts

    name = "learned_invariants"
    required = ("invariants",)
    modes = MODES
    condition = ("at a sampled step within an invariant's steps, a reduction of a tensor of the invariant's kind "
                 "(its collection, layer class and role in the model's structure, or its own name for the loss, "
                 "metrics, the learning rate and other tensors the structure does not know) lies outside the "
                 "invariant's bounds, or is not finite; the bounds are what every sampled step of every healthy "
                 "run showed, widened by `tripwire learn`'s margin. A warning, never an error: learned ranges are "
                 "evidence, not certainty")
    hint = ("This run left a range that every healthy run it was learned from stayed within: something in it "
            "differs from those runs. Likely causes: a changed learning rate or schedule, initialisation, data or "
            "preprocessing, model or loss. Try: `tripwire compare` this run with one of the healthy runs to find "
            "where they part; if the change is intended, learn again from healthy runs of the new pipeline "
            "(`tripwire learn RUN [RUN ...] -o learned.yaml`).")
    source = ("tripwire's (issue 24, item 5): invariants learned from healthy runs, in the spirit of Daikon-style "
              "likely invariants (Ernst et al., 2007) over training's reductions, per layer type and role.")

    def __post_init__(self):
        """Parse the invariants, every mistake at its key (ParamError); None is the rule as documented, before a
        config gives it what was learned."""
        found, problems = [], []
        if self.invariants is not None and (not isinstance(self.invariants, list) or not self.invariants):
            got = "none" if isinstance(self.invariants, list) else f"a {type(self.invariants).__name__}"
            problems.append((("invariants",), f"expected a list of invariants, got {got}: write them with `tripwire "
                                              "learn RUN [RUN ...] -o learned.yaml` from healthy runs of the "
                                              "pipeline."))
        elif self.invariants is not None:
            for i, entry in enumerate(self.invariants):
                invariant, wrong = parse(entry, ("invariants", i))
                problems += wrong
                if invariant is not None:
                    found.append(invariant)
        if not all(isinstance(url, str) for url in self.learned_from):
            problems.append((("learned_from",), f"expected a list of run URLs; got {self.learned_from!r}."))
        if problems:
            raise ParamError(problems)
        self._by_kind: dict = {}
        for invariant in found:
            self._by_kind.setdefault((invariant.kind, invariant.mode), []).append(invariant)

    def requires(self):
        """The collections and reductions the invariants read, and nothing else: the learned runs had them."""
        wanted: dict = {}
        for (kind, _), invariants in self._by_kind.items():
            kind = dict(kind)
            collection = kind.get("collection") or collection_of(kind["tensor"])
            wanted.setdefault(collection, set()).update(i.reduction for i in invariants if i.reduction != VALUE)
        return [Requirement(c, tuple(sorted(r))) for c, r in sorted(wanted.items())]

    def check(self, run, step):
        mode = run.default_mode
        recorded = reductions_at(run, step)
        broken: dict = {}  # kind -> [(tensor, invariant, value)]
        for name in run.tensor_names(step=step):
            kind = tuple(sorted(kind_of(run, name).items()))
            for invariant in self._by_kind.get((kind, mode), ()):
                if not invariant.steps[0] <= step <= invariant.steps[1]:
                    continue
                value = _value(run, recorded, name, invariant.reduction, step)
                if value is not None and not invariant.holds(value):
                    broken.setdefault(kind, []).append((name, invariant, value))
        return [self._verdict(step, dict(kind), found) for kind, found in broken.items()] or None

    def _verdict(self, step: int, kind: dict, found: list):
        """One verdict per kind of tensor: the first invariant it broke here, and how many more."""
        name, invariant, value = found[0]
        what = describe_kind(kind)
        shown = f"{value:.4g}" if math.isfinite(value) else f"{value} (not finite)"
        runs = f"the healthy runs ({listing(self.learned_from, 3)})" if self.learned_from else "the healthy runs"
        where = f"step {invariant.steps[0]}" if invariant.steps[0] == invariant.steps[1] else \
            f"steps {invariant.steps[0]}-{invariant.steps[1]}"
        more = f"; {len(found) - 1} more invariant(s) of {what} broken at this step" if len(found) > 1 else ""
        named = name if what == name else f"{name} ({what})"
        message = (f"{named}: {invariant.reduction} {shown} at step {step}, outside what {runs} showed at "
                   f"{where}: {invariant.expected()} (they held {invariant.seen[0]:.4g} to "
                   f"{invariant.seen[1]:.4g}){more}.")
        evidence = {**invariant.to_dict(), "tensor": name, "value": _shown(value),  # the kind, steps, seen, bounds
                    "learned_from": list(self.learned_from),
                    "broken": [{"tensor": n, "reduction": i.reduction, "value": _shown(v)} for n, i, v in found]}
        return self.fire(step, message, finding=what, **evidence)


def _shown(value: float) -> float | str:
    """A value for a verdict's evidence (JSON): a NaN or ±Inf as its name."""
    return value if math.isfinite(value) else str(value)


def _value(run, recorded, name: str, reduction: str, step: int) -> float | None:
    """A tensor's reduction at the step, or None where it was not captured there."""
    if recorded is not None:
        return recorded.get(name, {}).get(reduction)
    tensor = run.tensor(name)
    if reduction not in tensor.reductions():
        return None
    try:
        return tensor.reduction(step, reduction)
    except LookupError:
        return None
