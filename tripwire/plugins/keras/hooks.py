"""Hooks on a Keras optimizer: where every train step hands over its loss (`scale_loss`) and its gradients
(`apply`). They pass calls straight through unless a `StepCapture` is running; on TensorFlow the loss hook
also keeps each step's loss in the function of the unsampled steps (`KeptLoss`)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import keras

from . import origin

_WRAPPED = weakref.WeakSet()  # every optimizer wrap_optimizer wrapped, while it lives

if TYPE_CHECKING:
    from .capture import StepCapture


class ApplyHook:
    """Stands in for an optimizer's `apply`: passes straight through unless a capture is running."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.original = optimizer.apply
        self.capture: StepCapture | None = None

    def __call__(self, grads, trainable_variables=None):
        capture = self.capture
        if capture is None:
            return self.original(grads, trainable_variables)
        variables = list(self.optimizer._trainable_variables if trainable_variables is None else trainable_variables)
        before = capture.before_update(self.optimizer, grads, variables)
        result = self.original(grads, trainable_variables)
        capture.after_update(variables, before)
        return result


class LossHook:
    """Stands in for an optimizer's `scale_loss`, which every Keras train step calls with the step's loss."""

    def __init__(self, optimizer):
        self.original = optimizer.scale_loss
        self.capture: StepCapture | None = None
        self.kept = KeptLoss() if keras.backend.backend() == "tensorflow" else None

    def __call__(self, loss):
        origin.watch(loss)
        if self.capture is not None:
            self.capture.seen("scale_loss")
            self.capture.emit("losses", "train", loss)
        elif self.kept is not None:
            self.kept.keep(loss)
        return self.original(loss)


class KeptLoss:
    """TensorFlow: the function of the unsampled steps (Keras' own, or tripwire's one-step function), traced while
    the loss hook is in place, also writes each step's loss into a variable (one assign in the graph). A step
    that samples only the loss reads it after the step: no capture function runs, and none is traced for it.
    Not under a distribution strategy (a plain variable cannot be assigned per replica): there a capture
    function takes the loss, and where the train step calls no scale_loss, Keras' logs give it."""

    def __init__(self):
        import tensorflow as tf

        self.variable = None if tf.distribute.has_strategy() else tf.Variable(
            float("nan"), trainable=False, dtype=tf.float32, name="tripwire_loss")
        self.written = False  # a traced train function writes it
        self.refused = False  # Keras' function ran a step and did not write it: its train_step calls no scale_loss

    def keep(self, loss) -> None:
        import tensorflow as tf

        if self.variable is None or tf.executing_eagerly() or tf.distribute.has_strategy() or loss.shape.rank != 0:
            return
        self.variable.assign(tf.cast(loss, tf.float32))
        self.written = True

    def read(self) -> float:
        return float(self.variable.numpy())


def wrap_optimizer(optimizer):
    """Let tripwire see the loss and gradients of the steps this optimizer serves; returns the same optimizer.

    Keras gives callbacks neither, so tripwire reads them where every train step
    hands them to the optimizer: `scale_loss(loss)` and `apply(grads)` (which
    `apply_gradients` and `stateless_apply` call). `TripwireCallback` wraps
    `model.optimizer` by itself when training starts; call this only for an
    optimizer your own `train_step` uses instead of `model.optimizer`. Outside
    sampled steps the wrappers pass calls straight through; wrapping twice
    changes nothing.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer: see unscaled gradients
    for target, method, hook in ((inner, "apply", ApplyHook), (optimizer, "scale_loss", LossHook)):
        if not isinstance(vars(target).get(method), hook):
            object.__setattr__(target, method, hook(target))  # no attribute tracking: it is not state
    _WRAPPED.add(optimizer)
    return optimizer


def hook_model(model, remake: bool = True):
    """Wrap the model's optimizer, and put the guard that finds where a NaN began in place of its train step
    (origin.py); returns the guard (None where it does not apply). Keras' train function holds the train step it
    was made with (TensorFlow, JAX) and, on TensorFlow, traces the loss hook into itself (`KeptLoss`): where either
    is put in place only now, Keras makes its function again: before its first call that costs no trace; after a
    fit without tripwire, one trace, as a capture function would. remake: False where that trace would train other
    variables than the function in place (tf_step.trained_apart): the hooks then wait for the next compile()."""
    optimizer = model.optimizer
    if optimizer is None:
        return None
    backend = keras.backend.backend()
    new_hook = not isinstance(vars(optimizer).get("scale_loss"), LossHook) and backend == "tensorflow"
    new_guard = not isinstance(vars(model).get("train_step"), origin.StepGuard) and backend != "torch"
    wrap_optimizer(optimizer)
    step_guard = origin.guard(model)
    if (new_hook or new_guard and step_guard is not None) and model.train_function is not None and remake:
        model.make_train_function(force=True)
    return step_guard


def all_hooks(model) -> list:
    """The hooks a capture of this model's step turns on: its optimizer's, and those of every optimizer passed
    through wrap_optimizer (a GAN's train_step applies its own two, while `model.optimizer` is the one `compile()`
    made by default and never steps)."""
    optimizers = [model.optimizer] + [o for o in list(_WRAPPED) if o is not model.optimizer]
    return [hook for optimizer in optimizers for hook in hooks_of(optimizer)]


def hooks_of(optimizer) -> list:
    if optimizer is None:
        return []
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return [hook for hook in (vars(inner).get("apply"), vars(optimizer).get("scale_loss"))
            if isinstance(hook, (ApplyHook, LossHook))]
