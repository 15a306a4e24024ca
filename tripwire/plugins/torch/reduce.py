"""Reductions of torch tensors, where the tensors live.

CPU tensors are reduced by tripwire.core.reductions through a zero-copy
numpy view. Tensors on an accelerator are reduced there with torch ops
following the same definitions; the results stay on the device until the
step's single transfer to the host (`Reductions.to_host`).

Every kind of tensor a framework hands over is taken in a form that applies
(`plain`): a quantized tensor dequantized, float8 and integers as float32, a
complex one as its magnitudes, a nested one as its components end to end, a
DTensor as this rank's shard; a sparse tensor by its stored values, for the
reductions that do not depend on the zeros it leaves out (its norm, its
largest value, its count of zeros). A tensor without data (on the meta
device) cannot be reduced: `Unsupported` says why, and the caller skips it.
"""

from __future__ import annotations

import numpy as np
import torch

from tripwire.core.reductions import ACTIVE_SHARE, SATURATION_INPUTS, applicable, saturating
from tripwire.core.reductions import reduce as reduce_numpy

_FLOAT_HOST = (torch.float32, torch.float64)
# What a sparse tensor's stored values give as they would be over the dense tensor (its zeros add nothing).
SPARSE_REDUCTIONS = ("sum", "l1", "l2", "abs_max", "nonfinite_count")


class Unsupported(TypeError):
    """A tensor tripwire cannot read (no data on the meta device, a layout it does not know): skipped, said once."""


def plain(t: torch.Tensor, dense: bool = False) -> torch.Tensor:
    """The tensor as a dense, real, strided one of float32 or float64 (integers, float8 and the like as float32),
    detached. A sparse tensor is made dense only where `dense` asks (its full values were asked for): its
    reductions are taken from its values (`Reductions.add`)."""
    t = t.detach()
    if dense and t.layout != torch.strided and t.layout != torch.jagged:
        t = t.to_dense()
    if getattr(t, "is_meta", False) or t.device.type == "meta":
        raise Unsupported("it is on the meta device: it has no values")
    t = local_shard(t)
    if t.is_nested:
        t = torch.cat([part.reshape(-1) for part in t.unbind()])
    if t.is_quantized:
        t = t.dequantize()
    if t.layout != torch.strided:
        raise Unsupported(f"its layout {t.layout} is not one tripwire reads")
    if t.is_complex():
        t = t.abs()
    return t if t.dtype in _FLOAT_HOST else t.float()


def local_shard(t):
    """This rank's shard of a DTensor (torch.distributed.tensor: FSDP's parameters and gradients), without a
    collective; other tensors, and None, as they are."""
    return t.to_local() if type(t).__name__ == "DTensor" else t


def _is_plain(t: torch.Tensor) -> bool:
    """Whether a tensor is already what `plain` makes: the common case, checked in a few attribute reads."""
    return (t.dtype in _FLOAT_HOST and t.layout == torch.strided and not t.is_quantized and not t.is_nested
            and t.device.type != "meta" and type(t) in (torch.Tensor, torch.nn.Parameter))


def host_array(t: torch.Tensor, copy: bool = True) -> np.ndarray:
    """A numpy array of a tensor's values (a copy by default: parameters change in place)."""
    t = t.detach()
    if not (t.is_cpu and _is_plain(t)):
        t = plain(t, dense=True)  # the common case asks nothing more
        if not t.is_cpu:
            return t.cpu().numpy()
    return t.numpy().copy() if copy else t.numpy()


def _on_device(t: torch.Tensor, names, kind: str = "", channels: int = -1) -> torch.Tensor:
    """The named reductions, which must apply to the tensor (`applicable`), as one tensor on its device."""
    x = t.detach()
    shape = x.shape
    x = x.reshape(-1)
    if x.dtype not in _FLOAT_HOST:
        x = x.float()
    n = max(x.numel(), 1)
    out, memo = [], {}

    def var_mean():
        if "vm" not in memo:
            memo["vm"] = torch.var_mean(x, correction=0)
        return memo["vm"]

    def abs_max():
        if "am" not in memo:
            memo["am"] = x.abs().max()
        return memo["am"]

    for name in names:
        if name == "mean":
            out.append(var_mean()[1])
        elif name in ("var", "std"):
            var = var_mean()[0]
            out.append(var if name == "var" else var.sqrt())
        elif name == "sum":
            out.append(x.sum())
        elif name in ("min", "max"):
            if "mm" not in memo:
                memo["mm"] = torch.aminmax(x)
            out.append(memo["mm"][0] if name == "min" else memo["mm"][1])
        elif name == "l1":
            out.append(torch.linalg.vector_norm(x, 1))
        elif name == "l2":
            out.append(_l2(x, abs_max()) if x.numel() else torch.linalg.vector_norm(x, 2))
        elif name == "abs_mean":
            out.append(torch.linalg.vector_norm(x, 1) / n)
        elif name == "abs_min":
            out.append(x.abs().min())
        elif name == "abs_max":
            out.append(abs_max())
        elif name == "zero_fraction":
            out.append((x == 0).sum() / n)
        elif name == "nonfinite_count":
            out.append(n - torch.isfinite(x).sum())
        elif name == "dead_fraction":  # units: output features, over the batch and positions (core.reductions)
            positive = x.reshape(shape) > 0
            if positive.dim() >= 2:
                positive = positive.movedim(channels, -1).reshape(-1, shape[channels]).any(dim=0)
            out.append(1 - positive.sum() / max(positive.numel(), 1))
        elif name == "saturated_fraction":
            out.append(_saturated(x.reshape(shape), kind))
        elif name == "size":
            out.append(torch.tensor(float(x.numel()), device=x.device))
        elif name in ("p5", "p95"):
            out.append(_percentile(x, 5 if name == "p5" else 95))
        else:
            raise ValueError(f"unknown reduction {name!r}")
    return torch.stack([o.to(torch.float64 if x.dtype == torch.float64 else torch.float32) for o in out])


