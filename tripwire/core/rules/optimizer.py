"""Rules over the optimizer and what it trains, judged when training starts.

A learning rate far too high shows in the first step: the update rewrites the weights instead of nudging them, and
everything that follows (weights that jump, NaN, dead units) is its consequence. A parameter that gets a gradient
no optimizer applies shows at the first sampled step too. Both are judged from data every plugin captures: the
learning rate (`optimizer/lr`), the step's change of each kernel (`updates`) and the weights, and the model's
structure (its optimizers' classes, which parameters they hold).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..model import KERNEL_ROLES
from .base import Requirement, Rule, learning_rates, of_roles, values_at

# The learning rates each optimizer is commonly used with, (lowest, highest), by lower-cased class name (torch and
# Keras name them alike): from the frameworks' defaults and the ranges their documentation and common recipes use.
COMMON_RATES = {
    "sgd": (1e-4, 1.0), "adam": (1e-6, 1e-2), "adamw": (1e-6, 1e-2), "nadam": (1e-6, 1e-2), "radam": (1e-6, 1e-2),
    "adamax": (1e-5, 2e-2), "rmsprop": (1e-6, 1e-2), "adagrad": (1e-4, 0.5), "adadelta": (1e-3, 1.0),
    "lion": (1e-7, 1e-3), "lamb": (1e-5, 1e-2), "adafactor": (1e-5, 1e-2), "lbfgs": (1e-3, 1.0),
}


@dataclass
class LearningRate(Rule):
    """A learning rate too high for the optimizer and the model: far above the optimizer's usual range, or a first
    step that rewrites the weights."""

    steps: int = 5  # the first steps judged
    far: float = 10.0  # times above an optimizer's usual highest rate that count as far too high
    max_ratio: float = 1.0  # ‖update‖ / ‖weight‖ of one step that no healthy training reaches
    share: float = 0.75  # of the trainable kernels, that must be updated by more than max_ratio

    name = "learning_rate"
    condition = ("in the first `steps` steps: the learning rate is more than `far` times the highest an optimizer "
                 "of its class is commonly used with (SGD 1, Adam and AdamW 0.01, …; unknown optimizers are not "
                 "judged), or one step changed at least `share` of the trainable kernels (zero-initialised ones "
                 "left out) by more than `max_ratio` times their norm")
    hint = ("The learning rate is too high: each step throws the weights far from where they were, so they grow, "
            "units die and values overflow. Try: a learning rate 10 to 100 times lower, a warmup, gradient "
            "clipping.")
    source = ("AUTOTRAINER and DeepDiagnosis name an unsuitable learning rate as the commonest cause of exploding "
              "weights and NaN; smdebug's WeightUpdateRatio (above 10) judges it only later, over every step. Here "
              "it is judged at the first steps, from the rate against the optimizer's usual range and from the "
              "update against the weights.")

    def __post_init__(self):
        self._done: set = set()  # workers judged

    def requires(self):
        window = tuple(range(self.steps))
        return [Requirement("updates", ("l2",), steps=window), Requirement("weights", ("l2",), steps=window),
                Requirement("optimizer", steps=window, optional=True)]

    def check(self, run, step):
        if step >= self.steps or run.default_worker in self._done:
            return None
        rates = learning_rates(run, step)
        optimizer = _optimizer(run)
        rate = max(rates) if rates else None
        usual = COMMON_RATES.get(optimizer.lower()) if optimizer else None
        ratios = self._ratios(run, step)
        over = sorted((r for r in ratios.values() if r > self.max_ratio), reverse=True)
        rewrites = len(ratios) >= 1 and len(over) >= self.share * len(ratios)
        far = rate is not None and usual is not None and rate > self.far * usual[1]
        if not (rewrites or far):
            return None
        self._done.add(run.default_worker)
        with_what = f" with {optimizer}" if optimizer else ""
        said = [f"learning rate {rate:g}{with_what}" if rate is not None else f"the learning rate{with_what}"]
        if far:
            said.append(f"{rate / usual[1]:.0f}x the highest it is commonly used with ({usual[1]:g})")
        if rewrites:
            middle = sorted(ratios.values())[len(ratios) // 2]
            said.append(f"the update at step {step} is {middle:.3g}x the weight norm (median of {len(ratios)} "
                        f"kernels; a healthy step changes them by about 0.001x)")
        change = _suggestion(rate, sorted(ratios.values())[len(ratios) // 2] if rewrites else None, usual)
        return self.fire(step, said[0] + (": " + "; ".join(said[1:]) if len(said) > 1 else "") + ".",
                         finding="high", hint=f"The learning rate is too high for this model. Try: {change}, a "
                                              "warmup, gradient clipping.",
                         rate=rate, optimizer=optimizer, usual=list(usual) if usual else None, ratios=ratios)

    def _ratios(self, run, step: int) -> dict[str, float]:
        """{kernel's update: ‖update‖ / ‖weight‖} at this step, where the weight is not 0."""
        updates = of_roles(run, values_at(run, step, "l2", ["updates"]), KERNEL_ROLES)
        weights = values_at(run, step, "l2", ["weights"])
        out = {}
        for name, norm in updates.items():
            weight = weights.get("weights/" + name.split("/", 1)[1])
            if weight and math.isfinite(weight) and math.isfinite(norm):
                out[name] = norm / weight
        return out


def _optimizer(run) -> str | None:
    model = run.model
    return model.optimizers[0] if model is not None and model.optimizers else None


def _suggestion(rate: float | None, ratio: float | None, usual: tuple | None) -> str:
    """A learning rate to try: one that would change the weights by 0.1 % to 1 % per step (updates scale about
    linearly with the rate), else the optimizer's usual range."""
    if rate and ratio:
        return f"a learning rate of {rate * 1e-3 / ratio:.2g} to {rate * 1e-2 / ratio:.2g}"
    if usual:
        return f"a learning rate within {usual[0]:g} to {usual[1]:g}, as is usual for this optimizer"
    return "a learning rate 10 to 100 times lower"


@dataclass
class UntrainedParameters(Rule):
    """Parameters that get a gradient no optimizer applies, and parameters left frozen."""

    name = "untrained_parameters"
    condition = ("at the first sampled step with gradients: a parameter received a non-zero gradient but no "
                 "optimizer holds it (warning: it was meant to train, and never will); the parameters frozen "
                 "(requires_grad / trainable False), listed once as info")
    hint = ("These parameters get a gradient, but no optimizer holds them, so they never change: the optimizer "
            "was built before they were added or unfrozen, or from another module's parameters. Try: build the "
            "optimizer from model.parameters() after the model is complete, or rebuild it after unfreezing.")
    source = ("TrainCheck (Lou et al., OSDI 2025): every parameter that gets a gradient is stepped by an optimizer; "
              "a wrong parameter list is among the silent errors it finds in real programs.")

    def __post_init__(self):
        self._done: set = set()

    def requires(self):
        return [Requirement("gradients", ("l2",))]

    def check(self, run, step):
        model = run.model
        if model is None or run.default_worker in self._done:
            return None
        norms = values_at(run, step, "l2", ["gradients"])
        if not norms:
            return None
        self._done.add(run.default_worker)
        found = []
        stray = [name.split("/", 1)[1] for name, norm in norms.items()
                 if norm and (p := model.of(name)) is not None and not p.trainable and p.tied_to is None]
        if stray:
            found.append(self.fire(step, f"{len(stray)} parameter(s) get a gradient but no optimizer holds them: "
                                         f"{', '.join(stray[:5])}{' …' if len(stray) > 5 else ''}.",
                                   finding="no_optimizer", parameters=stray))
        layers: dict = {}
        for p in model.parameters.values():
            if p.tied_to is None:
                layers.setdefault(p.layer, []).append(p)
        frozen = [layer for layer, members in layers.items()
                  if not any(p.trainable or p.path in stray for p in members)]
        if frozen:
            found.append(self.fire(step, f"{len(frozen)} layer(s) are frozen (none of their parameters trains): "
                                         f"{', '.join(frozen[:8])}{' …' if len(frozen) > 8 else ''}. If that was not "
                                         "meant, unfreeze them and rebuild the optimizer.", severity="info",
                                   finding="frozen", layers=frozen))
        return found or None
