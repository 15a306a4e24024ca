"""Rules over gradients, judged on trainable kernels (dense, convolution, recurrent, attention weights).

Biases are left out: a bias whose shift the next layer removes (a
normalisation, the keys of an attention) has a gradient of 0 by
construction. Embedding tables are left out: a batch touches few of their
rows, so their gradient is small and sparse by nature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..firststep import summed_terms, task_of
from ..ranges import COUNT, POSITIVE, SHARE
from ..model import KERNEL_ROLES
from .base import Requirement, Rule, held, loss_fell_below, loss_not_a_fit, of_roles, values_at, warming_up


@dataclass
class VanishingGradient(Rule):
    """Gradients so small, against the rest of the network's, that the layers they reach stop learning."""

    threshold: float = 1e-7
    ratio: float = 1e-3
    patience: int = 3
    learned: float = 0.5  # not judged once the training loss is below this share of its first value

    name = "vanishing_gradient"
    limits = {"ratio": SHARE, "patience": COUNT, "learned": SHARE}
    condition = ("a trainable kernel's mean absolute gradient (abs_mean) is below `threshold` and below `ratio` "
                 "times the largest kernel's at each of its last `patience` samples, while the training loss is "
                 "still above `learned` times its first value (gradients that vanish before the network learns; "
                 "once it has, small gradients are convergence, and the gradients of a layer whose job is done, "
                 "such as the queries of a settled attention, shrink far below the rest), and the learning rate "
                 "has not risen over those samples (a warmup: the attention queries and keys of a transformer "
                 "initialised small get gradients of 1e-7 while its attention is still uniform, and grow as it "
                 "learns)")
    hint = ("Gradients vanish before reaching the early layers. Likely causes: saturating activations (sigmoid, "
            "tanh) in a deep stack, poor initialisation, a learning rate so small that nothing moves. Try: ReLU, "
            "GELU or SELU instead of sigmoid/tanh; batch or layer normalisation; residual connections; He "
            "(Kaiming) initialisation; a larger learning rate.")
    source = ("smdebug VanishingGradient: mean(|gradient|) < threshold, default 1e-7 (DeepDiagnosis uses the same); "
              "here on kernels, against the largest kernel gradient, over `patience` samples.")

    def __post_init__(self):
        self._first_loss: dict = {}  # worker -> the first training loss seen

    @property
    def history(self):
        return self.patience  # the learning rate at the first of the samples judged, to tell a warmup

    def requires(self):
        return [Requirement("gradients", ("abs_mean",)), Requirement("losses", optional=True),
                Requirement("optimizer", optional=True)]

    def check(self, run, step):
        if loss_fell_below(run, step, self._first_loss, self.learned):
            return None
        means = of_roles(run, values_at(run, step, "abs_mean", ["gradients"]), KERNEL_ROLES)
        if len(means) < 2:
            return None
        largest = max(means.values())
        onsets = {n: held(run, n, "abs_mean", self.patience, step, lambda g: g < self.threshold)
                  for n, v in means.items() if v < self.threshold and v < self.ratio * largest}
        small = {n: means[n] for n, onset in onsets.items() if onset is not None}
        if not small or warming_up(run, min(onsets[n] for n in small)):
            return None
        name = min(small, key=small.get)
        return self.fire(step, f"{len(small)} kernel gradient(s) have mean |g| below {self.threshold:g} at "
                               f"{self.patience} samples in a row; the smallest is {name} at {small[name]:.3g}, "
                               f"against {largest:.3g} for the largest.", finding=",".join(small), gradients=small,
                         threshold=self.threshold, onset=min(onsets[n] for n in small),
                         hint=_saturating_hint(run.model))