def _l2(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The norm of x scaled by its largest absolute value: float32 squares overflow past ~1.8e19 (a diverging
    run), and float64, which would avoid it, costs more and some accelerators have none."""
    scale = torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale))
    return torch.linalg.vector_norm(x / scale, 2) * scale


def _saturated(y: torch.Tensor, kind: str) -> torch.Tensor:
    kind = saturating(kind)
    f = torch.tanh if kind == "tanh" else torch.sigmoid
    low, high = (f(torch.tensor(v, dtype=y.dtype, device=y.device)) for v in SATURATION_INPUTS[kind])
    hit = ((y <= low) | (y >= high)).float()
    if hit.dim() < 2:
        return hit.mean()
    return (hit.reshape(hit.shape[0], -1).mean(dim=0) >= 1.0 - ACTIVE_SHARE).float().mean()


def _percentile(x: torch.Tensor, q: float) -> torch.Tensor:
    """numpy's linear-interpolation percentile, with kthvalue (torch.quantile refuses large tensors)."""
    position = (x.numel() - 1) * q / 100
    low, frac = int(position), position - int(position)
    a = torch.kthvalue(x, low + 1).values
    if frac == 0:
        return a
    return a + (torch.kthvalue(x, low + 2).values - a) * frac


class Reductions:
    """Reductions gathered over a step: host results at once for CPU tensors, device results kept until the end."""

    def __init__(self):
        self.values: dict[str, dict[str, float]] = {}
        self._device: list[tuple[str, tuple, torch.Tensor]] = []

    def add(self, name: str, tensor: torch.Tensor, names: tuple, kind: str = "", channels: int = -1) -> None:
        """Reduce one tensor (raises Unsupported for one that cannot be read); `channels`: the axis of its output
        features (tripwire.core.reductions.reduce)."""
        if tensor.layout in (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                             torch.sparse_bsc):
            self._add_sparse(name, tensor.detach(), names)
            return
        if not _is_plain(tensor):
            tensor = plain(tensor)
        names = names if names == ("value",) else applicable(names, tensor.shape, kind)
        if not names:
            return
        if tensor.is_cpu:
            if tensor.numel() == 1 and names == ("value",):
                self.values[name] = {"value": float(tensor.detach())}
            else:
                self.values[name] = reduce_numpy(host_array(tensor, copy=False), names, kind, channels)
        elif names == ("value",):
            self._device.append((name, names, tensor.detach().reshape(-1)[:1].float()))
        else:
            self._device.append((name, names, _on_device(tensor, names, kind, channels)))

    def _add_sparse(self, name: str, tensor: torch.Tensor, names: tuple) -> None:
        """A sparse tensor (an embedding's sparse gradient): the reductions its stored values give as the dense
        tensor would, and its share of zeros; the others do not apply to it."""
        values = plain(tensor.coalesce().values() if tensor.layout == torch.sparse_coo else tensor.values())
        reduced = reduce_numpy(host_array(values), [n for n in names if n in SPARSE_REDUCTIONS])
        dense = tensor.numel()
        if "zero_fraction" in names and dense:
            reduced["zero_fraction"] = 1.0 - int(torch.count_nonzero(values)) / dense
        if "size" in names:
            reduced["size"] = float(dense)
        self.values[name] = reduced

    def add_scalar(self, name: str, value) -> None:
        """One number: a Python number, a one-element tensor, or the mean of a tensor of several (a loss per
        sample, taken with reduction 'none', is the batch's loss)."""
        if isinstance(value, torch.Tensor):  # of any kind: a nested, sparse or quantized loss per sample too
            value = value.detach() if _is_plain(value) else plain(value, dense=True)
            self.add(name, value if value.numel() == 1 else value.float().mean(), ("value",))
        else:  # a number, or numbers (a numpy loss per sample): their mean
            array = np.asarray(value)
            if array.dtype.kind not in "fiub" or array.size == 0:
                raise TypeError(f"{value!r:.40} is not a number")
            self.values[name] = {"value": float(array.astype(np.float64).mean())}

    def forget(self, which) -> None:
        """Drop what was added under the names `which(name)` is true for."""
        self._device = [item for item in self._device if not which(item[0])]
        self.values = {name: v for name, v in self.values.items() if not which(name)}

    def to_host(self) -> dict[str, dict[str, float]]:
        """All results as {name: {reduction: float}}, with one device-to-host transfer for the device ones."""
        by_device: dict = {}
        for item in self._device:
            by_device.setdefault(item[2].device, []).append(item)
        for items in by_device.values():
            flat = torch.cat([r.double() for _, _, r in items]).cpu().tolist()
            i = 0
            for name, names, _ in items:
                self.values[name] = dict(zip(names, flat[i:i + len(names)]))
                i += len(names)
        self._device = []
        return self.values

