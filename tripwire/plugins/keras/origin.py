"""Where a NaN or Inf began in a Keras train step: the first layer whose output went non-finite, with the facts
tripwire.plugins.torch.origin records for torch (`origin/<layer path>`, judged by tripwire.core.rules.origins).

Keras' train step updates the weights inside the function that computes the loss: once a callback sees a NaN
loss, the weights it came from are gone. So the check sits in the step, before the update, where every Keras
train step hands its loss over: the optimizer's `scale_loss` (hooks.LossHook) passes it to `watch`. In a
compiled TensorFlow step that is a condition on the loss being finite, whose other branch, taken on the
non-finite step alone, copies the model's variables and the batch to the host; in an eager step on the CPU
(the torch backend, `run_eagerly`) one read of the loss. The callback then replays that step's forward from
the copy with `model.stateless_call` (the model's variables untouched, BatchNorm's statistics and the random
seeds updated in the copy only; dropout draws the step's own masks from the seed state kept at the step's
start) with each layer's `call` wrapped, and names the first layer, in the order their calls end, whose
output holds NaN/Inf. Where none did, the loss is where it began.

On JAX the step is handed the state before it: there the check follows the step, on the loss it logged, and
copies that state (a `lax.cond` holding a `jax.debug.callback`). Not with XLA on TensorFlow (`jit_compile`, its
default on a GPU: XLA compiles no host callback), on an accelerator in eager mode (the read would wait for it),
on several tf.distribute replicas (each computes its own loss), or for a model with its own `train_step` (the
forward replayed would not be its step's): there the NaN is told at its step without its origin.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
from keras import ops

from tripwire.core.rules.origins import OWN_FORWARD, loss_facts, origin_facts

log = logging.getLogger("tripwire")

_RUNNING: list = []  # the guard of the train step running (in eager mode) or being traced, innermost last


def guard(model) -> "StepGuard | None":
    """The model's guard, put in place as its `train_step` the first time; None where it does not apply."""
    current = vars(model).get("train_step")
    if isinstance(current, StepGuard):
        return current
    if current is not None or \
            not type(model).train_step.__module__.startswith("keras.") or _replicas(model) != 1:
        return None
    installed = StepGuard(model)
    object.__setattr__(model, "train_step", installed)  # past Keras' attribute tracking: it is not state
    return installed


def watch(loss) -> None:
    """Called with each train step's loss, before its gradients (hooks.LossHook)."""
    if _RUNNING:
        _RUNNING[-1].watch(loss)


