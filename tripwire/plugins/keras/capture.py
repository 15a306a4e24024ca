"""What a Keras train step shows tripwire at a sampled step, on the TensorFlow, torch and JAX backends.

Keras gives callbacks neither the step's loss (its logs hold the mean over the
epoch so far), nor gradients, nor layer outputs, and on TensorFlow and JAX the
train step is a compiled function Python does not re-enter. So on a sampled
step, and only then, the callback swaps `model.train_function` for a capture
function, traced while these hooks are in place, which are also in place
whenever it runs (Keras' own `make_train_function`; on TensorFlow, for the
usual one step per call on one replica, a leaner equivalent: `tf_step`):

- `model.train_step` is wrapped: inputs and labels, and (TensorFlow) it hands
  the captured tensors out as an extra entry of the step's logs;
- `call` of the selected layers is wrapped (activations; the model's own
  `call` gives the predictions);
- the optimizer's `scale_loss` and `apply` are wrapped (`wrap_optimizer`):
  the loss; gradients, parameters before the update, updates, learning rate.

At most two capture functions are built, each the first time it is needed:
one that takes only the loss and learning rate (the loss is usually sampled
most often), and one that takes everything the config can ask for in the
step; a step that needs less than all of it drops the rest on the host.
Each costs one more trace and compilation of the train step. Unsampled
steps run Keras' own function, or (where `tf_step` covers the model) its
leaner equivalent. On TensorFlow that function, traced with the loss hook in
place, also keeps each step's loss in a variable (one assign), so a step that
samples only the loss runs no capture function and none is traced for it; no
other hook is in it.

Captured tensors leave the step by one of three routes: eager tensors (torch,
`run_eagerly`) are handled at once; TensorFlow graph tensors go out through
the logs, removed before Keras sees them; JAX tracers (layer outputs live
inside `jax.value_and_grad`) go to the host through `jax.debug.callback`.
On the CPU they leave whole and the core's numpy reductions reduce them; on
an accelerator they are reduced where they are (`reduce_ops`) and only the
results leave, with full copies only where the config asks for tensors.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from collections.abc import Mapping

import keras
import numpy as np
from keras import ops

from tripwire.core.model import ModelInfo, parameter_collection
from tripwire.core.naming import SCALAR_COLLECTIONS, calls_left_out, collection_of, next_call
from tripwire.core.reductions import applicable
from tripwire.core.reductions import plain_array
from tripwire.core.reductions import reduce as reduce_numpy

from .hooks import KeptLoss, all_hooks
from .reduce import COMPUTE as DEVICE_REDUCTIONS
from .reduce import reduce_ops
from .tf_step import UnsampledSteps, covers, one_step_function

log = logging.getLogger("tripwire")

# Collections only the train step itself can see; metrics come from Keras' logs.
IN_STEP = frozenset({"losses", "weights", "biases", "gradients", "updates", "optimizer", "activations", "inputs",
                     "labels", "predictions", "custom"})
SCALARS_IN_STEP = frozenset({"losses", "optimizer"})  # cheap enough to get from a capture function of their own
LOGS_KEY = "__tripwire__"
# layers that read integer inputs as ids (a token, a category), not as measurements
ID_LAYERS = (keras.layers.Embedding, keras.layers.IntegerLookup, keras.layers.StringLookup,
             keras.layers.CategoryEncoding, keras.layers.Hashing, keras.layers.TextVectorization)
OPTIMIZER_CONSTANTS = {"momentum": "momentum", "beta1": "beta_1", "weight_decay": "weight_decay"}


def on_accelerator(model) -> bool:
    """Whether the model's variables live on an accelerator (then tensors are reduced where they are)."""
    variables = model.trainable_variables
    if not variables:
        return False
    device = getattr(variables[0].value, "device", "cpu")
    return "cpu" not in str(device() if callable(device) else device).lower()


def layer_kind(layer) -> str:
    """The layer's class, with its activation where it has one ('Dense/relu'): patterns like 'relu' find both."""
    activation = getattr(getattr(layer, "activation", None), "__name__", None)
    return type(layer).__name__ + (f"/{activation}" if activation else "")


