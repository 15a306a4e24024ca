"""Rules over weights and their updates, judged on kernels (dense, convolution, recurrent, attention weights)."""

from __future__ import annotations

from dataclasses import dataclass

from ..ranges import COUNT, POSITIVE, SHARE, Range
from ..model import KERNEL_ROLES
from .base import (FIRST_LABELS, Requirement, Rule, few_samples, learning_rates, loss_fell_below, of_roles,
                   schedule_ended, values_at)
from .optimizer import searching


# The variance of the smallest fixed-scale initialiser in common use, normal(0, 0.01) (Caffe's and torchvision's
# detection heads); BERT's and GPT's normal(0, 0.02) and Keras' RandomNormal() and RandomUniform() (0.05) lie above.
# They ignore the fans: on a narrow layer they start far below Glorot, and shallow networks train from them.
FIXED_SCALE = 1e-4


def init_band(fan_in: int, fan_out: int | None) -> tuple[float, float]:
    """The weight variances the standard initialisers give a kernel with these fans: from the smallest of Glorot
    (2 / (fan_in + fan_out)), torch's default (1 / (3 fan_in)) and the fixed-scale initialisers (FIXED_SCALE) to
    He's 2 / fan_in (LeCun's 1 / fan_in lies between)."""
    glorot = 2.0 / (fan_in + (fan_out or fan_in))
    return min(glorot, 1.0 / (3 * fan_in), FIXED_SCALE), 2.0 / fan_in


@dataclass
class PoorWeightInitialization(Rule):
    """Initial weights that keep the network from training: badly scaled for their layer, or all alike."""

    steps: int = 10
    threshold: float = 10.0

    name = "poor_weight_initialization"
    limits = {"steps": COUNT, "threshold": Range(1, what="a factor")}
    condition = ("at the first sample of the first `steps` steps, for each trainable kernel: all its weights are "
                 "equal (std 0: every unit computes the same; the output layer, which breaks the symmetry itself, "
                 "is left out), or its variance is more than `threshold` times above He's 2/fan_in or below the "
                 "smallest of Glorot's 2/(fan_in+fan_out), torch's 1/(3 fan_in) and the fixed-scale initialisers' "
                 "1e-4 (normal(0, 0.01); BERT's 0.02 and Keras' RandomNormal() lie above) divided by `threshold`, "
                 "with the layer's own fans (a grouped or depthwise convolution counted per group; the output layer, "
                 "often started small or at 0 on purpose, is not judged too small). Kernels whose output is "
                 "normalised next are free of scale and judged for equal weights only; kernels of one weight, "
                 "biases, normalisation parameters and embedding tables are left out")
    hint = ("The initial weights are badly scaled or symmetric. Try: a random initialiser suited to the "
            "activation (He/Kaiming for ReLU, Glorot/Xavier for tanh/sigmoid) for every layer, no constant "
            "initialisation of weights (biases may be 0), and normalisation layers.")
    source = ("smdebug PoorWeightInitialization (threshold 10 on the variance ratio across layers, steps 10); here "
              "each kernel is held to the band the standard initialisers (Glorot & Bengio 2010, He et al. 2015, "
              "LeCun et al. 1998, torch's kaiming_uniform(a=sqrt(5))) give its own fans, which needs the model's "
              "structure. smdebug's gradient-percentile check is left out: its fixed span fires on healthy "
              "recurrent and attention kernels at initialisation.")

    def __post_init__(self):
        self._judged: set = set()  # workers already judged

    def requires(self):
        return [Requirement("weights", ("std", "var"), steps=tuple(range(self.steps)))]

    def check(self, run, step):
        model = run.model
        if step >= self.steps or model is None or run.default_worker in self._judged:
            return None
        variances = of_roles(run, values_at(run, step, "var", ["weights"]), KERNEL_ROLES)
        if not variances:
            return None
        self._judged.add(run.default_worker)
        stds = values_at(run, step, "std", ["weights"])
        last = model.kernels()[-1].path if model.kernels() else None
        found = []
        for name, var in variances.items():
            p = model.of(name)
            if p is None or p.fan_in is None or p.size < 2:  # one weight has no spread: equal to itself, variance 0
                continue
            if stds.get(name) == 0 or var == 0:
                if p.path == last:  # the output layer's units differ by their error: zero is a common start
                    continue
                found.append(self.fire(step, f"all weights of {name} are equal ({p.layer_class} {p.layer}): every "
                                             "unit of the layer computes the same thing and gets the same update.",
                                       finding=name, tensor=name))
                continue
            if p.scale_free:
                continue
            low, high = init_band(p.fan_in, p.fan_out)
            if var > high * self.threshold or (var < low / self.threshold and p.path != last):
                side, bound = ("large", high) if var > high else ("small", low)
                # a badly scaled start is a risk many models train through (info); where it does harm (saturated
                # or exploding layers, a weight variance out of bounds) the diagnosis names it as their cause.
                # Equal weights (above) never train apart: a warning
                found.append(self.fire(
                    step, f"{name} ({p.layer_class}, fan-in {p.fan_in}) starts with weight variance {var:.3g}, "
                          f"{var / bound if side == 'large' else bound / var:.0f}x too {side} for its layer: standard "
                          f"initialisations give {low:.3g} to {high:.3g}.", severity="info", finding=name, tensor=name,
                    variance=var, expected=[low, high]))
        return found or None


