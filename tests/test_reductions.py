"""Reductions: core numpy definitions, and the torch device path held to them."""

import warnings

import numpy as np
import pytest
import torch

from tripwire.core.reductions import MIN_BATCH, REDUCTIONS, applicable, reduce
from tripwire.plugins.torch import reduce as torch_reduce

REFERENCE = {
    "min": np.min, "max": np.max, "mean": np.mean, "std": np.std, "var": np.var, "sum": np.sum,
    "l1": lambda x: np.abs(x).sum(), "l2": lambda x: np.sqrt((x * x).sum()),
    "abs_mean": lambda x: np.abs(x).mean(), "abs_min": lambda x: np.abs(x).min(),
    "abs_max": lambda x: np.abs(x).max(), "zero_fraction": lambda x: (x == 0).mean(),
    "nonfinite_count": lambda x: (~np.isfinite(x)).sum(),
    "dead_fraction": lambda x: (~(x > 0).reshape(-1, x.shape[-1]).any(axis=0)).mean(),
    "p5": lambda x: np.percentile(x, 5), "p95": lambda x: np.percentile(x, 95), "size": np.size,
}
KIND_FREE = [r for r in REDUCTIONS if r != "saturated_fraction"]


def arrays():
    rng = np.random.default_rng(0)
    relu = np.maximum(rng.normal(size=(64, 300)), 0).astype(np.float32)
    relu[:, :120] = 0  # 40% dead units
    return {
        "normal_f32": rng.normal(size=(256, 256)).astype(np.float32),
        "offset_f64": rng.normal(loc=1000.0, scale=0.01, size=5000),
        "relu": relu,
        "small": np.array([[0.0, -2.0, 3.0]], dtype=np.float32),
        "ints": rng.integers(0, 10, size=(50, 3)),
        "conv": rng.normal(size=(8, 4, 5, 5)).astype(np.float32),
    }


@pytest.mark.parametrize("case", list(arrays()))
def test_numpy_reductions_match_definitions(case):
    x = arrays()[case]
    got = reduce(x, KIND_FREE)
    ref = x.astype(np.float64)
    assert list(got) == list(applicable(KIND_FREE, x.shape))  # dead units only where the batch can tell
    for name in got:
        assert got[name] == pytest.approx(float(REFERENCE[name](ref)), rel=1e-5, abs=1e-6 * float(np.abs(ref).max() + 1),
                                          nan_ok=True), name


def test_dead_fraction_counts_units_not_elements():
    assert reduce(arrays()["relu"], ["dead_fraction"])["dead_fraction"] == pytest.approx(0.4)


def test_a_dead_unit_is_a_channel_dead_at_every_position():
    """A convolution's channel shares its weights across positions: it gets a gradient wherever it is positive.
    Here every channel of a ReLU'd NCHW output is positive at one position of one sample only (image borders and
    backgrounds are constant: most positions are never positive), and 2 of 8 channels nowhere."""
    x = np.zeros((32, 8, 6, 6), np.float32)
    for channel in range(6):
        x[channel, channel, channel % 6, 3] = 1.0
    assert reduce(x, ["dead_fraction"], "ReLU", channels=1)["dead_fraction"] == pytest.approx(2 / 8)
    on_device = torch_reduce._on_device(torch.from_numpy(x), ("dead_fraction",), "ReLU", channels=1)
    assert float(on_device[0]) == pytest.approx(2 / 8)
    # the same features last (Keras' NHWC, a sequence's N, T, D)
    assert reduce(np.moveaxis(x, 1, -1), ["dead_fraction"], "ReLU")["dead_fraction"] == pytest.approx(2 / 8)


@pytest.mark.parametrize("kind", ["Tanh", "Sigmoid", "Linear"])
def test_saturated_fraction_from_layer_outputs(kind):
    rng = np.random.default_rng(1)
    pre = rng.normal(size=(200, 50))
    pre[:, :30] = 40.0  # 60% of the units far beyond any saturation bound
    pre[:1, 30:40] = 40.0  # saturated in only 1 sample of 200: not saturated
    f = {"Tanh": np.tanh, "Sigmoid": lambda v: 1 / (1 + np.exp(-v)), "Linear": lambda v: v}[kind]
    y = f(pre).astype(np.float32)
    got = reduce(y, ["saturated_fraction"], kind)
    if kind == "Linear":  # not a saturating layer: the reduction is absent, not NaN
        assert got == {} and applicable(["saturated_fraction"], y.shape, kind) == ()
    else:
        device = torch_reduce._on_device(torch.from_numpy(y), ["saturated_fraction"], kind).item()
        assert got["saturated_fraction"] == pytest.approx(0.6) and device == pytest.approx(0.6)


def test_a_reduction_that_does_not_apply_is_absent_never_nan():
    """BatchNorm scales are 1-D, a batch of 4 cannot tell a dead unit from a quiet one, a tanh or leaky ReLU unit
    is not dead when it is never positive, an empty tensor has no mean: those reductions are left out, so a NaN in a stored reduction always means a NaN in the data."""
    small_batch = np.maximum(np.random.default_rng(0).normal(size=(MIN_BATCH - 1, 8)), 0).astype(np.float32)
    assert "dead_fraction" not in reduce(small_batch, ["dead_fraction", "mean"], "ReLU")
    assert "dead_fraction" in reduce(np.vstack([small_batch, small_batch]), ["dead_fraction"], "ReLU")
    assert "dead_fraction" not in reduce(np.vstack([small_batch, small_batch]), ["dead_fraction"], "Tanh")
    assert "dead_fraction" not in reduce(np.vstack([small_batch, small_batch]), ["dead_fraction"], "LeakyReLU")
    norm_scale = np.ones(64, dtype=np.float32)
    assert set(reduce(norm_scale, REDUCTIONS, "BatchNorm1d")) == set(REDUCTIONS) - {"saturated_fraction",
                                                                                    "dead_fraction"}
    for values in reduce(norm_scale, REDUCTIONS, "BatchNorm1d").values():
        assert np.isfinite(values)


