"""Rules over losses and metrics.

Which series they read, and in which mode, are parameters: the defaults read
Lightning's and Keras' `losses/train` and `metrics/val_loss`; XGBoost's eval
log (`metrics/<eval set>/<metric>`, all in mode train) is read by naming its
series (docs/rules.md shows the config).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..naming import MODES, collection_of
from .base import Requirement, Rule


@dataclass
class LossNotDecreasing(Rule):
    """A loss, or any series that should go down (an XGBoost eval metric), that stopped going down.

    On XGBoost's eval log: `params: {collection: metrics, tensor_regex: "^metrics/validation/logloss$"}`
    (the eval set's name as given to xgb.train; `validation_1` for the second `eval_set` of an sklearn estimator).
    """

    window: int = 5  # samples per mean
    diff_percent: float = 0.1
    tensor_regex: str = "^losses/"
    collection: str = "losses"  # the collection the `tensor_regex` series are in (captured for the rule)
    mode: str = "train"  # the mode whose steps hold the series

    name = "loss_not_decreasing"
    condition = ("for a series matching `tensor_regex` (in `mode`), the mean of the newest `window` samples is not "
                 "at least `diff_percent` % below the mean of the `window` samples before them")
    hint = ("The loss stopped going down. If it never went down: the learning rate may be 0 or far too small, "
            "the parameters may not be in the optimizer, labels may not match inputs, or gradients may vanish. If "
            "it went down and levelled off, training has converged: stop here or lower the learning rate "
            "(a scheduler).")
    source = ("smdebug LossNotDecreasing (num_steps 10, diff_percent 0.1): here compared over means of `window` "
              "samples rather than two single steps, so one noisy batch does not decide.")

    def __post_init__(self):
        self.modes = (_mode(self.mode),)

    @property
    def history(self):
        return 2 * self.window

    def requires(self):
        return [Requirement(self.collection)]

    def check(self, run, step):
        for name in run.tensor_names(regex=self.tensor_regex):
            steps, values = run.tensor(name).series()
            if len(steps) < 2 * self.window or steps[-1] != step:
                continue
            before = float(np.mean(values[-2 * self.window:-self.window]))
            now = float(np.mean(values[-self.window:]))
            if now > before * (1 - self.diff_percent / 100) or not np.isfinite(now):
                return self.fire(step, f"{name} averaged {now:.4g} over its last {self.window} samples, against "
                                       f"{before:.4g} over the {self.window} before: not {self.diff_percent:g}% "
                                       "lower.", tensor=name, mean_before=before, mean_now=now)
        return None


@dataclass
class Overfit(Rule):
    """A validation loss well above the training loss: the model fits its training data, not the task.

    On XGBoost's eval log, where every eval set is recorded at each round in mode train: `params:
    {train_tensor: metrics/train/logloss, val_tensor: metrics/validation/logloss, val_mode: train}` (a metric
    that is lower when better: logloss, mlogloss, rmse, error).
    """

    ratio_threshold: float = 0.1
    patience: int = 1
    start_step: int = 0
    val_tensor: str = "metrics/val_loss"
    train_tensor: str = "losses/train"
    val_mode: str = "eval"  # the mode holding `val_tensor`; the rule is evaluated at its steps
    train_mode: str = "train"  # the mode holding `train_tensor`

    name = "overfit"
    modes = ("eval",)
    condition = ("at `patience` evaluations in a row (from start_step), (val - train) / train > ratio_threshold, "
                 "where val is `val_tensor` (in `val_mode`) at the evaluation and train is the mean of "
                 "`train_tensor` (in `train_mode`) since the evaluation before")
    hint = ("The model fits the training data much better than held-out data. Try: more data or augmentation, "
            "dropout, weight decay, a smaller model, early stopping on the validation loss.")
    source = "smdebug Overfit (ratio_threshold 0.1, patience 1, start_step 0)."

    def __post_init__(self):
        self.modes = (_mode(self.val_mode),)
        _mode(self.train_mode)

    @property
    def history(self):
        return max(64, 4 * self.patience)

    def requires(self):
        return [Requirement(c) for c in dict.fromkeys([collection_of(self.train_tensor),
                                                        collection_of(self.val_tensor)])]

    def check(self, run, step):
        found = train_means_at_evals(run, self.val_tensor, self.train_tensor, step, self.val_mode, self.train_mode)
        if step < self.start_step or found is None or len(found[0]) < self.patience:
            return None
        val_steps, val, train = (a[len(a) - self.patience:] for a in found)
        if np.isnan(train).any() or val_steps[0] < self.start_step:
            return None
        ratios = [(v - t) / abs(t) if t else float("inf") for v, t in zip(val, train)]
        if all(r > self.ratio_threshold for r in ratios):
            return self.fire(step, f"{self.val_tensor} is {ratios[-1]:.0%} above the training loss "
                                   f"(limit {self.ratio_threshold:.0%}) at {self.patience} evaluation(s) in a row.",
                             ratios=ratios, val=float(val[-1]))
        return None


def train_means_at_evals(run, val_tensor: str, train_tensor: str, step: int, val_mode: str = "eval",
                         train_mode: str = "train"):
    """(evaluation steps, validation values, mean training value since the evaluation before) up to `step`,
    which must be an evaluation; None when either series is missing. NaN where no training value fell between."""
    if val_tensor not in run.tensor_names(mode=val_mode) or train_tensor not in run.tensor_names(mode=train_mode):
        return None
    val_steps, val = run.tensor(val_tensor).series(mode=val_mode)
    train_steps, train = run.tensor(train_tensor).series(mode=train_mode)
    if not len(val_steps) or val_steps[-1] != step:
        return None
    means = np.full(len(val_steps), np.nan)
    for i, s in enumerate(val_steps):
        window = train[(train_steps > (val_steps[i - 1] if i else -1)) & (train_steps <= s)]
        if len(window):
            means[i] = float(np.mean(window))
    return val_steps, val, means


def _mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode '{mode}' is not one of {', '.join(MODES)}")
    return mode
