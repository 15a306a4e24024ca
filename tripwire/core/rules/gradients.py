"""Rules over gradients."""

from __future__ import annotations

from dataclasses import dataclass

from ..naming import is_bias, path_of
from .base import Requirement, Rule, values_at


@dataclass
class VanishingGradient(Rule):
    """Gradients so small that the layers they reach stop learning."""

    threshold: float = 1e-7

    name = "vanishing_gradient"
    condition = "the mean absolute value (abs_mean) of any captured gradient is below `threshold`"
    hint = ("Gradients vanish before reaching the early layers. Likely causes: saturating activations (sigmoid, "
            "tanh) in a deep stack, poor initialisation, a learning rate so small that nothing moves. Try: ReLU, "
            "GELU or SELU instead of sigmoid/tanh; batch or layer normalisation; residual connections; He "
            "(Kaiming) initialisation; a larger learning rate.")
    source = "smdebug VanishingGradient: mean(|gradient|) < threshold, default 1e-7 (DeepDiagnosis uses the same)."

    def requires(self):
        return [Requirement("gradients", ("abs_mean",))]

    def check(self, run, step):
        small = {n: v for n, v in values_at(run, step, "abs_mean", ["gradients"]).items() if v < self.threshold}
        if not small:
            return None
        name = min(small, key=small.get)
        return self.fire(step, f"{len(small)} gradient(s) have mean |g| below {self.threshold:g}; the smallest is "
                               f"{name} at {small[name]:.3g}.", gradients=small, threshold=self.threshold)


@dataclass
class ExplodingGradient(Rule):
    """Gradients that grow on their way back to the input, or that are simply too large."""

    ratio_threshold: float = 70.0
    max_norm: float = 1000.0

    name = "exploding_gradient"
    condition = ("the L2 norm of the first layer's weight gradient is more than `ratio_threshold` times the last "
                 "layer's (layers in the model's order), or any gradient's L2 norm exceeds `max_norm`")
    hint = ("Gradients grow as they flow back through the layers, so early layers take huge steps. Likely causes: "
            "weights initialised too large, no normalisation, a deep stack without residual connections, a "
            "learning rate too high. Try: gradient clipping (gradient_clip_val / clipnorm), He or Glorot "
            "initialisation, batch or layer normalisation, a lower learning rate.")
    source = ("AUTOTRAINER (Zhang et al., ICSE 2021) exploding gradient: first/last layer gradient-norm ratio > 70 "
              "(beta_3); the absolute bound `max_norm` is tripwire's own.")

    def requires(self):
        return [Requirement("gradients", ("l2",))]

    def check(self, run, step):
        norms = values_at(run, step, "l2", ["gradients"])
        large = {n: v for n, v in norms.items() if v > self.max_norm}
        if large:
            name = max(large, key=large.get)
            return self.fire(step, f"{name} has L2 norm {large[name]:.3g}, above {self.max_norm:g}.",
                             gradients=large, max_norm=self.max_norm)
        weights = [n for n in norms if not is_bias(path_of(n))]
        if len(weights) < 2 or not norms[weights[-1]] > 0:
            return None
        ratio = norms[weights[0]] / norms[weights[-1]]
        if ratio > self.ratio_threshold:
            return self.fire(step, f"the first layer's gradient ({weights[0]}, L2 {norms[weights[0]]:.3g}) is "
                                   f"{ratio:.0f}x the last layer's ({weights[-1]}, L2 {norms[weights[-1]]:.3g}); "
                                   f"limit {self.ratio_threshold:g}x.", ratio=ratio, first=weights[0],
                             last=weights[-1])
        return None