@pytest.mark.parametrize("loc", [0.0, 3e19])  # the variance from the sum of squares, or from the deviations
def test_finite_values_whose_squares_overflow_float32(loc):
    # a diverging run: every value finite, the float32 sum of squares not (l2, var and nonfinite_count read it)
    x = np.random.default_rng(2).normal(loc=loc, scale=1e19, size=(64, 64)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing for the training run's log either
        got = reduce(x, KIND_FREE)
    ref = x.astype(np.float64)
    for name in got:
        assert got[name] == pytest.approx(float(REFERENCE[name](ref)), rel=1e-5, nan_ok=True), name
    # the accelerator path, run here on CPU: l2 too (var, ~1e38 and more, is past what its float32 results hold)
    names = applicable(KIND_FREE, x.shape)
    device = dict(zip(names, torch_reduce._on_device(torch.from_numpy(x), names).tolist()))
    assert device["l2"] == pytest.approx(float(np.linalg.norm(ref)), rel=1e-5)


def test_nonfinite_and_empty():
    x = np.ones((10, 10), dtype=np.float32)
    x[0, 0], x[1, 1], x[2, 2] = np.nan, np.inf, -np.inf
    assert reduce(x, ["nonfinite_count"])["nonfinite_count"] == 3
    out = reduce(np.zeros((0, 3)), ["mean", "nonfinite_count", "size", "l2"])
    assert out == {"nonfinite_count": 0, "size": 0, "l2": 0}  # an empty tensor has no mean


@pytest.mark.parametrize("case", list(arrays()))
def test_torch_device_path_matches_numpy(case):
    """The accelerator code path, run here on CPU tensors, against the numpy definitions."""
    x = arrays()[case]
    names = applicable(KIND_FREE, x.shape)
    device_values = torch_reduce._on_device(torch.from_numpy(np.ascontiguousarray(x)), names).tolist()
    ref = reduce(x, KIND_FREE)
    for name, value in zip(names, device_values):
        assert value == pytest.approx(ref[name], rel=1e-4, abs=1e-5 * float(np.abs(x).max() + 1), nan_ok=True), name


def test_reductions_collect_scalars_and_tensors_in_one_transfer():
    r = torch_reduce.Reductions()
    r.add("weights/w", torch.arange(6.0).reshape(2, 3), ("mean", "max"))
    r.add_scalar("losses/train", torch.tensor(0.5))
    r.add_scalar("optimizer/lr", 0.1)
    assert r.to_host() == {"weights/w": {"mean": 2.5, "max": 5.0}, "losses/train": {"value": 0.5},
                           "optimizer/lr": {"value": 0.1}}


def _against_the_stride(n: int = 65536) -> np.ndarray:
    """Large values exactly where the percentile bracket's subsample looks: its bounds miss every rank."""
    x = np.random.default_rng(3).normal(size=n).astype(np.float32)
    x[:: (n // 2048) | 1] = 1e6
    return x


@pytest.mark.parametrize("x", [
    np.random.default_rng(4).normal(size=(256, 256)).astype(np.float32) * np.linspace(0, 9, 256, dtype=np.float32),
    np.sort(np.random.default_rng(5).normal(size=70000))[::-1],
    np.random.default_rng(6).integers(0, 3, size=40000).astype(np.float32),
    _against_the_stride(),
], ids=["scaled columns", "sorted descending", "three values", "against the subsample"])
def test_percentiles_of_large_arrays_are_exact(x):
    """p5/p95 of large arrays partition only a bracket around each rank; whatever the data's order, the result
    is numpy's (where the bracket misses, the whole array is partitioned); only the interpolation's rounding
    differs, as it is done in float64."""
    got = reduce(x, ["p5", "p95"])
    assert got == {"p5": pytest.approx(float(np.percentile(x, 5)), rel=1e-6),
                   "p95": pytest.approx(float(np.percentile(x, 95)), rel=1e-6)}


def test_the_reductions_of_shards_combine_into_the_whole_tensors():
    """FSDP holds a parameter as one shard per rank (a rank may hold none): the whole tensor's reductions come
    exactly from each shard's, percentiles and unit reductions aside (they have no such form)."""
    from tripwire.core.reductions import REDUCTIONS, combine_shards, reduce, shard_reductions

    x = np.random.default_rng(1).normal(loc=0.3, size=(33, 7)).astype("float32")
    x[3, 2] = 0.0
    shards = [reduce(part, shard_reductions(REDUCTIONS)) for part in (x[:10], x[10:30], x[30:], x[:0])]
    combined, whole = combine_shards(shards, REDUCTIONS), reduce(x, REDUCTIONS)
    assert set(whole) - set(combined) == {"p5", "p95", "dead_fraction"}
    assert combined == pytest.approx({k: whole[k] for k in combined}, rel=1e-5, abs=1e-7)
    assert set(combine_shards(shards, ("l2", "std"))) == {"l2", "std"}  # what was asked for, no more
