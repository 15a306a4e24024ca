"""Keras' TensorFlow train function for the usual case, one step per call on one replica, as one tf.function.

Keras' own nests its step function in a second tf.function, hands the logs out
through a tf.data Optional and unwraps them with two eager ops in Python, at
every step: 150-250 us a step on a small model, ~30 ms more to compile, and ~20 us
per logged tensor, which for a capture function (whose logs carry every captured
tensor) adds up. tripwire builds its capture functions this way, and, while a
callback fits, runs the unsampled steps through one such function too: it does
what Keras' does, to the bit, and its compile (the second of a fit, after the
capture function's) is cheaper. Whatever this does not cover is left to Keras.
"""

from __future__ import annotations

import keras


def covers(model) -> bool:
    """Whether a one-step function can stand in for the model's train function.

    Not under `run_eagerly`, for `steps_per_execution` > 1, on several replicas, for a model that makes its own
    train function, or with XLA (`jit_compile=True`: XLA cannot compile the dataset's get_next, which Keras keeps
    in the outer function)."""
    return (keras.backend.backend() == "tensorflow" and not model.run_eagerly
            and (model.steps_per_execution or 1) == 1 and not model.jit_compile
            and model.distribute_strategy.num_replicas_in_sync == 1
            and type(model).make_train_function.__module__.startswith("keras."))


def trained_apart(model) -> tuple[list, list]:
    """(made trainable, frozen): the variables whose `trainable` changed after Keras' TensorFlow
    train function first applied gradients, by the variables its optimizer was built for then. That function,
    once traced, trains those variables until compile() makes a new one (Keras warns: "A layer's `trainable`
    state has changed since the model was compiled"): the ones made trainable since are not trained, the ones
    frozen since still are. A function traced afresh (every function of tripwire's) would train the others, or
    fail on them ("Unknown variable"), so such a fit traces none: it runs the function in place. ([], []) where
    nothing changed,
    the optimizer has not stepped yet, on other backends (torch reads the flags at every step; JAX is not
    judged), and for a train_step of the model's own, whose optimizer may hold any part of it."""
    optimizer = getattr(model, "optimizer", None)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # under mixed precision, a LossScaleOptimizer
    built = getattr(optimizer, "_trainable_variables", None) if getattr(optimizer, "built", False) else None
    if keras.backend.backend() != "tensorflow" or not built or \
            not type(model).train_step.__module__.startswith("keras."):
        return [], []
    now = {id(v): v for v in model.trainable_variables}
    then = {id(v): v for v in built}
    return [v for key, v in now.items() if key not in then], [v for key, v in then.items() if key not in now]


def one_step_function(model):
    """A tf.function that takes the next batch from a dataset iterator and runs `model.train_step` on it.

    As Keras, optional parts of a batch that are absent from it are None. Keras' epoch iterator turns the
    OutOfRangeError of an exhausted dataset into StopIteration, as for its own function."""
    import tensorflow as tf

    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step(iterator):
        data = keras.tree.map_structure(
            lambda x: None if isinstance(x, tf.experimental.Optional) else x, iterator.get_next())
        logs = strategy.run(model.train_step, args=(data,))
        return tf.nest.map_structure(lambda value: strategy.experimental_local_results(value)[0], logs)

    return tf.function(one_step, reduce_retracing=True)


class UnsampledSteps:
    """Stands in for Keras' train function from a fit with tripwire on: a one-step function for dataset
    iterators, Keras' own function for anything else it is handed (`train_on_batch` passes a generator). Once
    traced, it stays the model's train function after the fit, until compile() makes a new one, as Keras' own
    would have been traced in its place: a later fit, with tripwire or without, trains what it traced
    (trained_apart)."""

    def __init__(self, model, keras_function):
        import tensorflow as tf

        self.keras_function = keras_function
        self.function = one_step_function(model)
        self._iterators = (tf.data.Iterator, tf.distribute.DistributedIterator)

    @property
    def traced(self) -> bool:
        return self.function.experimental_get_tracing_count() > 0

    def __call__(self, iterator):
        if isinstance(iterator, self._iterators):
            return self.function(iterator)
        return self.keras_function(iterator)
