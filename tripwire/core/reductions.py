"""Reductions: the numbers a tensor is summarised by, defined once here in numpy.

Plugins on an accelerator compute the same reductions there (see
`tripwire.plugins.torch.reduce`); tests hold both to these definitions. The
computation shares its intermediate results (one sum, one dot product, one
absolute value) so that asking for many reductions costs little more than
asking for one; float32 data is reduced with float32 BLAS kernels and float64
accumulation of their partial results. `std` and `var` are the population ones
(ddof=0).

A reduction that does not apply to a tensor is absent from the result, never
NaN or 0 (`applicable`): the saturation of a ReLU layer, the mean of an empty
tensor, the dead units of a batch too small to tell. So a NaN in a stored
reduction always means a NaN in the data.
"""

from __future__ import annotations

import math

import numpy as np

from .shardfile import dtype_code

DESCRIPTIONS = {
    "min": "smallest element",
    "max": "largest element",
    "mean": "mean of the elements",
    "std": "population standard deviation (ddof=0)",
    "var": "population variance (ddof=0)",
    "sum": "sum of the elements",
    "l1": "sum of absolute values",
    "l2": "Euclidean norm",
    "abs_mean": "mean absolute value",
    "abs_min": "smallest absolute value",
    "abs_max": "largest absolute value",
    "zero_fraction": "fraction of elements exactly zero",
    "nonfinite_count": "number of NaN and ±Inf elements",
    "dead_fraction": "fraction of units never positive in the batch: a unit is an output feature (a "
                     "convolution's channel), never positive in any sample at any position that shares its weights "
                     "(axis 0 is the batch; the features are the last axis, or axis 1 of a torch convolution's "
                     "NCHW); only for batches of at least 16 samples",
    "saturated_fraction": "for tanh and sigmoid layer outputs: fraction of units saturated in at least 99% of the "
                          "batch (input beyond ±9.4999 for tanh, outside (-23, 16.99999) for sigmoid); only for "
                          "batches of at least 16 samples",
    "p5": "5th percentile (linear interpolation)",
    "p95": "95th percentile (linear interpolation)",
    "size": "number of elements",
}
SATURATION_INPUTS = {"tanh": (-9.4999, 9.4999), "sigmoid": (-23.0, 16.99999)}  # smdebug SaturatedActivation
ACTIVE_SHARE = 0.01  # a unit active in less than 1% of the samples is dead or saturated (smdebug)
# Whether a unit is ever active says little about a handful of samples: a healthy unit is off for about half
# of them, so in a batch of 4 one unit in 16 looks dead. Below this batch size the unit reductions are absent.
MIN_BATCH = 16
UNIT_REDUCTIONS = ("dead_fraction", "saturated_fraction")
EMPTY_REDUCTIONS = ("sum", "l1", "l2", "size", "nonfinite_count")  # defined for an empty tensor (sums over nothing)
REDUCTIONS = tuple(DESCRIPTIONS)
DEFAULT_REDUCTIONS = ("mean", "std", "min", "max", "l2")

_BLOCK = 1024
_ONES = np.ones(_BLOCK, dtype=np.float32)


