"""Reductions of Keras tensors where they live, for tensors that are not on the CPU.

On the CPU, tripwire.core.reductions (numpy) reduces what the train step
hands out, so the numbers are the same as in every other plugin. On an
accelerator, copying whole gradients and activations to the host at every
sampled step would cost more than the step, so the step reduces them in
place with `reduce_ops` (keras.ops, following the core definitions) and only
the small vector of results leaves the device. Tests hold `reduce_ops` to
the numpy definitions; a reduction it does not know yet is computed on the
host instead (see `capture.StepCapture.emit`).
"""

from __future__ import annotations

import math

import keras
import numpy as np
from keras import ops

from tripwire.core.reductions import ACTIVE_SHARE, SATURATION_INPUTS, saturating


def reduce_ops(x, names, kind: str = "", channels: int = -1):
    """The named reductions of one tensor as a 1-D float tensor, in the order of `names`, which must apply to it
    (tripwire.core.reductions.applicable).

    kind, channels: as for tripwire.core.reductions.reduce (the layer type, the axis of its output features)."""
    x = ops.convert_to_tensor(x)
    shape = tuple(x.shape)
    if keras.backend.standardize_dtype(x.dtype) != "float64":
        x = ops.cast(x, "float32")
    flat = ops.reshape(x, (-1,))
    memo: dict = {}

    def once(key, compute):
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    mean = lambda: once("mean", lambda: ops.mean(flat))  # noqa: E731
    var = lambda: once("var", lambda: ops.mean(ops.square(flat - mean())))  # noqa: E731
    absolute = lambda: once("abs", lambda: ops.abs(flat))  # noqa: E731
    abs_max = lambda: once("abs_max", lambda: ops.max(absolute()))  # noqa: E731
    percentiles = lambda: once("p", lambda: ops.quantile(flat, [0.05, 0.95]))  # noqa: E731
    out = []
    for name in names:
        if name not in COMPUTE:
            raise ValueError(f"unknown reduction {name!r}")
        out.append(ops.cast(COMPUTE[name](x=x, flat=flat, shape=shape, kind=kind, channels=channels, mean=mean,
                                          var=var, absolute=absolute, abs_max=abs_max, percentiles=percentiles),
                            flat.dtype))
    return ops.stack(out)


def _l2(flat, abs_max):
    """The norm of x scaled by its largest absolute value: float32 squares overflow past ~1.8e19 (a diverging
    run), and float64, which would avoid it, JAX does not compute by default."""
    if flat.shape[0] == 0:
        return ops.sqrt(ops.sum(ops.square(flat)))
    scale = abs_max()
    scale = ops.where(ops.logical_and(ops.isfinite(scale), ops.greater(scale, 0)), scale, ops.ones_like(scale))
    return ops.sqrt(ops.sum(ops.square(flat / scale))) * scale


def _saturated(x, shape, kind):
    """Fraction of units (elements of one sample) beyond the saturation bounds in at least 99% of the batch."""
    kind = saturating(kind)
    f = np.tanh if kind == "tanh" else (lambda v: 1.0 / (1.0 + np.exp(-v)))
    dtype = keras.backend.standardize_dtype(x.dtype)
    low, high = (float(np.array(f(v)).astype(dtype)) for v in SATURATION_INPUTS[kind])
    hit = ops.cast(ops.logical_or(ops.less_equal(x, low), ops.greater_equal(x, high)), x.dtype)
    if len(shape) < 2:
        return ops.mean(hit)
    share = ops.mean(ops.reshape(hit, (-1, _units(shape))), axis=0)
    return ops.mean(ops.cast(ops.greater_equal(share, 1.0 - ACTIVE_SHARE), x.dtype))


def _dead(x, shape, channels: int = -1):
    """Fraction of units never positive in the batch: a unit is an output feature (a convolution's channel, a
    sequence's feature: last in Keras, at axis `channels` for channels-first layers), over the samples and every
    position that shares its weights."""
    positive = ops.greater(x, 0)
    if len(shape) >= 2:
        if channels != -1 and len(shape) > 2:
            positive, shape = ops.moveaxis(positive, channels, -1), (*shape[:channels], *shape[channels + 1:],
                                                                      shape[channels])
        features = shape[-1] if shape[-1] is not None else ops.shape(positive)[-1]
        positive = ops.any(ops.reshape(positive, (-1, features)), axis=0)
    return 1 - ops.mean(ops.cast(positive, x.dtype))


def _units(shape) -> int:
    return math.prod(shape[1:]) if None not in shape[1:] else -1


COMPUTE = {
    "mean": lambda mean, **_: mean(),
    "var": lambda var, **_: var(),
    "std": lambda var, **_: ops.sqrt(var()),
    "sum": lambda flat, **_: ops.sum(flat),
    "min": lambda flat, **_: ops.min(flat),
    "max": lambda flat, **_: ops.max(flat),
    "l1": lambda absolute, **_: ops.sum(absolute()),
    "l2": lambda flat, abs_max, **_: _l2(flat, abs_max),
    "abs_mean": lambda absolute, **_: ops.mean(absolute()),
    "abs_min": lambda absolute, **_: ops.min(absolute()),
    "abs_max": lambda abs_max, **_: abs_max(),
    "zero_fraction": lambda flat, **_: ops.mean(ops.cast(ops.equal(flat, 0), flat.dtype)),
    "nonfinite_count": lambda flat, **_: ops.sum(ops.cast(ops.logical_not(ops.isfinite(flat)), flat.dtype)),
    "dead_fraction": lambda x, shape, channels, **_: _dead(x, shape, channels),
    "saturated_fraction": lambda x, shape, kind, **_: _saturated(x, shape, kind),
    "p5": lambda percentiles, **_: percentiles()[0],
    "p95": lambda percentiles, **_: percentiles()[1],
    "size": lambda flat, **_: ops.size(flat),
}