class StepGuard:
    """Stands in for a model's `train_step`: keeps the batch and the random seeds' state at the step's start for
    `watch`, which copies them with the variables where the loss is not finite (once)."""

    def __init__(self, model):
        self.model = model
        self.step = type(model).train_step.__get__(model)
        self.kept: tuple | None = None  # (trainable, non-trainable, batch leaves), on the host
        self.done = False  # a copy was taken (or replayed): later non-finite steps follow from it
        self._x = None  # the inputs of the step running or being traced
        self._layout = None  # their structure, to rebuild the kept inputs in
        self._seeds: list = []
        self._seed_states = [generator.state for layer in model._flatten_layers()
                             for generator in getattr(layer, "_seed_generators", ())]

    def __call__(self, *args):
        if len(args) == 2:  # JAX: (state, data), the state before the step handed in
            return self._stateless_step(*args)
        (data,) = args
        eager = _eager()
        if self.done and eager:
            return self.step(data)
        self._x = keras.utils.unpack_x_y_sample_weight(data)[0]
        # the seed state before the step's dropout advances it (read, or copied: torch assigns in place)
        self._seeds = [ops.copy(state) if eager else ops.convert_to_tensor(state) for state in self._seed_states]
        _RUNNING.append(self)
        try:
            return self.step(data)
        finally:
            _RUNNING.pop()
            self._x, self._seeds = None, []

    def watch(self, loss) -> None:
        try:
            self._watch(loss)
        except Exception as exc:  # noqa: BLE001 - the guard must never break the step it watches
            self._give_up(exc)

    def _give_up(self, exc: Exception) -> None:
        """Stop looking for where a NaN begins in this training, and say so once: training goes on."""
        self.done = True
        log.warning("tripwire: where a NaN begins is not looked for in this training (%s: %s); a NaN is still told "
                    "at its step.", type(exc).__name__, exc)

    def _watch(self, loss) -> None:
        leaves = keras.tree.flatten(self._x)
        if not leaves or not all(_dense(leaf) for leaf in leaves):  # sparse or ragged inputs: not copied
            return
        self._layout = keras.tree.map_structure(lambda leaf: 0, self._x)
        if not _eager():
            if self.model.jit_compile:  # XLA cannot compile a host callback (the default on a GPU)
                return
            import tensorflow as tf

            tf.cond(tf.reduce_all(tf.math.is_finite(loss)), lambda: tf.constant(False),
                    lambda: tf.numpy_function(self._keep, self._values() + self._seeds + leaves, Tout=tf.bool,
                                              stateful=True))
            return
        if not _on_cpu(loss):
            return
        if not np.isfinite(ops.convert_to_numpy(loss)).all():
            self._keep(*(self._values() + self._seeds + leaves))

    def _stateless_step(self, state, data):
        """JAX's step, given the state before it: after it, where the loss it logged (the epoch's mean so far, not
        finite from the first non-finite step on) is not finite, that state and the batch go to the host (in a
        jitted step, a `lax.cond` whose other branch holds a `jax.debug.callback`)."""
        import jax
        import jax.numpy as jnp

        logs, after = self.step(state, data)
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        leaves, loss = keras.tree.flatten(x), logs.get("loss") if isinstance(logs, dict) else None
        if self.done or loss is None or not leaves or not all(_dense(leaf) for leaf in leaves):
            return logs, after
        try:
            self._layout = keras.tree.map_structure(lambda leaf: 0, x)
            trainable, non_trainable = list(state[0]), list(state[1])
            where = {id(v): i for i, v in enumerate(self.model.non_trainable_variables)}
            values = trainable + non_trainable + [non_trainable[where[id(s)]] for s in self._seed_states] + leaves
            if isinstance(loss, jax.core.Tracer):
                jax.lax.cond(jnp.all(jnp.isfinite(loss)), lambda: None,
                             lambda: jax.debug.callback(self._keep, *values))
            elif _on_cpu(loss) and not np.isfinite(np.asarray(loss)).all():
                self._keep(*values)
        except Exception as exc:  # noqa: BLE001 - the guard must never break the step it watches
            self._give_up(exc)
        return logs, after

    def _values(self) -> list:
        return [ops.convert_to_tensor(v) for v in self.model.trainable_variables + self.model.non_trainable_variables]

    def _keep(self, *arrays) -> np.bool_:
        """On the host, inside the step (a host callback): copies what the replay needs, once. Never raises: an
        error here would end the step it runs in."""
        if self.done:
            return np.bool_(True)
        try:
            self._copy(arrays)
        except Exception as exc:  # noqa: BLE001
            self._give_up(exc)
        return np.bool_(True)

    def _copy(self, arrays) -> None:
        self.done = True
        arrays = [np.array(ops.convert_to_numpy(a)) for a in arrays]
        trainable = len(self.model.trainable_variables)
        non_trainable = trainable + len(self.model.non_trainable_variables)
        states = arrays[non_trainable:non_trainable + len(self._seed_states)]
        self.kept = (arrays[:trainable], _with_seeds(self.model, arrays[trainable:non_trainable],
                                                     self._seed_states, states),
                     arrays[non_trainable + len(self._seed_states):])

    def origin(self) -> dict:
        """{`origin/<layer path>`: facts} of the step whose loss went non-finite, once; {} where none was kept or
        the replay found nothing."""
        if self.kept is None:
            return {}
        (trainable, non_trainable, leaves), self.kept = self.kept, None
        x = keras.tree.pack_sequence_as(self._layout, [ops.convert_to_tensor(leaf) for leaf in leaves])
        try:
            return replay(self.model, [ops.convert_to_tensor(v) for v in trainable],
                          [ops.convert_to_tensor(v) for v in non_trainable], x)
        except Exception as exc:  # noqa: BLE001 - a replay that fails ends the look there: training goes on
            log.debug("tripwire: the replay of the non-finite step stopped: %s: %s", type(exc).__name__, exc)
            return {}


