"""Rules over losses and metrics."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import Requirement, Rule


@dataclass
class LossNotDecreasing(Rule):
    window: int = 5  # samples per mean
    diff_percent: float = 0.1
    tensor_regex: str = "^losses/"

    name = "loss_not_decreasing"
    condition = ("the mean of the newest `window` loss samples is not at least `diff_percent` % below the mean of "
                 "the `window` samples before them")
    hint = ("The loss stopped going down. If it never went down: the learning rate may be 0 or far too small, "
            "the parameters may not be in the optimizer, labels may not match inputs, or gradients may vanish. If "
            "it went down and levelled off, training has converged: stop here or lower the learning rate "
            "(a scheduler).")
    source = ("smdebug LossNotDecreasing (num_steps 10, diff_percent 0.1): here compared over means of `window` "
              "samples rather than two single steps, so one noisy batch does not decide.")

    @property
    def history(self):
        return 2 * self.window

    def requires(self):
        return [Requirement("losses")]

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
    ratio_threshold: float = 0.1
    patience: int = 1
    start_step: int = 0
    val_tensor: str = "metrics/val_loss"
    train_tensor: str = "losses/train"

    name = "overfit"
    modes = ("eval",)
    condition = ("at `patience` evaluations in a row (from start_step), (val - train) / train > ratio_threshold, "
                 "where val is `val_tensor` at the evaluation and train is the mean of `train_tensor` since the "
                 "evaluation before")
    hint = ("The model fits the training data much better than held-out data. Try: more data or augmentation, "
            "dropout, weight decay, a smaller model, early stopping on the validation loss.")
    source = "smdebug Overfit (ratio_threshold 0.1, patience 1, start_step 0)."

    @property
    def history(self):
        return max(64, 4 * self.patience)

    def requires(self):
        return [Requirement("losses"), Requirement("metrics")]

    def check(self, run, step):
        if step < self.start_step or self.val_tensor not in run.tensor_names(mode="eval") or \
                self.train_tensor not in run.tensor_names(mode="train"):
            return None
        val_steps, val = run.tensor(self.val_tensor).series(mode="eval")
        train_steps, train = run.tensor(self.train_tensor).series(mode="train")
        if len(val_steps) < self.patience or val_steps[-1] != step:
            return None
        ratios = []
        for i in range(len(val_steps) - self.patience, len(val_steps)):
            lo = val_steps[i - 1] if i > 0 else -1
            window = train[(train_steps > lo) & (train_steps <= val_steps[i])]
            if not len(window) or val_steps[i] < self.start_step:
                return None
            mean = float(np.mean(window))
            ratios.append((val[i] - mean) / abs(mean) if mean else float("inf"))
        if all(r > self.ratio_threshold for r in ratios):
            return self.fire(step, f"{self.val_tensor} is {ratios[-1]:.0%} above the training loss "
                                   f"(limit {self.ratio_threshold:.0%}) at {self.patience} evaluation(s) in a row.",
                             ratios=ratios, val=float(val[-1]))
        return None


