"""What a training loss is measured against, beside its own start: the least it can reach (its targets' entropy
under binary cross-entropy), what guessing scores (ln C), what predicting the targets' mean scores, how far the
steps move the weights (a loss that stays put while they move learns nothing that holds), and a booster whose
trees never split."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..model import KERNEL_ROLES
from .base import of_roles

FLOOR_NOTE = " (the least it can reach is {:.4g}, its targets' own entropy)"


def constant_predictor_loss(run) -> float | None:
    """The mean squared error of predicting the first batch's mean target, where the training step's one loss is
    mean squared error and the plugin saw its targets: a loss that stays there has learned nothing from the
    inputs. None otherwise."""
    first = run.first_step
    uses = first.losses if first is not None else ()
    if len(uses) != 1 or uses[0].loss != "mse_loss" or uses[0].labels is None:
        return None
    return uses[0].labels.variance or None


def chance_loss(run) -> tuple[float, int] | None:
    """(the loss of guessing, ln C; C) for a classifier whose loss reads its output as a neural network's does
    and takes the mean of its terms (the first step's record), else None. A loss that sums them (pytorch/examples'
    VAE sums the binary cross-entropy of every pixel), or hands them to the loop to add up (reduction "none"), is
    many times ln C however well the model fits."""
    first = run.first_step
    for use in first.losses if first is not None else ():
        if use.reads == "scores" or use.kind not in ("categorical", "binary") or use.terms is not None or \
                use.settings.get("reduction") in ("sum", "none"):
            continue
        classes = use.units if use.kind == "categorical" and use.units and use.units >= 2 else 2
        return math.log(classes), classes
    return None


def untrained_loss(run) -> float | None:
    """What a model that learned nothing from its inputs scores: ln C for a classifier (chance_loss), the targets'
    variance under mean squared error (constant_predictor_loss); None where neither is known."""
    chance = chance_loss(run)
    return chance[0] if chance is not None else constant_predictor_loss(run)


def unsplit(run, verdict):
    """A loss that never went down on a booster none of whose trees split (`trees/splits`, where the trees are
    captured): each round added one leaf, a constant, so the model is its base score (finding `no_splits`)."""
    if "trees/splits" not in run.tensor_names("trees"):
        return verdict
    splits = run.tensor("trees/splits").series()[1]
    if not len(splits) or np.any(splits > 0):
        return verdict
    return replace(verdict, finding="no_splits", hint=NO_SPLITS_HINT,
                   message=verdict.message + f" None of the trees of its last {len(splits)} rounds split: each is "
                                             "one leaf, and the model stays at its base score.")


NO_SPLITS_HINT = ("Every tree XGBoost adds is a single leaf: no split reduces the loss by `gamma` (min_split_loss) "
                  "while keeping `min_child_weight` of hessian on each side. Likely causes: hessians too small "
                  "for min_child_weight (reg:pseudohubererror on targets far beyond huber_slope, whose hessian "
                  "falls as the cube of slope/residual), a large gamma, features that are constant or missing. "
                  "Try: huber_slope near the targets' spread (or standardise the targets), a lower "
                  "min_child_weight, gamma 0; check the features.")


def loss_floor(run) -> float | None:
    """The least the training loss can reach, where its targets say: under binary cross-entropy, the targets' mean
    binary entropy (0 for labels of 0 and 1; ratings scaled to [0, 1] keep the loss of a perfect model near 0.5,
    and one that learns goes from ln 2 to 0.6: 4 % in the rule's first 850 steps, 30 % of the way to its floor).
    From the first batch's targets, where the step's one loss is binary cross-entropy; None otherwise."""
    first = run.first_step
    uses = first.losses if first is not None else ()
    if len(uses) != 1 or uses[0].kind != "binary" or uses[0].reads not in ("logits", "probabilities") or \
            uses[0].labels is None or uses[0].labels.entropy is None or uses[0].terms is not None:
        return None
    return uses[0].labels.entropy


def room_above(start: float, floor: float | None) -> float:
    """How far a loss that starts at `start` can go down: to its floor where known and below the start."""
    return start - floor if floor is not None and floor < start else abs(start)


STUCK_HINT = ("The weights move at every step, yet the loss stays where it began: what the model learns from one "
              "batch does not hold for the next. Likeliest cause: labels that do not match their inputs (shuffled "
              "apart, the wrong column, a misaligned join); also a task the inputs say nothing about. Try: check "
              "that each sample keeps its own label through loading and shuffling; train on one small batch "
              "until it is learned by heart (if even that fails, look at the loss and the labels).")


def update_ratios(run) -> list[float]:
    """‖update‖ / ‖weight‖ of the trainable kernels at the newest step that holds their updates."""
    names = [n for n in run.tensor_names("updates") if "l2" in run.tensor(n).reductions()]
    names = list(of_roles(run, dict.fromkeys(names), KERNEL_ROLES))
    out = []
    for name in names:
        weight = "weights/" + name.split("/", 1)[1]
        if weight not in run.tensor_names("weights"):
            continue
        u_steps, u = run.tensor(name).tail("l2", 1)
        w_steps, w = run.tensor(weight).tail("l2", 1)
        if len(u_steps) and len(w_steps) and u_steps[-1] == w_steps[-1] and w[-1] > 0:
            out.append(float(u[-1] / w[-1]))
    return out
