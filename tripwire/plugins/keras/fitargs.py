"""What Keras' fit was given, read as the training begins: Keras hands callbacks neither the data nor the arguments of
fit (only `params`: epochs and steps), and bugs in them show no bad number until late. A `class_weight` computed
by integer division weighs most classes 0, and they are never learned; `validation_split` takes the last part of
the arrays before any shuffling, so on data ordered by class the validation holds classes training never sees. Both
were told only by `overfit`, after evaluations that never beat chance, under a diagnosis that blamed the labels.

Read once per fit from the locals of the fit that calls its callbacks (`x`, `y`, `val_y`, `class_weight`, and the
data adapter in `epoch_iterator`); where that frame is not found (a Keras whose fit changed), nothing is read, and
what is judged from it is not judged."""

from __future__ import annotations

import numpy as np

from tripwire.core.firststep import caller_locals

MAX_CLASSES = 1000  # labels with more distinct values are not class ids
MIN_SHARE = 0.05  # of the validation's labels, in classes training never holds, that is told


def fit_locals() -> dict:
    """The locals of the Keras fit whose callback calls this ({} where not found)."""
    return caller_locals("fit", "epoch_iterator")


def zero_weighted(class_weight) -> tuple | None:
    """The classes a fit's `class_weight` weighs 0, where it weighs classes and weighs any at 0."""
    if not isinstance(class_weight, dict):
        return None
    zero = tuple(sorted(int(c) for c, weight in class_weight.items() if float(weight) == 0))
    return zero or None


def classes_only_in(validation, training) -> tuple | None:
    """The classes the validation's labels hold and the training's never do, where they make MIN_SHARE of the
    validation's labels or more (a rare class that fell into the validation alone is no bug of the split); for
    labels that are class ids or one-hot rows in numpy arrays; None for others, or where there are none."""
    seen = [_classes(labels) for labels in (training, validation)]
    if seen[0] is None or seen[1] is None:
        return None
    only = sorted(set(seen[1]) - set(seen[0]))
    share = sum(seen[1][c] for c in only) / max(sum(seen[1].values()), 1)
    return tuple(only) if only and share >= MIN_SHARE else None


def _classes(labels) -> dict | None:
    """{class: labels of it} in an array of labels: its whole-number values, or the columns of its one-hot rows."""
    if not isinstance(labels, np.ndarray) or labels.size == 0 or not np.issubdtype(labels.dtype, np.number):
        return None
    if labels.ndim == 2 and labels.shape[1] >= 2:  # one-hot rows: the columns that hold a row's one
        one_hot = np.all((labels == 0) | (labels == 1)) and np.all(labels.sum(axis=1) == 1)
        return {int(c): int(n) for c, n in enumerate(labels.sum(axis=0)) if n} if one_hot else None
    values, counts = np.unique(labels, return_counts=True)
    if values.size > MAX_CLASSES or not np.all(np.isfinite(values)) or not np.all(values == np.round(values)):
        return None
    return dict(zip(values.astype(np.int64).tolist(), counts.tolist()))
