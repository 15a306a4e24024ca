"""The structure of a Keras model for tripwire.core.model, read from its layer classes.

A parameter is a variable a layer created as trainable (`layer._trainable_variables`,
where Keras keeps them also while the layer is frozen); a BatchNormalization's
moving statistics are state, not parameters. Its layer type and role come
from the class of the layer that owns it (a `BatchNormalization`'s `beta` is a
normalisation shift, an `LSTMCell`'s `recurrent_kernel` a recurrent kernel).
What follows a layer is read from the model's graph (a Functional model's
nodes, a Sequential model's order); for a subclassed model, from the order
its layers were created in.
"""

from __future__ import annotations

import math

import keras

from tripwire.core.model import ModelInfo, Parameter

from .tf_step import trained_apart

L = keras.layers


def _classes(*names) -> tuple:
    """Layer classes by name, those this Keras has (RMSNormalization came in 3.9)."""
    return tuple(getattr(L, n) for n in names if hasattr(L, n))


_DENSE = _classes("Dense", "EinsumDense")
_CONV = _classes("Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
                 "DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D")
_DEPTHWISE = _classes("DepthwiseConv1D", "DepthwiseConv2D")
_NORM = _classes("BatchNormalization", "LayerNormalization", "GroupNormalization", "UnitNormalization",
                 "RMSNormalization")
_RECURRENT_CELLS = _classes("LSTMCell", "GRUCell", "SimpleRNNCell", "ConvLSTM1D", "ConvLSTM2D", "ConvLSTM3D")
_PASS_THROUGH = _classes("Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D", "GaussianDropout",
                         "AlphaDropout", "Flatten", "Reshape", "MaxPooling1D", "MaxPooling2D", "MaxPooling3D",
                         "AveragePooling1D", "AveragePooling2D", "AveragePooling3D", "GlobalAveragePooling1D",
                         "GlobalAveragePooling2D", "GlobalAveragePooling3D", "GlobalMaxPooling1D",
                         "GlobalMaxPooling2D", "GlobalMaxPooling3D", "ZeroPadding1D", "ZeroPadding2D",
                         "ZeroPadding3D")
_ROLES = {"kernel": "kernel", "depthwise_kernel": "kernel", "pointwise_kernel": "kernel",
          "recurrent_kernel": "recurrent_kernel", "bias": "bias", "gamma": "norm_scale", "scale": "norm_scale",
          "beta": "norm_shift", "embeddings": "embedding"}


def layer_type(layer) -> str:
    if isinstance(layer, _DENSE):
        return "dense"
    if isinstance(layer, _CONV):
        return "conv"
    if isinstance(layer, _NORM):
        return "norm"
    if isinstance(layer, L.Embedding):
        return "embedding"
    if isinstance(layer, _RECURRENT_CELLS):
        return "recurrent"
    if isinstance(layer, L.MultiHeadAttention):
        return "attention"
    return "other"


def _role(kind: str, name: str) -> str:
    role = _ROLES.get(name, "other") if kind != "other" else "other"
    if kind == "norm" and role not in ("norm_scale", "norm_shift"):
        return "other"
    return role


def _fans(layer, name: str, shape: tuple) -> tuple[int | None, int | None]:
    """Inputs per output unit (a depthwise kernel counted per channel, an EinsumDense kernel by its equation) and
    outputs per input, as Keras' own initialisers count the latter."""
    if len(shape) < 2:
        return None, None
    if isinstance(layer, L.EinsumDense):
        inputs, kernel, output = _einsum_parts(layer.equation)
        if len(kernel) == len(shape):
            dims = dict(zip(kernel, shape))
            return (math.prod(d for k, d in dims.items() if k in inputs and k not in output),
                    math.prod(d for k, d in dims.items() if k in output))
    receptive = math.prod(shape[:-2])
    fan_out = int(receptive * shape[-1])
    if name == "depthwise_kernel" or isinstance(layer, _DEPTHWISE):  # each output channel sees one input channel
        return int(receptive), fan_out
    return int(receptive * shape[-2]), fan_out


def _einsum_parts(equation: str) -> tuple[str, str, str]:
    operands, output = equation.replace(" ", "").split("->")
    inputs, kernel = operands.split(",")
    return inputs, kernel, output


def _activation(layer) -> str | None:
    name = getattr(getattr(layer, "activation", None), "__name__", None)
    return None if name in (None, "linear") else name


def _followers(container, out: dict | None = None) -> dict[int, str]:
    """{id(layer): what follows it} for every layer under `container`: its own activation where it has one (but
    linear and relu, which keep a normalisation after them free of scale), else 'norm' where every layer fed by its
    output is a normalisation, else the type of the first layer fed by it. Consumers come from the graph (Functional
    and Sequential models), else, for the layers of a subclassed model, from the order they were made in; the
    sublayers of a layer (the projections inside MultiHeadAttention) have none."""
    out = {} if out is None else out
    children = [c for c in container._flatten_layers(include_self=False, recursive=False)
                if not isinstance(c, (_PASS_THROUGH, L.InputLayer))]
    for i, layer in enumerate(children):
        activation = _activation(layer)
        consumers = _consumers(layer)
        if consumers is None and isinstance(container, keras.Model):
            consumers = children[i + 1:i + 2]
        if activation is not None and activation != "relu":
            out[id(layer)] = activation
        elif consumers:
            kinds = {layer_type(c) for c in consumers}
            out[id(layer)] = "norm" if kinds == {"norm"} else layer_type(consumers[0])
        _followers(layer, out)
    return out


