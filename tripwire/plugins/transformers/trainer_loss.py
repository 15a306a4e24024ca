"""The loss a `transformers.Trainer` computes itself, where the model's output holds none or not the one trained on.

With `label_smoothing_factor`, a `compute_loss_func` or a subclass's own `compute_loss`, the Trainer takes the labels
away from the model (or ignores its loss) and computes the loss it back-propagates in `compute_loss`. The Trainer
hands callbacks neither itself nor that loss, and its logs hide a NaN. So the callback finds the Trainer whose event
it handles up the call stack, and wraps that one instance's `compute_loss` while training: the wrapper calls the
Trainer's own method with what it was given, returns what it returned, and hands the training loss (and the labels,
taken before the Trainer pops them) to the callback. It is removed when training ends.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Mapping

import transformers

log = logging.getLogger("tripwire")
CALLERS = 8  # frames between a callback's event method and the Trainer's loop (CallbackHandler's two, and margin)


def calling_trainer() -> transformers.Trainer | None:
    """The Trainer up the call stack of a callback's event (Trainer -> CallbackHandler.on_… -> call_event -> the
    callback); None where there is none."""
    frame = sys._getframe(1)
    for _ in range(CALLERS):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, transformers.Trainer):
            return owner
        frame = frame.f_back
    return None


def computes_own_loss(trainer: transformers.Trainer) -> bool:
    """Whether the loss the Trainer back-propagates may not be the model's `outputs.loss`."""
    return getattr(trainer, "label_smoother", None) is not None or \
        getattr(trainer, "compute_loss_func", None) is not None or \
        type(trainer).compute_loss is not transformers.Trainer.compute_loss


def is_share(trainer: transformers.Trainer, num_items_in_batch) -> bool:
    """Whether compute_loss's loss is a share of the step's (the Trainer's own test, in training_step, of whether to
    divide it by the accumulation steps): the step's loss is then the sum of its micro-batches', else their mean."""
    if getattr(trainer, "loss_is_scaled_for_ga", None) is not None:
        return bool(trainer.loss_is_scaled_for_ga)
    return bool(getattr(trainer, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None) or \
        getattr(trainer, "compute_loss_func", None) is not None


def wrap_compute_loss(trainer: transformers.Trainer, seen: Callable) -> Callable[[], None]:
    """Wrap `trainer.compute_loss` so that each training call hands `seen(loss, labels, share, replay)` what it
    computed: its loss, the labels it was given, whether the loss is a share of the step's, and a function that
    computes the same loss again from the same inputs (to find where a NaN began). Returns what undoes it."""
    own = trainer.__dict__.get("compute_loss")
    original = trainer.compute_loss

    @functools.wraps(original)
    def compute_loss(model, inputs, *args, **kwargs):
        training = getattr(model, "training", False)
        given = dict(inputs) if training and isinstance(inputs, Mapping) else None  # the Trainer pops the labels
        result = original(model, inputs, *args, **kwargs)
        if given is not None:
            try:
                loss = result[0] if isinstance(result, tuple) else result
                share = is_share(trainer, kwargs.get("num_items_in_batch"))
                seen(loss, given.get("labels"), share, lambda: original(model, dict(given), *args, **kwargs))
            except Exception as exc:  # noqa: BLE001 - a look at the loss must never stop the training
                log.warning("tripwire: could not read the Trainer's loss: %s: %s", type(exc).__name__, exc)
        return result

    trainer.compute_loss = compute_loss

    def undo() -> None:
        if trainer.__dict__.get("compute_loss") is compute_loss:
            if own is None:
                del trainer.compute_loss
            else:
                trainer.compute_loss = own

    return undo
