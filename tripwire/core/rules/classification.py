"""Rules over labels and predictions of a classifier, for any framework.

They read the full `labels` and `predictions` tensors, pooled over the newest
saved steps until `samples` labels are in hand: one XGBoost eval set at one
boosting round, or the last few batches of a neural network. The data is a
classifier's only where the shapes say so (`_classified`): scores with a class
axis after the labels' shape ([n] or [n, 1] labels with [n, C] scores, [n, T] token
labels with [n, T, V] logits), one-hot labels with scores of their shape, or
one score per label (binary). Anything else (a regressor's targets, an
autoencoder's reconstructions) is not judged: `no_data`. Labels of a
classifier that are not class ids (class ids divided by 255) are a finding.

A classifier is judged only once it has learned (its accuracy is well above
what the majority class alone gives), and a class only by how much worse it
does than the rest: early in training every class is confused, and a hard
task has hard classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ranges import ANY, COUNT, POSITIVE, SHARE, Range
from ..firststep import task_of
from .base import NotApplicable, Requirement, Rule

IGNORE_INDEX = -100  # torch's CrossEntropyLoss default ignore_index: padding tokens carry it


class NotClassIds(Exception):
    """The labels of a classifier's data are not whole numbers >= 0."""


@dataclass
class _Pooled(Rule):
    """Shared parameters, pooling and gates of the classification rules."""

    samples: int = 500  # labels pooled before the rule decides
    window: int = 16  # at most this many of the newest saved steps are pooled
    binary_threshold: float = 0.5  # one score per sample above it is class 1 (0.0 for logits)
    learned: float = 0.7  # judged once accuracy covers this share of the way from the majority class's share to 1
    ratio: float = 2.0  # a class is singled out only when its error is this many times the overall error
    min_class_samples: int = 20  # classes with fewer pooled samples are not judged alone
    patience: int = 2  # pools' worth of fresh samples a class must stand out over (one learned last is no fault)
    labels: str = "labels"
    predictions: str = "predictions"

    limits = {"samples": COUNT, "window": COUNT, "binary_threshold": ANY, "learned": SHARE, "ratio": POSITIVE,
              "patience": COUNT}

    def __post_init__(self):
        self._streaks: dict = {}  # (worker, finding) -> fresh samples judged since it began to hold, without a break
        self._fresh = 0  # samples at the step just pooled

    @property
    def history(self):
        return self.window

    def requires(self):
        return [Requirement("labels", save_tensors=True), Requirement("predictions", save_tensors=True)]

    def lasting(self, run, found: list):
        """The findings among these (singled-out classes) that held at every judgement over the last `patience`
        pools' worth of fresh samples: consecutive pools share most of their labels, so it is the new samples that
        count, not the judgements; and samples, not labels: a sequence's tokens (labels [n, T]) are one draw of the
        data, and a batch of them would meet the patience at once, while a class is still being learned."""
        worker = run.default_worker
        held = {v.finding for v in found}
        for key in [k for k in self._streaks if k[0] == worker and k[1] not in held]:
            del self._streaks[key]
        for finding in held:
            self._streaks[(worker, finding)] = self._streaks.get((worker, finding), 0) + self._fresh
        return [v for v in found if self._streaks[(worker, v.finding)] >= self.patience * self.samples] or None

    def pooled(self, run, step):
        """(true class ids, predicted class ids) of the newest steps up to `step`, or None if too few yet.
        Raises NotApplicable for data that is not a classifier's, NotClassIds for a classifier's labels that are
        not class ids."""
        names = run.tensor_names()
        if self.labels not in names or self.predictions not in names:
            return None
        task = task_of(run.first_step)
        if task in ("regression", "ranking"):
            raise NotApplicable(f"the training's loss is a {task}'s (recorded at its first step): its targets are "
                                "not classes, whatever values they take (a ranker's relevance, 0 or 1 for a click)")
        labels, predictions = run.tensor(self.labels), run.tensor(self.predictions)
        steps = sorted(set(labels.steps(tensors=True)) & set(predictions.steps(tensors=True)))
        if not steps or steps[-1] != step:
            return None
        y, y_hat, n = [], [], 0
        for s in reversed(steps[-self.window:]):
            batch = np.asarray(labels.value(s))
            true, predicted = _classified(batch, predictions.value(s), self.binary_threshold)
            if s == step:  # fresh samples, not labels: the tokens of one sequence are one draw of the data
                self._fresh = batch.shape[0] if batch.ndim else 1
            y.append(true)
            y_hat.append(predicted)
            n += len(true)
            if n >= self.samples:
                return np.concatenate(y), np.concatenate(y_hat)
        return None

    def classes(self, run, step):
        """(labels, predictions) pooled, or None before there are enough; a verdict (labels that are not class
        ids) where that is the finding."""
        try:
            return self.pooled(run, step)
        except NotClassIds as exc:
            return self.fire(step, f"{self.labels} are not class ids: {exc}. A classifier's loss takes whole "
                                   "numbers from 0 (or one-hot rows); these are cast or read as probabilities, so "
                                   "the model learns the wrong target.", finding="not_class_ids",
                             hint=NOT_CLASS_IDS_HINT)

    def judged(self, y: np.ndarray, y_hat: np.ndarray):
        """(overall error, per-class error, class counts) once the model has learned; None before."""
        counts = np.bincount(y)
        present = np.flatnonzero(counts)
        majority = counts.max() / len(y)
        error = float(np.mean(y_hat != y))
        if len(present) < 2 or 1 - error < majority + self.learned * (1 - majority):
            return None
        return error, {int(c): float(np.mean(y_hat[y == c] != c)) for c in present}, counts

    def singled_out(self, class_error: float, overall: float, count: int, limit: float) -> bool:
        """Whether a class's error is beyond `limit` and far beyond the model's overall error, on enough samples."""
        return count >= self.min_class_samples and class_error > limit and class_error > self.ratio * overall


