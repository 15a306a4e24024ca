"""Rules over any captured tensor."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ..firststep import task_of
from ..ranges import PERCENT, SHARE
from ..model import KERNEL_ROLES
from ..naming import collection_of
from .base import FIRST_LABELS, Requirement, Rule, few_samples, loss_fell_below, of_roles, reductions_at, values_at
from .origins import ORIGIN, origin_of
from .weights import init_band


@dataclass
class ExplodingTensor(Rule):
    """NaN or ±Inf in a captured tensor or scalar: training has blown up."""

    collections: list = field(default_factory=list)  # restrict to these collections; empty = every one captured
    regex: str = ""  # restrict to tensor names matching this (re.search)

    name = "exploding_tensor"
    modes = ("train", "eval", "predict")
    severity = "error"
    condition = ("a captured tensor holds a NaN or ±Inf at the step evaluated: its reduction nonfinite_count is "
                 "above 0, or, for a tensor captured without it, a scalar or reduction is not finite (a reduction "
                 "that does not apply to a tensor is absent, never NaN). Where the plugin found where the NaN "
                 "began (the probe and Lightning where the loss is on the CPU; Keras on TensorFlow without XLA, "
                 "on JAX, and on torch with the loss on the CPU: the step's forward replayed from the state before "
                 "its update, `origin/<module>`), the verdict names the module, what came into it, and the change "
                 "to make")
    hint = ("Values overflowed. Likely causes: a learning rate too high, a division by ~0 or log(0) in the loss, "
            "no gradient clipping, fp16 overflow. Try: lower the learning rate (10x), clip gradients "
            "(gradient_clip_val / clipnorm), add an epsilon to divisions and logs, check inputs for NaN, use "
            "bf16 or loss scaling with mixed precision.")
    source = "smdebug ExplodingTensor (only_nan=False): any non-finite value in the saved tensors."

    def __post_init__(self):
        self._episodes: dict = {}  # (worker, collection) -> [blow-ups reported, finite since the last one]

    def requires(self):
        return [Requirement("losses"), Requirement("*", ("nonfinite_count",))]

    def check(self, run, step):
        bad = self._nonfinite(run, step)
        collections = {collection_of(name) for name in run.tensor_names(step=step)}
        for collection in collections - {collection_of(name) for name in bad}:  # finite again: a new blow-up is news
            episode = self._episodes.get((run.default_worker, collection))
            if episode is not None:
                episode[1] = True
        if not bad:
            return None
        found = [name for name in bad if collection_of(name) != ORIGIN] or list(bad)
        first = found[0]
        what = f"holds {int(bad[first])} NaN/Inf values" if bad[first] > 1 else "is not finite (NaN or Inf)"
        more = f"; so do {len(found) - 1} more tensors" if len(found) > 1 else ""
        began = origin_of(run, step)
        # one finding per collection and blow-up: NaN spreads to every tensor within a step or two, and each is not
        # news; a collection that was finite again and blows up again is (a NaN batch skipped, then divergence)
        episode = self._episodes.setdefault((run.default_worker, collection_of(first)), [0, True])
        if episode[1]:
            episode[0], episode[1] = episode[0] + 1, False
        finding = collection_of(first) + (f"#{episode[0]}" if episode[0] > 1 else "")
        if began is None:
            return self.fire(step, f"{first} {what} at step {step}{more}.", finding=finding, tensors=bad)
        said, hint = began
        return self.fire(step, f"{first} {what} at step {step}{more}. {said}", finding=finding, hint=hint,
                         tensors=bad)

    def _nonfinite(self, run, step) -> dict:
        """{tensor: NaN/Inf count} of the tensors at this step that hold any."""
        recorded = reductions_at(run, step, self.collections, self.regex)
        if recorded is not None:
            bad = {name: count for name, values in recorded.items() if (count := _nonfinite_in(values))}
        else:
            pattern = re.compile(self.regex) if self.regex else None
            bad = {}
            for name in run.tensor_names(step=step):
                if (self.collections and collection_of(name) not in self.collections) or (
                        pattern and not pattern.search(name)):
                    continue
                count = _nonfinite(run.tensor(name), step)
                if count:
                    bad[name] = count
        return bad


def _nonfinite_in(values: dict) -> float:
    """The NaN/Inf count from a tensor's reductions at one step (1 where only a non-finite one shows it)."""
    if "nonfinite_count" in values:
        return values["nonfinite_count"]
    return 1 if any(not math.isfinite(v) for v in values.values()) else 0


def _nonfinite(tensor, step) -> float:
    """The NaN/Inf count of a tensor at a step (1 where only a non-finite reduction or scalar shows it)."""
    reductions = tensor.reductions()
    if "nonfinite_count" in reductions:
        try:
            return tensor.reduction(step, "nonfinite_count")
        except LookupError:
            return 0
    for reduction in reductions:
        try:
            value = tensor.reduction(step, reduction)
        except LookupError:
            continue
        if not math.isfinite(value):
            return 1
    return 0


