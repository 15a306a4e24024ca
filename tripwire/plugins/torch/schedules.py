"""Where a learning-rate schedule takes the rate over a planned training, read from a copy of the scheduler stepped
ahead, before the first step.

A schedule is written in some unit: optimizer steps (a warmup over N steps, OneCycleLR's total_steps,
Transformers' get_linear_schedule_with_warmup) or epochs (StepLR's step_size). Stepped at the other interval it
runs its course far too slowly or far too fast, and nothing fails: a warmup written in steps and stepped once per
epoch never ends, and the model trains at a few percent of its rate; a decay written in epochs and stepped per
batch has the rate near 0 within the first epochs. Lightning steps a scheduler per epoch unless
configure_optimizers says `"interval": "step"`. Stepping a copy at both intervals over the planned training tells
which the schedule was written for.
"""

from __future__ import annotations

import copy
import gc
import logging
import warnings

import torch

log = logging.getLogger("tripwire")
NEVER_PAST = 0.1  # a rate that never gets past this share of the peak the schedule reaches at the other interval
COLLAPSED = 0.01  # a rate at this share of its base or below, from a tenth into the training on
STEPS = 20_000  # the most steps a copy is stepped through
FEW_EPOCHS = 3  # a training of fewer epochs is not judged


class _StandIn:
    """What a scheduler reads and writes of its optimizer: copies of its groups' settings, and a step it takes as
    the one it wrapped (no warning that the optimizer did not step first)."""

    def __init__(self, optimizer):
        self.param_groups = [{key: value for key, value in group.items() if key != "params"}
                             for group in optimizer.param_groups]
        self.defaults = dict(getattr(optimizer, "defaults", {}))
        self._opt_called = True

    def step(self) -> None:
        """Nothing to step: the copy's groups hold settings, no parameters."""


_StandIn.step._wrapped_by_lr_sched = True


