"""Reductions: the numbers a tensor is summarised by, defined once here in numpy.

Plugins on an accelerator compute the same reductions there (see
`tripwire.plugins.torch.reduce`); tests hold both to these definitions. The
computation shares its intermediate results (one sum, one dot product, one
absolute value) so that asking for many reductions costs little more than
asking for one; float32 data is reduced with float32 BLAS kernels and float64
accumulation of their partial results. `std` and `var` are the population ones
(ddof=0).
"""

from __future__ import annotations

import math

import numpy as np

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
    "dead_fraction": "fraction of units (the elements of one sample; axis 0 is the batch) never positive in it",
}
REDUCTIONS = tuple(DESCRIPTIONS)
DEFAULT_REDUCTIONS = ("mean", "std", "min", "max", "l2")

_BLOCK = 1024
_ONES = np.ones(_BLOCK, dtype=np.float32)


class _Parts:
    """Intermediate results of one flat array, each computed at most once."""

    def __init__(self, x: np.ndarray, shape: tuple):
        self.x, self.shape, self.n = x, shape, x.size
        self._sum = self._abs = self._sq = None

    def sum(self) -> float:
        if self._sum is None:
            x = self.x
            if x.dtype == np.float32 and x.size >= 4 * _BLOCK:
                head = x[: x.size - x.size % _BLOCK].reshape(-1, _BLOCK)
                self._sum = float((head @ _ONES).sum(dtype=np.float64)) + float(
                    x[head.size:].sum(dtype=np.float64))
            else:
                self._sum = float(x.sum(dtype=np.float64))
        return self._sum

    def sumsq(self) -> float:
        if self._sq is None:
            self._sq = float(np.dot(self.x, self.x))
        return self._sq

    def abs(self) -> np.ndarray:
        if self._abs is None:
            self._abs = np.abs(self.x)
        return self._abs

    def var(self) -> float:
        d = self.x - self.x.dtype.type(self.sum() / self.n)
        return float(np.dot(d, d)) / self.n

    def nonfinite(self) -> float:
        if math.isfinite(self.sum()) and math.isfinite(self.sumsq()):
            return 0.0
        return float(self.n - np.count_nonzero(np.isfinite(self.x)))

    def dead(self) -> float:
        positive = self.x.reshape(self.shape) > 0
        if positive.ndim >= 2:
            positive = positive.reshape(positive.shape[0], -1).any(axis=0)
        return float(1.0 - np.count_nonzero(positive) / positive.size)


_COMPUTE = {
    "min": lambda p: float(p.x.min()),
    "max": lambda p: float(p.x.max()),
    "mean": lambda p: p.sum() / p.n,
    "std": lambda p: math.sqrt(p.var()) if math.isfinite(p.var()) else p.var(),
    "var": lambda p: p.var(),
    "sum": lambda p: p.sum(),
    "l1": lambda p: float(p.abs().sum(dtype=np.float64)),
    "l2": lambda p: math.sqrt(p.sumsq()) if math.isfinite(p.sumsq()) else p.sumsq(),
    "abs_mean": lambda p: float(p.abs().sum(dtype=np.float64)) / p.n,
    "abs_min": lambda p: float(p.abs().min()),
    "abs_max": lambda p: float(p.abs().max()),
    "zero_fraction": lambda p: float(np.count_nonzero(p.x == 0)) / p.n,
    "nonfinite_count": lambda p: p.nonfinite(),
    "dead_fraction": lambda p: p.dead(),
}


def reduce(array, names) -> dict[str, float]:
    """Every named reduction of one array, as floats. Empty arrays give NaN (and 0 for counts)."""
    x = np.asarray(array)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    if x.size == 0:
        return {n: (0.0 if n == "nonfinite_count" else float("nan")) for n in names}
    parts = _Parts(np.ascontiguousarray(x).reshape(-1), x.shape)
    with np.errstate(all="ignore"):
        return {n: _COMPUTE[n](parts) for n in names}
