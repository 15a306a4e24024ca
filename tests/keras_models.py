"""Small Keras models on sklearn's digits for the Keras plugin tests, on whichever backend KERAS_BACKEND names."""

from __future__ import annotations

import keras
import numpy as np

import helpers
import tripwire
from benchmarks.zoo.keras_cases import limit_threads

limit_threads()  # one thread: the test machines have few cores, shared


def mlp(hidden=(32,), activation="relu", lr=0.1, optimizer="sgd", first_bias=None):
    """An MLP on 64 inputs, 10 classes (logits), compiled; `first_bias` breaks its first layer on purpose.

    Its layers are always named sequential/dense, sequential/dense_1, …"""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    layers = [keras.Input((64,))]
    for i, width in enumerate(hidden):
        bias = keras.initializers.Constant(first_bias) if i == 0 and first_bias is not None else "zeros"
        layers.append(keras.layers.Dense(width, activation=activation, bias_initializer=bias))
    layers.append(keras.layers.Dense(10))
    model = keras.Sequential(layers)
    opt = keras.optimizers.Adam(lr) if optimizer == "adam" else keras.optimizers.SGD(lr)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def fit(callback, model=None, epochs=2, n_train=None, batch_size=32, validation=True, callbacks=(), **kwargs):
    """Train on digits (1347 training samples: 43 steps per epoch at batch size 32); returns the model."""
    model = model if model is not None else mlp()
    (xt, yt), (xv, yv) = helpers.digits(n_train=n_train)
    keras.utils.set_random_seed(0)
    model.fit(xt, yt, batch_size=batch_size, epochs=epochs, verbose=0, validation_data=(xv, yv) if validation else None,
              validation_batch_size=kwargs.pop("validation_batch_size", 256),
              callbacks=([callback] if callback is not None else []) + list(callbacks),
              **kwargs)
    return model


def fired(run_url) -> dict:
    """Each rule's first verdict at warning or error (in step order): what a fault is caught by."""
    first = {}
    for v in tripwire.open_run(run_url).verdicts():
        if v.counts:
            first.setdefault(v.rule, v)
    return first


def first_nonfinite_step(run) -> int:
    """The first train step at which any stored reduction shows a NaN or Inf."""
    steps = []
    for name in run.tensor_names(mode="train"):
        tensor = run.tensor(name)
        for reduction in tensor.reductions(mode="train"):
            s, v = tensor.series(reduction, mode="train")
            bad = s[~np.isfinite(v) | ((v > 0) if reduction == "nonfinite_count" else False)]
            steps += bad[:1].tolist()
    return min(steps)