def keras_function_of(model):
    """The model's train function, past any function of tripwire that a fit cut short left in its place."""
    function = model.train_function
    if isinstance(function, UnsampledSteps):
        return function.keras_function
    owner = getattr(function, "__self__", None)
    return owner.keras_function if isinstance(owner, StepCapture) else function


def _named_inputs(x) -> list:
    """(path, tensor) of a batch's inputs: `x` for one; a model of several inputs (keras.io's structured-data
    recipes feed one per feature, by name) gives each its key, or `x.<i>` where they come as a list."""
    if isinstance(x, Mapping):
        return [(str(key), part) for key, part in x.items()]
    if isinstance(x, (tuple, list)):
        return [(f"x.{i}", part) for i, part in enumerate(x)]
    return [("x", x)]


def _named_labels(y) -> list:
    """(path, tensor) of a batch's labels: `labels` for one; a model of several outputs trained on a dict of
    targets gives each its output's key (`labels/<key>`), on a list `labels/y.<i>`."""
    if y is None:
        return []
    if isinstance(y, Mapping):
        return [(str(key), part) for key, part in y.items()]
    if isinstance(y, (tuple, list)):
        return [("", y[0])] if len(y) == 1 else [(f"y.{i}", part) for i, part in enumerate(y)]
    return [("", y)]