class _Parts:
    """Intermediate results of one flat array, each computed at most once."""

    def __init__(self, x: np.ndarray, shape: tuple, kind: str, channels: int):
        self.x, self.shape, self.n, self.kind, self.channels = x, shape, x.size, kind.lower(), channels
        self._sum = self._abs = self._l1 = self._sq = self._var = self._percentiles = None

    def sum(self) -> float:
        if self._sum is None:
            self._sum = _sum(self.x)
        return self._sum

    def l1(self) -> float:
        if self._l1 is None:
            self._l1 = _sum(self.abs())
        return self._l1

    def sumsq(self) -> float:
        if self._sq is None:
            self._sq = _sum_of_squares(self.x)
        return self._sq

    def abs(self) -> np.ndarray:
        if self._abs is None:
            self._abs = np.abs(self.x)
        return self._abs

    def var(self) -> float:
        """From the sum of squares where the mean is small beside the spread (then E[x²] - mean² is as exact
        as the sum of squares itself, and costs no pass); else from the deviations, a second pass."""
        if self._var is None:
            mean, second = self.sum() / self.n, self.sumsq() / self.n
            if mean * mean <= 0.1 * second:
                self._var = max(second - mean * mean, 0.0)
            else:
                d = self.x - self.x.dtype.type(mean)
                self._var = _sum_of_squares(d) / self.n
        return self._var

    def percentiles(self) -> tuple[float, float]:
        """p5 and p95, as numpy's linear interpolation, from the two order statistics around each rank."""
        if self._percentiles is None:
            if not math.isfinite(self.sumsq()) and np.isnan(self.x).any():  # np.percentile gives NaN then
                self._percentiles = (math.nan, math.nan)
            else:
                sample = _sorted_sample(self.x)
                self._percentiles = tuple(_percentile(self.x, q, sample) for q in (0.05, 0.95))
        return self._percentiles

    def nonfinite(self) -> float:
        if math.isfinite(self.sumsq()):  # a NaN or ±Inf element makes the sum of squares NaN or Inf
            return 0.0
        return float(self.n - np.count_nonzero(np.isfinite(self.x)))

    def dead(self) -> float:
        """Over the batch and the positions: a convolution's channel (an attention block's feature) gets a
        gradient where it is positive anywhere, since its weights are shared across the positions."""
        positive = self.x.reshape(self.shape) > 0
        if positive.ndim >= 2:
            features = positive.shape[self.channels]
            positive = np.moveaxis(positive, self.channels, -1).reshape(-1, features).any(axis=0)
        return float(1.0 - np.count_nonzero(positive) / positive.size)

    def saturated(self) -> float:
        """From the outputs: an input beyond the bound gives an output beyond the bound's image."""
        kind = saturating(self.kind)
        low, high = SATURATION_INPUTS[kind]
        f = np.tanh if kind == "tanh" else (lambda v: 1.0 / (1.0 + np.exp(-v)))
        y = self.x.reshape(self.shape)
        hit = (y <= y.dtype.type(f(low))) | (y >= y.dtype.type(f(high)))
        if hit.ndim < 2:
            return float(np.mean(hit))
        share = hit.reshape(hit.shape[0], -1).mean(axis=0)
        return float(np.mean(share >= 1.0 - ACTIVE_SHARE))


def saturating(kind: str) -> str | None:
    """The saturating activation ('tanh' or 'sigmoid') a layer kind names, or None."""
    kind = kind.lower()
    return next((k for k in SATURATION_INPUTS if k in kind), None)


def rectifying(kind: str) -> bool:
    """Whether a layer kind names a ReLU (ReLU, ReLU6, a Dense layer's relu): an activation whose unit is dead when
    it is never positive. Leaky and parametric ReLUs pass negative values on, and their gradient."""
    kind = kind.lower()
    return "relu" in kind and not any(other in kind for other in ("leaky", "prelu", "rrelu"))


def applicable(names, shape, kind: str = "") -> tuple:
    """The reductions among `names` that apply to a tensor of this shape coming out of a layer of this kind.

    Absent: every reduction but sums and counts for an empty tensor; `saturated_fraction` outside tanh and sigmoid
    layers, `dead_fraction` outside ReLU layers (where the kind is known); both unit reductions for fewer than
    MIN_BATCH samples (an unknown batch size, None in a traced
    shape, is assumed large enough). Every plugin asks this before it reduces, on the host or on a device."""
    shape = tuple(shape)
    if any(d == 0 for d in shape):
        return tuple(n for n in names if n in EMPTY_REDUCTIONS)
    out = []
    for name in names:
        if name in UNIT_REDUCTIONS:
            batch = shape[0] if len(shape) >= 2 else (shape[0] if shape else 1)
            if batch is not None and batch < MIN_BATCH:
                continue
            if name == "saturated_fraction" and saturating(kind) is None:
                continue
            if name == "dead_fraction" and kind and not rectifying(kind):
                continue
        out.append(name)
    return tuple(out)


