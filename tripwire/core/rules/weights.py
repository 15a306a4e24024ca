"""Rules over weights and their updates."""

from __future__ import annotations

from dataclasses import dataclass

from ..naming import is_bias, path_of
from .base import Requirement, Rule, values_at


@dataclass
class PoorWeightInitialization(Rule):
    """An initialisation that keeps the network from training well, seen in its first steps."""

    steps: int = 10
    threshold: float = 10.0
    distribution_range: float = 0.001

    name = "poor_weight_initialization"
    condition = ("in the first `steps` steps: (a) all weights of a layer are identical (std 0: constant or "
                 "zero initialisation, so every unit computes the same), or (b) across layers, the largest "
                 "weight variance scaled by the layer's fan-in (var × fan_in, which standard initialisations keep "
                 "between about 1/3 and 2) is more than `threshold` times the smallest, or (c) some weight "
                 "gradient's 5th-95th percentile span is below `distribution_range`; 1-D weights (normalisation "
                 "layers) and embedding tables are left out")
    hint = ("The initial weights are badly scaled or symmetric. Try: a random initialiser suited to the "
            "activation (He/Kaiming for ReLU, Glorot/Xavier for tanh/sigmoid) for every layer, no constant "
            "initialisation of weights (biases may be 0), and normalisation layers.")
    source = ("smdebug PoorWeightInitialization: threshold 10 (variance ratio across layers; here scaled by "
              "fan-in so that layers of different widths compare), distribution_range 0.001 (gradient P95-P5), "
              "steps 10; its loss-convergence check is left to loss_not_decreasing.")

    def requires(self):
        first = tuple(range(self.steps))
        return [Requirement("weights", ("std", "var", "fan_in"), steps=first),
                Requirement("gradients", ("p5", "p95"), steps=first)]

    def check(self, run, step):
        if step >= self.steps:
            return None
        fan_in = {n: v for n, v in values_at(run, step, "fan_in", ["weights"]).items() if v > 1}
        identical = [n for n, v in values_at(run, step, "std", ["weights"]).items() if v == 0 and n in fan_in]
        if identical:
            return self.fire(step, f"all weights of {identical[0]} are identical: every unit of the layer computes "
                                   "the same thing and gets the same update.", identical=identical)
        scaled = {n: v * fan_in[n] for n, v in values_at(run, step, "var", ["weights"]).items()
                  if n in fan_in and v > 0}
        if len(scaled) >= 2 and max(scaled.values()) / min(scaled.values()) > self.threshold:
            hi, lo = max(scaled, key=scaled.get), min(scaled, key=scaled.get)
            return self.fire(step, f"weight scale differs {scaled[hi] / scaled[lo]:.0f}x across layers (var x "
                                   f"fan_in: {hi} {scaled[hi]:.3g} vs {lo} {scaled[lo]:.3g}); limit "
                                   f"{self.threshold:g}x.", scaled_variances=scaled)
        p5, p95 = values_at(run, step, "p5", ["gradients"]), values_at(run, step, "p95", ["gradients"])
        spans = {n: p95[n] - p5[n] for n in p5 if n in p95 and not is_bias(path_of(n))}
        narrow = {n: v for n, v in spans.items() if v < self.distribution_range}
        if narrow:
            name = min(narrow, key=narrow.get)
            return self.fire(step, f"the gradient of {name} spans only {narrow[name]:.3g} between its 5th and 95th "
                                   f"percentiles; limit {self.distribution_range:g}.", spans=narrow)
        return None


@dataclass
class WeightUpdateRatio(Rule):
    """Steps that change the weights too much (unstable) or hardly at all (not learning)."""

    large_threshold: float = 10.0
    small_threshold: float = 1e-8
    epsilon: float = 1e-9

    name = "weight_update_ratio"
    condition = ("for a weight tensor, ‖update‖ / (‖weight‖ + epsilon) over one step is above `large_threshold` "
                 "or below `small_threshold` (needs the `updates` collection: the step's change of each parameter)")
    hint = ("Too large: each step rewrites the weights (learning rate too high, exploding gradients): lower the "
            "learning rate, clip gradients, warm up. Too small: the weights barely move (learning rate too low "
            "or decayed to 0, vanishing gradients, frozen layers): raise the learning rate, check the schedule "
            "and the optimizer's parameter groups. A healthy ratio is around 1e-3.")
    source = "smdebug WeightUpdateRatio: large_threshold 10, small_threshold 1e-8, epsilon 1e-9."

    def requires(self):
        return [Requirement("updates", ("l2",)), Requirement("weights", ("l2",))]

    def check(self, run, step):
        updates = values_at(run, step, "l2", ["updates"])
        weights = values_at(run, step, "l2", ["weights"])
        ratios = {}
        for name, update in updates.items():
            weight = weights.get("weights/" + path_of(name))
            if weight is not None:
                ratios[name] = update / (weight + self.epsilon)
        out = {n: r for n, r in ratios.items() if r > self.large_threshold or r < self.small_threshold}
        if not out:
            return None
        name = next(iter(out))
        side = "large" if out[name] > self.large_threshold else "small"
        return self.fire(step, f"{name}: ‖update‖/‖weight‖ = {out[name]:.3g}, too {side} (allowed "
                               f"{self.small_threshold:g} to {self.large_threshold:g})"
                         + (f"; {len(out) - 1} more tensors too." if len(out) > 1 else "."), ratios=out)
