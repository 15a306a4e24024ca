"""Rules over layer outputs."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Requirement, Rule


@dataclass
class DeadRelu(Rule):
    threshold_layer: float = 50.0  # percent of a layer's units

    name = "dead_relu"
    condition = ("in a ReLU layer, more than `threshold_layer` % of the units are never positive over the sampled "
                 "batch (reduction dead_fraction)")
    hint = ("ReLU units died: they output 0 for every input, so they get no gradient and never recover. Likely "
            "causes: a learning rate too high, large negative biases, poor initialisation. Try: a lower learning "
            "rate, LeakyReLU/ELU/GELU, He initialisation with zero biases, batch normalisation before the ReLU.")
    source = ("smdebug DeadRelu: threshold_layer 50 %, threshold_inactivity 1 % (here a unit counts as dead when "
              "it is active for none of the batch's samples, which is below 1 % for batches of up to 100).")

    def requires(self):
        return [Requirement("activations", ("dead_fraction",), include=("relu",))]

    def check(self, run, step):
        dead = {}
        for name in run.tensor_names("activations"):
            tensor = run.tensor(name)
            if "dead_fraction" not in tensor.reductions():
                continue
            try:
                value = tensor.reduction(step, "dead_fraction")
                if "nonfinite_count" in tensor.reductions() and tensor.reduction(step, "nonfinite_count"):
                    continue  # NaN is not "never positive": exploding_tensor reports it
            except LookupError:
                continue
            if value * 100 > self.threshold_layer:
                dead[name] = value
        if not dead:
            return None
        name = max(dead, key=dead.get)
        return self.fire(step, f"{dead[name]:.0%} of the units of {name} are dead (never positive in the batch); "
                               f"limit {self.threshold_layer:g}%.", layers=dead)
