"""Rules over layer outputs."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..ranges import COUNT, PERCENT, SHARE
from .base import NotApplicable, Requirement, Rule, held, loss_fell_below, values_at
from .baselines import untrained_loss


@dataclass
class DeadRelu(Rule):
    """ReLU units that output zero for every input, so they no longer learn."""

    threshold_layer: float = 70.0  # percent of a layer's units
    patience: int = 3
    learned: float = 0.5  # some units alive, and a training loss below this share of an untrained model's: info

    name = "dead_relu"
    limits = {"threshold_layer": PERCENT, "patience": COUNT, "learned": SHARE}
    condition = ("in a ReLU layer (in torch, also a ReLU applied as a function to a layer's output, "
                 "`activations/fc1:relu`), more than `threshold_layer` % of the units are never positive over the "
                 "sampled batch (reduction dead_fraction, taken on batches of at least 16 samples; a unit is an "
                 "output feature, a convolution's channel over every position, since its weights are shared across "
                 "them) at each of the last `patience` samples; an error where every unit of the layer is dead; "
                 "info where some are alive and the training loss is below `learned` times what an untrained "
                 "model scores (the smaller of its first loss and ln C, or its targets' variance under mean squared "
                 "error): the units left carry a model that learns; "
                 "layers holding NaN/Inf are left to exploding_tensor")
    hint = ("ReLU units died: they output 0 for every input, so they get no gradient and never recover. Likely "
            "causes: a learning rate too high, large negative biases, poor initialisation. Try: a lower learning "
            "rate, LeakyReLU/ELU/GELU, He initialisation with zero biases, batch normalisation before the ReLU.")
    source = ("smdebug DeadRelu: threshold_layer 50 %, threshold_inactivity 1 % (here a unit counts as dead when "
              "it is active for none of the batch's samples, which is below 1 % for batches of up to 100). A unit "
              "active in a few samples of a hundred looks dead in a batch of 32, and healthy zoo models showed up to "
              "56 % of such units in one layer (counted per position then), so here 70 % over 3 samples; the "
              "faults leave 100 %.")

    def requires(self):
        return [Requirement("activations", ("dead_fraction",), include=("relu",)),
                Requirement("biases", ("mean", "max"), optional=True), Requirement("losses", optional=True)]

    def __post_init__(self):
        self._judged: set = set()  # workers whose ReLU layers came in a batch large enough at some sample
        self._first_loss: dict = {}

    def check(self, run, step):
        learns = loss_fell_below(run, step, self._first_loss, self.learned, untrained_loss(run))
        dead = values_at(run, step, "dead_fraction", ["activations"])
        if dead:
            self._judged.add(run.default_worker)
        elif run.default_worker not in self._judged and run.tensor_names("activations", step=step) and \
                not values_at(run, step, "saturated_fraction", ["activations"]):
            # every sample so far too small; an epoch's short last batch after full ones is no reason to say so
            raise NotApplicable("no captured layer has a dead_fraction: its layers' outputs came in batches of "
                                "fewer than 16 samples, too few to tell a dead unit from one that was not needed, "
                                "or they are no ReLU (a LeakyReLU, PReLU or RReLU unit never dies)")
        nonfinite = values_at(run, step, "nonfinite_count", ["activations"])
        found = []
        for name, share in dead.items():
            if share * 100 <= self.threshold_layer or nonfinite.get(name):
                continue
            onset = held(run, name, "dead_fraction", self.patience, step, lambda d: d * 100 > self.threshold_layer)
            if onset is None:
                continue
            layer, where, hint = _behind(run, step, name)
            severity = "error" if share >= 1.0 else "info" if learns else "warning"
            found.append(self.fire(step, f"{share:.0%} of the units of {name}{where} are dead (never positive in the "
                                         f"batch) at {self.patience} samples in a row since step {onset}; limit "
                                         f"{self.threshold_layer:g}%." + (LEARNS if severity == "info" else ""),
                                   severity=severity, finding=name, hint=hint, onset=onset, layer=name,
                                   feeds_from=layer, share=share))
        return found or None


LEARNS = " The units left carry a model that learns (its training loss is below half of an untrained model's)."


def _behind(run, step: int, activation: str) -> tuple[str | None, str, str]:
    """The layer whose output a ReLU takes (from the model's structure), the words that name it in a message, and
    a fix that names it: its biases where they hold every unit below zero."""
    model, path = run.model, activation.split("/", 1)[1]
    layer = run.input_layer(path) if model is not None else None
    if layer is None:
        return None, "", ""
    parameters = model.layer_parameters(layer)
    kind = parameters[0].layer_class if parameters else "layer"
    where = f" (the output of {kind} {layer})" if layer != path else f" ({kind})"
    bias = next((p for p in parameters if p.role == "bias"), None)
    tops = values_at(run, step, "max", ["biases"], f"^biases/{re.escape(bias.path)}$") if bias is not None else {}
    means = values_at(run, step, "mean", ["biases"], f"^biases/{re.escape(bias.path)}$") if bias is not None else {}
    if tops and means:
        top, mean = next(iter(tops.values())), next(iter(means.values()))
        if top < 0:
            return layer, where, (f"Every bias of {kind} {layer} is negative (at most {top:.3g}, mean {mean:.3g}), so "
                                  "its units output nothing positive for the ReLU to pass: initialise its biases to 0 "
                                  "(nn.init.zeros_ / bias_initializer='zeros'), or use LeakyReLU/GELU after it.")
    return layer, where, (f"The ReLU after {kind} {layer} passes nothing back. Try: a lower learning rate, LeakyReLU "
                          f"or GELU after {layer}, He initialisation of {layer} with zero biases, a normalisation "
                          "before the ReLU.")


@dataclass
class SaturatedActivation(Rule):
    """tanh or sigmoid units stuck at their bounds, where their gradient is ~0."""

    threshold_layer: float = 50.0  # percent of a layer's units
    patience: int = 2

    name = "saturated_activation"
    limits = {"threshold_layer": PERCENT, "patience": COUNT}
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
                                                                lambda f: f * 100 > self.threshold_layer) is not None}
        return [self.fire(step, f"{share:.0%} of the units of {name} are saturated at {self.patience} samples in a "
                                f"row; limit {self.threshold_layer:g}%.", finding=name, layer=name, share=share)
                for name, share in saturated.items()] or None