class StepCapture:
    """One callback's capture of one model, kept across its fits while Keras' train function stays the same, so
    that its traced functions serve them all (a loop of one-epoch fits traces once); a fresh one after `compile`."""

    def __init__(self, model, plan, structure: ModelInfo):
        self.model, self.plan, self.structure = model, plan, structure
        self.backend = keras.backend.backend()
        self.on_device = on_accelerator(model)
        self.active: dict = {}
        self.values: dict = {}
        self.tensors: dict = {}
        self.fingerprints: dict = {}  # input name -> a digest of its bytes, where the step's inputs reached the host
        self.budget_of = None  # the recorder's tensor_budget: the room the full tensors of a step are copied within
        self.budget = None
        self._key: frozenset = frozenset()
        self._everything = frozenset(plan.collections) & IN_STEP
        self._emitting: dict = {}  # the plans of the collections the running capture hands over
        self._normal = None
        self.retraces = True  # this fit may trace functions of tripwire's (start)
        self._kept_loss: KeptLoss | None = None  # this step's loss is read from there
        self._functions: dict = {}  # the collections it captures -> capture function
        self._seen: dict = {}  # same key -> the optimizer hooks that ran in it
        self._original_step = model.train_step
        self._selected = list(self._layers(plan.collections["activations"])) if "activations" in plan else []
        self._wrappers: dict = {}
        self._graph_out: dict = {}
        self._calls: dict = {}  # layer path -> its calls in the step being traced or run (naming.next_call)
        self._graph = None
        self._order: dict = {}  # name -> when the step first handed it over: JAX delivers in no fixed order
        self._kinds: dict = {}  # name -> the kind its reductions are computed for
        self._channels: dict = {}  # name -> the axis of an activation's output features, where not the last
        self._reduced_as: dict = {}  # name -> the reductions the step computes on the device, in order
        self._warned: set = set()
        self.keras_function = keras_function_of(model)
        # integer inputs are ids where a layer looks them up (token ids are not measurements), else measurements
        self._reads_ids = any(isinstance(layer, ID_LAYERS) for layer in model._flatten_layers())
        # what runs the unsampled steps of a fit in place of Keras' function, where tf_step covers the model: the
        # one an earlier capture of this function left in place, traced already, or a new one
        current = model.train_function
        self._unsampled = current if isinstance(current, UnsampledSteps) and \
            current.keras_function is self.keras_function else \
            UnsampledSteps(model, self.keras_function) if covers(model) else None

    def serves(self, model) -> bool:
        return model is self.model and keras_function_of(model) is self.keras_function

    def start(self, retraces: bool = True) -> None:
        """A fit begins. retraces: False where the model's train function, traced already, trains other variables
        than the model's trainable ones (tf_step.trained_apart): no function is traced in this fit, as one traced
        now would train the others, where Keras' would not. The fit then runs the train function in place
        (tripwire's traced one, or Keras'), and its sampled steps capture only its loss, where that keeps it."""
        self.retraces = retraces
        if self._unsampled is not None and (self.retraces or self._unsampled.traced):
            self._set_train_function(self._unsampled)

    # -- phases ---------------------------------------------------------------------------------------------------
    def begin(self, collections) -> None:
        """Prepare a sampled step: swap in the capture function if the step needs anything from inside it."""
        self.active = {c.name: c for c in collections}
        self.values, self.tensors, self.fingerprints = {}, {}, {}
        self.budget = self.budget_of() if self.budget_of is not None else None
        needed = frozenset(self.active) & (IN_STEP if self.retraces else {"losses"})
        self._key = self._everything & SCALARS_IN_STEP if needed <= SCALARS_IN_STEP else self._everything
        self._kept_loss = self._kept_loss_of() if needed == {"losses"} else None
        if needed and self._kept_loss is None and self.retraces:
            self._normal = self.model.train_function
            self._set_train_function(self._run)

    def end(self) -> tuple[dict, dict]:
        """Put Keras' train function back; the step's (values, tensors)."""
        if self._normal is not None:
            self._set_train_function(self._normal)
            self._normal = None
            self._warn_without_gradients()
        if self._kept_loss is not None:
            self._kept_loss, kept = None, self._kept_loss
            if not kept.written:  # no scale_loss in the train step: the callback falls back on Keras' logs
                kept.refused = True
            elif self.active["losses"].selects("train"):
                self._order.setdefault("losses/train", len(self._order))
                self.values["losses/train"] = {"value": kept.read()}
        optimizer = getattr(self.model.optimizer, "inner_optimizer", self.model.optimizer)
        if "optimizer" in self.active and optimizer is not None:
            plan = self.active["optimizer"]
            for name, attr in OPTIMIZER_CONSTANTS.items():
                value = getattr(optimizer, attr, None)
                value = 0.0 if value is None and name == "weight_decay" else value  # None: no decay
                if isinstance(value, (int, float)) and not isinstance(value, bool) and plan.selects(name):
                    self.values[f"optimizer/{name}"] = {"value": float(value)}
        values = dict(sorted(self.values.items(), key=lambda item: self._order.get(item[0], len(self._order))))
        tensors = self.tensors
        self.active, self.values, self.tensors = {}, {}, {}
        return values, tensors

    def _kept_loss_of(self):
        """The loss the function of the unsampled steps keeps (TensorFlow; traced, if not yet, at the step about
        to run)."""
        hook = vars(self.model.optimizer).get("scale_loss") if self.model.optimizer is not None else None
        kept = getattr(hook, "kept", None)
        usable = kept is not None and kept.variable is not None and not kept.refused and not self.model.run_eagerly
        return kept if usable else None

    def close(self) -> None:
        """Keras' train function back in place, unless something else replaced ours (a fit may have been cut
        short inside a sampled step, and the model compiled again since); the function of the unsampled steps
        stays, where it was traced (UnsampledSteps)."""
        current = self.model.train_function
        if current == self._run or current is not None and current is self._unsampled:
            traced = self._unsampled is not None and self._unsampled.traced
            self._set_train_function(self._unsampled if traced else self.keras_function)
        self._normal = None

    def _set_train_function(self, function) -> None:
        """Past Keras' attribute tracking, which costs more than the swap itself on every sampled step."""
        object.__setattr__(self.model, "train_function", function)

    # -- the capture function ---------------------------------------------------------------------------------------
    def _run(self, *args):
        """Called by Keras' fit loop in place of its train function, on sampled steps only."""
        eager = self.backend == "torch" or self.model.run_eagerly  # hooks run at every step, not once in a trace
        # a compiled function is traced once for all the steps it serves: with every reduction any of them takes
        self._emitting = self.active if eager else {name: self.plan.collections[name].at_step(None)
                                                    for name in self._key}
        with self._hooks(self._key):
            function = self._functions.get(self._key)
            if function is None:
                function = self._functions[self._key] = self._make(*args)
            try:
                out = function(*args)
            finally:
                self._emitting = {}
        if self.backend == "jax":
            import jax

            jax.effects_barrier()  # every debug.callback of the step has delivered
        logs = out[0] if isinstance(out, tuple) else out
        for key, value in logs.pop(LOGS_KEY, {}).items():
            what, _, name = key.partition(":")
            self._receive(name, what, value)
        return out

    def _make(self, *args):
        """The capture function, traced at its first call with the hooks in place."""
        if covers(self.model):
            return one_step_function(self.model)
        current = self.model.train_function  # else: Keras' own, or the model's own
        with _state_in_variables(self.model, args[0] if self.backend == "jax" and args else None):
            self.model.make_train_function(force=True)
        function, self.model.train_function = self.model.train_function, current
        return function

    @contextlib.contextmanager
    def _hooks(self, key):
        patches = [(self.model, "train_step", self._train_step)]
        if "activations" in key:
            patches += [(layer, "call", self._wrapper(layer, "activations", path, kind))
                        for layer, path, kind in self._selected]
        if "predictions" in key:
            patches.append((self.model, "call", self._wrapper(self.model, "predictions", "", "")))
        previous = [vars(obj).get(attr) for obj, attr, _ in patches]
        for obj, attr, function in patches:
            object.__setattr__(obj, attr, function)
        hooks = all_hooks(self.model)
        for hook in hooks:
            hook.capture = self
        try:
            yield
        finally:
            for hook in hooks:
                hook.capture = None
            for (obj, attr, _), old in zip(patches, previous):
                if old is None:
                    object.__delattr__(obj, attr)
                else:
                    object.__setattr__(obj, attr, old)

    def _layers(self, plan):
        """The layers whose outputs the activations collection selects: leaves, or any layer its patterns name."""
        for layer in self.model._flatten_layers(include_self=False, recursive=True):
            if isinstance(layer, keras.layers.InputLayer):
                continue
            path, kind = getattr(layer, "path", None) or layer.name, layer_kind(layer)
            leaf = not any(True for _ in layer._flatten_layers(include_self=False, recursive=False))
            if (plan.include or leaf) and plan.selects(path, kind):
                yield layer, path, kind

    def _wrapper(self, layer, collection, path, kind):
        """A `call` that reports its output; made once per layer, so compiled-function caches keep hitting."""
        key = (id(layer), collection)
        if key not in self._wrappers:
            call = layer.call

            channels = channels_axis(layer)

            def wrapped(*args, **kwargs):
                out = call(*args, **kwargs)
                path_now = path
                if collection == "activations":  # each call of a layer several calls share, under its own name
                    path_now = next_call(self._calls, path)
                    if path_now is None:
                        self.warn_once(f"calls:{path}", calls_left_out(path))
                        return out
                self.emit(collection, path_now, out[0] if isinstance(out, (tuple, list)) and out else out, kind,
                          channels)
                return out

            self._wrappers[key] = wrapped
        return self._wrappers[key]

    def _train_step(self, *args):
        self._graph_out = {}
        self._calls = {}
        if self.backend == "tensorflow":
            import tensorflow as tf

            self._graph = tf.compat.v1.get_default_graph()
        x, y, _ = keras.utils.unpack_x_y_sample_weight(args[-1])
        for path, part in _named_inputs(x):
            if ops.is_tensor(part) and keras.backend.is_float_dtype(part.dtype):
                self.emit("inputs", path, part)
            elif ops.is_tensor(part) and keras.backend.is_int_dtype(part.dtype) and not self._reads_ids:
                self.emit("inputs", path, ops.cast(part, "float32"))  # uint8 pixels, counts: the layer casts them
        for path, part in _named_labels(y):  # none where a model trains on inputs alone (a GAN's custom step)
            self.emit("labels", path, part)
        out = self._original_step(*args)
        if self._graph_out:  # TensorFlow graph tensors leave the compiled step with its logs
            out = {**out, LOGS_KEY: self._graph_out}
        return out

    # -- what the hooks report ----------------------------------------------------------------------------------------
    def before_update(self, optimizer, grads, variables) -> dict:
        """Optimizer hook, before the update: parameters, gradients, learning rate; keeps what `updates` needs."""
        self.seen("apply")
        updates = self._emitting.get("updates")
        before = {}
        for grad, variable in zip(grads, variables):
            path, value = variable.path, ops.convert_to_tensor(variable)
            info = self.structure.parameters.get(path)
            kind = info.layer_class if info is not None else ""
            self.emit(parameter_collection(info.role if info is not None else "other", path), path, value, kind)
            if grad is not None:
                self.emit("gradients", path, grad, kind)
            if updates is not None and updates.selects(path):
                before[path] = ops.copy(value)  # torch updates in place
        if "optimizer" in self._emitting:
            self.emit("optimizer", "lr", ops.convert_to_tensor(optimizer.learning_rate))
        return before

    def after_update(self, variables, before: dict) -> None:
        for variable in variables:
            if variable.path in before:
                self.emit("updates", variable.path, ops.subtract(ops.convert_to_tensor(variable), before[variable.path]))

    def emit(self, collection: str, path: str, tensor, kind: str = "", channels: int = -1) -> None:
        """Hand one tensor of the step to tripwire, if its collection is sampled now and selects it; `channels`:
        the axis of its output features (an activation's)."""
        plan = self._emitting.get(collection)
        if plan is None or not plan.selects(path, kind):
            return
        name = f"{collection}/{path}" if path else collection
        if not ops.is_tensor(tensor):  # numbers or a numpy array from the user's own code: on the host already
            self._receive(name, "raw", tensor)
            return
        try:
            self._order.setdefault(name, len(self._order))
            self._kinds[name] = kind
            if channels != -1:
                self._channels[name] = channels
            if self.on_device and collection not in SCALAR_COLLECTIONS and \
                    DEVICE_REDUCTIONS.keys() >= set(plan.reductions):
                reductions = applicable(plan.reductions, tensor.shape, kind)
                parts = {"reduced": reduce_ops(tensor, reductions, kind, channels)}
                self._reduced_as[name] = reductions
                if plan.save_tensors:
                    parts["tensor"] = tensor
            else:
                parts = {"raw": tensor}
            self._send(name, parts)
        except Exception as exc:  # noqa: BLE001 - a tensor tripwire cannot read (sparse, ragged, strings) is skipped
            self.not_captured(name, tensor, exc)

    def not_captured(self, name: str, value, exc: Exception) -> None:
        """Say once per name that a value is not captured, and why: training goes on without it."""
        self.warn_once(f"unread:{name}", f"tripwire: {name} (a {type(value).__name__} of "
                                         f"{getattr(value, 'dtype', '?')}) is not captured: {type(exc).__name__}: {exc}.")

    def _send(self, name: str, parts: dict) -> None:
        tensor = next(iter(parts.values()))
        if self.backend == "jax":
            import jax

            if isinstance(tensor, jax.core.Tracer):
                jax.debug.callback(functools.partial(self._receive_all, name), parts)
                return
        elif self.backend == "tensorflow":
            import tensorflow as tf

            if not tf.executing_eagerly():
                parts = {what: tf.convert_to_tensor(value) for what, value in parts.items()}  # variables: read now
                if any(value.graph is not self._graph for value in parts.values()):
                    # inside a branch or a loop of the step (mixed precision's loss-scale optimizer updates the
                    # weights in a tf.cond): no output of the function; a host callback that runs there hands
                    # the values over instead
                    whats = list(parts)
                    tf.numpy_function(lambda *arrays: self._receive_all(name, dict(zip(whats, arrays))) or [],
                                      list(parts.values()), Tout=[], stateful=True)
                    return
                self._graph_out.update({f"{what}:{name}": value for what, value in parts.items()})
                return
        self._receive_all(name, parts)

    def _receive_all(self, name: str, parts: dict) -> None:
        for what, value in parts.items():
            self._receive(name, what, value)

    def _receive(self, name: str, what: str, value) -> None:
        plan = self.active.get(collection_of(name))
        if plan is None:
            return
        try:
            self._take(name, what, plain_array(ops.convert_to_numpy(value)), plan)
        except Exception as exc:  # noqa: BLE001 - on the host, or in the step's host callback: never into training
            self.not_captured(name, value, exc)

    def _take(self, name: str, what: str, array: np.ndarray, plan) -> None:
        if what == "reduced":  # computed for every reduction the function serves; kept: those due now
            reduced = dict(zip(self._reduced_as[name], array.astype(np.float64).tolist()))
            self.values[name] = {r: reduced[r] for r in plan.reductions if r in reduced}
        elif what == "tensor":  # the compiled function sends every tensor any step saves: kept where this one does
            if plan.save_tensors and (self.budget is None or self.budget.take(name, array.nbytes)):
                self.tensors[name] = np.array(array)
        elif plan.name in SCALAR_COLLECTIONS:
            self.values[name] = {"value": float(array.reshape(-1)[0])}
        else:
            self.values[name] = reduce_numpy(array, plan.reductions, self._kinds.get(name, ""),
                                             self._channels.get(name, -1))
            # whole on the host: whether the next batch is the same one (InputRepeats); not one whose samples are
            # all alike, which data may well repeat (a placeholder of zeros for a train_step that makes its own, a
            # flat stretch of a series, one class's code in data sorted by class)
            if plan.name == "inputs" and array.ndim and len(array) > 1 and not np.all(array == array[:1]):
                self.fingerprints[name] = hashlib.blake2b(np.ascontiguousarray(array).view(np.uint8),
                                                          digest_size=16).digest()
            if plan.save_tensors and (self.budget is None or self.budget.take(name, array.nbytes)):
                self.tensors[name] = np.array(array)  # a copy: parameters change in place

    def seen(self, hook: str) -> None:
        """An optimizer hook ran in this capture function (on compiled backends: while it was traced)."""
        self._seen.setdefault(self._key, set()).add(hook)

    def _warn_without_gradients(self) -> None:
        if "gradients" in self.active and "apply" not in self._seen.get(self._key, ()):
            self.warn_once("gradients", "tripwire: rules need gradients, but the train step did not apply them "
                            "through model.optimizer, so none were captured (rules on gradients report no_data). "
                            "If your train_step uses another optimizer, pass it through "
                            "tripwire.plugins.keras.wrap_optimizer(optimizer).")

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)


