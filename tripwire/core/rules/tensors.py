"""Rules over any captured tensor."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from ..naming import collection_of
from .base import Requirement, Rule, reductions_at, values_at


@dataclass
class ExplodingTensor(Rule):
    """NaN or ±Inf in a captured tensor or scalar: training has blown up."""

    collections: list = field(default_factory=list)  # restrict to these collections; empty = every one captured
    regex: str = ""  # restrict to tensor names matching this (re.search)

    name = "exploding_tensor"
    modes = ("train", "eval", "predict")
    condition = ("a captured tensor holds a NaN or ±Inf (reduction nonfinite_count > 0, or any reduction or "
                 "scalar not finite) at the step evaluated")
    hint = ("Values overflowed. Likely causes: a learning rate too high, a division by ~0 or log(0) in the loss, "
            "no gradient clipping, fp16 overflow. Try: lower the learning rate (10x), clip gradients "
            "(gradient_clip_val / clipnorm), add an epsilon to divisions and logs, check inputs for NaN, use "
            "bf16 or loss scaling with mixed precision.")
    source = "smdebug ExplodingTensor (only_nan=False): any non-finite value in the saved tensors."

    def requires(self):
        return [Requirement("losses"), Requirement("*", ("nonfinite_count",))]

    def check(self, run, step):
        recorded = reductions_at(run, step, self.collections, self.regex)
        if recorded is not None:
            bad = {name: count for name, values in recorded.items() if (count := _nonfinite_in(values))}
        else:
            pattern = re.compile(self.regex) if self.regex else None
            bad = {}
            for name in run.tensor_names(step=step):
                if (self.collections and collection_of(name) not in self.collections) or (
                        pattern and not pattern.search(name)):
                    continue
                count = _nonfinite(run.tensor(name), step)
                if count:
                    bad[name] = count
        if not bad:
            return None
        first = next(iter(bad))
        what = f"holds {int(bad[first])} NaN/Inf values" if bad[first] > 1 else "is not finite (NaN or Inf)"
        more = f"; so do {len(bad) - 1} more tensors" if len(bad) > 1 else ""
        return self.fire(step, f"{first} {what} at step {step}{more}.", tensors=bad)


def _nonfinite_in(values: dict) -> float:
    """The NaN/Inf count from a tensor's reductions at one step (1 where only a non-finite one shows it)."""
    if "nonfinite_count" in values:
        return values["nonfinite_count"]
    return 1 if any(not math.isfinite(v) for v in values.values()) else 0


def _nonfinite(tensor, step) -> float:
    """The NaN/Inf count of a tensor at a step (1 where only a non-finite reduction or scalar shows it)."""
    reductions = tensor.reductions()
    if "nonfinite_count" in reductions:
        try:
            return tensor.reduction(step, "nonfinite_count")
        except LookupError:
            return 0
    for reduction in reductions:
        try:
            value = tensor.reduction(step, reduction)
        except LookupError:
            continue
        if not math.isfinite(value):
            return 1
    return 0


@dataclass
class AllZero(Rule):
    """Tensors that are entirely (or almost entirely) zero."""

    threshold: float = 100.0  # percent of elements
    collections: list = field(default_factory=lambda: ["weights", "gradients"])
    regex: str = ""

    name = "all_zero"
    condition = "at least `threshold` % of a tensor's elements are exactly zero (reduction zero_fraction)"
    hint = ("A tensor is all zeros. Weights: zero initialisation (every unit computes the same thing and gets "
            "the same update). Gradients: nothing flows back (dead units, detached graph, a loss that does not "
            "depend on the parameter). Activations (add them to `collections`): dead units or an input of "
            "zeros. Try: a random initialiser (He/Glorot), check the forward pass and what the loss depends on.")
    source = "smdebug AllZero: threshold 100 (percent); collections to check must be named (here a default set)."

    def requires(self):
        return [Requirement(c, ("zero_fraction",)) for c in self.collections]

    def check(self, run, step):
        zero = {n: v for n, v in values_at(run, step, "zero_fraction", self.collections, self.regex).items()
                if v * 100 >= self.threshold}
        if not zero:
            return None
        first = next(iter(zero))
        return self.fire(step, f"{first} is {zero[first]:.0%} zeros" +
                         (f"; so are {len(zero) - 1} more tensors." if len(zero) > 1 else "."), tensors=zero)