@dataclass
class AllZero(Rule):
    """Tensors that are entirely (or almost entirely) zero."""

    threshold: float = 100.0  # percent of elements
    collections: list = field(default_factory=lambda: ["weights", "gradients"])
    regex: str = ""
    fitted: float = 1e-3  # gradients are not judged once the training loss is below this share of its first value

    name = "all_zero"
    limits = {"threshold": PERCENT, "fitted": SHARE}
    condition = ("at least `threshold` % of the elements of a trainable kernel's weights or gradients are exactly "
                 "zero (reduction zero_fraction); biases, normalisation shifts and embedding tables, which may be "
                 "zero by design or sparse, are left out, and gradients once the training loss is below `fitted` "
                 "times its first value (a model that fits its data exactly, its output saturated, has nothing "
                 "left to learn) or where batches hold fewer than 16 samples (one sample of zeros leaves the first "
                 "layer without gradient)")
    hint = ("A tensor is all zeros. Weights: zero initialisation (every unit computes the same thing and gets "
            "the same update). Gradients: nothing flows back (dead units, detached graph, a loss that does not "
            "depend on the parameter). Activations (add them to `collections`): dead units or an input of "
            "zeros. Try: a random initialiser (He/Glorot), check the forward pass and what the loss depends on.")
    source = "smdebug AllZero: threshold 100 (percent); collections to check must be named (here a default set)."

    def __post_init__(self):
        self._first_loss: dict = {}  # worker -> the first training loss seen

    def requires(self):
        return [Requirement(c, ("zero_fraction",)) for c in self.collections] + \
            [Requirement("losses", optional=True), FIRST_LABELS]

    def check(self, run, step):
        collections = self.collections
        if "gradients" in collections and (loss_fell_below(run, step, self._first_loss, self.fitted) or
                                           few_samples(run)):
            collections = [c for c in collections if c != "gradients"]
            if not collections:
                return None
        fractions = of_roles(run, values_at(run, step, "zero_fraction", collections, self.regex), KERNEL_ROLES)
        zero = {n: v for n, v in fractions.items() if v * 100 >= self.threshold}
        if not zero:
            return None
        first = next(iter(zero))
        return self.fire(step, f"{first} is {zero[first]:.0%} zeros" +
                         (f"; so are {len(zero) - 1} more tensors." if len(zero) > 1 else "."),
                         finding=",".join(zero), tensors=zero)


@dataclass
class TensorVariance(Rule):
    """Kernels whose values spread far too much or hardly at all."""

    max_threshold: float = 10.0
    min_threshold: float = 1e-5
    collections: list = field(default_factory=lambda: ["weights"])
    regex: str = ""

    name = "tensor_variance"
    condition = ("a trainable kernel's variance (reduction var) is above `max_threshold` or below `min_threshold` "
                 "(or below a tenth of what the standard initialisations give its fans, where that is lower: a "
                 "layer with a fan-in of hundreds of thousands starts there; above 100 times He's 2/fan_in, where "
                 "that is higher: a layer of a few inputs needs large weights); kernels whose output is normalised "
                 "next (their scale does not matter), kernels of one weight (no spread), biases, normalisation "
                 "parameters and embedding tables are left out; a regressor's output kernel (the last, under a "
                 "regression loss) is not judged above: its weights carry the targets' scale")
    hint = ("Weight variance out of range. Too large: initialisation too wide or weights growing without bound "
            "(learning rate too high, no weight decay). Too small: weights collapsed (too much weight decay, "
            "constant initialisation) so the layer cannot tell inputs apart. Try: He/Glorot initialisation, a "
            "lower learning rate, weight decay tuned.")
    source = ("smdebug TensorVariance (no default thresholds); max 10 and min 1e-5 from the AWS documentation's "
              "example, also used by DeepDiagnosis (Wardat et al., ICSE 2022); here on kernels that are not followed "
              "by a normalisation.")

    def requires(self):
        return [Requirement(c, ("var",)) for c in self.collections]

    def check(self, run, step):
        variances = of_roles(run, values_at(run, step, "var", self.collections, self.regex), KERNEL_ROLES)
        model = run.model
        output = _regression_output(run)
        found = []
        for name, var in variances.items():
            parameter = model.of(name) if model is not None else None
            if parameter is not None and (parameter.scale_free or parameter.size < 2):  # one weight: no spread
                continue
            low, high = self.min_threshold, self.max_threshold
            if parameter is not None and parameter.fan_in:  # a wide layer starts below it by design, a layer of
                band = init_band(parameter.fan_in, parameter.fan_out)  # a few inputs sums few: large weights
                low, high = min(low, band[0] / 10), max(high, band[1] * FEW_INPUTS)
            above = var > high and (parameter is None or parameter.path != output)
            if above or var < low:
                side = "above" if above else "below"
                bound = high if side == "above" else low
                found.append(self.fire(step, f"{name} has variance {var:.3g}, {side} {bound:g}.",
                                       finding=f"{name}:{side}", tensor=name, variance=var))
        return found or None


# How far above He's variance (2 / fan_in) a trained kernel may grow: a layer that sums a few inputs (XOR's two)
# needs weights of several units to saturate its activation; above 20 inputs `max_threshold` is the larger.
FEW_INPUTS = 100


def _regression_output(run) -> str | None:
    """The path of a regressor's output kernel (the model's last kernel, where every loss of the first step is a
    regression's): its weights grow to the targets' scale, a polynomial's coefficients of 5 as well as 0.5."""
    model = run.model
    if model is None or task_of(run.first_step) != "regression":
        return None
    kernels = [p for p in model.kernels(trainable=None) if p.tied_to is None]
    return kernels[-1].path if kernels else None
