"""The validation loss against the training loss: a model that fits its training data, not the task (Overfit),
and the evaluations' own reading of them (what `first_evaluation` and `overtraining` share).

The defaults read `metrics/val_loss` (mode eval) and `losses/train`, which every plugin records (XGBoost from its
eval log, as its early stopping reads it).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import numpy as np

from ..naming import collection_of
from ..ranges import COUNT, SHARE
from .base import Requirement, Rule, checked_mode
from .baselines import chance_loss


@dataclass
class Overfit(Rule):
    """A validation loss that rises from its best while the training loss does not: the model fits its training
    data, not the task.

    On XGBoost's eval log the defaults read the validation set's loss as XGBoost's early stopping does; another
    series: `params: {val_tensor: metrics/validation/error, val_mode: train}` (a metric that is lower when better).
    """

    patience: int = 3
    min_delta: float = 0.1
    give_back: float = 0.25
    at_chance: float = 0.95  # a validation loss never below this share of chance's (ln C) learned nothing
    start_step: int = 0
    val_tensor: str = "metrics/val_loss"
    train_tensor: str = "losses/train"
    val_mode: str = "eval"  # the mode holding `val_tensor`; the rule is evaluated at its steps
    train_mode: str = "train"  # the mode holding `train_tensor`

    name = "overfit"
    limits = {"patience": COUNT, "min_delta": SHARE, "give_back": SHARE, "at_chance": SHARE}
    modes = ("eval",)
    condition = ("at `patience` evaluations in a row (from start_step), `val_tensor` (in `val_mode`; or the first "
                "validation loader's, `<val_tensor>/dataloader_idx_0`, as Lightning names each of several loaders') "
                "is above its best before them by more than `min_delta` of that best, more than its own noise (the "
                "median change from one evaluation to the next) and more than `give_back` of what it had come down "
                "from its first evaluation to that best (near 0 a tiny loss can triple without undoing the learning), "
                "and still rising (the newest above the one before the streak and not below the streak's first: a "
                "bump after a noisy step comes back down), while the training loss (`train_tensor`, mean since the "
                "evaluation before, stored at both) is no higher than at the best evaluation and has fallen by "
                "`min_delta` since the rise began (the newest evaluation before them within that margin: a validation "
                "loss that jumps while the training loss stands still is the evaluation's own, BatchNorm's moving "
                "statistics out of step with the weights), nor the learning rate higher than then (a schedule that "
                "raised it: a one-cycle, a warm restart); or, for a classifier of C classes (from the first step's "
                "loss, one that takes the mean of its terms), the validation loss has not once been below `at_chance` "
                "times ln C, and its newest `patience` evaluations brought no new low (one still falling is "
                "learning), while the training loss fell by `min_delta` of its first value (labels that do not match "
                "their inputs), judged once the training steps have left less than 1% of BatchNorm's initial running "
                "statistics (an evaluation normalises with them; the best a validation loss rises from is one of an "
                "evaluation made after that too)")
    hint = ("The validation loss rises while the training loss keeps falling: the model fits the training data, "
            "not the task. Try: early stopping on the validation loss (keep the best checkpoint), more data or "
            "augmentation, dropout, weight decay, a smaller model; for boosted trees a lower max_depth, a larger "
            "min_child_weight, subsample < 1, fewer rounds (early_stopping_rounds).")
    source = ("smdebug Overfit (ratio_threshold 0.1 on the gap between validation and training loss, patience 1): "
              "a gap alone holds on most healthy models, so here the validation loss must rise from its own best, "
              "beyond its noise, for `patience` evaluations while the training loss does not.")

    def __post_init__(self):
        self.modes = (checked_mode(self.val_mode),)
        checked_mode(self.train_mode)
        self._seen: dict = {}  # worker -> _Evaluations: the memory in the training process holds only the last few

    @property
    def history(self):
        return max(64, 4 * self.patience)

    def requires(self):
        return [Requirement(c) for c in dict.fromkeys([collection_of(self.train_tensor),
                                                        collection_of(self.val_tensor)])]

    def check(self, run, step):
        val_tensor = logged_as(run, self.val_tensor, self.val_mode)
        if step < self.start_step or val_tensor is None:
            return None
        steps, val = run.tensor(val_tensor).series(mode=self.val_mode)
        if not len(steps) or steps[-1] != step or not np.isfinite(val[-1]):
            return None
        found = train_means_at_evals(run, val_tensor, self.train_tensor, step, self.val_mode, self.train_mode)
        seen = self._seen.setdefault(run.default_worker, _Evaluations(self.patience))
        # BatchNorm's running statistics, which an evaluation normalises with, hold their initial values for
        # hundreds of steps at Keras' momentum 0.99: until then validation reads them more than the model (chance
        # on a model that learns; a best, at step 120, that a model at 50 % accuracy is 'above' at step 320)
        settled = run.model is None or run.model.statistics_settled(step)
        seen.add(step, float(val[-1]), float(found[2][-1]) if found is not None else math.nan, _rate(run, step),
                 settled)
        if not seen.full:
            return None
        chance = chance_loss(run)
        train_now = seen.recent[-1][2]
        recent = [value for _, value, _, _, _ in seen.recent]
        best, best_step, train_at_best, rate_at_best = seen.best
        # judged once it stopped coming down: a validation loss still falling towards chance (from a huge first
        # value, raw inputs) is learning, however slowly
        if chance is not None and settled and seen.lowest >= self.at_chance * chance[0] and \
                min(recent) >= seen.lowest_before and train_now < (1 - self.min_delta) * seen.first_train:
            return self.fire(step, f"{val_tensor} has not once been below chance: its lowest, {seen.lowest:.4g}, "
                                   f"is what guessing among {chance[1]} classes gives (ln {chance[1]} = "
                                   f"{chance[0]:.4g}), while the training loss fell from {seen.first_train:.4g} to "
                                   f"{train_now:.4g}: the model learns its training set, nothing that holds for "
                                   "other data.", finding="chance", hint=CHANCE_HINT + _statistics_note(run),
                             onset=seen.first_step,
                             chance=chance[0],
                             lowest=seen.lowest, train=train_now)
        if best_step < 0:
            return None  # no evaluation with settled statistics before the newest `patience`
        noise = float(np.median(np.abs(np.diff(val[np.isfinite(val)])))) if len(val) > 1 else 0.0
        margin = max(self.min_delta * abs(best), noise, self.give_back * (seen.first - best))
        if not all(v > best + margin for v in recent) or not recent[-1] > seen.before or recent[-1] < recent[0]:
            # not above its best throughout, or coming back down: below where the streak began (a bump from a
            # noisy step, a swing of a class-weighted loss: 0.0040 at its best, then 0.023, 0.020, 0.011)
            return None
        if not (math.isfinite(train_at_best) and math.isfinite(train_now)) or train_now > train_at_best:
            # both rise: not overfitting (the loss rules see a training that diverges); or the training loss is not
            # known yet at one of them (the losses of the steps between samples are stored at the next sample), and
            # a validation loss that rose with it (BatchNorm's moving statistics off for a few epochs) is no fault
            return None
        train_then = seen.train_where_rise_began(best + margin)
        if not train_now <= (1 - self.min_delta) * train_then:
            # the training loss stood still while the validation loss rose: what rose is the evaluation's own reading,
            # not a closer fit of the training set (keras.io's timeseries classifier, BatchNorm, epoch 77: the
            # validation loss went 0.25 -> 1.06 -> 2.1 while the training loss held at 0.134; the model in inference
            # mode did as badly on its own training samples, 0.66 accurate, and 0.88 on the validation set with batch
            # statistics: moving statistics out of step with the weights, until the learning rate came down)
            return None
        if seen.recent[-1][3] > rate_at_best:
            # the schedule raised the learning rate since the best (a one-cycle's climb, a warm restart): the
            # validation loss of a model under BatchNorm at ten times the rate jumps (1.98 -> 4.83) and comes back
            # below its best as the rate comes down; what it shows is the step size, not a fit of the training set
            return None
        return self.fire(step, f"{val_tensor} rose to {recent[-1]:.4g} from its best {best:.4g} at step "
                               f"{best_step}, for {self.patience} evaluations in a row, while the training loss "
                               f"fell from {train_then:.4g} to {train_now:.4g}.", tensor=val_tensor, best=best,
                         best_step=best_step, now=recent[-1])


CHANCE_HINT = ("The validation loss never beats guessing while the training loss falls: the model memorises its "
               "training samples. Likely causes: labels that do not match their inputs (shuffled apart, the wrong "
               "column, a misaligned join), or validation data of another kind than the training data. Try: check "
               "that each sample keeps its own label through loading and shuffling; look at a few samples and "
               "their labels.")


def _statistics_note(run) -> str:
    """Where the model keeps BatchNorm running statistics that move: the other cause of a validation at chance.
    statistics_settled assumes the batches' own statistics are of the order of the initial ones (variance 1);
    inputs scaled to [0, 1] give batch variances a hundred times smaller, and the initial variance then dominates
    the running one for far longer."""
    keep = run.model.running_keep if run.model is not None else None
    if keep is None or not 0 < keep < 1:
        return ""
    return (f" Or, since the model has BatchNorm (each step, its running statistics keep {keep:.0%} of what they "
            "held): the statistics evaluation normalises with may still hold their start, where the batches' own "
            "variance is far below the initial 1.0 (inputs scaled to [0, 1]); if the model does better on the "
            "validation data in training mode (batch statistics), evaluate after more steps or let the statistics "
            "follow the batches faster (Keras: BatchNormalization(momentum=0.9); torch: momentum=0.1 or more).")


def _rate(run, step: int) -> float:
    """The first parameter group's learning rate at `step` (its newest sample at or before it); NaN where the run
    does not hold it (XGBoost, a config without the optimizer collection)."""
    if "optimizer/lr" not in run.tensor_names("optimizer", mode="train"):
        return math.nan
    steps, rates = run.tensor("optimizer/lr").series(mode="train")
    i = int(np.searchsorted(steps, step, side="right")) - 1
    return float(rates[i]) if i >= 0 else math.nan


KEPT = 256  # evaluations before the newest `patience` that overfit keeps, to find where a rise began


class _Evaluations:
    """What overfit keeps of one worker's evaluations: the first value, the lowest, the lowest before the newest
    `patience` and the best among those with settled statistics (with its step, the training loss and the learning
    rate then), the value just before them, the newest KEPT before them with their training losses, and the newest
    `patience`."""

    def __init__(self, patience: int):
        self.patience = patience
        self.first: float | None = None
        self.first_step = -1
        self.lowest = math.inf  # of every evaluation so far
        self.lowest_before = math.inf  # of every evaluation before the newest `patience`
        self.first_train = math.nan  # the first training loss known at an evaluation
        self.best = (math.inf, -1, math.nan, math.nan)  # (value, step, training loss, learning rate)
        self.before = math.nan
        self.recent: list = []  # (step, value, training loss, learning rate, settled), oldest first
        self.earlier = 0  # evaluations before the newest `patience`
        self.past = collections.deque(maxlen=KEPT)  # (value, training loss) of the newest KEPT of those

    def add(self, step: int, value: float, train: float, rate: float, settled: bool) -> None:
        """settled: the evaluation normalised with BatchNorm statistics that hold little of their initial values
        (or the model has none); only such an evaluation can be the best a later one rose from."""
        if self.first is None:
            self.first, self.first_step = value, step
        self.lowest = min(self.lowest, value)
        if math.isnan(self.first_train):
            self.first_train = train
        self.recent.append((step, value, train, rate, settled))
        if len(self.recent) > self.patience:
            old_step, old, old_train, old_rate, old_settled = self.recent.pop(0)
            self.before, self.earlier = old, self.earlier + 1
            self.past.append((old, old_train))
            self.lowest_before = min(self.lowest_before, old)
            if old_settled and old < self.best[0]:
                self.best = (old, old_step, old_train, old_rate)

    def train_where_rise_began(self, within: float) -> float:
        """The training loss at the newest evaluation before the newest `patience` whose value was still `within`
        (the best plus the margin): where the rise began; at the oldest one kept where none is (a rise longer than
        KEPT evaluations). Kept as each evaluation was made: the training process holds the last few training
        losses only."""
        near = [train for value, train in self.past if value <= within]
        return near[-1] if near else self.past[0][1]

    @property
    def full(self) -> bool:
        """At least `patience` + 2 evaluations: a best before the newest and the one just before them."""
        return len(self.recent) == self.patience and self.earlier >= 2


def logged_as(run, name: str, mode: str) -> str | None:
    """The series a rule reads for `name` in `mode`: itself where logged, else the first validation loader's
    (Lightning names the metric of each of several loaders `<name>/dataloader_idx_<k>`; the first is the validation
    set), else None. Not any series under the name: `val_loss/kl` is one term of a loss, not the loss."""
    names = run.tensor_names(mode=mode)
    for logged in (name, f"{name}/dataloader_idx_0"):
        if logged in names:
            return logged
    return None


def train_means_at_evals(run, val_tensor: str, train_tensor: str, step: int, val_mode: str = "eval",
                         train_mode: str = "train", least: int = 1):
    """(evaluation steps, validation values, mean training value since the evaluation before) up to `step`,
    which must be an evaluation; None when either series is missing. NaN where fewer than `least` training values
    fell between. The validation series as `logged_as` finds it."""
    val_tensor = logged_as(run, val_tensor, val_mode)
    if val_tensor is None or train_tensor not in run.tensor_names(mode=train_mode):
        return None
    val_steps, val = run.tensor(val_tensor).series(mode=val_mode)
    train_steps, train = run.tensor(train_tensor).series(mode=train_mode)
    if not len(val_steps) or val_steps[-1] != step:
        return None
    # each evaluation's window of training steps, from cumulative sums: a booster evaluates at every round, and a
    # loop over the windows cost a millisecond per evaluation there
    high = np.searchsorted(train_steps, val_steps, side="right")
    low = np.concatenate(([np.searchsorted(train_steps, -1, side="right")], high[:-1]))
    finite = np.isfinite(train)
    sums = np.concatenate(([0.0], np.cumsum(np.where(finite, train, 0.0))))
    nonfinite = np.concatenate(([0], np.cumsum(~finite)))
    counts = high - low
    means = np.full(len(val_steps), np.nan)
    filled = counts >= max(least, 1)
    means[filled] = (sums[high[filled]] - sums[low[filled]]) / counts[filled]
    for i in np.flatnonzero(filled & (nonfinite[high] > nonfinite[low])):  # NaN or Inf in it: as numpy's mean
        means[i] = float(np.mean(train[low[i]:high[i]]))
    return val_steps, val, means