def shares(scheduler, steps: int) -> list[float] | None:
    """The learning rate as a share of its base rate (each group's `initial_lr`, which schedulers set; the largest
    share over the groups) as it is now and after each of `steps` steps of a copy of the scheduler (at most STEPS);
    None where there is no base rate above 0, or the scheduler cannot be stepped that way (ReduceLROnPlateau steps
    on a metric) or fails."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return None
    optimizer = getattr(scheduler, "optimizer", None)
    if optimizer is None:
        return None
    try:
        bases = [float(group.get("initial_lr", group["lr"])) for group in optimizer.param_groups]  # set by schedulers
        if not bases or not all(base > 0 for base in bases):
            return None
        stand_in = _StandIn(optimizer)
        ahead = _ahead(scheduler, stand_in)
        share = lambda: max(float(g["lr"]) / base for g, base in zip(stand_in.param_groups, bases))  # noqa: E731
        found = [share()]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(min(steps, STEPS)):
                ahead.step()
                found.append(share())
        return found
    except Exception as exc:  # noqa: BLE001 - a look ahead must never stop the training
        log.debug("tripwire: the schedule of %s could not be stepped ahead: %s: %s", type(scheduler).__name__,
                  type(exc).__name__, exc)
        return None


def _ahead(scheduler, stand_in: _StandIn):
    """A copy of a scheduler to step ahead, on the stand-in for its optimizer: its state copied one level deep (the
    numbers and lists it steps), the schedulers it chains copied the same way, and whatever else it holds (a
    lambda, a bound method of the LightningModule) shared, never copied: a deep copy would copy a whole model."""
    ahead = copy.copy(scheduler)
    for key, value in vars(scheduler).items():
        if key == "optimizer":
            value = stand_in
        elif isinstance(value, torch.optim.lr_scheduler.LRScheduler):
            value = _ahead(value, stand_in)
        elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.optim.lr_scheduler.LRScheduler)
                                                      for v in value):
            value = type(value)(_ahead(v, stand_in) for v in value)
        elif isinstance(value, (list, dict, set)):
            value = copy.copy(value)
        vars(ahead)[key] = value
    return ahead


def wrong_interval(scheduler, per_epoch: bool, epochs: int, steps: int) -> str | None:
    """What goes wrong with a scheduler stepped per epoch (else per optimizer step) over a training of `epochs`
    epochs and `steps` optimizer steps, where its schedule was written for the other interval; None where it is
    not (or cannot be told)."""
    if epochs < FEW_EPOCHS:  # a schedule stepped once or twice per training hardly moves the rate at all
        return None
    ahead = shares(scheduler, max(epochs, steps))  # a step of the copy is a step, whichever interval it stands for
    if ahead is None:
        return None
    at_epochs, at_steps = ahead[:epochs + 1], ahead[:steps + 1]
    if per_epoch and max(at_epochs) < NEVER_PAST * max(at_steps):
        return (f"stepped per epoch, its rate never gets past {max(at_epochs) / max(at_steps):.0%} of its peak in "
                f"the {epochs} epoch(s) planned; stepped per optimizer step, it reaches it")
    after_tenth = max(at_steps[min(steps // 10, len(at_steps) - 1):])
    tenth_epochs = at_epochs[min(epochs // 10, len(at_epochs) - 1)]
    if not per_epoch and after_tenth <= COLLAPSED and tenth_epochs >= NEVER_PAST:  # and stays there (no restart)
        return (f"stepped per optimizer step, its rate is at most {after_tenth:.2g} of its base rate from a tenth "
                f"into the {steps} steps planned; stepped per epoch, it would be {tenth_epochs:.0%} there")
    return None


class RateWatch:
    """A learning rate that a scheduler stepped per batch took near 0 early, where it stayed: at some step an
    optimizer's rate (the largest of its groups') is at COLLAPSED of its peak so far or below, and has stayed there
    for as many steps as it took to fall there (at least LEAST), and a scheduler that holds the optimizer has
    stepped at every training step. A schedule written in epochs and stepped per batch (StepLR, ExponentialLR in
    the batch loop) does this within the first epochs, and the model trains no further while its loss looks
    settled. A healthy schedule gets there, if at all, at its end: a decay to 0 at the planned last step, a cosine
    that rises again, a step decay whose last stage is shorter than the stages before it. A rate lowered per epoch
    or by the loop itself (a decay on a plateau, written by hand or a ReduceLROnPlateau) follows the training's
    progress: it is not judged. Rates are read from the optimizers' groups (Python numbers only: a tensor rate
    would wait for its device) at every EVERY-th step, which tells a collapse at most 2 x EVERY steps late; the
    schedulers are looked for once, when a rate has collapsed."""

    LEAST = 10
    EVERY = 8

    def __init__(self, optimizers):
        self._optimizers = list(optimizers)
        self._peaks = [0.0] * len(self._optimizers)
        self._since = [None] * len(self._optimizers)  # the step each rate fell to COLLAPSED of its peak, while there
        self.told = False

    def see(self, step: int) -> str | None:
        """After the optimizer steps of `step`: what collapsed, where this step tells it (once per run)."""
        if self.told or step % self.EVERY:
            return None
        collapsed = []
        for i, optimizer in enumerate(self._optimizers):
            rate = _largest_rate(optimizer)
            if rate is None:
                continue
            if rate > COLLAPSED * self._peaks[i] or not self._peaks[i]:  # no peak yet: a warmup from 0
                self._peaks[i], self._since[i] = max(self._peaks[i], rate), None
            elif self._since[i] is None:
                self._since[i] = step
            elif step - self._since[i] >= max(self._since[i], self.LEAST):
                collapsed.append((optimizer, rate, self._peaks[i], self._since[i]))
        if not collapsed:
            return None
        self.told = True  # looked at once: a rate that stays down is no news at the next step
        per_batch = [s for s in _schedulers_of([optimizer for optimizer, *_ in collapsed])
                     if isinstance(getattr(s, "last_epoch", None), int) and s.last_epoch >= step
                     and not isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau)]
        if not per_batch:
            return None
        said = "; ".join(f"{type(optimizer).__name__}'s learning rate fell from {peak:.3g} to {COLLAPSED:.0%} of it "
                         f"or below at step {since} and is {rate:.3g} at step {step}"
                         for optimizer, rate, peak, since in collapsed)
        return said + "".join(f"; {type(s).__name__} has stepped {s.last_epoch} time(s) in {step + 1} step(s)"
                              for s in per_batch)


def _largest_rate(optimizer) -> float | None:
    """The largest learning rate of an optimizer's groups, where each is a Python number; else None."""
    rates = [group.get("lr") for group in optimizer.param_groups]
    return max(rates) if rates and all(type(rate) in (float, int) for rate in rates) else None


def _schedulers_of(optimizers: list) -> list:
    """The learning-rate schedulers that hold any of these optimizers (found once, through what refers to each)."""
    found = []
    for optimizer in optimizers:
        for referrer in gc.get_referrers(optimizer):
            if isinstance(referrer, dict):  # an instance's __dict__: its owner is what refers to it
                owners = [o for o in gc.get_referrers(referrer) if getattr(o, "__dict__", None) is referrer]
            else:
                owners = [referrer]
            found += [o for o in owners if isinstance(o, torch.optim.lr_scheduler.LRScheduler)
                      and o.optimizer is optimizer and o not in found]
    return found
