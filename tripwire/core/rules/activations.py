"""Rules over layer outputs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import Requirement, Rule, values_at


@dataclass
class DeadRelu(Rule):
    """ReLU units that output zero for every input, so they no longer learn."""

    threshold_layer: float = 50.0  # percent of a layer's units

    name = "dead_relu"
    condition = ("in a ReLU layer, more than `threshold_layer` % of the units are never positive over the sampled "
                 "batch (reduction dead_fraction); layers holding NaN/Inf are left to exploding_tensor")
    hint = ("ReLU units died: they output 0 for every input, so they get no gradient and never recover. Likely "
            "causes: a learning rate too high, large negative biases, poor initialisation. Try: a lower learning "
            "rate, LeakyReLU/ELU/GELU, He initialisation with zero biases, batch normalisation before the ReLU.")
    source = ("smdebug DeadRelu: threshold_layer 50 %, threshold_inactivity 1 % (here a unit counts as dead when "
              "it is active for none of the batch's samples, which is below 1 % for batches of up to 100).")

    def requires(self):
        return [Requirement("activations", ("dead_fraction",), include=("relu",))]

    def check(self, run, step):
        dead = values_at(run, step, "dead_fraction", ["activations"])
        nonfinite = values_at(run, step, "nonfinite_count", ["activations"])
        dead = {n: v for n, v in dead.items() if v * 100 > self.threshold_layer and not nonfinite.get(n)}
        if not dead:
            return None
        name = max(dead, key=dead.get)
        return self.fire(step, f"{dead[name]:.0%} of the units of {name} are dead (never positive in the batch); "
                               f"limit {self.threshold_layer:g}%.", layers=dead)


@dataclass
class SaturatedActivation(Rule):
    """tanh or sigmoid units stuck at their bounds, where their gradient is ~0."""

    threshold_layer: float = 50.0  # percent of a layer's units

    name = "saturated_activation"
    condition = ("in a tanh or sigmoid layer, more than `threshold_layer` % of the units are saturated (input "
                 "beyond ±9.4999 for tanh, outside (-23, 16.99999) for sigmoid) in at least 99% of the batch "
                 "(reduction saturated_fraction, computed from the layer's outputs)")
    hint = ("The activations sit at their flat ends, where the gradient is ~0, so these units stop learning. "
            "Likely causes: inputs not normalised, weights initialised too large, a learning rate too high. Try: "
            "normalise inputs, Glorot (Xavier) initialisation, batch normalisation before the activation, or "
            "ReLU/GELU instead.")
    source = ("smdebug SaturatedActivation: threshold_tanh (-9.4999, 9.4999), threshold_sigmoid (-23, 16.99999), "
              "threshold_inactivity 1 %, threshold_layer 50 %.")

    def requires(self):
        return [Requirement("activations", ("saturated_fraction",), include=("tanh", "sigmoid"))]

    def check(self, run, step):
        saturated = {n: v for n, v in values_at(run, step, "saturated_fraction", ["activations"]).items()
                     if not math.isnan(v) and v * 100 > self.threshold_layer}
        if not saturated:
            return None
        name = max(saturated, key=saturated.get)
        return self.fire(step, f"{saturated[name]:.0%} of the units of {name} are saturated; limit "
                               f"{self.threshold_layer:g}%.", layers=saturated)
