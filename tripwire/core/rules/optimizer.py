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

from ..ranges import COUNT, POSITIVE, SHARE
from ..model import KERNEL_ROLES
from .base import HEALTHY_STEP, Requirement, Rule, learning_rates, of_roles, values_at

# The learning rates each optimizer is commonly used with, (lowest, highest), by lower-cased class name (torch and
# Keras name them alike): from the frameworks' defaults and the ranges their documentation and common recipes use.
COMMON_RATES = {
    "sgd": (1e-4, 1.0), "adam": (1e-6, 1e-2), "adamw": (1e-6, 1e-2), "nadam": (1e-6, 1e-2), "radam": (1e-6, 1e-2),
    "adamax": (1e-5, 2e-2), "rmsprop": (1e-6, 1e-2), "adagrad": (1e-4, 0.5), "adadelta": (1e-3, 1.0),
    "lion": (1e-7, 1e-3), "lamb": (1e-5, 1e-2), "adafactor": (1e-5, 1e-2), "lbfgs": (1e-3, 1.0),
}

ZERO_HINT = ("The learning-rate schedule gives 0 from the start of training. Likely causes: integer division in a "
             "LambdaLR factor or a Keras schedule (step // total is 0 until the end), a decay counted in steps where "
             "epochs were meant (or the reverse), a schedule stepped before the optimizer. Try: print the schedule's "
             "first values; use float division (step / total).")

ONCE = 10.0  # times max_ratio one step's update must reach to be told alone (else two steps in a row)

# Optimizers whose one step is a search over several evaluations of the loss (quasi-Newton, with its own step size):
# a step may move the weights by their own size, and once converged not at all; neither says anything of a rate.
SEARCHING = {"lbfgs"}


def searching(run) -> bool:
    """Whether the run's optimizer searches within each step (SEARCHING): its updates are not judged by size."""
    optimizer = _optimizer(run)
    return optimizer is not None and optimizer.lower() in SEARCHING


