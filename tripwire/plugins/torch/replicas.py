"""Replicas under DDP hold the same parameters (tripwire.core.rules.relations judges `replicas_differ`).

DistributedDataParallel broadcasts rank 0's parameters when it wraps the model and averages the gradients of every
backward pass through the wrapper, so after each optimizer step every rank holds exactly the same parameters.
Silent bugs break this while every rank looks healthy: the training forward called on the inner module
(`model.module(x)`), which no all-reduce follows, so each rank trains on its own data and drifts; replicas that
differ from the start (a rank-dependent seed where DDP's broadcast is skipped, `init_sync=False`; a checkpoint
loaded on one rank after wrapping); parameters changed on one rank only.

At a step where the `relations` collection is sampled (no other), after the optimizer step, every rank takes a
checksum of the parameters its optimizers hold, and one all_gather of four numbers compares it with rank 0's. The
checksum adds the parameters' bits as 16-bit integers: integer addition gives the same sum in any order, where a
float sum depends on how the reduction is split (on CPU, on the number of threads), so the replicas are compared
exactly, and a change of one bit shows. Exact is right: under DDP every rank applies the same all-reduced gradient
with the same optimizer, elementwise, so the replicas are bitwise equal (checked on CPU; on GPUs of one model the
same kernels give the same bits). Only DDP: under FSDP, tensor or pipeline parallelism ranks hold different
parameters by design, so the check runs only where the model is the DistributedDataParallel wrapper.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger("tripwire")

CHUNK = 1 << 23  # 16-bit words summed at once: an int64 copy of 64 MB at most, whatever the parameter's size


class Replicas:
    """The ranks of one DDP training. Every rank calls its methods at the same steps (they are collectives)."""

    def __init__(self, device: torch.device):
        self.device = device  # where the process group's collectives take their tensors
        self.rank = dist.get_rank()
        self._broken = False  # a collective failed: the ranks are not compared again
        self._unread = False  # a parameter could not be read (said once)

    @classmethod
    def of(cls, model, device=None) -> Replicas | None:
        """The ranks, where `model` is a DistributedDataParallel wrapper in a process group of several ranks; None
        elsewhere (one process, or a parallelism whose ranks hold different parameters). `device`: that of the
        collectives, by default the CPU for gloo and the model's device for the others (NCCL)."""
        if not (isinstance(model, torch.nn.parallel.DistributedDataParallel) and dist.is_available()
                and dist.is_initialized() and dist.get_world_size() > 1):
            return None
        if device is None:
            backend = str(dist.get_backend())
            first = next(model.parameters(), None)
            device = torch.device("cpu") if "gloo" in backend or first is None else first.device
        return cls(torch.device(device))

    def differ(self, optimizers) -> int | None:
        """How many ranks hold parameters (those `optimizers` hold) that differ from rank 0's; None where that
        cannot be told (a checksum or the gather failed; said once)."""
        if self._broken:
            return None
        local = self._checksum(_held(optimizers))
        try:
            gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local)
        except Exception as exc:  # noqa: BLE001 - a failed check must not take training down
            self._broken = True
            log.warning("tripwire: the ranks' parameters are not compared any more (relations/replicas_differ): the "
                        "all_gather failed: %s: %s", type(exc).__name__, exc)
            return None
        rows = torch.stack(gathered).cpu().tolist()
        if not all(ok for ok, *_ in rows):
            return None
        return sum(row[1:] != rows[0][1:] for row in rows[1:])

    def _checksum(self, parameters: list) -> torch.Tensor:
        """[1, parameters, 16-bit words, their sum] as int64; [0, 0, 0, 0] where a parameter cannot be read (said
        once), so that this rank still takes part in the gather."""
        try:
            sums, words = [], 0
            for param in parameters:
                bits = _words(param)
                words += bits.numel()
                sums += [chunk.sum(dtype=torch.int64).to(self.device) for chunk in bits.split(CHUNK)]
            head = torch.tensor([1, len(parameters), words], dtype=torch.int64, device=self.device)
            total = torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.int64, device=self.device)
            return torch.cat([head, total.reshape(1)])
        except Exception as exc:  # noqa: BLE001 - a parameter tripwire cannot read must not stop training
            if not self._unread:
                self._unread = True
                log.warning("tripwire: the ranks' parameters are not compared (relations/replicas_differ): %s: %s",
                            type(exc).__name__, exc)
            return torch.zeros(4, dtype=torch.int64, device=self.device)

    def reduce_max(self, flags: list) -> list:
        values = torch.tensor(flags, device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return values.tolist()

    def broadcast(self, value, src: int):
        box = [value]
        dist.broadcast_object_list(box, src=src)
        return box[0]


def _words(param: torch.Tensor) -> torch.Tensor:
    """A parameter's bits as 16-bit integers (8-bit for one-byte types), flat."""
    flat = param.detach().contiguous().view(-1)
    return flat.view(torch.int16) if flat.element_size() % 2 == 0 else flat.view(torch.int8)


def _held(optimizers) -> list:
    """The parameters the optimizers hold, each once, in the order of their groups (the same on every rank)."""
    seen, out = set(), []
    for optimizer in optimizers:
        for group in getattr(optimizer, "optimizer", optimizer).param_groups:  # Lightning wraps the optimizer
            for param in group["params"]:
                if id(param) not in seen:
                    seen.add(id(param))
                    out.append(param)
    return out