# Layers whose output keeps its input's layout: an activation's units are the features of the layer before them
LAYOUT_KEEPING = (keras.layers.Activation, keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.ELU,
                  keras.layers.PReLU, keras.layers.BatchNormalization, keras.layers.Dropout)


@contextlib.contextmanager
def _state_in_variables(model, state):
    """JAX: during an epoch Keras keeps the training state outside the model, whose variables it empties, and
    under a distribution its `make_train_function` reads each variable's sharding from its value: the state the
    step was handed is lent to the variables it empties (references, no copy) while it runs, and taken back."""
    variables = (model.trainable_variables, model.non_trainable_variables,
                 model.optimizer.variables if model.optimizer is not None else [], model.metrics_variables)
    lent = []
    for group, values in zip(variables, state or ()):
        for variable, value in zip(group, values):
            if getattr(variable, "_value", 0) is None:
                variable._value = value
                lent.append(variable)
    try:
        yield
    finally:
        for variable in lent:
            variable._value = None


def channels_axis(layer) -> int:
    """The axis of a layer's output features: 1 where it, or the layer it takes its input from through layers that
    keep the layout (an activation, a normalisation, dropout), computes channels first (a Conv2D with
    data_format="channels_first"); else the last, Keras' default. A layer of a subclassed model, which keeps no
    record of its inputs, is read by its own format alone."""
    for _ in range(4):
        data_format = getattr(layer, "data_format", None)
        if data_format is not None:
            return 1 if data_format == "channels_first" else -1
        if not isinstance(layer, LAYOUT_KEEPING):  # a Dense computes its units on the last axis, whatever came in
            return -1
        nodes = getattr(layer, "_inbound_nodes", None)
        parents = nodes[0].parent_nodes if nodes else []
        if len(parents) != 1:
            return -1
        layer = parents[0].operation
    return -1
