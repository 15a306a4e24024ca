"""A training loss, or a gradient norm, that jumps far above its own recent level and stays there: judged on the value
of every step the plugin hands over (Rule.stream), not on the sampled steps alone."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..ranges import COUNT, SHARE
from .base import NotApplicable, Requirement, Rule, loss_not_a_fit, values_at

MIN_SEEN = 20  # finite values seen before the first is judged (loss_spike)


@dataclass
class LossSpike(Rule):
    """The training loss jumps far above its own recent level and stays there for several steps: a spike, which in
    a long run is the moment to roll back to, not a trend a sampled series would show."""

    window: int = 100  # the steps whose losses make the recent level
    threshold: float = 6.0  # robust standard deviations (1.4826 x the median absolute deviation) above the median
    ratio: float = 1.25  # and at least this many times the median (above it by this share of |median| if <= 0)
    # steps in a row above both: a loss that comes back on its own needs no rollback. The aftermath of an epoch's
    # last batch of 3 samples under BatchNorm (a ResNet near a perfect fit, the long zoo) stays up to 7 steps
    patience: int = 10
    # and above it by this share of the ground the loss gained since its first steps (their median less the recent
    # one): a model near a perfect fit loses a few samples for a few tens of steps after a bad batch (a ResNet under
    # BatchNorm after an epoch's last batch of 3, the long zoo: 0.002 to 0.14 from 2.3), nothing to roll back for
    progress: float = 0.1

    name = "loss_spike"
    modes = ("train",)
    severity = "warning"
    limits = {"window": COUNT, "patience": COUNT, "progress": SHARE}
    condition = ("the training loss of every step the plugin hands over (Lightning: every step, read at the next "
                "sample; the probe and the Trainer: every step; Keras: every step's own loss, told from the change of "
                "the epoch's running mean it logs), against the `window` finite losses before it (at least 20): above "
                "their median by `threshold` robust standard deviations and by `ratio` of the median, and above their "
                "99th percentile (one sample a step, hard samples come in runs), and, where the loss has gone down, "
                "giving back `progress` of the ground it gained (the median of its first 20 losses less the recent "
                "median), `patience` steps in a row; not once that median is below a thousandth of the first losses' "
                "(a model that fits its data exactly, where one sample's loss is noise around 0). The recent level is "
                "the median, or, where the window's newer half is higher than its older, the line through their "
                "medians at its newest end (a level that climbs); high losses enter it once they come back before "
                "`patience` or once their spike is told. Each spike is told once, at the step `patience` is reached, "
                "naming the step it began. Not on a training loss that is one of several objectives the step trains "
                "in turn, each with a backward pass and optimizer steps of its own (a GAN: the discriminator's loss "
                "climbs back from near 0 as the generator learns; torch, seen at the first step), nor on one whose "
                "targets the model computes itself (a DQN's, from its target network: they grow as its values do), "
                "nor a policy-gradient objective (the first step draws samples from the model's output; torch), "
                "nor on one that adds up over a number of forward passes that changes from step to step "
                "(reinforcement learning: the loss of an episode grows with its length as the agent learns; the "
                "probe, three or more numbers in the first 20 steps); judged afresh from a step at which none of the "
                "optimizers that stepped at the step before steps (the probe: a layer trained after another, as "
                "forward-forward training trains them, starts its own loss high), or at which the probe's model gets "
                "inputs of a shape (the batch aside) it has not seen, while it has seen no more than 4 (progressive "
                "resizing: a stage on larger images starts its loss over from about chance)")
    hint = ("The loss jumped and stays up: a batch of bad data, a learning rate too high for this stage (after a "
            "warmup or a restart of the schedule), fp16 overflow, an optimizer state that went stale after "
            "a resume. Roll back to the checkpoint before the step it began and skip that data, or lower the "
            "learning rate, or clip gradients.")
    source = ("Large-model training logs (OPT, BLOOM, PaLM) restart from the checkpoint before a loss spike, "
              "skipping its batches; judged here against the loss's own noise, with patience, not one threshold.")
    what = "the training loss"  # in the verdict's message
    settled = MIN_SEEN  # finite values seen before the first is judged

    def requires(self):
        return [Requirement("losses")]

    def stream(self):
        return SpikeWatch(self.window, self.threshold, self.ratio, self.patience, self.settled, self.progress)

    def check(self, run, step):
        why = loss_not_a_fit(run)
        if why:
            raise NotApplicable(why)
        mine = f"^spikes/{re.escape(self.id or self.name)}$"  # what the recorder found for this rule, as this rule
        began = values_at(run, step, "began", ["spikes"], mine)
        if not began:
            return None
        name, start = next(iter(began.items()))
        value, level = (values_at(run, step, key, ["spikes"], mine).get(name) for key in ("value", "level"))
        return self.fire(step, f"{self.what} jumped at step {int(start)} and stays up: {value:.4g} at step "
                               f"{step}, {self.patience} steps in a row, against a recent level (median) of "
                               f"{level:.4g}. Roll back to a checkpoint from before step {int(start)}.",
                         finding=f"{int(start)}", onset=int(start), began=int(start))


@dataclass
class GradientSpike(LossSpike):
    """The total gradient norm jumps far above its own recent level and stays there: in a large model's run it
    often shows before the loss does. Not in the default config: the norm of every step's gradients is one more
    pass over them (a few percent of a small model's step)."""

    progress: float = 0.0  # a gradient norm has no ground to gain: it climbs as a model leaves its initialisation

    name = "gradient_spike"
    streamed = "metrics/grad_norm"
    what = "the gradient norm"
    # a whole window first: leaving its initialisation, a healthy model's gradient norm climbs for tens of steps
    # (to 2-5x its first steps', in the zoo), which a level of the first 20 steps would read as a spike
    settled = None
    condition = ("the total l2 norm of the gradients of every step (`metrics/grad_norm`, of the first optimizer to "
                 "step where there are several: one set of parameters; Lightning and the probe compute it where "
                 "this rule is on, after the loss scale is removed and before clipping; the "
                 "Transformers Trainer logs it at its logging steps; not Keras, whose step is compiled, nor XGBoost), "
                 "judged as loss_spike judges the loss: against the `window` finite norms before it (a whole "
                 "window: the first `window` steps are not judged), above their median by `threshold` robust "
                 "standard deviations and by `ratio` of it, and above their 99th percentile, `patience` steps in "
                 "a row; not where the step trains several objectives in turn (a GAN), nor where its loss adds up "
                 "over a number of forward passes that changes from step to step (an RL episode)")
    hint = ("The gradient norm jumped and stays up: a batch of bad data, a learning rate too high for this stage, "
            "fp16 overflow, an optimizer state gone stale after a resume; the loss often follows. Roll back to the "
            "checkpoint before the step it began and skip that data, or lower the learning rate, or clip "
            "gradients (gradient_clip_val / clip_grad_norm_).")
    source = ("Large-model training reports (OPT, BLOOM, PaLM) watch the gradient norm beside the loss for spikes "
              "to roll back from; judged here against the norm's own noise, with patience, as loss_spike.")

    def requires(self):
        # judged at the steps a spike is recorded at (with the norm, a metric, as the Trainer's grad_norm is) and at
        # the sampled steps (which capture the loss), so that a run without a spike is not said to be unjudged
        return [Requirement("metrics"), Requirement("losses")]


class SpikeWatch:
    """LossSpike's look at every step: a ring of the recent finite losses, their level and spread recomputed every
    tenth value (about 10 us), and one comparison per step. A run of high values waits outside the ring until it
    comes back (then it was noise, and joins) or reaches `patience` (a spike, told once; it and what follows while
    the series stays high join, so that the level follows the series to where it now is)."""

    REFRESH = 10
    FITTED = 1e-3  # a recent level below this share of the first one: the data fit exactly, not judged

    def __init__(self, window: int, threshold: float, ratio: float, patience: int, min_seen: int | None = MIN_SEEN,
                 progress: float = 0.0):
        """min_seen: finite values seen before the first is judged (None: a whole window). progress: the share of
        the ground the series lost since its first level (that level less the recent one) a value must be above
        the recent level by."""
        self.window, self.threshold, self.ratio, self.patience = int(window), threshold, ratio, int(patience)
        self.progress = progress
        self.min_seen = self.window if min_seen is None else min(int(min_seen), self.window)
        self.restart()

    def restart(self) -> None:
        """Judge what comes next on its own: the series is another objective's from here (the optimizers that step
        changed: a layer trained after another, as in forward-forward training)."""
        self._recent: list = []  # the last `window` losses outside spikes
        self._limit: float | None = None  # above it a loss is high
        self._level = 0.0
        self._since_refresh = 0
        self._high: list = []  # (step, value) of the high losses in a row so far
        self._told = False  # the values are in a spike already told
        self._first_level: float | None = None  # the median of the first values judged against

    def see(self, step: int, value: float) -> dict | None:
        if not math.isfinite(value):
            return None
        high = self._limit is not None and value > self._limit
        if high and self._told:  # the spike told goes on: the level follows the series to where it now is
            self._admit([(step, value)])
            return None
        self._told = False
        if high:
            self._high.append((step, value))
            if len(self._high) < self.patience:
                return None
            found = {"value": value, "level": self._level, "limit": self._limit, "began": self._high[0][0]}
            self._admit(self._high)
            self._high, self._told = [], True
            return found
        # a run of high values that came back before `patience` was no spike: the series' own noise, or a level
        # that rises as a model leaves a plateau; kept out, it would hold the level where it was (censored)
        self._admit(self._high + [(step, value)])
        self._high = []
        return None

    def _admit(self, values: list) -> None:
        """Values into the recent level, which is recomputed every REFRESH values."""
        self._recent.extend(value for _, value in values)
        del self._recent[:-self.window]
        self._since_refresh += len(values)
        if len(self._recent) >= self.min_seen and (self._limit is None or self._since_refresh >= self.REFRESH):
            self._refresh()

    def _refresh(self) -> None:
        """The level, spread and limit of the recent values: in plain Python, which on a window of 100 floats takes
        a tenth of numpy's time (its median and percentile cost tens of microseconds in calls alone, and this runs
        every tenth step of the training)."""
        recent = self._recent
        # where the series climbs through the window (a model leaving a plateau: its gradient norm grows tenfold in
        # tens of steps while its loss falls), the level is where the climb has got to, not the window's median,
        # which trails it by half a window: the line through the medians of the window's halves, at its newest end
        half = (len(recent) + 1) // 2  # the older half holds the odd value, as numpy's array_split puts it
        older, newer = _median(sorted(recent[:half])), _median(sorted(recent[half:]))
        ordered = sorted(recent)
        level = max(_median(ordered), newer + (newer - older) / 2)
        spread = 1.4826 * _median(sorted(abs(value - level) for value in recent))
        self._level, self._since_refresh = level, 0
        if self._first_level is None:
            self._first_level = level
        if abs(level) < self.FITTED * abs(self._first_level):  # a model that fits its data exactly: what is left
            self._limit = math.inf  # is one sample's noise around 0, no state to roll back from
            return
        # above both margins; and above a floor, for a loss that has settled at exactly 0 (a problem fit perfectly);
        # and above all but the highest of the recent losses: one sample a step (batch size 1), a run of hard
        # samples is as high as the hard samples before it, where a spike rises above everything recent
        gained = max(self._first_level - level, 0.0)
        margin = max(self.threshold * spread, (self.ratio - 1) * abs(level), self.progress * gained, 1e-6)
        self._limit = max(level + margin, _percentile(ordered, 0.99))


def _median(ordered: list) -> float:
    """The median of sorted values (numpy's: the mean of the middle two of an even count)."""
    middle = len(ordered) // 2
    return float(ordered[middle]) if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _percentile(ordered: list, share: float) -> float:
    """The `share` quantile of sorted values, interpolated linearly between the two nearest (numpy's default)."""
    position = share * (len(ordered) - 1)
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return float(ordered[below] + (ordered[above] - ordered[below]) * (position - below))
