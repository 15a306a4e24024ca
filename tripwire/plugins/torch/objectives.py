"""What a torch training step's loss is made of: how many objectives the step trains in turn
(tripwire.core.firststep.FirstStep.objectives), and over how many forward passes it adds up.

A GAN's step runs the discriminator's backward pass and its optimizer's step, then the generator's backward pass
and its optimizer's step: two objectives, each trained against the other, and neither loss need go down. A model
with two optimizers over one loss (sparse embeddings under SparseAdam, the rest under Adam) runs one backward
pass and steps both: one objective. The difference shows in the gradients between two optimizer steps of one
training step: where a backward pass ran after an optimizer stepped, some gradient is new since that step, or
was added to since. Looked at during the first sampled step only (the loop does the same every step).

Whether the training loss measures the fit at all: where the number of forward passes it adds up changes from
step to step (ForwardCounts), it measures the episode's length as much.
"""

from __future__ import annotations

import logging

log = logging.getLogger("tripwire")


class Objectives:
    """Fed each optimizer's step of one training step (`before` from its pre-step hook, `after` from its post-step
    hook); `count` is 1 plus the backward passes seen between two optimizer steps.

    A parameter's gradient counts as the work of a backward pass since the last optimizer stepped where it is a
    tensor it did not hold then (zero_grad sets gradients to None, and a backward makes new ones), or, for a
    parameter whose optimizer has already stepped and that the optimizer about to step does not hold, the same
    tensor written since (a backward adds to a gradient in place). The gradients of the optimizer about to step
    are changed in place before its step by a GradScaler's unscale or a clip: that is no backward pass."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)
        self._count = 1
        self._failed = False  # a look that failed counts nothing: it must never stop the optimizer's step
        self._left: dict | None = None  # id(parameter) -> (id(grad), version), as the last optimizer's step left them
        self._stepped: set = set()  # ids of the parameters held by the optimizers that stepped so far

    @property
    def count(self) -> int | None:
        """The objectives counted; None where the look failed."""
        return None if self._failed else self._count

    def before(self, optimizer, *_) -> None:
        try:
            self._before(optimizer)
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)

    def after(self, optimizer, *_) -> None:
        try:
            self._after(optimizer)
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)

    def fail(self, exc: Exception) -> None:
        """Count nothing more: the count is None."""
        self._failed, self._left = True, None
        log.debug("tripwire: the first step's objectives are not counted: %s: %s", type(exc).__name__, exc)

    def _before(self, optimizer) -> None:
        if self._left is None or self._failed:
            return
        about_to_step = {id(p) for p in _parameters(optimizer)}
        for parameter in self._all_parameters():
            key, grad = id(parameter), parameter.grad
            if grad is None:
                continue
            was = self._left.get(key)
            made = was is None or was[0] != id(grad)
            added_to = not made and grad._version != was[1] and key in self._stepped and key not in about_to_step
            if made or added_to:
                self._count += 1
                self._left = None  # counted: the next optimizer's step compares with the state after this one's
                return

    def _after(self, optimizer) -> None:
        if self._failed:
            return
        self._stepped.update(id(p) for p in _parameters(optimizer))
        self._left = {id(p): None if p.grad is None else (id(p.grad), p.grad._version)
                      for p in self._all_parameters()}

    def _all_parameters(self):
        for optimizer in self.optimizers:
            yield from _parameters(optimizer)


def _parameters(optimizer):
    return (p for group in optimizer.param_groups for p in group["params"])


class ForwardCounts:
    """The model's training forward passes (with gradients, outside an optimizer's own closure) in each of the first
    STEPS steps. Where they take three or more different numbers, the step's loss adds up over a number of forward
    passes that changes from step to step (a reinforcement-learning episode, one forward per action; a sequence
    unrolled one forward per element), and its size follows that number, not the fit: an agent that learns plays
    longer episodes and its loss grows. Gradient accumulation's short last group of an epoch makes two numbers; a
    GAN's or a siamese network's forwards one."""

    STEPS = 20
    DISTINCT = 3

    def __init__(self):
        self.this_step = 0
        self._counts: list = []

    def end_step(self) -> dict | None:
        """At the end of a step: at the STEPS-th, where the numbers varied, the fact to record
        ({"value": distinct numbers, "min": …, "max": …}); None otherwise."""
        self._counts.append(self.this_step)
        self.this_step = 0
        if len(self._counts) < self.STEPS:
            return None
        distinct = len(set(self._counts))
        return {"value": float(distinct), "min": float(min(self._counts)), "max": float(max(self._counts))} \
            if distinct >= self.DISTINCT else None

    @property
    def done(self) -> bool:
        return len(self._counts) >= self.STEPS
