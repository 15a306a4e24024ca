"""Rules over the model's output against its loss: a model and a loss that read the output differently.

A classifier's output is read by its loss as logits, as probabilities or as
log-probabilities. When the model's output is one kind and the loss reads it
as another (a softmax layer before CrossEntropyLoss, which applies softmax
again; logits into a Keras loss left at from_logits=False), the model still
trains, slowly or not at all, and nothing goes NaN. The loss a framework
reports says which reading it made: from the output and the labels, each
reading gives a loss of its own, and the one that matches the reported
loss is the one the loss made.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ranges import COUNT, Range
from .base import NotApplicable, Requirement, Rule
from .classification import NotClassIds, _classified

EPSILON = 1e-7  # Keras' clip of probabilities before the log; torch's losses clip the same way in effect
# The output's kind, from its values: probabilities (rows of non-negative numbers that sum to 1), log-probabilities
# (rows whose logsumexp is 0), else logits. For one score per sample: within [0, 1], else logits.
READINGS = {
    ("probabilities", "logits"): ("the model outputs probabilities (a softmax or sigmoid output layer) and the loss "
                                  "reads them as logits, applying softmax or sigmoid again (CrossEntropyLoss, "
                                  "BCEWithLogitsLoss, from_logits=True)",
                                  "remove the output layer's softmax/sigmoid (the loss applies it), or use a loss "
                                  "that takes probabilities (NLLLoss on log-probabilities, from_logits=False)"),
    ("logits", "probabilities"): ("the model outputs logits and the loss reads them as probabilities "
                                  "(a Keras loss left at from_logits=False, BCELoss on raw outputs)",
                                  "pass from_logits=True to the loss (or add a softmax/sigmoid output layer), or use "
                                  "CrossEntropyLoss / BCEWithLogitsLoss"),
    ("logits", "log-probabilities"): ("the model outputs logits and the loss reads them as log-probabilities "
                                      "(NLLLoss without log_softmax)",
                                      "apply log_softmax before NLLLoss, or use CrossEntropyLoss on the logits"),
    ("probabilities", "log-probabilities"): ("the model outputs probabilities and the loss reads them as "
                                             "log-probabilities (NLLLoss after softmax)",
                                             "use log_softmax instead of softmax before NLLLoss"),
}


@dataclass
class OutputLossMismatch(Rule):
    """A classifier whose loss reads its output as another kind than it is: softmax before a loss that applies it
    again, logits into a loss that expects probabilities."""

    tolerance: float = 0.02  # relative distance at which the reported loss matches a reading
    separation: float = 5.0  # the matched reading is at least this many times closer than the output's own
    patience: int = 2  # judged steps in a row the mismatch holds at
    loss: str = "losses/train"

    name = "output_loss_mismatch"
    limits = {"separation": Range(1, what="a factor"), "patience": COUNT}
    condition = ("at the steps it samples (0, 10, 20, 50, 100, 200, 500, 1000), for a classifier's output and "
                 "labels (the shapes say so, as for class_imbalance) and the training loss reported at the same "
                 "step: the output is one kind (probabilities: non-negative rows summing to 1, or one score in "
                 "[0, 1]; log-probabilities: rows whose logsumexp is 0; else logits), the reported loss is within "
                 "`tolerance` of the cross-entropy of reading it as another kind, and `separation` times closer to "
                 "that than to reading it as what it is, at `patience` judged steps in a row. A loss that adds "
                 "terms (regularisation, label smoothing, class weights) matches no reading and is not judged; nor is an "
                 "XGBoost objective, which reads its own output")
    hint = ("The model's output layer and its loss read the output differently, so the loss computes something "
            "else than intended: the model learns slowly or not at all, and nothing goes NaN. The message says "
            "which reading the loss made and the change to make.")
    source = ("DeepDiagnosis (Wardat et al., ICSE 2022) and AUTOTRAINER list a wrong last-layer activation for the "
              "loss among the commonest training bugs, judged there from the program's source; here from the "
              "values: which reading of the output reproduces the loss the framework reported.")
    steps = (0, 10, 20, 50, 100, 200, 500, 1000)

    def __post_init__(self):
        self._streaks: dict = {}  # worker -> (finding, judged steps in a row it held at)

    def requires(self):
        return [Requirement("labels", save_tensors=True, steps=self.steps),
                Requirement("predictions", save_tensors=True, steps=self.steps),
                Requirement("losses", steps=self.steps)]

    def check(self, run, step):
        own = [use for use in (run.first_step.losses if run.first_step is not None else ()) if use.reads == "scores"]
        if own:
            raise NotApplicable(f"the training's objective ({own[0].settings.get('objective', own[0].loss)}) reads "
                                "its output its own way, and its loss is logged on other data than the predictions "
                                "captured (a booster's eval log against its eval_data)")
        names = run.tensor_names(step=step)
        if not {"labels", "predictions", self.loss} <= set(names):
            return None
        try:
            loss = run.tensor(self.loss).reduction(step)
            scores = np.asarray(run.tensor("predictions").value(step), dtype=np.float64)
            labels = np.asarray(run.tensor("labels").value(step))
            _classified(labels, scores, 0.5)  # a classifier's data, or NotApplicable
        except (NotApplicable, NotClassIds, LookupError):
            return None
        found = _mismatch(scores, labels, loss, self.tolerance, self.separation)
        key = found[:2] if found is not None else None
        previous, count = self._streaks.get(run.default_worker, (None, 0))
        count = count + 1 if key is not None and key == previous else (1 if key else 0)
        self._streaks[run.default_worker] = (key, count)
        if found is None or count < self.patience:
            return None
        kind, reading, readings = found
        what, change = READINGS[(kind, reading)]
        return self.fire(step, f"{what}: the reported loss {loss:.4g} is what reading the output as {reading} "
                               f"gives ({readings[reading]:.4g}); read as {kind}, it would be {readings[kind]:.4g}. "
                               f"Try: {change}.", finding=f"{kind}->{reading}", output=kind, loss_reads=reading,
                         loss=loss, readings=readings)


def _mismatch(scores: np.ndarray, labels: np.ndarray, loss: float, tolerance: float, separation: float):
    """(the output's kind, the reading the loss matches, the readings' losses) where they differ, else None."""
    if scores.ndim == labels.ndim + 1 and scores.shape[-1] >= 2:
        rows = scores.reshape(-1, scores.shape[-1])
        y = labels.reshape(-1).astype(np.int64)
        keep = y >= 0  # padding (ignore_index) is not in the loss
        rows, y = rows[keep], y[keep]
        readings = _categorical(rows, y, loss)
        kind = _kind(rows)
    elif scores.size == labels.size and set(np.unique(labels).tolist()) <= {0, 1}:
        p, y = scores.reshape(-1), labels.reshape(-1).astype(np.float64)
        readings = _binary(p, y)
        kind = "probabilities" if p.min() >= 0 and p.max() <= 1 else "logits"
    else:
        return None
    if kind not in readings or not np.isfinite(loss):
        return None
    distance = {reading: abs(loss - value) / max(abs(value), 1e-6) for reading, value in readings.items()}
    reading = min(distance, key=distance.get)
    if reading == kind or distance[reading] > tolerance or distance[kind] < separation * max(distance[reading], 1e-3):
        return None
    return kind, reading, readings


def _kind(rows: np.ndarray) -> str:
    if rows.min() >= 0 and np.allclose(rows.sum(axis=1), 1.0, atol=1e-3):
        return "probabilities"
    if rows.max() <= 0 and np.allclose(_logsumexp(rows), 0.0, atol=1e-3):
        return "log-probabilities"
    return "logits"


def _logsumexp(rows: np.ndarray) -> np.ndarray:
    top = rows.max(axis=1, keepdims=True)
    return (top + np.log(np.exp(rows - top).sum(axis=1, keepdims=True)))[:, 0]


def _categorical(rows: np.ndarray, y: np.ndarray, loss: float) -> dict:
    """The cross-entropy of the labels under each reading of the output rows. Frameworks read rows as
    probabilities in two ways (clipped then normalised: Keras' sparse loss; normalised then clipped: its one-hot
    loss, torch's losses on probabilities): the one nearer the reported loss is the reading."""
    index = np.arange(len(y))
    picked = rows[index, y]
    out = {"logits": float(np.mean(_logsumexp(rows) - picked)), "log-probabilities": float(np.mean(-picked))}
    clipped = np.clip(rows, EPSILON, 1 - EPSILON)
    ways = [float(np.mean(-np.log(clipped[index, y] / clipped.sum(axis=1))))]
    totals = rows.sum(axis=1)
    if np.all(totals > 0):
        ways.append(float(np.mean(-np.log(np.clip(picked / totals, EPSILON, 1 - EPSILON)))))
    out["probabilities"] = min(ways, key=lambda value: abs(value - loss))
    return out


def _binary(p: np.ndarray, y: np.ndarray) -> dict:
    clipped = np.clip(p, EPSILON, 1 - EPSILON)
    return {"probabilities": float(np.mean(-(y * np.log(clipped) + (1 - y) * np.log(1 - clipped)))),
            "logits": float(np.mean(np.maximum(p, 0) - p * y + np.log1p(np.exp(-np.abs(p)))))}
