"""A loss, or any series that should go down, that does not, judged against its own noise (LossNotDecreasing).

Which series it reads, and in which mode, are parameters: the default reads `losses/train`, which every plugin
records (XGBoost from its eval log, as its early stopping reads it). The validation loss against it: overfit.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..ranges import COUNT, SHARE
from .base import (FIRST_LABELS, HEALTHY_STEP, NotApplicable, Requirement, Rule, checked_mode, loss_not_a_fit,
                   warming_up)
from .baselines import (FLOOR_NOTE, STUCK_HINT, constant_predictor_loss, loss_floor, room_above, unsplit,
                        update_ratios)
from .drift import SLOW_HINT, Drift, slow_start
from .trend import Trend, noise


@dataclass
class LossNotDecreasing(Rule):
    """A loss, or any series that should go down, that does not: it never went down, it rises, or it levelled off.

    On a series of your own: `params: {tensor_regex: "^metrics/my_loss$", collection: metrics}`.
    """

    window: int = 5  # samples per window
    z: float = 2.0  # a difference counts when it exceeds this many standard errors of the two windows' means
    tensor_regex: str = "^losses/"
    collection: str = "losses"  # the collection the `tensor_regex` series are in (captured for the rule)
    mode: str = "train"  # the mode whose steps hold the series
    min_drop: float = 0.1  # a series that fell by this share of its first window has gone down, noise or not
    min_steps: int = 300  # steps from the first window before "never went down" is judged: a slow start is no fault
    full_batch: int = 32  # min_steps counts steps of this many samples or more: smaller batches wait longer

    name = "loss_not_decreasing"
    limits = {"window": COUNT, "min_drop": SHARE, "min_steps": COUNT, "full_batch": COUNT}
    condition = ("for a series matching `tensor_regex` (in `mode`), with windows of `window` samples and a change "
                 "counted only beyond `z` standard errors of the difference of the windows' means (the batch loss is "
                 "noisy; its spread is taken from the changes between neighbouring samples): the newest window is "
                 "not below the run's first (which holds step 0: a fit that continues a run has not seen training "
                 "begin) nor its median `min_drop` of the first's lower (of the way from the first's to the loss's "
                 "floor, where the targets tell it: under binary cross-entropy, the first batch's targets' mean "
                 "binary entropy, 0 for labels of 0 and 1), three or more windows and `min_steps` steps in, or for a "
                 "first batch of fewer than `full_batch` samples `full_batch` / its size times as many steps, and "
                 "the fall of the least-squares line through every sample the rule saw, plus one standard error, is "
                 "less than `min_drop` of that (error: nothing learns), or above it, its median by `min_drop`, three "
                 "or more windows in (warning: the loss rises); or it is below the first (by `min_drop` of the "
                 "first's median itself, not of the room above a floor), and the fall of the line through the newest "
                 "two windows, plus one standard error, is less than `min_drop` of the newest window's median and "
                 "less than a quarter of what the loss's mean pace since the first window takes off over those steps "
                 "(info: it levelled off, training has converged). Not judged while the learning rate is still "
                 "rising (a warmup), nor on a training loss that is one of several objectives the step trains in "
                 "turn, each with a backward pass and optimizer steps of its own (a GAN's discriminator and "
                 "generator: neither need go down; torch, seen at the first step), nor on one whose targets the "
                 "model computes itself (a DQN's from its target network, a momentum encoder's, a teacher's whose "
                 "parameters take a gradient: they move as it trains; a frozen network outside the model, a "
                 "perceptual loss's VGG, makes data; torch, seen at the first step), nor a policy-gradient "
                 "objective (the first step draws samples from the model's output: a policy's actions, "
                 "Categorical.sample; torch), nor on one that adds up over a "
                 "number of forward passes that changes from step to step (a reinforcement-learning episode's; the "
                 "probe). Finding `stuck` (labels that do not match their inputs?) where the loss that did not go "
                 "down stays within 20 % of what predicting the targets' mean scores under mean squared error (the "
                 "first batch's variance), or the steps move the weights as a healthy step does (1e-3 of their norm, "
                 "median) or more. Finding `no_splits` where the trees are captured and none of a booster's rounds "
                 "split. A series whose every sample is the same number, other than 0, is not waited for "
                 '(`min_steps`): it has not moved at all. Finding `slow` (info) instead of "never went down" where '
                 "the kernels' norm grew by 3 % or more of the distance their steps travelled since the rule's first "
                 "sample (each sample's update times the steps since the one before), and twice as much over the "
                 "second half of those steps as over the first: the weights drift one way, faster and faster, a slow "
                 'start; and likewise where the least-squares line through every sample the rule saw falls by '
                 '3 or more standard errors of its fall (a descent too slow to have covered `min_drop` yet): '
                 '"never went down" then waits as long again')
    hint = ("The loss does not go down. If it never did: the learning rate may be 0 or far too small, the "
            "parameters may not be in the optimizer, labels may not match inputs (shuffled apart, wrong column), "
            "the output layer and the loss may not fit each other (softmax into a loss that takes logits), or "
            "gradients may vanish. If it rises: the learning rate is too high. If it went down and levelled off, "
            "training has converged: stop here or lower the learning rate (a scheduler).")
    source = ("smdebug LossNotDecreasing (num_steps 10, diff_percent 0.1 on two single steps): here windows of "
              "samples compared against their own noise, so that the noise of minibatch losses does not decide, "
              "and a plateau after progress is info, not a warning.")

    def __post_init__(self):
        self.modes = (checked_mode(self.mode),)
        self._first: dict = {}  # (worker, series) -> the first window's values
        self._count: dict = {}  # (worker, series) -> samples seen (the history in memory holds only the last few)
        self._drift: dict = {}  # worker -> Drift: how far the kernels travelled, and how far their norm moved
        self._slow_until: dict = {}  # (worker, series) -> the step before which "never went down" is not judged
        self._trend: dict = {}  # (worker, series) -> Trend of every sample the rule saw

    @property
    def history(self):
        return 2 * self.window

    def requires(self):
        # the first batch's labels: what predicting their mean scores, where the loss stays there
        return [Requirement(self.collection), Requirement("optimizer", optional=True),
                FIRST_LABELS]

    def check(self, run, step):
        self._drift.setdefault(run.default_worker, Drift()).see(run, step)
        found = []
        names = run.tensor_names(regex=self.tensor_regex, mode=self.mode)
        why = loss_not_a_fit(run) if names else None
        if why:  # a GAN's losses, an RL episode's: the training loss is no measure of the fit
            names = [n for n in names if not n.startswith("losses/")]
            if not names:
                raise NotApplicable(why)
        for name in names:
            steps, values = run.tensor(name).series(mode=self.mode)
            if not len(steps) or steps[-1] != step:
                continue
            key = (run.default_worker, name)
            first = self._first.setdefault(key, [])
            self._count[key] = self._count.get(key, 0) + 1
            trend = self._trend.setdefault(key, Trend())
            if np.isfinite(values[-1]):
                trend.add(float(steps[-1]), float(values[-1]))
            if len(first) < self.window:
                first.append((int(steps[-1]), float(values[-1])))
                continue
            if len(values) < 2 * self.window or not np.all(np.isfinite(values[-2 * self.window:])) \
                    or warming_up(run, steps[-2 * self.window]):
                continue
            floor = loss_floor(run) if name == "losses/train" else None
            # a slow start is waited for; a series that has not moved at all (every sample the same number, a
            # booster whose trees cannot split: pseudo-Huber on targets far beyond huber_slope) has no start to wait
            # for, unless that number is 0 (a metric at its floor from the start, an error rate on easy data)
            patience = 0 if trend.yy == 0 and trend.y != 0 else self._patience(run)
            verdict = self._judge(step, name, first, steps[-2 * self.window:], values[-2 * self.window:],
                                  self._count[key], patience, floor)
            if verdict is not None and verdict.finding == "never" and step < self._slow_until.get(key, 0):
                verdict = None  # a slow start, told: it is given as long again to leave its plateau
            most = trend.fall_at_most()
            if verdict is not None and verdict.finding == "never" and most is not None and \
                    most >= self.min_drop * room_above(verdict.evidence["start"], verdict.evidence.get("floor")):
                verdict = None  # every sample together does not show it flat: two windows of noisy batches cannot
            if verdict is not None and verdict.finding == "never":
                verdict = self._slow_start(step, verdict, key, trend)
            if verdict is not None and verdict.finding == "never" and trend.yy == 0:
                verdict = replace(verdict, message=verdict.message + f" Not one of its {trend.n} samples differs from "
                                                                     "the first: the steps do not change the model.")
            if verdict is not None and verdict.finding == "never":
                verdict = unsplit(run, verdict)
            if verdict is not None and verdict.finding in ("never", "rising"):
                verdict = self._stuck(run, step, verdict, trend.y)
            if verdict is not None:
                found.append(verdict)
        return found or None

    def _slow_start(self, step, verdict, key, trend):
        """A loss that has not gone down by `min_drop` yet, but is on its way (drift.slow_start): told at info
        (finding `slow`); "never went down" then waits as long again."""
        why = slow_start(trend, self._drift.get(key[0]))
        if why is None:
            return verdict
        self._slow_until[key] = 2 * step
        return replace(verdict, finding="slow", severity="info", hint=SLOW_HINT, message=verdict.message + why)

    def _stuck(self, run, step, verdict, mean: float):
        """A loss that never went down (or rose) to about what predicting the targets' mean scores under mean
        squared error, or that never went down while the steps move the weights as a healthy step does (the newest
        updates are HEALTHY_STEP of the kernels' norm or more, median; smaller steps are a slow start or a rate
        too low, not evidence about the labels): nothing the model learns from one batch holds for the next.
        Labels that do not match their inputs are the likeliest cause: the verdict says so (finding `stuck`).
        mean: of every sample the rule saw, where the loss sits when it never went down (its newest five batch
        losses can stand a quarter off it); a rising loss is read at its newest window."""
        constant = constant_predictor_loss(run)
        level = mean if verdict.finding == "never" else verdict.evidence["now"]
        if constant and abs(level - constant) <= 0.2 * constant:  # one batch's variance
            return replace(verdict, finding="stuck", hint=STUCK_HINT,
                           message=verdict.message + f" Its level, {level:.4g}, is about what predicting the "
                                                     "targets' mean scores under mean squared error gives (the "
                                                     f"first batch's variance, {constant:.4g}): the model has "
                                                     "learned nothing from its inputs.")
        ratios = sorted(update_ratios(run))
        if verdict.finding != "never" or not ratios or ratios[len(ratios) // 2] < HEALTHY_STEP:
            return verdict
        return replace(verdict, finding="stuck", hint=STUCK_HINT,
                       message=verdict.message + f" The steps do move the weights (by {ratios[len(ratios) // 2]:.2g} "
                                                 "of their norm, median): they learn nothing that holds from one "
                                                 "batch to the next.")

    def _patience(self, run) -> int:
        """The steps "never went down" waits for: `min_steps`, times `full_batch` over the first batch's size where
        that is smaller and the plugin saw the labels. A slow start is measured in the data seen: a batch of one
        sample moves the weights by one sample's gradient, and a healthy loss can stay on its first plateau for
        thousands of such steps."""
        first = run.first_step
        sizes = [use.labels.shape[0] for use in (first.losses if first is not None else ())
                 if use.labels is not None and use.labels.shape and use.labels.shape[0] > 0]
        return self.min_steps * max(1, -(-self.full_batch // min(sizes))) if sizes else self.min_steps

    def _judge(self, step, name, first, recent_steps, recent, samples, patience: int, floor: float | None):
        """first: (step, value) of the rule's first `window` samples of the series; recent_steps, recent: its
        newest 2 x `window` samples; patience: the steps from the first before "never went down" is judged;
        floor: the least the loss can reach, where its targets tell (baselines.loss_floor), else None."""
        from_start = first[0][0] == 0  # a fit that continues a run (or a resumed one) did not see training begin
        # "never went down" waits for `patience` too: a slow start is no fault; a rise is one at any time
        long_enough = samples >= 3 * self.window
        early = step - first[0][0] < patience
        first_step = float(np.median([s for s, _ in first]))
        first = np.asarray([value for _, value in first])
        before, now = recent[:self.window], recent[self.window:]
        sigma = noise(np.concatenate([before, now]))
        below = lambda a, b: float(b.mean() - a.mean()) > self.z * sigma * np.sqrt(1 / len(a) + 1 / len(b))  # noqa
        # a change of the windows' medians this large is no noise (medians: one sample of a heavy-tailed loss, a
        # batch of one, moves a mean far)
        level, start = float(np.median(now)), float(np.median(first))
        margin = self.min_drop * abs(start)
        never_down = not below(now, first) and level > start - self.min_drop * room_above(start, floor)
        # "levelled off" asks for a fall from the start itself: a loss that covered a share of the room above its
        # floor but a few percent of its start (soft targets) is still too noisy to show its newest windows flat
        went_down = below(now, first) or level <= start - margin
        rising = below(first, now) and level > start + margin
        if never_down and from_start and long_enough and (rising or not early):
            return self.fire(step, f"{name} {'rose' if rising else 'has not gone down'} since training began: "
                                   f"{now.mean():.4g} over its last {self.window} samples against {first.mean():.4g} "
                                   f"over its first {self.window}{FLOOR_NOTE.format(floor) if floor else ''}.",
                             severity="warning" if rising else "error",
                             finding="rising" if rising else "never", tensor=name, first=float(first.mean()),
                             now=float(now.mean()), start=start,
                             **({"floor": floor} if floor is not None else {}))
        # levelled off: the newest samples' line falls, at the most, by less than `min_drop` of the level and less
        # than LEVELLED of what the loss's mean pace so far would take off over those steps. Samples too noisy to
        # show it say nothing (two windows 25 % apart on a loss falling 4 % an epoch), nor is a booster's training
        # loss still falling 1.5 % a round levelled, nor a loss falling 30 % every five epochs
        most = Trend(zip(recent_steps, recent)).fall_at_most()
        pace = (start - level) / max(step - first_step, 1.0) * float(recent_steps[-1] - recent_steps[0])
        if went_down and not below(before, now) and most is not None and \
                most < min(self.min_drop * abs(level), LEVELLED * pace):
            # told in the statistic that showed the fall: a heavy-tailed loss (a batch of four) can go down in its
            # median while one sample keeps its newest mean above the first's
            typical = np.mean if now.mean() < first.mean() else np.median
            return self.fire(step, f"{name} levelled off at {typical(now):.4g} (the {self.window} samples before: "
                                   f"{typical(before):.4g}), after going down from {typical(first):.4g}"
                                   f"{'' if typical is np.mean else ' (medians)'}.",
                             severity="info", finding="plateau", tensor=name, before=float(before.mean()),
                             now=float(now.mean()))
        return None


LEVELLED = 0.25  # of what the loss's mean pace so far takes off over the newest samples' steps: levelled below it