NOT_CLASS_IDS_HINT = ("The labels fed to the classifier are not class ids (e.g. labels scaled like pixels, divided "
                      "by 255, or a regression target given to a classification loss). Try: pass the integer class "
                      "ids (0 … C-1) or one-hot rows; check the label preprocessing and the dtype; for a regression "
                      "task, use a regression loss and objective.")


def _classified(labels: np.ndarray, scores: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """(class ids, predicted class ids), one per labelled element, from a classifier's labels and predictions."""
    labels, scores = np.asarray(labels), np.asarray(scores)
    if labels.ndim == scores.ndim >= 2 and labels.shape[-1] == 1 and scores.shape[-1] >= 2 and \
            labels.shape[:-1] == scores.shape[:-1]:
        labels = labels[..., 0]  # class ids with a trailing axis of 1, as Keras' sparse losses take them
    if scores.ndim == labels.ndim + 1 and scores.shape[:-1] == labels.shape and scores.shape[-1] >= 2:
        y, predicted = labels.reshape(-1), scores.reshape(-1, scores.shape[-1]).argmax(axis=1)
        classes = scores.shape[-1]
    elif scores.shape == labels.shape and labels.ndim >= 2 and labels.shape[-1] >= 2 and _one_hot(labels):
        y = labels.reshape(-1, labels.shape[-1]).argmax(axis=1)
        predicted = scores.reshape(-1, scores.shape[-1]).argmax(axis=1)
        classes = labels.shape[-1]
    elif scores.size == labels.size and (scores.ndim == labels.ndim or scores.shape[-1:] == (1,)):
        y, scores = labels.reshape(-1), scores.reshape(-1)
        if _whole(scores) and scores.min() >= 0 and not _whole(y):  # class ids predicted against other labels
            raise NotApplicable("the predictions are class ids but the labels are not: not a classifier's data")
        if _whole(scores) and scores.size and scores.min() >= 0:
            predicted, classes = scores.astype(np.int64), None
        elif _whole(y) and y.size and y.max() > 1:
            raise NotApplicable("one score per sample against labels above 1: a regressor's or a ranker's data")
        else:
            predicted, classes = (scores > threshold).astype(np.int64), 2
            if not _whole(y):
                y = _binary_labels(y)
    else:
        raise NotApplicable(f"labels of shape {labels.shape} and predictions of shape {scores.shape} are not a "
                            "classifier's (scores per class with the labels' shape and a class axis, or one score "
                            "per label)")
    keep = y != IGNORE_INDEX
    y, predicted = y[keep], predicted[keep]
    if y.size and (not _whole(y) or y.min() < 0 or (classes is not None and y.max() >= classes)):
        odd = y[(y != np.round(y)) | (y < 0) | (y >= (classes or np.inf))]
        raise NotClassIds(f"{odd.size} of {y.size} are like {float(odd[0]):.4g}" +
                          (f" for {classes} classes" if classes is not None else ""))
    return y.astype(np.int64), predicted.astype(np.int64)


def _binary_labels(y: np.ndarray) -> np.ndarray:
    """Labels of a classifier with one score per sample that are not 0/1: probabilities (soft labels) that split at
    0.5 into both classes are read that way; anything else is not class ids, or not a classifier's labels."""
    values = np.unique(y)
    if values.size > 20:
        raise NotApplicable("the labels take many values that are not whole numbers: a regressor's targets, not a "
                            "classifier's labels")
    if values.min() >= 0 and values.max() <= 1 and values.min() < 0.5 < values.max():
        return (y > 0.5).astype(np.float64)
    return y  # fails the class id check with the values it holds


def _whole(x: np.ndarray) -> bool:
    return bool(np.all(np.isfinite(x)) and np.all(x == np.round(x)))


def _one_hot(labels: np.ndarray) -> bool:
    rows = labels.reshape(-1, labels.shape[-1])
    return bool(np.all((rows == 0) | (rows == 1)) and np.all(rows.sum(axis=1) == 1))


@dataclass
class ClassImbalance(_Pooled):
    """Classes of very different sizes (worth a look), or a class the trained model mostly misses (a problem).

    Reads the full `labels` (class ids [n], or one-hot [n, C]) and `predictions` (scores [n, C], argmax taken;
    one score [n], class 1 above `binary_threshold` (0.0 for logits); or class ids): XGBoost's `eval_data`, or
    a training step's labels and returned `preds`.
    """

    threshold_imbalance: float = 10.0
    threshold_misprediction: float = 0.7

    name = "class_imbalance"
    limits = {"threshold_imbalance": Range(1, what="a factor"), "threshold_misprediction": SHARE}
    condition = ("over the newest `samples` labels (pooled from at most `window` saved steps) of a classifier: "
                 "labels that are not class ids (warning); the largest class count more than `threshold_imbalance` "
                 "times the smallest (info: a property of the data); once the model has learned (accuracy at least "
                 "`learned` of the way from the majority class's share to 1), a class of at least "
                 "`min_class_samples` samples with more than `threshold_misprediction` of them predicted as another "
                 "class and an error `ratio` times the overall error, at every judgement over `patience` × `samples` "
                 "fresh samples (rows of labels: a sequence's tokens are one sample) (warning)")
    hint = ("The classes are unbalanced or one class is mostly missed: the model can score well by ignoring the "
            "rare class. Try: class weights (XGBoost `scale_pos_weight` or sample weights; `weight=` in the loss), "
            "resampling (oversample the rare class, undersample the common one), a metric that sees the rare class "
            "(AUC-PR, F1, balanced accuracy), more data for the rare class, a stratified split.")
    source = ("smdebug ClassImbalance: threshold_imbalance 10, threshold_misprediction 0.7, samples 500 (labels "
              "pooled over steps); here pooled over the newest steps until `samples` are in hand, so the verdict "
              "describes the model as it is now. The imbalance alone is info, and a class is judged against the "
              "overall error once the model has learned: every class is missed by an untrained model.")

    def check(self, run, step):
        pooled = self.classes(run, step)
        if not isinstance(pooled, tuple):
            return pooled
        y, y_hat = pooled
        found = []
        counts = np.bincount(y)
        present = np.flatnonzero(counts)
        big, small = present[counts[present].argmax()], present[counts[present].argmin()]
        if counts[big] > self.threshold_imbalance * counts[small]:
            found.append(self.fire(step, f"class {big} has {counts[big] / counts[small]:.1f}x the samples of class "
                                         f"{small} ({counts[big]} against {counts[small]} of {len(y)}).",
                                   severity="info", finding="imbalance",
                                   counts={int(c): int(counts[c]) for c in present}))
        judged = self.judged(y, y_hat)
        if judged is None:
            return found or None
        error, per_class, counts = judged
        worst = max(per_class, key=per_class.get)
        missed = []
        if self.singled_out(per_class[worst], error, counts[worst], self.threshold_misprediction):
            missed.append(self.fire(step, f"{per_class[worst]:.0%} of the {counts[worst]} samples of class {worst} "
                                          f"are predicted as another class, against {error:.0%} of all samples, over "
                                          f"its last {self.patience * self.samples} samples.",
                                    finding=f"missed:{worst}",
                                    mispredicted=per_class, overall_error=error))
        return (found + (self.lasting(run, missed) or [])) or None


@dataclass
class Confusion(_Pooled):
    """Classes the trained model mixes up far more than the rest, read from the confusion matrix.

    Reads the full `labels` (class ids [n], or one-hot [n, C]) and `predictions` (scores [n, C], argmax taken;
    one score [n], class 1 above `binary_threshold` (0.0 for logits); or class ids): XGBoost's `eval_data`, or
    a training step's labels and returned `preds`.
    """

    min_diag: float = 0.9
    max_off_diag: float = 0.1

    name = "confusion"
    limits = {"min_diag": SHARE, "max_off_diag": SHARE}
    condition = ("over the newest `samples` labels (pooled from at most `window` saved steps) of a classifier, with "
                 "C[i, j] the samples of class i predicted as j: labels that are not class ids; or, once the model "
                 "has learned (accuracy at least `learned` of the way from the majority class's share to 1), a "
                 "class of at least `min_class_samples` samples with C[i, i] / sum_j C[i, j] < `min_diag`, or a cell "
                 "off the diagonal with C[i, j] / sum_k C[k, j] > `max_off_diag`, where that error is `ratio` times "
                 "the overall error, at every judgement over `patience` × `samples` fresh samples (rows of labels): "
                 "a warning where "
                 "half the class or more is confused, else info (a class harder than the rest)")
    hint = ("The classifier confuses some classes far more than the rest: a class is often missed, or a predicted "
            "class often holds samples of another. Look at the pair in the message: similar classes need features "
            "that tell them apart; mislabelled training data (check samples of the pair); class imbalance (see "
            "class_imbalance); an underfit model (more rounds or depth, a higher learning rate).")
    source = ("smdebug Confusion: min_diag 0.9, max_off_diag 0.1 (off-diagonal normalised by column). smdebug "
              "documents the diagonal normalised by the sum of the diagonal, which its own test contradicts; here "
              "per class (by row), once the model has learned and only for classes far worse than the rest: a model "
              "below 90% on some class is not broken.")

    def check(self, run, step):
        pooled = self.classes(run, step)
        if not isinstance(pooled, tuple):
            return pooled
        y, y_hat = pooled
        judged = self.judged(y, y_hat)
        if judged is None:
            return None
        error, per_class, counts = judged
        k = int(max(y.max(), y_hat.max())) + 1
        matrix = np.zeros((k, k), dtype=np.int64)
        np.add.at(matrix, (y, y_hat), 1)
        rows, cols = matrix.sum(axis=1), matrix.sum(axis=0)
        evidence = {"matrix": matrix.tolist()} if k <= 20 else {}
        found = []
        i = max(per_class, key=per_class.get)
        if self.singled_out(per_class[i], error, int(rows[i]), 1 - self.min_diag):
            found.append(self.fire(step, f"only {1 - per_class[i]:.0%} of the {rows[i]} samples of class {i} are "
                                         f"predicted as {i}, against {1 - error:.0%} of all samples.",
                                   severity=_mostly(per_class[i]), finding=f"missed:{i}", cls=i,
                                   share=1 - per_class[i], **evidence))
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(cols > 0, matrix / cols, 0.0)
        np.fill_diagonal(share, 0.0)
        i, j = np.unravel_index(int(share.argmax()), share.shape)
        if self.singled_out(float(share[i, j]), error, int(cols[j]), self.max_off_diag):
            found.append(self.fire(step, f"{share[i, j]:.0%} of the {cols[j]} samples predicted as class {j} are "
                                         f"class {i}, against an error of {error:.0%} over all samples.",
                                   severity=_mostly(float(share[i, j])), finding=f"confused:{i}->{j}", true=int(i),
                                   predicted=int(j), share=float(share[i, j]), **evidence))
        return self.lasting(run, found)


def _mostly(wrong: float) -> str:
    """A class mostly confused (half or more of it) is a warning; a harder class than the rest is worth a look."""
    return "warning" if wrong >= 0.5 else "info"