@dataclass
class WeightUpdateRatio(Rule):
    """Steps that change a kernel by far more than its size (unstable) or by nothing measurable (not learning)."""

    large_threshold: float = 10.0
    small_threshold: float = 1e-8
    patience: int = 2
    fitted: float = 1e-3  # not judged too small once the training loss is below this share of its first value

    name = "weight_update_ratio"
    limits = {"large_threshold": POSITIVE, "patience": COUNT, "fitted": SHARE}
    condition = ("for a trainable kernel, ‖update‖ / ‖weight‖ over one optimizer step (the `updates` collection) "
                 "is above `large_threshold` or below `small_threshold` at each of its last `patience` samples. "
                 "Undefined, so not judged, where ‖weight‖ is 0 (a zero-initialised layer) or the step's learning "
                 "rate is 0 (the start of a warmup); not too small once the training loss is below `fitted` times "
                 "its first value (a model that fits its data exactly has nothing left to learn), nor once the "
                 "learning rate is below 1/1000 of its largest so far (the end of a schedule, a plateau cut again "
                 "and again: the weights are meant to stop moving), nor at exactly 0 "
                 "where batches hold fewer than 16 samples (one sample of zeros gives the first layer no gradient, "
                 "and a step without momentum no update); a parameter no "
                 "optimizer stepped has no update; not judged for "
                 "an optimizer that searches within its step (LBFGS: a step may rewrite the weights, and once "
                 "converged leaves them as they are)")
    hint = ("Too large: each step rewrites the weights (learning rate too high, exploding gradients): lower the "
            "learning rate, clip gradients, warm up. Too small: the weights barely move (learning rate too low "
            "or decayed to 0, vanishing gradients): raise the learning rate, check the schedule. A healthy ratio "
            "is around 1e-3.")
    source = ("smdebug WeightUpdateRatio: large_threshold 10, small_threshold 1e-8; here on kernels only, over "
              "`patience` samples, and undefined where the weight norm or the learning rate is 0.")

    def __post_init__(self):
        self._first_loss: dict = {}  # worker -> the first training loss seen
        self._peak_rate: dict = {}  # worker -> the largest learning rate seen

    def requires(self):
        return [Requirement("updates", ("l2",)), Requirement("weights", ("l2",)),
                Requirement("optimizer", optional=True), Requirement("losses", optional=True), FIRST_LABELS]

    def check(self, run, step):
        rates = learning_rates(run, step)
        if (rates is not None and not any(rates)) or searching(run):
            return None
        fitted = loss_fell_below(run, step, self._first_loss, self.fitted) or \
            schedule_ended(max(rates) if rates else None, self._peak_rate, run.default_worker)
        zero_explained = few_samples(run)  # a batch of a few samples may give no gradient, so no update
        updates = of_roles(run, values_at(run, step, "l2", ["updates"]), KERNEL_ROLES)
        found = []
        for name in updates:
            weight = "weights/" + name.split("/", 1)[1]
            ratios = self._ratios(run, name, weight)
            if len(ratios) < self.patience or ratios[-1][0] != step:
                continue
            last = [r for _, r in ratios[-self.patience:]]
            too_small = not fitted and all(r < self.small_threshold and not (r == 0 and zero_explained) for r in last)
            for side, beyond in (("large", all(r > self.large_threshold for r in last)), ("small", too_small)):
                if beyond:
                    found.append(self.fire(step, f"{name}: ‖update‖/‖weight‖ = {last[-1]:.3g}, too {side} (allowed "
                                                 f"{self.small_threshold:g} to {self.large_threshold:g}) at "
                                                 f"{self.patience} samples in a row.", finding=f"{name}:{side}",
                                           onset=ratios[-self.patience][0], tensor=name, ratios=last))
        return found or None

    def _ratios(self, run, update: str, weight: str) -> list[tuple[int, float]]:
        """(step, ‖update‖/‖weight‖) at the newest samples holding both, where the weight is not 0."""
        if weight not in run.tensor_names("weights"):
            return []
        u_steps, u = run.tensor(update).tail("l2", self.patience)
        w_steps, w = run.tensor(weight).tail("l2", self.patience)
        by_step = dict(zip(w_steps, w))
        return [(s, v / by_step[s]) for s, v in zip(u_steps, u) if by_step.get(s)]
