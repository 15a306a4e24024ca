"""What a training loss is measured against, beside its own start: the least it can reach (its targets' entropy
under binary cross-entropy), what predicting the targets' mean scores, and a booster whose trees never split."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

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
