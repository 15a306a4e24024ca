"""Exact ROC and precision-recall curves and their areas, from scores, with numpy alone.

Every distinct score is a threshold (no bucketing), ties are one point, and
the definitions are scikit-learn's (`roc_curve`, `roc_auc_score`,
`precision_recall_curve`, `average_precision_score`), so the numbers in a
report can be checked against it; scikit-learn itself is not needed.
"""

from __future__ import annotations

import numpy as np


def counts_at_thresholds(y_true, score) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(false positives, true positives, thresholds) at each distinct score, highest score first."""
    y = np.asarray(y_true).astype(bool).ravel()
    s = np.asarray(score, dtype=np.float64).ravel()
    if y.shape != s.shape:
        raise ValueError(f"labels and scores differ in length: {y.size} and {s.size}")
    order = np.argsort(s, kind="mergesort")[::-1]
    s, y = s[order], y[order]
    last_of_tie = np.r_[np.flatnonzero(np.diff(s)), s.size - 1]
    tps = np.cumsum(y, dtype=np.float64)[last_of_tie]
    fps = 1.0 + last_of_tie - tps
    return fps, tps, s[last_of_tie]


def roc_curve(y_true, score, drop_intermediate: bool = True):
    """(fpr, tpr, thresholds), starting at (0, 0) with threshold +inf; collinear points dropped if asked."""
    fps, tps, thresholds = counts_at_thresholds(y_true, score)
    if drop_intermediate and fps.size > 2:
        keep = np.r_[True, np.logical_or(np.diff(fps, 2), np.diff(tps, 2)), True]
        fps, tps, thresholds = fps[keep], tps[keep], thresholds[keep]
    fps, tps = np.r_[0.0, fps], np.r_[0.0, tps]
    fpr = fps / fps[-1] if fps[-1] > 0 else np.full(fps.shape, np.nan)
    tpr = tps / tps[-1] if tps[-1] > 0 else np.full(tps.shape, np.nan)
    return fpr, tpr, np.r_[np.inf, thresholds]


def roc_auc(y_true, score) -> float:
    """Area under the ROC curve (the probability that a positive outranks a negative, ties counted half)."""
    fpr, tpr, _ = roc_curve(y_true, score, drop_intermediate=False)
    return float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1])) / 2.0)


def precision_recall_curve(y_true, score):
    """(precision, recall, thresholds) with recall decreasing and a final (precision 1, recall 0) point."""
    fps, tps, thresholds = counts_at_thresholds(y_true, score)
    predicted = tps + fps
    precision = np.divide(tps, predicted, out=np.zeros_like(tps), where=predicted != 0)
    recall = tps / tps[-1] if tps[-1] > 0 else np.ones_like(tps)
    return np.r_[precision[::-1], 1.0], np.r_[recall[::-1], 0.0], thresholds[::-1]


def average_precision(y_true, score) -> float:
    """The area under the step-wise PR curve: sum over thresholds of (recall gained) x precision."""
    precision, recall, _ = precision_recall_curve(y_true, score)
    return float(-np.sum(np.diff(recall) * precision[:-1]))


def class_scores(labels, predictions) -> dict:
    """Labels (class ids [n], or one-hot [n, C]) and predictions (scores [n] or [n, 1] for binary, [n, C]) ->
    {"classes": C, "y": class ids, "rank": [n, K] scores to rank by, "prob": [n, K] probabilities, "predicted":
    class ids}, K = 1 (the positive class) for binary scores, else C.

    Logits are accepted: ranks come from quantities monotone in the probability that do not saturate (the logit
    itself, the logit difference of two columns, log-softmax), so ties are never made up by float rounding."""
    y = np.asarray(labels)
    p = np.asarray(predictions, dtype=np.float64)
    p = p[:, 0] if p.ndim == 2 and p.shape[1] == 1 else p
    if y.ndim == 2 and p.ndim == 2 and y.shape == p.shape:
        y = y.argmax(axis=1)
    y = y.reshape(-1) if y.ndim == 2 and 1 in y.shape else y
    if y.ndim != 1 or p.ndim not in (1, 2) or len(y) != len(p):
        raise ValueError(f"labels {y.shape} and predictions {p.shape} do not pair up as class ids [n] and scores "
                         "[n] or [n, C]")
    if not np.all(np.isfinite(p)):
        raise ValueError(f"{np.count_nonzero(~np.isfinite(p))} prediction scores are NaN or Inf")
    if not np.all(np.equal(np.mod(y, 1), 0)):
        raise ValueError("labels are not integer class ids")
    y = y.astype(np.int64)
    probabilities = bool(np.all((p >= 0) & (p <= 1)))
    if p.ndim == 1:
        classes = 2
        rank = p
        prob = p if probabilities else _sigmoid(p)
        predicted = (prob >= 0.5).astype(np.int64)
    else:
        classes = p.shape[1]
        probabilities = probabilities and bool(np.allclose(p.sum(axis=1), 1.0, atol=1e-3))
        if classes == 2:
            rank = p[:, 1] if probabilities else p[:, 1] - p[:, 0]
            prob = p[:, 1] if probabilities else _sigmoid(rank)
        else:
            rank = p if probabilities else p - _logsumexp(p)
            prob = p if probabilities else np.exp(rank)
        predicted = p.argmax(axis=1)
    if y.min(initial=0) < 0 or y.max(initial=0) >= classes:
        raise ValueError(f"labels hold class ids outside 0..{classes - 1}")
    as_2d = lambda a: a[:, None] if a.ndim == 1 else a  # noqa: E731
    return {"classes": classes, "y": y, "rank": as_2d(rank), "prob": as_2d(prob), "predicted": predicted}


def _sigmoid(z: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _logsumexp(z: np.ndarray) -> np.ndarray:
    top = z.max(axis=1, keepdims=True)
    return top + np.log(np.exp(z - top).sum(axis=1, keepdims=True))