def _sum_of_squares(x: np.ndarray) -> float:
    """x·x; where float32 squares overflow (finite values past ~1.8e19, a diverging run) again in float64, so that
    only a NaN or ±Inf element makes it NaN or Inf, and numpy has no overflow to warn the training run about."""
    with np.errstate(over="ignore"):
        sq = float(np.dot(x, x))
    if sq == math.inf and x.dtype != np.float64:  # NaN: an element is NaN, float64 would not change it
        x = x.astype(np.float64)
        sq = float(np.dot(x, x))
    return sq


def _sum(x: np.ndarray) -> float:
    """The sum in float64: float32 data through a float32 BLAS kernel over blocks, their sums added in float64
    (twice as fast as numpy's float64 accumulation, as accurate for the block sizes used)."""
    if x.dtype == np.float32 and x.size >= 4 * _BLOCK:
        head = x[: x.size - x.size % _BLOCK].reshape(-1, _BLOCK)
        return float((head @ _ONES).sum(dtype=np.float64)) + float(x[head.size:].sum(dtype=np.float64))
    return float(x.sum(dtype=np.float64))


def _percentile(x: np.ndarray, q: float, sample: np.ndarray | None) -> float:
    """The q-quantile of x with numpy's linear interpolation between the order statistics around rank (n-1)q."""
    position = (x.size - 1) * q
    low = int(position)
    ranked = _order_statistics(x, low, 2 if low + 1 < x.size else 1, sample)
    a, b = ranked[0], ranked[-1]
    return a if position == low or b == a else a + (b - a) * (position - low)


_SAMPLE = 2048  # elements of the subsample that brackets a rank