def replay(model, trainable: list, non_trainable: list, x) -> dict:
    """Run the model's forward once from these values with every layer's `call` wrapped: the facts of the first
    layer whose output holds NaN/Inf, in the order their calls end (`forward` for the model's own operations
    between its layers); the loss's where every output was finite."""
    found: dict = {}

    def wrapper(layer, call, path):
        def wrapped(*args, **kwargs):
            out = call(*args, **kwargs)
            if not found:
                bad = nonfinite_count(out)
                if bad:
                    given = nonfinite_count((args, kwargs))
                    own = nonfinite_count(list(layer._trainable_variables) + list(layer._non_trainable_variables))
                    found.update(origin_facts(path, bad, given, 0.0 if given else max_abs((args, kwargs)), own))
            return out
        return wrapped

    layers = [(layer, getattr(layer, "path", None) or layer.name) for layer in model._flatten_layers(
        include_self=False, recursive=True) if not isinstance(layer, keras.layers.InputLayer)]
    layers.append((model, OWN_FORWARD))
    previous = [vars(layer).get("call") for layer, _ in layers]
    for layer, path in layers:
        object.__setattr__(layer, "call", wrapper(layer, layer.call, path))
    try:
        output, _ = model.stateless_call(trainable, non_trainable, x, training=True)
    finally:
        for (layer, _), old in zip(layers, previous):
            if old is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", old)
    return found or loss_facts(max_abs(output))


def _floats(value) -> list:
    """The floating-point arrays among the tensors (and variables) of a call's arguments or outputs, on the host."""
    arrays = []
    for leaf in keras.tree.flatten(value):
        if isinstance(leaf, keras.Variable):
            leaf = leaf.value
        if ops.is_tensor(leaf) and keras.backend.is_float_dtype(leaf.dtype):
            array = np.asarray(ops.convert_to_numpy(leaf))
            arrays.append(array if array.dtype in (np.float32, np.float64) else array.astype(np.float32))  # bf16
    return arrays


def nonfinite_count(value) -> int:
    return sum(int((~np.isfinite(a)).sum()) for a in _floats(value))


def max_abs(value) -> float:
    """The largest |value| over the finite values (0.0 where there are none)."""
    tops = [float(np.abs(a[np.isfinite(a)]).max()) for a in _floats(value) if np.isfinite(a).any()]
    return max(tops, default=0.0)


def _with_seeds(model, values: list, seed_states: list, starts: list) -> list:
    """The non-trainable values with each seed generator's state as it was at the step's start."""
    start_of = {id(state): start for state, start in zip(seed_states, starts)}
    return [start_of.get(id(variable), value) for variable, value in zip(model.non_trainable_variables, values)]


def _dense(leaf) -> bool:
    """A plain tensor of the backend, which a host callback takes as it is (not a sparse or ragged one)."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return isinstance(leaf, tf.Tensor)
    if backend == "jax":
        import jax

        return isinstance(leaf, jax.Array)
    import torch

    return isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided


def _on_cpu(tensor) -> bool:
    devices = tensor.devices() if callable(getattr(tensor, "devices", None)) else [getattr(tensor, "device", "cpu")]
    return all("cpu" in str(getattr(d, "platform", d)).lower() for d in devices)


def _replicas(model) -> int:
    strategy = getattr(model, "distribute_strategy", None)  # TensorFlow's
    return strategy.num_replicas_in_sync if strategy is not None else 1


def _eager() -> bool:
    if keras.backend.backend() != "tensorflow":
        return True
    import tensorflow as tf

    return tf.executing_eagerly()
