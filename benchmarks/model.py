"""The benchmarked model and data, in torch alone: it is imported by smdebug's venv too, so no tripwire here.

MLP 128-256-256-10, batch 64, synthetic data made once per process before any timing.
"""

from __future__ import annotations

import torch

WIDTHS = (128, 256, 256, 10)
BATCH = 64


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    a, b, c, d = WIDTHS
    return torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.ReLU(), torch.nn.Linear(b, c), torch.nn.ReLU(),
                               torch.nn.Linear(c, d))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` distinct (x, y) batches, made once: data loading is not what is measured."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, BATCH, WIDTHS[0], generator=g)
    y = torch.randint(0, WIDTHS[-1], (steps, BATCH), generator=g)
    return list(zip(x.unbind(0), y.unbind(0)))


def single_thread() -> None:
    """One intra-op thread: the other core is left to tripwire's writer thread, as on a busy trainer."""
    torch.set_num_threads(1)


def plain_loop(model: torch.nn.Module, optimizer, data, loss_fn, after_step=None) -> None:
    """The plain training loop both tools are measured in; `after_step(loss)` after each optimizer step
    (tripwire's `probe.step`)."""
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step(loss)
