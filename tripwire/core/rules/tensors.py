"""Rules over any captured tensor."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ..naming import collection_of
from .base import Requirement, Rule


@dataclass
class ExplodingTensor(Rule):
    """Any NaN or ±Inf in a captured tensor or scalar."""

    collections: list = field(default_factory=list)  # restrict to these collections; empty = every one captured
    regex: str = ""  # restrict to tensor names matching this (re.search)

    name = "exploding_tensor"
    modes = ("train", "eval")
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
        pattern = re.compile(self.regex) if self.regex else None
        bad = {}
        for name in run.tensor_names():
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
