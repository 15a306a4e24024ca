"""Rules over the data fed to the model."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import COUNT
from .base import Requirement, Rule

STATISTICS = ("mean", "std", "min", "max")


@dataclass
class InputNotNormalized(Rule):
    """Inputs on a scale far from the unit one (raw pixels 0-255, raw measurements), which slows or breaks training."""

    max_mean: float = 5.0
    max_std: float = 5.0
    samples: int = 3  # batches pooled before the rule decides

    name = "input_not_normalized"
    limits = {"samples": COUNT}
    condition = ("over the newest `samples` sampled batches of float inputs (collection `inputs`; integer inputs "
                 "such as token ids are not captured), pooled: values outside [-1, 1] (data scaled to [0, 1] or "
                 "[-1, 1] is normalised) with a mean further than `max_mean` from 0 or a standard deviation above "
                 "`max_std`")
    hint = ("The inputs are not normalised, so early layers see badly scaled values (saturation, huge gradients, "
            "slow training). Try: standardise each feature with the training set's mean and std, or scale images "
            "to [0, 1] (divide by 255) and then normalise per channel; make sure the same transform is applied at "
            "evaluation.")
    source = ("smdebug CheckInputImages (|mean| > 0.2) and DeepDiagnosis (Wardat et al., ICSE 2022: inputs outside "
              "[-1, 1]) fire on images scaled to [0, 1], on one-hot features and on one small batch's mean; here "
              "bounded data is accepted and the scale is judged over several batches, against bounds that "
              "standardised data keeps.")

    @property
    def history(self):
        return self.samples

    def requires(self):
        return [Requirement("inputs", STATISTICS)]

    def check(self, run, step):
        found = []
        for name in run.tensor_names("inputs", step=step):
            tensor = run.tensor(name)
            if not set(STATISTICS) <= set(tensor.reductions()):
                continue
            tails = {r: tensor.tail(r, self.samples) for r in STATISTICS}
            steps = tails["mean"][0]
            if len(steps) < self.samples or steps[-1] != step or any(t[0] != steps for t in tails.values()):
                continue
            means, stds, lows, highs = (tails[r][1] for r in STATISTICS)
            if not all(math.isfinite(v) for t in tails.values() for v in t[1]):
                continue  # NaN in the inputs is exploding_tensor's
            if min(lows) >= -1.0 and max(highs) <= 1.0:
                continue
            mean = sum(means) / len(means)
            std = math.sqrt(max(sum(s * s + m * m for s, m in zip(stds, means)) / len(means) - mean * mean, 0.0))
            if abs(mean) > self.max_mean or std > self.max_std:
                found.append(self.fire(step, f"{name} has mean {mean:.3g} and std {std:.3g} over its last "
                                             f"{self.samples} sampled batches (values from {min(lows):.3g} to "
                                             f"{max(highs):.3g}); normalised data keeps its mean within "
                                             f"±{self.max_mean:g} and its std below {self.max_std:g}.",
                                       finding=name, onset=steps[0], tensor=name, mean=mean, std=std))
        return found or None
