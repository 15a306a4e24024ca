"""Rules over the data fed to the model."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Requirement, Rule, values_at


@dataclass
class InputNotNormalized(Rule):
    """Inputs far from zero mean and unit spread, which slows or breaks training."""

    threshold_mean: float = 0.2
    max_std_ratio: float = 5.0

    name = "input_not_normalized"
    condition = ("a batch of inputs (collection `inputs`) has a mean further than `threshold_mean` from 0, or a "
                 "standard deviation above `max_std_ratio` or below 1/`max_std_ratio`")
    hint = ("The inputs are not normalised, so early layers see badly scaled values (saturation, huge gradients, "
            "slow training). Try: standardise each feature with the training set's mean and std, or scale images "
            "to [0, 1] and then normalise per channel; make sure the same transform is applied at evaluation.")
    source = ("smdebug CheckInputImages: |mean| > 0.2 (threshold_mean); the spread check follows DeepDiagnosis "
              "(Wardat et al., ICSE 2022), which flags inputs outside [-1, 1].")

    def requires(self):
        return [Requirement("inputs", ("mean", "std"))]

    def check(self, run, step):
        means, stds = values_at(run, step, "mean", ["inputs"]), values_at(run, step, "std", ["inputs"])
        for name, mean in means.items():
            std = stds.get(name)
            if abs(mean) > self.threshold_mean or (std is not None and not (
                    1 / self.max_std_ratio <= std <= self.max_std_ratio)):
                return self.fire(step, f"{name} has mean {mean:.3g} and std {std:.3g}; expected a mean within "
                                       f"±{self.threshold_mean:g} and a std within {1 / self.max_std_ratio:g} to "
                                       f"{self.max_std_ratio:g}.", mean=mean, std=std)
        return None