@dataclass
class LearningRate(Rule):
    """A learning rate unfit for the optimizer and the model: far above the optimizer's usual range, or a first
    step that rewrites the weights (too high); below the usual range, with steps that hardly move them (too low)."""

    steps: int = 5  # the first steps judged
    far: float = 10.0  # times above an optimizer's usual highest rate that count as far too high
    max_ratio: float = 1.0  # ‖update‖ / ‖weight‖ of one step that no healthy training reaches
    share: float = 0.75  # of the trainable kernels, that must be updated by more than max_ratio
    min_ratio: float = 1e-5  # median ‖update‖ / ‖weight‖ over the first steps below which a low rate does nothing

    name = "learning_rate"
    limits = {"steps": COUNT, "far": POSITIVE, "max_ratio": POSITIVE, "share": SHARE}
    condition = ("in the first `steps` steps: the learning rate is more than `far` times the highest an optimizer "
                 "of its class is commonly used with (SGD 1, Adam and AdamW 0.01, …; unknown optimizers are not "
                 "judged) where no update was measured (measured, the updates decide: gradient clipping caps "
                 "the steps of a high rate, as pytorch's word language model trains SGD at 20), or a step changed "
                 "at least `share` of the trainable kernels (zero-initialised ones left out) by more than "
                 "`max_ratio` times their norm at two steps in a row, or at one where that is ten times their norm "
                 "or the rate is also `far` above its usual range (a first step may rescale a small "
                 "initialisation once: Adam's moves every weight by about the rate; too high; not for an optimizer "
                 "that searches within its step, LBFGS); or, by the last of those steps, "
                 "the rate is below the lowest the optimizer is commonly used with, did not rise (no warmup), and "
                 "the steps changed the kernels by less than `min_ratio` of their norm (median; too low); or the "
                 "rate is 0 after earlier steps trained (a rate above 0, or kernels moved), or at the first two "
                 "steps with no kernel moved (error: a schedule that gives 0; a warmup from 0 rises at its first "
                 "step, a decay reaches 0 at the end)")
    hint = ("The learning rate is too high: each step throws the weights far from where they were, so they grow, "
            "units die and values overflow. Try: a learning rate 10 to 100 times lower, a warmup, gradient "
            "clipping. Too low: the weights hardly move and nothing learns; raise it into the optimizer's usual "
            "range.")
    source = ("AUTOTRAINER and DeepDiagnosis name an unsuitable learning rate as the commonest cause of exploding "
              "weights and NaN, and of training that does not move; smdebug's WeightUpdateRatio (above 10, below "
              "1e-8) judges it only later, over every step. Here it is judged at the first steps, from the rate "
              "against the optimizer's usual range and from the update against the weights.")

    def __post_init__(self):
        self._done: set = set()  # workers judged
        self._seen: dict = {}  # worker -> [(learning rate, median update ratio)] of the first steps
        self._rewrote: dict = {}  # worker -> whether its last judged step changed the kernels by > max_ratio

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
        ratios = {} if searching(run) else self._ratios(run, step)
        middle = sorted(ratios.values())[len(ratios) // 2] if ratios else None
        seen = self._seen.setdefault(run.default_worker, [])
        seen.append((rate, middle))
        # trained before: a rate above 0 or an update that moved the kernels (a loop that steps its schedule before
        # the sample is taken records the next step's rate)
        started = max((r for r, _ in seen[:-1] if r), default=None)
        if rate == 0 and (started or any(m for _, m in seen[:-1])):
            self._done.add(run.default_worker)
            at = f" at {started:g}" if started else ""
            return self.fire(step, f"the learning rate is 0 at step {step}, after the first steps trained{at}: every "
                                   "step from here on changes nothing.", severity="error", finding="zero",
                             hint=ZERO_HINT, rate=rate, started=started)
        over = [r for r in ratios.values() if r > self.max_ratio]
        rewrote = len(ratios) >= 1 and len(over) >= self.share * len(ratios)
        far = rate is not None and usual is not None and rate > self.far * usual[1]
        # a first step may rescale a small initialisation once (Adam's moves every weight by about the rate:
        # forward-forward training grows its layers so, 1.2x at step 0, 0.7x at 1, 0.5x at 2): one step is told
        # where the rate is also far outside its usual range or the step is ten times the weights, else two in a row
        before, self._rewrote[run.default_worker] = self._rewrote.get(run.default_worker, False), rewrote
        rewrites = rewrote and (far or before or middle > ONCE * self.max_ratio)
        with_what = f" with {optimizer}" if optimizer else ""
        named = f"learning rate {rate:g}{with_what}" if rate is not None else f"the learning rate{with_what}"
        if rewrites or (far and not ratios):  # measured, the updates decide: clipping caps a high rate's steps
            self._done.add(run.default_worker)
            said = [f"{rate / usual[1]:.0f}x the highest it is commonly used with ({usual[1]:g})"] if far else []
            if rewrites:
                said.append(f"the update at step {step} is {middle:.3g}x the weight norm (median of {len(ratios)} "
                            f"kernels; a healthy step changes them by about {HEALTHY_STEP:g}x)")
            change = _suggestion(rate, middle if rewrites else None, usual) + _summed(run)
            return self.fire(step, f"{named}: {'; '.join(said)}.", finding="high",
                             hint=f"The learning rate is too high for this model. Try: {change}, a warmup, gradient "
                                  "clipping.", rate=rate, optimizer=optimizer, usual=list(usual) if usual else None,
                             ratios=ratios)
        if len(seen) >= 2 and all(r == 0 for r, _ in seen) and not any(m for _, m in seen):
            self._done.add(run.default_worker)  # 0 at the first two steps, nothing moved: a warmup rises at once
            return self.fire(step, f"the learning rate has been 0 at each of the first {len(seen)} steps, and no "
                                   "step moved the kernels: a warmup from 0 would have risen at its first step.",
                             severity="error", finding="zero", hint=ZERO_HINT, rate=0.0, started=None)
        if step < self.steps - 1 or len(seen) < 2:
            return None
        self._done.add(run.default_worker)
        judged = [m for _, m in seen if m is not None]
        first_rate = seen[0][0]
        if rate is None or usual is None or not rate or rate >= usual[0] or not judged or \
                (first_rate is not None and rate > first_rate) or max(judged) >= self.min_ratio:
            return None
        return self.fire(step, f"{named}: below the lowest it is commonly used with ({usual[0]:g}); the first "
                               f"{len(seen)} steps changed the kernels by {max(judged):.2g}x their norm at most "
                               f"(median), where a healthy step changes them by about {HEALTHY_STEP:g}x.",
                         finding="low",
                         hint=f"The learning rate is too low: the weights hardly move and nothing learns. Try: a "
                              f"learning rate within {usual[0]:g} to {usual[1]:g}, as is usual for {optimizer}.",
                         rate=rate, optimizer=optimizer, usual=list(usual), ratios=judged)

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


def _summed(run) -> str:
    """A word on a loss summed over the batch, where the first step shows one: its steps are the batch size times
    a mean's, which looks like a rate too high."""
    first = run.first_step
    if first is not None and any(use.settings.get("reduction") == "sum" for use in first.losses):
        return ("; the loss is summed over the batch (reduction='sum'), so each step is the batch size times a "
                "mean loss's: use reduction='mean', or divide the rate by the batch size")
    return ""


def _optimizer(run) -> str | None:
    model = run.model
    return model.optimizers[0] if model is not None and model.optimizers else None


def _suggestion(rate: float | None, ratio: float | None, usual: tuple | None) -> str:
    """A learning rate to try: one that would change the weights by 0.1 % to 1 % per step (updates scale about
    linearly with the rate), else the optimizer's usual range."""
    if rate and ratio:
        return f"a learning rate of {rate * HEALTHY_STEP / ratio:.2g} to {rate * 10 * HEALTHY_STEP / ratio:.2g}"
    if usual:
        return f"a learning rate within {usual[0]:g} to {usual[1]:g}, as is usual for this optimizer"
    return "a learning rate 10 to 100 times lower"


NOTHING_TRAINS_HINT = ("Every parameter is frozen. Likely causes: `model.trainable = False` (Keras) or "
                       "requires_grad_(False) on the whole model, meant for a base model or a part of it; a freezing "
                       "loop that froze everything. Try: freeze only the part you mean (base.trainable = False, "
                       "then compile the model built on it), and check model.trainable_weights / the parameters "
                       "with requires_grad before training.")


FROZEN_HINT = ("Frozen layers keep the values they started with: right for a pretrained base you fine-tune on top "
               "of, wrong for layers meant to learn (random weights stay random). Try, where they were meant to "
               "train: set requires_grad / trainable back on them, then build the optimizer (or compile the model) "
               "again so that it holds them.")


@dataclass
class UntrainedParameters(Rule):
    """Parameters that get a gradient no optimizer applies, and parameters left frozen."""

    name = "untrained_parameters"
    condition = ("at the first sampled step: a model none of whose parameters trains or gets a gradient (every "
                 "one frozen: error); else at the first sampled step with gradients: a parameter received a non-zero "
                 "gradient but no "
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
        # the losses are there at the first step even where no gradient is (a model with nothing to train)
        return [Requirement("gradients", ("l2",)), Requirement("losses")]

    def check(self, run, step):
        model = run.model
        if model is None or run.default_worker in self._done:
            return None
        norms = values_at(run, step, "l2", ["gradients"])
        parameters = [p for p in model.parameters.values() if p.tied_to is None]
        if parameters and not any(p.trainable for p in parameters) and not any(norms.values()):
            self._done.add(run.default_worker)
            return self.fire(step, f"nothing trains: all {len(parameters)} parameters of the model are frozen "
                                   "(requires_grad / trainable False) and none gets a gradient, so every step "
                                   "leaves the model as it was.", severity="error", finding="nothing_trains",
                             hint=NOTHING_TRAINS_HINT)
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
                                   finding="frozen", layers=frozen, hint=FROZEN_HINT))
        return found or None