def _sorted_sample(x: np.ndarray) -> np.ndarray | None:
    """About _SAMPLE elements of a large array, sorted (None for an array small enough to partition whole).
    The stride is odd, so that it walks across the columns of a matrix."""
    return np.sort(x[:: (x.size // _SAMPLE) | 1]) if x.size > 4 * _SAMPLE else None


def _order_statistics(x: np.ndarray, k: int, count: int, sample: np.ndarray | None) -> list[float]:
    """The elements of ranks k .. k+count-1 of x (0-based, ascending), exactly as a full partition gives them.

    Partitioning a large array is slow (about a millisecond for 65,536 floats), so a sorted subsample of it
    (`_sorted_sample`) gives bounds that hold the ranks with near certainty, and only the elements between
    them are partitioned. The bounds are checked by counting: where they miss the ranks (data ordered
    against the subsample's stride), the whole array is partitioned instead."""
    n = x.size
    if sample is not None:
        m, share = sample.size, k / (n - 1)
        centre, spread = share * (m - 1), 4 * math.sqrt(m * share * (1 - share)) + 4
        lo = sample[int(centre - spread)] if centre - spread >= 0 else -np.inf
        hi = sample[int(centre + spread) + 1] if centre + spread + 1 < m else np.inf
        below = int(np.count_nonzero(x < lo))
        inside = x[(x >= lo) & (x <= hi)]
        if below <= k and k + count <= below + inside.size:
            x, k = inside, k - below
    ranks = list(range(k, k + count))
    return [float(v) for v in np.partition(x, ranks)[ranks]]


_COMPUTE = {
    "min": lambda p: float(p.x.min()),
    "max": lambda p: float(p.x.max()),
    "mean": lambda p: p.sum() / p.n,
    "std": lambda p: math.sqrt(p.var()) if math.isfinite(p.var()) else p.var(),
    "var": lambda p: p.var(),
    "sum": lambda p: p.sum(),
    "l1": lambda p: p.l1(),
    "l2": lambda p: math.sqrt(p.sumsq()) if math.isfinite(p.sumsq()) else p.sumsq(),
    "abs_mean": lambda p: p.l1() / p.n,
    "abs_min": lambda p: float(p.abs().min()),
    "abs_max": lambda p: float(p.abs().max()),
    "zero_fraction": lambda p: float(np.count_nonzero(p.x == 0)) / p.n,
    "nonfinite_count": lambda p: p.nonfinite(),
    "dead_fraction": lambda p: p.dead(),
    "saturated_fraction": lambda p: p.saturated(),
    "p5": lambda p: p.percentiles()[0],
    "p95": lambda p: p.percentiles()[1],
    "size": lambda p: float(p.n),
}


def plain_array(value) -> np.ndarray:
    """An array's values as numbers tripwire reduces and stores: real float32/float64, integers and booleans as
    they are; complex as its magnitude; bfloat16, float8 and other number types as float32. TypeError for what
    holds no numbers (strings, objects)."""
    x = np.asarray(value)
    if x.dtype.kind == "c":
        return np.abs(x)
    if x.dtype.kind in "OSUa":
        raise TypeError(f"it holds {x.dtype} values, not numbers")
    if dtype_code(x) is not None:
        return x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("="))
    return x.astype(np.float32)  # ml_dtypes' bfloat16 and float8_* (numpy kind 'V'), longdouble


# What a sharded tensor's reductions need of each shard to be combined exactly (FSDP: each rank holds a part of
# every parameter); percentiles and the unit reductions have no such form, so a sharded tensor has none of them.
SHARD_NEEDS = {"mean": ("size",), "var": ("size", "mean"), "std": ("size", "mean", "var"), "abs_mean": ("size",),
               "zero_fraction": ("size",)}
UNSHARDABLE = ("p5", "p95", "dead_fraction", "saturated_fraction")


def shard_reductions(names) -> tuple:
    """The reductions to take of each shard for the named reductions of the whole tensor."""
    wanted = [n for n in names if n not in UNSHARDABLE]
    return tuple(dict.fromkeys([*wanted, *(need for n in wanted for need in SHARD_NEEDS.get(n, ())), "size"]))


def combine_shards(shards: list, names) -> dict[str, float]:
    """The named reductions of a tensor from those of its disjoint shards (each reduced with `shard_reductions`):
    sums add, norms add in squares, extremes take the extreme, means and fractions weigh by size, the variance
    comes from each shard's mean and variance. A shard of no elements counts in the sums only."""
    held = [s for s in shards if s.get("size")]
    n = sum(s["size"] for s in held)
    out: dict = {"size": float(n), "sum": sum(s.get("sum", 0.0) for s in shards),
                 "l1": sum(s.get("l1", 0.0) for s in shards),
                 "nonfinite_count": sum(s.get("nonfinite_count", 0.0) for s in shards),
                 "l2": math.sqrt(sum(s.get("l2", 0.0) ** 2 for s in shards))}
    if held:
        out.update({"min": min(s.get("min", math.inf) for s in held), "max": max(s.get("max", -math.inf) for s in held),
                    "abs_min": min(s.get("abs_min", math.inf) for s in held),
                    "abs_max": max(s.get("abs_max", -math.inf) for s in held)})
        for key in ("mean", "abs_mean", "zero_fraction"):
            if all(key in s for s in held):
                out[key] = sum(s[key] * s["size"] for s in held) / n
        if all("mean" in s and "var" in s for s in held):
            out["var"] = max(sum(s["size"] * (s["var"] + s["mean"] ** 2) for s in held) / n - out["mean"] ** 2, 0.0)
            out["std"] = math.sqrt(out["var"])
    return {k: float(v) for k, v in out.items() if k in names}


def reduce(array, names, kind: str = "", channels: int = -1) -> dict[str, float]:
    """The named reductions of one array that apply to it (`applicable`), as floats.

    kind: the layer type the array comes out of (e.g. 'Tanh'), for reductions that depend on it; channels: the
    axis of its output features (dead_fraction's units: -1, or 1 for torch's NCHW convolutions)."""
    x = np.asarray(array)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    names = applicable(names, x.shape, kind)
    if x.size == 0:
        return {n: 0.0 for n in names}
    parts = _Parts(np.ascontiguousarray(x).reshape(-1), x.shape, kind, channels)
    if math.isfinite(parts.sumsq()):  # no NaN or ±Inf, and no sum can overflow: numpy has nothing to warn about
        return {n: _COMPUTE[n](parts) for n in names}
    with np.errstate(all="ignore"):  # entering it costs more than most reductions of a small tensor
        return {n: _COMPUTE[n](parts) for n in names}
