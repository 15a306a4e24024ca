"""The first evaluation against the start of training: a model evaluated far worse than it trains.

An untrained model's loss is about its first training loss (ln C for a classifier of C classes). A first
validation loss tens of times above both says the model computes something else in evaluation than in training:
a module whose eval mode relies on state that only training builds (spectral_norm's power iteration, a BatchNorm
whose running statistics never moved), or validation data prepared apart from the training data. Nothing else
shows it: the training loss is fine and every tensor looks healthy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..naming import collection_of
from ..ranges import Range
from .base import NotApplicable, Requirement, Rule, checked_mode
from .baselines import chance_loss
from .overfit import logged_as


@dataclass
class FirstEvaluation(Rule):
    """A first validation loss far above the loss the model started training at."""

    factor: float = 10.0
    val_tensor: str = "metrics/val_loss"
    train_tensor: str = "losses/train"
    val_mode: str = "eval"
    train_mode: str = "train"

    name = "first_evaluation"
    limits = {"factor": Range(1.0, None, what="times the start's loss")}
    modes = ("train", "eval")
    condition = ("judged once, when both are known, where the run saw training begin (its training series starts at "
                "step 0): the first value of `val_tensor` (in `val_mode`; or the first validation loader's, "
                "`<val_tensor>/dataloader_idx_0`, as Lightning names each of several loaders') is more than `factor` "
                "times the larger of the training loss at the start (the largest sampled value of `train_tensor` up "
                "to the first evaluation, or its first value where the evaluation came before any training) and, for "
                "a classifier of C classes (from the first step's loss, one that takes the mean of its terms), ln C; "
                "where the model trained before its first evaluation, the second must still be above that baseline, "
                "and with BatchNorm's running statistics every one up to the one after the first made once they hold "
                "less than 1% of their initial values (they can lag weights a high rate moved fast, for a few "
                "evaluations, which the next ones undo)")
    hint = ("The model is evaluated far worse than it trains from the start. Likely causes: a module whose eval "
            "mode needs state only training builds — torch.nn.utils.spectral_norm evaluated before any training "
            "forward (its power iteration has not run), BatchNorm whose running statistics never moved (momentum "
            "0, or evaluated before training with track_running_stats) — or validation data prepared apart from "
            "the training data (not normalised the same way, another label encoding), or a validation loss "
            "computed differently. Try: one training step before the first evaluation; the same preprocessing "
            "object for both sets; the validation step on a training batch.")
    source = ("TrainCheck (Lu et al., OSDI 2025) lists an evaluation before any train-mode forward of a "
              "spectral_norm model among the silent errors it reproduces (a first loss of 1.5e5 where ln 10 = 2.3); "
              "an untrained classifier's loss is ln C (Karpathy, 'A Recipe for Training Neural Networks', 2019: "
              "verify the loss at init).")

    def __post_init__(self):
        self.modes = tuple(dict.fromkeys((checked_mode(self.train_mode), checked_mode(self.val_mode))))
        self._judged: set = set()  # workers

    @property
    def history(self):
        return 64  # the sampled training losses up to the first evaluation: the first epoch's samples

    def requires(self):
        return [Requirement(c) for c in dict.fromkeys([collection_of(self.train_tensor),
                                                        collection_of(self.val_tensor)])]

    def check(self, run, step):
        worker = run.default_worker
        val_tensor = logged_as(run, self.val_tensor, self.val_mode)
        if worker in self._judged or val_tensor is None or \
                self.train_tensor not in run.tensor_names(mode=self.train_mode):
            return None
        val_steps, val = run.tensor(val_tensor).series(mode=self.val_mode)
        train_steps, train = run.tensor(self.train_tensor).series(mode=self.train_mode)
        if not len(val_steps) or not len(train_steps):
            return None
        if int(train_steps[0]) > 0:  # a model trained before (a checkpoint, xgb_model=): no untrained start
            self._judged.add(worker)
            raise NotApplicable(f"the run's first training loss is step {int(train_steps[0])}'s, not step 0's: the "
                                "model trained before it (resumed from a checkpoint, a booster trained further), or "
                                "one call ran several steps (Keras' steps_per_execution), so no loss of the untrained "
                                "model is there to measure the first evaluation against")
        first_eval, eval_step = float(val[0]), int(val_steps[0])
        # after training steps, BatchNorm's running statistics may still lag weights that moved fast (SGD 0.1 with
        # momentum: 70 at the first evaluation, 1.5 at the next): a later evaluation back below the start undoes it
        trained = eval_step > int(train_steps[0])
        confirming = _confirming(run, val_steps) if trained else 0
        if confirming is None or len(val) <= confirming:
            return None
        self._judged.add(worker)
        start = train[(train_steps <= max(eval_step, train_steps[0])) & np.isfinite(train)]
        if not len(start) or not math.isfinite(first_eval):
            return None  # a NaN is exploding_tensor's
        chance = chance_loss(run)
        baseline = max(float(start.max()), chance[0] if chance is not None else 0.0)
        if baseline <= 0 or first_eval <= self.factor * baseline or \
                (trained and not float(np.min(val[1:confirming + 1])) > baseline):
            return None
        against = f"the training loss at the start ({float(start.max()):.4g})"
        if chance is not None:
            against += f" and ln {chance[1]} = {chance[0]:.4g}, an untrained classifier's loss"
        return self.fire(step, f"the first evaluation's {val_tensor}, {first_eval:.4g} at step {eval_step}, is "
                               f"{first_eval / baseline:.0f}x {against}: the model computes something else in "
                               "evaluation than in training.", tensor=val_tensor, onset=eval_step,
                         first_eval=first_eval, baseline=baseline)


def _confirming(run, val_steps) -> int | None:
    """The index of the evaluation up to which every one after the first must stay above the baseline, for a model
    that trained before its first evaluation: the second; where BatchNorm's running statistics were still taking
    the place of their initial values then (torch's momentum 0.1: 44 steps), the one after the first evaluation
    made once they had (a ResNet at SGD 0.1 with 11 steps an epoch read 58,576, 8,219, 414 and 4.9 at its first
    four, 0.26 at the fifth); None until that evaluation is made. Statistics that never move (momentum 0) never
    settle: the second decides, as without them."""
    model = run.model
    keep = model.running_keep if model is not None else None
    if keep is None or keep >= 1.0:
        return 1
    settled = next((i for i, s in enumerate(val_steps) if model.statistics_settled(int(s))), None)
    return None if settled is None else max(1, settled + 1)