@dataclass
class TensorVariance(Rule):
    """Tensors whose values spread far too much or hardly at all."""

    max_threshold: float = 10.0
    min_threshold: float = 1e-5
    collections: list = field(default_factory=lambda: ["weights"])
    regex: str = ""

    name = "tensor_variance"
    condition = "a tensor's variance (reduction var) is above `max_threshold` or below `min_threshold`"
    hint = ("Weight variance out of range. Too large: initialisation too wide or weights growing without bound "
            "(learning rate too high, no weight decay). Too small: weights collapsed (too much weight decay, "
            "constant initialisation) so the layer cannot tell inputs apart. Try: He/Glorot initialisation, a "
            "lower learning rate, weight decay tuned; note that very wide layers (fan-in > 30,000) have a small "
            "variance by design.")
    source = ("smdebug TensorVariance (no default thresholds); max 10 and min 1e-5 from the AWS documentation's "
              "example, also used by DeepDiagnosis (Wardat et al., ICSE 2022).")

    def requires(self):
        return [Requirement(c, ("var",)) for c in self.collections]

    def check(self, run, step):
        out = {n: v for n, v in values_at(run, step, "var", self.collections, self.regex).items()
               if v > self.max_threshold or v < self.min_threshold}
        if not out:
            return None
        first = next(iter(out))
        side = "above" if out[first] > self.max_threshold else "below"
        bound = self.max_threshold if side == "above" else self.min_threshold
        return self.fire(step, f"{first} has variance {out[first]:.3g}, {side} {bound:g}" +
                         (f"; {len(out) - 1} more tensors are out of range." if len(out) > 1 else "."),
                         tensors=out)


@dataclass
class UnchangedTensor(Rule):
    """Tensors that stopped changing: layers that no longer train (blind spots)."""

    num_steps: int = 3
    rtol: float = 1e-5
    atol: float = 1e-8
    collections: list = field(default_factory=lambda: ["weights"])
    regex: str = ""

    name = "unchanged_tensor"
    condition = ("a tensor's values are allclose (rtol, atol) over its last `num_steps` samples: its full values "
                 "where saved, else every captured reduction (l2, mean, min, max)")
    hint = ("These layers stopped training (blind spots). Likely causes: their parameters are not in the "
            "optimizer or are frozen by mistake, a learning rate of 0 (or a schedule that decayed to 0), "
            "gradients that never reach them (detached graph, dead units). Try: check optimizer param groups and "
            "requires_grad, the learning-rate schedule, and the gradients collection for these layers.")
    source = "smdebug UnchangedTensor: num_steps 3, rtol 1e-5, atol 1e-8 (numpy.allclose defaults)."

    @property
    def history(self):
        return self.num_steps

    def requires(self):
        return [Requirement(c, ("l2", "mean", "min", "max")) for c in self.collections]

    def check(self, run, step):
        pattern = re.compile(self.regex) if self.regex else None
        names = [n for n in run.tensor_names(step=step) if collection_of(n) in self.collections
                 and (pattern is None or pattern.search(n))]
        unchanged = [n for n in names if self._unchanged(run.tensor(n), step)]
        if not unchanged:
            return None
        training = [n for n in names if n not in unchanged]
        return self.fire(step, f"{len(unchanged)} of {len(names)} tensors did not change over their last "
                               f"{self.num_steps} samples: {', '.join(unchanged[:5])}"
                               + (" …" if len(unchanged) > 5 else "") + ".",
                         unchanged=unchanged, still_training=training)

    def _unchanged(self, tensor, step) -> bool:
        saved = tensor.steps(tensors=True)[-self.num_steps:]
        if len(saved) == self.num_steps and saved[-1] == step:  # full values: compare them
            values = [tensor.value(s) for s in saved]
            return all(np.allclose(a, b, self.rtol, self.atol) for a, b in zip(values, values[1:]))
        compared = False
        captured = tensor.reductions()
        for reduction in ("l2", "mean", "min", "max"):  # one at a time: a tensor that trains differs in the first
            if reduction not in captured:
                continue
            steps, last = tensor.tail(reduction, self.num_steps)
            if len(steps) < self.num_steps or steps[-1] != step:
                return False
            # np.allclose's test, without its cost for a few numbers
            if not all(a == b or abs(a - b) <= self.atol + self.rtol * abs(b) for a, b in zip(last[1:], last)):
                return False
            compared = True
        return compared