@dataclass
class ExplodingGradient(Rule):
    """Gradients that grow on their way back to the input, or that are simply too large."""

    ratio_threshold: float = 70.0
    max_norm: float = 1000.0
    patience: int = 3  # samples in a row the ratio must hold at

    name = "exploding_gradient"
    limits = {"ratio_threshold": POSITIVE, "max_norm": POSITIVE, "patience": COUNT}
    condition = ("the L2 norm of the first layer's trainable kernel gradients is more than `ratio_threshold` times "
                 "the last layer's (layers in the model's order; a layer's kernels taken together, so a recurrent "
                 "layer's input and recurrent kernels are one layer) at `patience` samples in a row (a last "
                 "layer of few weights, such as a siamese network's Dense(1) on a distance, has a gradient that "
                 "crosses 0 from batch to batch: one sample's ratio is heavy-tailed), or some kernel gradient's "
                 "L2 norm exceeds `max_norm`, for a regression times its first training loss where that is above 1 "
                 "(the loss's "
                 "scale is the targets' units: a regression on targets in the hundreds starts at a loss of 10^4 "
                 "and trains with gradient norms in the thousands; a classifier's loss starts near ln C, and a "
                 "large one is the bad initialisation this rule is for), and for a loss that sums its terms "
                 "instead of taking their mean (torch's reduction=\"sum\", Keras' \"sum\") times their number, "
                 "where the first step shows it (its gradients are that many times the mean's: a VAE's summed "
                 "pixel losses), and for a loss that is no measure of the fit (its targets computed by the model "
                 "itself, as a DQN's TD targets, which grow as its values are learnt) times the largest training "
                 "loss so far")
    hint = ("Gradients grow as they flow back through the layers, so early layers take huge steps. Likely causes: "
            "weights initialised too large, no normalisation, a deep stack without residual connections, a "
            "learning rate too high. Try: gradient clipping (gradient_clip_val / clipnorm), He or Glorot "
            "initialisation, batch or layer normalisation, a lower learning rate.")
    source = ("AUTOTRAINER (Zhang et al., ICSE 2021) exploding gradient: first/last layer gradient-norm ratio > 70 "
              "(beta_3); the absolute bound `max_norm` is tripwire's own; here on kernels, by layer.")

    def __post_init__(self):
        self._seen: dict = {}  # worker -> [|first training loss|, |largest so far|]
        self._above: dict = {}  # worker -> [first step, samples in a row] the layer ratio was above its threshold

    def requires(self):
        return [Requirement("gradients", ("l2",)), Requirement("losses", optional=True)]

    def check(self, run, step):
        norms = of_roles(run, values_at(run, step, "l2", ["gradients"]), KERNEL_ROLES)
        found = []
        scale, why = self._scale(run, step)
        bound = self.max_norm * scale
        large = {n: v for n, v in norms.items() if v > bound}
        if large:
            name = max(large, key=large.get)
            scaled = f" (max_norm {self.max_norm:g} times {why})" if why else ""
            found.append(self.fire(step, f"{name} has gradient L2 norm {large[name]:.3g}, above {bound:.3g}{scaled}.",
                                   finding="norm", gradients=large, max_norm=bound))
        layers = {layer: sum(norms[n] ** 2 for n in names) ** 0.5 for layer, names in _by_layer(run, norms).items()}
        if len(layers) >= 2:
            (first, a), (last, b) = next(iter(layers.items())), list(layers.items())[-1]
            above = self._above.setdefault(run.default_worker, [step, 0])
            if b > 0 and a / b > self.ratio_threshold:
                above[:] = [above[0] if above[1] else step, above[1] + 1]
            else:
                above[:] = [step, 0]
            if above[1] >= self.patience:
                found.append(self.fire(step, f"the first layer's kernel gradient ({first}, L2 {a:.3g}) is "
                                             f"{a / b:.0f}x the last layer's ({last}, L2 {b:.3g}), above "
                                             f"{self.ratio_threshold:g}x at {above[1]} samples in a row since step "
                                             f"{above[0]}.", finding="ratio", ratio=a / b, first=first, last=last,
                                       onset=above[0]))
        return found or None

    def _scale(self, run, step: int) -> tuple[float, str | None]:
        """What max_norm is multiplied by at this step (at least 1), and what that factor is (None: 1)."""
        scales = [(1.0, None)]
        terms = summed_terms(run.first_step)
        if terms:
            scales.append((terms, f"the {terms} terms the loss sums"))
        regression, unfit = task_of(run.first_step) == "regression", loss_not_a_fit(run)
        if regression or unfit:
            seen = self._read_losses(run, step)
            if seen and regression:
                scales.append((seen[0], "the first training loss of this regression"))
            if seen and unfit:
                scales.append((seen[1], "the largest training loss so far, whose scale the model sets itself"))
        return max(scales, key=lambda scale: scale[0])

    def _read_losses(self, run, step: int) -> list[float]:
        """[|the first training loss|, |the largest so far|] of this worker by this step; [] where the run holds
        none yet (in training the memory holds the newest samples only: both are kept as they come)."""
        worker = run.default_worker
        if "losses/train" in run.tensor_names("losses"):
            steps, values = run.tensor("losses/train").series("value")
            finite = [abs(float(v)) for s, v in zip(steps, values) if s <= step and math.isfinite(v)]
            if finite:
                seen = self._seen.setdefault(worker, [finite[0], 0.0])
                seen[1] = max(seen[1], *finite)
        return self._seen.get(worker, [])


SATURATING = ("sigmoid", "tanh", "hardsigmoid", "hardtanh", "softsign", "logsigmoid")


def _saturating_hint(model) -> str:
    """A fix that names the layers whose saturating activations shrink the gradient on its way back, where the
    model's structure shows them; the rule's own hint otherwise."""
    if model is None:
        return ""
    layers = list(dict.fromkeys(p.layer for p in model.kernels() if p.followed_by in SATURATING))
    if len(layers) < 2:
        return ""
    kinds = sorted({p.followed_by for p in model.kernels() if p.layer in layers})
    return (f"{len(layers)} layers are followed by {' or '.join(kinds)} ({', '.join(layers[:4])}"
            f"{', …' if len(layers) > 4 else ''}): each passes back at most a fraction of the gradient (a sigmoid "
            "0.25), and a stack of them multiplies it away before it reaches the first layers. Try: ReLU or GELU "
            "in the hidden layers (keep a sigmoid only at the output), a normalisation after each layer, or "
            "residual connections.")


def _by_layer(run, values: dict) -> dict[str, list]:
    """{layer: its tensor names}, in the model's order: a recurrent layer's input and recurrent kernels are one
    layer, not its first and last."""
    model = run.model
    out: dict = {}
    for name in values:
        parameter = model.of(name) if model is not None else None
        out.setdefault(parameter.layer if parameter is not None else name, []).append(name)
    return out
