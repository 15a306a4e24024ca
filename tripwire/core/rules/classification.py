"""Rules over labels and predictions of a classifier, for any framework.

They read the full `labels` and `predictions` tensors, pooled over the newest
saved steps until `samples` labels are in hand: one XGBoost eval set at one
boosting round, or the last few batches of a neural network. Labels are class
ids ([n]) or one-hot ([n, C]); predictions are scores per class ([n, C]:
probabilities or logits, argmax taken), one score per sample ([n]: class 1
when above `binary_threshold`), or class ids ([n], whole numbers >= 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import Requirement, Rule


@dataclass
class _Pooled(Rule):
    """Shared parameters and pooling of the classification rules."""

    samples: int = 500  # labels pooled before the rule decides
    window: int = 16  # at most this many of the newest saved steps are pooled
    binary_threshold: float = 0.5  # [n] scores above it are class 1 (0.0 for logits)
    labels: str = "labels"
    predictions: str = "predictions"

    @property
    def history(self):
        return self.window

    def requires(self):
        return [Requirement("labels", save_tensors=True), Requirement("predictions", save_tensors=True)]

    def pooled(self, run, step) -> tuple[np.ndarray, np.ndarray] | None:
        """(true class ids, predicted class ids) of the newest steps up to `step`, or None if too few yet."""
        names = run.tensor_names()
        if self.labels not in names or self.predictions not in names:
            return None
        labels, predictions = run.tensor(self.labels), run.tensor(self.predictions)
        steps = sorted(set(labels.steps(tensors=True)) & set(predictions.steps(tensors=True)))
        if not steps or steps[-1] != step:
            return None
        y, y_hat, n = [], [], 0
        for s in reversed(steps[-self.window:]):
            true, predicted = _class_ids(labels.value(s), "labels"), self._predicted(predictions.value(s))
            if len(true) != len(predicted):
                raise ValueError(f"at step {s}, {self.labels} holds {len(true)} samples but {self.predictions} "
                                 f"holds {len(predicted)}")
            y.append(true)
            y_hat.append(predicted)
            n += len(true)
            if n >= self.samples:
                return np.concatenate(y), np.concatenate(y_hat)
        return None

    def _predicted(self, scores: np.ndarray) -> np.ndarray:
        scores = np.asarray(scores)
        if scores.ndim == 2 and scores.shape[1] > 1:
            return scores.argmax(axis=1)
        scores = scores.reshape(len(scores), -1)[:, 0] if scores.ndim == 2 else scores
        if scores.size and scores.min() >= 0 and np.all(scores == np.round(scores)):
            return scores.astype(np.int64)
        return (scores > self.binary_threshold).astype(np.int64)


def _class_ids(values: np.ndarray, what: str) -> np.ndarray:
    values = np.asarray(values)
    if values.ndim == 2 and values.shape[1] > 1:  # one-hot
        return values.argmax(axis=1)
    values = values.reshape(-1)
    if values.size and (not np.all(values == np.round(values)) or values.min() < 0):
        raise ValueError(f"{what} are not class ids (whole numbers >= 0): these rules are for classifiers")
    return values.astype(np.int64)


@dataclass
class ClassImbalance(_Pooled):
    """Classes of very different sizes, or a class the model mostly misses.

    Reads the full `labels` (class ids [n], or one-hot [n, C]) and `predictions` (scores [n, C], argmax taken;
    one score [n], class 1 above `binary_threshold` (0.0 for logits); or class ids): XGBoost's `eval_data`, or
    a training step's labels and returned `preds`.
    """

    threshold_imbalance: float = 10.0
    threshold_misprediction: float = 0.7
    start_step: int = 10  # the misprediction check starts here: an untrained model misses the rare class

    name = "class_imbalance"
    condition = ("at a step with new labels and predictions, over the newest `samples` labels (pooled from at most "
                 "`window` saved steps): the largest class count is more than `threshold_imbalance` times the "
                 "smallest, or (from `start_step` on) some class has more than `threshold_misprediction` of its "
                 "samples predicted as another class")
    hint = ("The classes are unbalanced or one class is mostly missed: the model can score well by ignoring the "
            "rare class. Try: class weights (XGBoost `scale_pos_weight` or sample weights; `weight=` in the loss), "
            "resampling (oversample the rare class, undersample the common one), a metric that sees the rare class "
            "(AUC-PR, F1, balanced accuracy), more data for the rare class, a stratified split.")
    source = ("smdebug ClassImbalance: threshold_imbalance 10, threshold_misprediction 0.7, samples 500 (labels "
              "pooled over steps); here pooled over the newest steps until `samples` are in hand, so the verdict "
              "describes the model as it is now. `start_step` is tripwire's: in its first rounds a model "
              "predicts the majority class everywhere.")

    def check(self, run, step):
        pooled = self.pooled(run, step)
        if pooled is None:
            return None
        y, y_hat = pooled
        counts = np.bincount(y)
        present = np.flatnonzero(counts)
        if len(present) >= 2:
            big, small = present[counts[present].argmax()], present[counts[present].argmin()]
            ratio = counts[big] / counts[small]
            if ratio > self.threshold_imbalance:
                return self.fire(step, f"class {big} has {ratio:.1f}x the samples of class {small} ({counts[big]} "
                                       f"against {counts[small]} of {len(y)}); limit {self.threshold_imbalance:g}x.",
                                 counts={int(c): int(counts[c]) for c in present}, ratio=float(ratio))
        if step < self.start_step:
            return None
        missed = {int(c): float(np.mean(y_hat[y == c] != c)) for c in present}
        worst = max(missed, key=missed.get)
        if missed[worst] > self.threshold_misprediction:
            return self.fire(step, f"{missed[worst]:.0%} of the {counts[worst]} samples of class {worst} are "
                                   f"predicted as another class; limit {self.threshold_misprediction:.0%}.",
                             mispredicted=missed, counts={int(c): int(counts[c]) for c in present})
        return None


@dataclass
class Confusion(_Pooled):
    """Classes the model mixes up, read from the confusion matrix of labels and predictions.

    Reads the full `labels` (class ids [n], or one-hot [n, C]) and `predictions` (scores [n, C], argmax taken;
    one score [n], class 1 above `binary_threshold` (0.0 for logits); or class ids): XGBoost's `eval_data`, or
    a training step's labels and returned `preds`.
    """

    min_diag: float = 0.9
    max_off_diag: float = 0.1
    start_step: int = 10  # steps before it are not checked: an untrained model confuses every class

    name = "confusion"
    condition = ("from `start_step` on, at a step with new labels and predictions, over the newest `samples` labels "
                 "(pooled from at most `window` saved steps), with C[i, j] the samples of class i predicted as j: "
                 "some class has C[i, i] / sum_j C[i, j] < `min_diag`, or some cell off the diagonal has "
                 "C[i, j] / sum_k C[k, j] > `max_off_diag`")
    hint = ("The classifier confuses classes: a class is often missed, or a predicted class often holds samples "
            "of another. Look at the pair in the message: similar classes need features that tell them apart; "
            "mislabelled training data (check samples of the pair); class imbalance (see class_imbalance); an "
            "underfit model (more rounds or depth, a higher learning rate). Early in training every class is "
            "confused: set `start_step` to where the model should already be good.")
    source = ("smdebug Confusion: min_diag 0.9, max_off_diag 0.1 (off-diagonal normalised by column). smdebug "
              "documents the diagonal normalised by the sum of the diagonal, which its own test contradicts; here "
              "per class (by row). `samples` and `start_step` are tripwire's: a verdict from a few samples or from "
              "an untrained model says nothing.")

    def check(self, run, step):
        pooled = None if step < self.start_step else self.pooled(run, step)
        if pooled is None:
            return None
        y, y_hat = pooled
        k = int(max(y.max(), y_hat.max())) + 1
        matrix = np.zeros((k, k), dtype=np.int64)
        np.add.at(matrix, (y, y_hat), 1)
        rows, cols = matrix.sum(axis=1), matrix.sum(axis=0)
        evidence = {"matrix": matrix.tolist()} if k <= 20 else {}
        with np.errstate(invalid="ignore", divide="ignore"):
            diag = np.where(rows > 0, np.diag(matrix) / rows, 1.0)
            share = np.where(cols > 0, matrix / cols, 0.0)
        np.fill_diagonal(share, 0.0)
        i = int(diag.argmin())
        if diag[i] < self.min_diag:
            return self.fire(step, f"only {diag[i]:.0%} of the {rows[i]} samples of class {i} are predicted as "
                                   f"{i}; limit {self.min_diag:.0%}.", cls=i, share=float(diag[i]), **evidence)
        i, j = np.unravel_index(int(share.argmax()), share.shape)
        if share[i, j] > self.max_off_diag:
            return self.fire(step, f"{share[i, j]:.0%} of the {cols[j]} samples predicted as class {j} are class "
                                   f"{i}; limit {self.max_off_diag:.0%}.", true=int(i), predicted=int(j),
                             share=float(share[i, j]), **evidence)
        return None
