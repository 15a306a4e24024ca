"""What a Keras model trains with, read once at the first step (tripwire.core.firststep): its compiled loss, how that
loss reads the model's output, the output layer's activation, and the labels of the first batch."""

from __future__ import annotations

import keras
import numpy as np

from tripwire.core.firststep import FirstStep, loss_use

# Keras' losses by class or function name, as the canonical losses of tripwire.core.firststep and the targets they
# take (class ids or one-hot rows); Keras reads its cross-entropies' input as probabilities unless from_logits.
LOSSES = {
    "sparse_categorical_crossentropy": ("cross_entropy", "ids"), "categorical_crossentropy": ("cross_entropy", "one_hot"),
    "binary_crossentropy": ("binary_cross_entropy", None), "mean_squared_error": ("mse_loss", None),
    "mean_absolute_error": ("l1_loss", None), "huber": ("huber_loss", None),
}
_SPELLINGS = {"sparsecategoricalcrossentropy": "sparse_categorical_crossentropy",
              "categoricalcrossentropy": "categorical_crossentropy", "binarycrossentropy": "binary_crossentropy",
              "meansquarederror": "mean_squared_error", "mse": "mean_squared_error",
              "meanabsoluteerror": "mean_absolute_error", "mae": "mean_absolute_error", "huber_loss": "huber"}


def first_step(model, step: int, labels=None, zero_weight: tuple | None = None,
               validation_only: tuple | None = None, column_swaps: tuple | None = None) -> FirstStep:
    """The model's loss as its first step uses it; no loss where the model has several outputs or a loss Keras does
    not name (a custom function, a train_step of its own). zero_weight, validation_only, column_swaps: what fit
    was given (fitargs; LossUse, FirstStep)."""
    loss = getattr(model, "loss", None)
    if isinstance(loss, (list, tuple)) and len(loss) == 1:
        loss = loss[0]
    if isinstance(loss, dict) and len(loss) == 1:
        loss = next(iter(loss.values()))
    name, settings = _name_and_settings(loss)
    if name not in LOSSES or len(getattr(model, "outputs", None) or [None]) != 1:
        return FirstStep(step, (), column_swaps=column_swaps)
    canonical, targets = LOSSES[name]
    output, units = _output(model)
    use = loss_use(canonical, output, units, output == "softmax" and units == 1, labels,
                   _summed_terms(labels) if settings.get("reduction") == "sum" else None,
                   zero_weight=zero_weight, validation_only=validation_only,
                   **settings, **({"targets": targets} if targets else {}))
    return FirstStep(step, (use,) if use is not None else (), column_swaps=column_swaps)


def _name_and_settings(loss) -> tuple[str | None, dict]:
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        config = loss.get_config()
        name = type(loss).__name__.lower()
        settings = {"from_logits": bool(config.get("from_logits", False))} if "crossentropy" in name else {}
        if config.get("label_smoothing"):
            settings["label_smoothing"] = float(config["label_smoothing"])
        if config.get("reduction") == "sum":
            settings["reduction"] = "sum"
    elif callable(loss):
        name, settings = getattr(loss, "__name__", "").lower(), {}
        if "crossentropy" in name:
            settings["from_logits"] = False
    else:
        return None, {}
    return _SPELLINGS.get(name, name), settings


def _summed_terms(labels) -> int | None:
    """The per-sample losses a Keras loss with reduction "sum" adds up: one per label row (each the mean over the
    last axis, as Keras computes a sample's loss); None where the labels were not seen."""
    shape = getattr(labels, "shape", None)
    if not shape:
        return None
    return int(np.prod(shape[:-1])) if len(shape) >= 2 else int(shape[0])


def _output(model) -> tuple[str | None, int | None]:
    """The output layer's activation (`linear` for none) and its units, for a model built as a graph (Sequential,
    Functional); (None, units) where the layer that makes the output is not known."""
    try:
        units = int(model.outputs[0].shape[-1])
    except (AttributeError, IndexError, TypeError, ValueError):
        units = None
    try:
        layer = model.outputs[0]._keras_history.operation
    except (AttributeError, IndexError, TypeError, ValueError):
        return None, units
    if isinstance(layer, keras.layers.Softmax):
        return "softmax", units
    if isinstance(layer, keras.layers.ReLU):
        return "relu", units
    activation = getattr(getattr(layer, "activation", None), "__name__", None)
    if activation is None:
        return None, units
    return activation, units
