"""Rules over the course of training: oscillation and overtraining, read from losses and eval metrics."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..ranges import COUNT, SHARE, Range
from .base import Requirement, Rule
from .overfit import train_means_at_evals


@dataclass
class OscillatingLoss(Rule):
    """A loss or metric that swings up and down instead of settling."""

    amplitude: float = 0.25
    rate: float = 0.2
    min_samples: int = 10
    tensor_regex: str = "^metrics/val_loss$"
    mode: str = "eval"

    name = "oscillating_loss"
    limits = {"rate": SHARE, "min_samples": Range(3, what="samples: a swing spans three")}
    modes = ("train", "eval")
    condition = ("over the samples of a tensor matching `tensor_regex` in `mode` (at least `min_samples`), pair "
                 "the k-th local maximum with the k-th local minimum; the rule fires when the pairs whose "
                 "difference is at least `amplitude` times the series' scale number at least `rate` × the samples. "
                 "The scale is the larger of its median and how far it came down from its first value: a swing "
                 "relative to its level, so neither the noise of a small validation set nor that of a loss near 0 "
                 "after a long descent counts. An evaluation series is not judged to oscillate while the training "
                 "loss (its mean between evaluations over two or more training samples, three or more such "
                 "windows) has not swung once by `amplitude` of its own scale, nor where fewer than three windows "
                 "hold two training samples: the validation loss alone swings with its own noise")
    hint = ("The loss oscillates instead of converging. Likely causes: a learning rate too high, a batch size "
            "too small, momentum too high, an unsuitable output activation or loss. Try: lower the learning rate "
            "(or decay it), increase the batch size, reduce momentum, check that the last layer and the loss "
            "match the task.")
    source = ("AUTOTRAINER (Zhang et al., ICSE 2021) unstable training: zeta 0.03 (amplitude), eta 0.2 (rate), "
              "there on per-epoch training accuracy, which lies in [0, 1]; here on any series, by default the "
              "per-evaluation val_loss, so the amplitude is relative to the series' level.")

    @property
    def history(self):
        return max(64, self.min_samples)

    def requires(self):
        return [Requirement("metrics"), Requirement("losses")]

    def check(self, run, step):
        if run.default_mode != self.mode:
            return None
        pattern = re.compile(self.tensor_regex)
        for name in run.tensor_names(mode=self.mode):
            if not pattern.search(name):
                continue
            steps, values = run.tensor(name).series(mode=self.mode)
            if len(values) < self.min_samples or steps[-1] != step:
                continue
            if not np.all(np.isfinite(values)):
                continue
            large = self._large_swings(values)
            if large >= self.rate * len(values) and not self._training_steady(run, name, step):
                return self.fire(step, f"{name} swung by at least {self.amplitude:.0%} of its scale {large} times "
                                       f"over its last {len(values)} samples (limit {self.rate:.0%} of them).",
                                 finding=name, tensor=name, swings=large, samples=len(values))
        return None

    def _large_swings(self, values: np.ndarray) -> int:
        scale = max(float(np.median(np.abs(values))), float(values[0] - values.min()))
        return int(np.sum(_swings(values) >= self.amplitude * scale))

    def _training_steady(self, run, name: str, step: int) -> bool:
        """Whether an evaluation series swings while the training loss, its mean between evaluations, has not
        been seen to swing by `amplitude` of its scale: what the hint blames (a learning rate too high, momentum, a
        batch too small) unsettles the training itself; swings of the validation loss alone are its own noise (a
        few hundred samples, a few confident mistakes: 0.13 -> 0.19 -> 0.13 at 97 % accuracy) or the start of an
        overfit, which overfit judges. A window is read where it holds two or more training samples: the loss of
        one sampled batch is no mean (a class-weighted loss: 4e-7 at one sample, 1e-5 at the next, on a training
        that settles), and with fewer than three such windows the training is not seen to swing."""
        if self.mode != "eval":
            return False
        found = train_means_at_evals(run, name, "losses/train", step, least=2)
        if found is None:
            return False
        train = found[2][np.isfinite(found[2])]
        return len(train) < 3 or self._large_swings(train) == 0


def _swings(v: np.ndarray) -> np.ndarray:
    """max_k - min_k for the k-th interior local maximum and minimum (AUTOTRAINER's ol_judge)."""
    inner = np.arange(1, len(v) - 1)
    maxima = v[inner[(v[inner] >= v[inner - 1]) & (v[inner] >= v[inner + 1])]]
    minima = v[inner[(v[inner] <= v[inner - 1]) & (v[inner] <= v[inner + 1])]]
    k = min(len(maxima), len(minima))
    return maxima[:k] - minima[:k]


@dataclass
class Overtraining(Rule):
    """Training that goes on after it stopped helping."""

    patience_train: int = 5
    patience_validation: int = 10
    delta: float = 0.01
    val_tensor: str = "metrics/val_loss"
    train_tensor: str = "losses/train"

    name = "overtraining"
    limits = {"patience_train": COUNT, "patience_validation": COUNT}
    modes = ("eval",)
    severity = "info"  # training that stopped improving has converged: worth a look, not a fault
    condition = ("at an evaluation: the training loss (mean since the previous evaluation) has not improved on its "
                 "best so far for the last `patience_train` evaluations, or the validation loss for the last "
                 "`patience_validation`; an evaluation improves when it is below the best before it by more than "
                 "`delta` of that best (0.01 = 1 %)")
    hint = ("Training goes on without improving: the remaining epochs cost time and, with validation getting "
            "worse, generalisation. Try: early stopping on the validation loss, a learning-rate schedule "
            "(reduce on plateau), or stop here and keep the best checkpoint.")
    source = ("smdebug Overtraining: patience_train 5, patience_validation 10, delta 0.01 (AWS docs, current): the "
              "number of evaluations without a new optimum, one that beats the best so far by `delta`. Here "
              "`delta` is relative to that best, so a loss already below 0.01 can still count as improving.")

    @property
    def history(self):
        return 4 * max(self.patience_train, self.patience_validation) + 64

    def requires(self):
        return [Requirement("losses"), Requirement("metrics")]

    def check(self, run, step):
        found = train_means_at_evals(run, self.val_tensor, self.train_tensor, step)
        if found is None:
            return None
        val_steps, val, train = found
        for label, values, patience in (("training", train, self.patience_train),
                                        ("validation", val, self.patience_validation)):
            keep = ~np.isnan(values)
            best = _best_so_far(values[keep], self.delta)
            if best is None:
                continue
            index, waited = best
            if waited >= max(patience, 1):
                best_value, best_step = float(values[keep][index]), int(val_steps[keep][index])
                since = float(np.min(values[keep][index + 1:]))
                return self.fire(step, f"the {label} loss has not improved on its best, {best_value:.4g} at step "
                                       f"{best_step}, by more than {self.delta:.0%} of it in the {waited} "
                                       f"evaluations since (lowest since: {since:.4g}; patience {patience}).",
                                 loss=label, best=best_value, best_step=best_step, evaluations_since=waited,
                                 lowest_since=since, patience=patience)
        return None


def _best_so_far(values: np.ndarray, delta: float):
    """(index of the last new optimum, evaluations since it) over `values`, where a value is a new optimum when it
    is below the best before it by more than `delta` × |best|; None when there are no values."""
    if not len(values):
        return None
    best, index = float(values[0]), 0
    for i in range(1, len(values)):
        if values[i] < best - delta * abs(best):
            best, index = float(values[i]), i
    return index, len(values) - 1 - index
