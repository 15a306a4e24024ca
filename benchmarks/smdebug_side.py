"""smdebug's side of the plain-loop and reading benchmarks. Runs in benchmarks/.smdebug-venv (numpy<2).

Imports torch and smdebug only, never tripwire.
"""

from __future__ import annotations

import logging
import os

from .common import Clock

CASES = ("none", "default", "every_step")


def train(case: str, steps: int, out_dir: str) -> dict:
    """The plain loop with smdebug's Hook: `default` (save_interval=100, default collections) or `every_step`
    (weights, biases, gradients every step). Timed from the hook's creation to its close."""
    import torch

    from .model import batches, mlp, plain_loop, single_thread

    os.environ.setdefault("SMDEBUG_LOG_LEVEL", "error")
    logging.getLogger("smdebug").setLevel(logging.ERROR)
    import smdebug.pytorch as smd

    single_thread()
    model, data = mlp(), batches(steps)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    with Clock() as clock:
        hook = None
        if case == "default":
            hook = smd.Hook(out_dir=out_dir, save_config=smd.SaveConfig(save_interval=100))
        elif case == "every_step":
            hook = smd.Hook(out_dir=out_dir, save_config=smd.SaveConfig(save_interval=1),
                            include_collections=["weights", "biases", "gradients"])
        if hook is not None:
            hook.register_module(model)
            hook.register_loss(loss_fn)
        plain_loop(model, optimizer, data, loss_fn)
        if hook is not None:
            hook.close()
    return clock.to_dict()


def read(out_dir: str, name: str) -> dict:
    """create_trial + one tensor's values at every step (what smdebug's docs show for analysis)."""
    os.environ.setdefault("SMDEBUG_LOG_LEVEL", "error")
    from smdebug.trials import create_trial

    with Clock() as clock:
        values = create_trial(out_dir).tensor(name).values()
    return {**clock.to_dict(), "steps": len(values)}