def _consumers(layer, depth: int = 0) -> list | None:
    """The layers that take this layer's output in a graph, past dropout, pooling and reshaping; None where the
    layer is in no graph (a subclassed model's layer)."""
    nodes = getattr(layer, "_outbound_nodes", None)
    if not nodes or depth > 8:
        return None
    found = []
    for node in nodes:
        after = node.operation
        if isinstance(after, _PASS_THROUGH):
            found += _consumers(after, depth + 1) or []
        else:
            found.append(after)
    return found


def _in_order(model) -> list:
    """The model and every layer under it, depth first, a container before its sublayers and those in their own
    order. Keras' _flatten_layers(recursive=True) visits a nested model's sublayers last-first (a deque's
    extendleft): a Normalization first in a nested model came out last, and a nested model's last Dense first."""
    out, seen, stack = [], set(), [model]
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        out.append(layer)
        stack.extend(reversed(layer._flatten_layers(include_self=False, recursive=False)))
    return out


def _activation_inputs(model) -> dict[str, str]:
    """{path of a layer with an activation: the layer whose output it takes}: a layer with its own activation (a
    Dense with activation='relu') takes its own; an activation layer (ReLU, Activation, LeakyReLU, …) the layer
    with parameters made before it."""
    out, last = {}, None
    for layer in _in_order(model)[1:]:
        path = getattr(layer, "path", None) or layer.name
        has_parameters = bool(getattr(layer, "_trainable_variables", ()))
        if has_parameters and _activation(layer) is not None:
            out[path] = path
        elif not has_parameters and type(layer).__module__.startswith("keras.src.layers.activations") \
                and last is not None:
            out[path] = last
        if has_parameters:
            last = path
    return out


def describe(model) -> ModelInfo:
    """Every parameter of a built Keras model with its layer, type, role, shape and fans; those the fit does not
    train (a layer with trainable False, or made trainable after Keras' train function was traced:
    tf_step.trained_apart) with trainable False."""
    made, frozen = ({id(v) for v in variables} for variables in trained_apart(model))
    trainable = {id(v) for v in model.trainable_variables} - made | frozen
    followers = _followers(model)
    parameters = {}
    for layer in _in_order(model):
        kind = layer_type(layer)
        for variable in getattr(layer, "_trainable_variables", ()):
            path = variable.path
            if path in parameters:
                continue
            name = variable.name
            role = _role(kind, name)
            shape = tuple(int(d) for d in variable.shape)
            fan_in, fan_out = _fans(layer, name, shape) if role in ("kernel", "recurrent_kernel") else (None, None)
            parameters[path] = Parameter(path=path, layer=getattr(layer, "path", None) or layer.name,
                                         layer_type=kind, layer_class=type(layer).__name__, role=role, shape=shape,
                                         trainable=id(variable) in trainable, fan_in=fan_in, fan_out=fan_out,
                                         followed_by=followers.get(id(layer)))
    optimizer = getattr(model, "optimizer", None)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # under mixed precision, a LossScaleOptimizer
    return ModelInfo(model.name, parameters, _activation_inputs(model),
                     (type(optimizer).__name__,) if optimizer is not None else (), _inputs_scaled(model),
                     _running_keep(model))


def _running_keep(model) -> float | None:
    """The largest `momentum` of the BatchNormalization layers that train (a frozen one runs in inference mode and
    keeps its statistics as they are), None where there are none."""
    kept = [float(layer.momentum) for layer in _in_order(model)
            if isinstance(layer, L.BatchNormalization) and layer.trainable]
    return max(kept) if kept else None


# Layers that rescale or normalise what they are given; and layers that only move, crop or augment it, which may
# come before (keras.io's image models: augmentation, then Rescaling(1/255))
_SCALING = _NORM + _classes("Rescaling", "Normalization")
_SHAPING = _classes("InputLayer", "Reshape", "Flatten", "Permute", "Resizing", "CenterCrop", "Cropping1D",
                    "Cropping2D", "Cropping3D", "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D", "RandomFlip",
                    "RandomRotation", "RandomZoom", "RandomTranslation", "RandomCrop", "RandomContrast",
                    "RandomBrightness")


def _inputs_scaled(model) -> str:
    """The class of the first layer that does more than move its input, where it rescales or normalises it."""
    for layer in _in_order(model)[1:]:
        if isinstance(layer, (keras.Model, *_SHAPING)):
            continue
        return type(layer).__name__ if isinstance(layer, _SCALING) else ""
    return ""
