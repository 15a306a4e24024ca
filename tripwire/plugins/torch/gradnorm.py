"""Every step's total gradient norm (`metrics/grad_norm`, the l2 norm of all the gradients an optimizer holds, as
the Hugging Face Trainer logs it), for the rules that judge it at every step (gradient_spike): computed only where
such a rule is on, since it is one more pass over the gradients: ~60 us on one CPU thread for the benchmark MLP's
100,000 parameters, 4 % of its 1.5 ms step (measured here, best of 5 x 2,000).

Shared by the Lightning callback and the plain-loop probe, which call `see` after the loss scale is removed and
before clipping. On the CPU a norm is handed over at once; on an accelerator it stays on the device and is read
with the next sample (`store`), or once KEPT_LOSSES are kept, so that no step waits for the device. Sharded
gradients (DTensor: FSDP2) are not judged, a rank's shard not being the whole gradient; nor are sparse ones.
"""

from __future__ import annotations

import logging

import torch

from .losswatch import KEPT_LOSSES, read_kept

log = logging.getLogger("tripwire")

SERIES = "metrics/grad_norm"


class GradientNorms:
    def __init__(self):
        self.kept: list = []  # (step, norm on its device) since the last store
        self._off = False
        self._last_step: int | None = None
        self._optimizer: int | None = None  # id() of the optimizer whose gradients make the series

    def see(self, step: int, optimizer, recorder) -> None:
        """The norm of the gradients `optimizer` holds at `step`, handed to `recorder` (now, or with the next
        sample on an accelerator): one a step, always of the first optimizer that stepped, so that the series is
        of one set of parameters (a plain loop's GAN steps two; pytorch/examples' forward-forward trains its
        layers one after another, each with its own, a new layer's gradients 30 times the converged one's).
        A failure turns it off for the run, said once: it must never stop training."""
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's LightningOptimizer unwrapped
        if self._optimizer is None:
            self._optimizer = id(optimizer)
        if self._off or step == self._last_step or id(optimizer) != self._optimizer:
            return
        self._last_step = step
        try:
            norm = _norm(optimizer)
        except Exception as exc:  # noqa: BLE001
            self._off = True
            log.warning("tripwire: the gradient norm of step %s could not be computed (%s: %s); gradient_spike "
                        "reads no more of this run", step, type(exc).__name__, exc)
            return
        if norm is None:
            return
        if norm.device.type == "cpu":
            recorder.scalars(step, "train", {SERIES: {"value": float(norm)}})
            return
        self.kept.append((step, norm))
        if len(self.kept) >= KEPT_LOSSES:
            self.store(recorder)

    def store(self, recorder) -> None:
        """The kept norms, read in one copy: called at a sampled step (which waits for the device anyway) and when
        training ends."""
        kept, self.kept = self.kept, []
        if kept and recorder is not None:
            for step, value in read_kept(kept):
                recorder.scalars(step, "train", {SERIES: {"value": value}})


def _norm(optimizer) -> torch.Tensor | None:
    """The l2 norm of every gradient the optimizer holds (one fused pass), in float32 on their device; None where
    it holds none, or a shard of one."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads or any(type(g).__name__ == "DTensor" or g.layout != torch.strided for g in grads):
        return None
    return torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(grads)]))
