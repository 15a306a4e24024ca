"""The training loss of every step, judged for NaN/Inf without holding training up, and kept where asked.

Shared by the Lightning callback and the plain-loop probe. On the CPU the loss is read at once (a scalar read,
about a microsecond). On an accelerator, reading it would wait for the device: it is read late (LateRead: at a
later step, once the device got there), so no step ever waits; a loss of one value is copied as it is and judged
on the host, since an isfinite kernel costs as much again as the copy.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .lateread import LateRead

KEPT_LOSSES = 1000  # the losses of unsampled steps kept on the device before they are read (`store`)


class LossWatch:
    def __init__(self, keep: bool = False):
        """keep: also keep each step's loss (a reference, no copy), read all at once by `drain()`."""
        self._finite = LateRead(dtype=torch.float32)  # an accelerator's losses (or their finiteness), with steps
        self.keep = keep
        self.kept: list = []  # (step, loss) seen since the last drain()

    def drain(self) -> list[tuple[int, float]]:
        """(step, loss) of the losses kept since the last call, read in one device-to-host copy: called
        at a sampled step, which waits for the device anyway, so the steps between samples never do. A loss of
        several values counts as their mean."""
        kept, self.kept = self.kept, []
        try:
            return read_kept(kept)
        except Exception:  # noqa: BLE001 - a loss tripwire cannot read (meta, quantized) must not stop training
            return []

    def store(self, recorder) -> None:
        """The kept losses of the steps between samples, as `losses/train` at each step: stored and handed to the
        rules that judge every step's loss (Recorder.scalars), not judged by the others, so that they read the
        sampled steps as before; a NaN is judged at its step already (see; the non-finite ones are left out
        here). The tensors are read here, in one copy: called at a sampled step (which waits for the device
        anyway) or once KEPT_LOSSES are kept, so an unsampled step never waits."""
        if not self.kept:
            return
        kept = self.drain()
        if recorder is not None:
            for step, value in kept:
                if math.isfinite(value):
                    recorder.scalars(step, "train", {"losses/train": {"value": value}})

    def see(self, step: int, loss) -> tuple[int, float] | None:
        """(step, value) of a non-finite loss, as soon as it is known (this step on the CPU, a later one on an
        accelerator); None otherwise, and for a loss it cannot read (nested, sparse, quantized: the sampled steps
        say so). `loss` is the step's loss (a tensor, a number, or None)."""
        try:
            return self._see(step, loss)
        except Exception:  # noqa: BLE001 - a loss tripwire cannot read must not stop training
            return None

    def _see(self, step: int, loss) -> tuple[int, float] | None:
        found = self._judge_pending()
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        if self.keep and loss is not None:
            self.kept.append((step, loss))
        if found is not None or loss is None:
            return found
        if not isinstance(loss, torch.Tensor):
            value = float(np.mean(np.asarray(loss, dtype=np.float64)))
            return None if math.isfinite(value) else (step, value)
        if loss.device.type == "cpu":
            return _on_host(step, loss)
        if loss.device.type != "meta":
            whole = loss.numel() == 1 and loss.dtype in (torch.float32, torch.float16, torch.bfloat16)
            self._finite.put(loss.float() if whole else torch.isfinite(loss).all(), (step, whole))
        return None

    def _judge_pending(self, wait: bool = False) -> tuple[int, float] | None:
        """The first of the accelerator's losses read since the last step that is not finite (wait: of all those
        still being read)."""
        return next(((step, value if whole else float("nan")) for (step, whole), value in self._finite.ready(wait)
                     if not (math.isfinite(value) if whole else value)), None)

    def close(self, recorder) -> None:
        """At the end of training: the first non-finite loss among those still being read (an accelerator's last
        steps, which no later step will read) is recorded, waiting for the device, too late to act on; then the
        kept losses are stored."""
        try:
            found = self._judge_pending(wait=True)
        except Exception:  # noqa: BLE001 - a device that cannot be read at the end must not fail the close
            found = None
        if found is not None and recorder is not None:
            recorder.check_loss(*found)
        self.store(recorder)


def _on_host(step: int, loss: torch.Tensor) -> tuple[int, float] | None:
    if loss.numel() == 1:
        value = loss.item()
        return None if math.isfinite(value) else (step, float(value))
    if bool(torch.isfinite(loss).all()):  # a loss per sample (reduction "none")
        return None
    return step, float(loss.float().mean())


def read_kept(kept: list) -> list[tuple[int, float]]:
    """(step, value) of kept values (losses; gradient norms, tripwire.plugins.torch.gradnorm): the tensors in one
    copy to the host."""
    tensors = [(step, loss) for step, loss in kept if isinstance(loss, torch.Tensor) and loss.numel()]
    numbers = [(step, float(np.mean(np.asarray(loss, dtype=np.float64)))) for step, loss in kept
               if not isinstance(loss, torch.Tensor)]
    # a CPU loss of one value is read as it is (a microsecond; a mean and a stack cost ten)
    numbers += [(step, loss.item()) for step, loss in tensors if loss.device.type == "cpu" and loss.numel() == 1]
    tensors = [(step, loss) for step, loss in tensors if loss.device.type != "cpu" or loss.numel() != 1]
    if tensors:
        values = torch.stack([loss.float().mean() for _, loss in tensors]).cpu().tolist()
        numbers += [(step, value) for (step, _), value in zip(tensors, values)]
    return sorted(numbers)
