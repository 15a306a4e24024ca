"""Rules over gradients."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Requirement, Rule


@dataclass
class VanishingGradient(Rule):
    threshold: float = 1e-7

    name = "vanishing_gradient"
    condition = "the mean absolute value (abs_mean) of any captured gradient is below `threshold`"
    hint = ("Gradients vanish before reaching the early layers. Likely causes: saturating activations (sigmoid, "
            "tanh) in a deep stack, poor initialisation, a learning rate so small that nothing moves. Try: ReLU, "
            "GELU or SELU instead of sigmoid/tanh; batch or layer normalisation; residual connections; He "
            "(Kaiming) initialisation; a larger learning rate.")
    source = "smdebug VanishingGradient: mean(|gradient|) < 1e-7 (threshold default 1e-7)."

    def requires(self):
        return [Requirement("gradients", ("abs_mean",))]

    def check(self, run, step):
        small = {}
        for name in run.tensor_names("gradients"):
            tensor = run.tensor(name)
            if "abs_mean" not in tensor.reductions():
                continue
            try:
                value = tensor.reduction(step, "abs_mean")
            except LookupError:
                continue
            if value < self.threshold:
                small[name] = value
        if not small:
            return None
        name = min(small, key=small.get)
        return self.fire(step, f"{len(small)} gradient(s) have mean |g| below {self.threshold:g}; the smallest is "
                               f"{name} at {small[name]:.3g}.", gradients=small, threshold=self.threshold)
