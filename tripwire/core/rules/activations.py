"""Rules over layer outputs."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Requirement, Rule, held, values_at


@dataclass
class DeadRelu(Rule):
    """ReLU units that output zero for every input, so they no longer learn."""

    threshold_layer: float = 70.0  # percent of a layer's units
    patience: int = 3

    name = "dead_relu"
    condition = ("in a ReLU layer, more than `threshold_layer` % of the units are never positive over the sampled "
                 "batch (reduction dead_fraction, taken on batches of at least 16 samples) at each of the last "
                 "`patience` samples; an error where every unit of the layer is dead; layers holding NaN/Inf are "
                 "left to exploding_tensor")
    hint = ("ReLU units died: they output 0 for every input, so they get no gradient and never recover. Likely "
            "causes: a learning rate too high, large negative biases, poor initialisation. Try: a lower learning "
            "rate, LeakyReLU/ELU/GELU, He initialisation with zero biases, batch normalisation before the ReLU.")
    source = ("smdebug DeadRelu: threshold_layer 50 %, threshold_inactivity 1 % (here a unit counts as dead when "
              "it is active for none of the batch's samples, which is below 1 % for batches of up to 100). A unit "
              "active in a few samples of a hundred looks dead in a batch of 32, and healthy zoo models show up to "
              "56 % of such units in one layer, so here 70 % over 3 samples; the faults leave 100 %.")

    def requires(self):
        return [Requirement("activations", ("dead_fraction",), include=("relu",))]

    def check(self, run, step):
        dead = values_at(run, step, "dead_fraction", ["activations"])
        nonfinite = values_at(run, step, "nonfinite_count", ["activations"])
        dead = {n: v for n, v in dead.items() if v * 100 > self.threshold_layer and not nonfinite.get(n)
                and held(run, n, "dead_fraction", self.patience, step, lambda d: d * 100 > self.threshold_layer)}
        return [self.fire(step, f"{share:.0%} of the units of {name} are dead (never positive in the batch) at "
                                f"{self.patience} samples in a row; limit {self.threshold_layer:g}%.",
                          severity="error" if share >= 1.0 else "warning", finding=name, layer=name, share=share)
                for name, share in dead.items()] or None


@dataclass
class SaturatedActivation(Rule):
    """tanh or sigmoid units stuck at their bounds, where their gradient is ~0."""

    threshold_layer: float = 50.0  # percent of a layer's units
    patience: int = 2

    name = "saturated_activation"
    condition = ("in a tanh or sigmoid layer, more than `threshold_layer` % of the units are saturated (input "
                 "beyond ±9.4999 for tanh, outside (-23, 16.99999) for sigmoid) in at least 99% of the batch "
                 "(reduction saturated_fraction, computed from the layer's outputs on batches of at least 16 "
                 "samples) at each of the last `patience` samples")
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
                     if v * 100 > self.threshold_layer and held(run, n, "saturated_fraction", self.patience, step,
                                                                lambda f: f * 100 > self.threshold_layer)}
        return [self.fire(step, f"{share:.0%} of the units of {name} are saturated at {self.patience} samples in a "
                                f"row; limit {self.threshold_layer:g}%.", finding=name, layer=name, share=share)
                for name, share in saturated.items()] or None
