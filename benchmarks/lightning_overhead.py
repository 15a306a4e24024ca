"""Family 1: overhead of the Lightning callback on a small MLP (2,000 steps, CPU, one thread; or on a GPU).

Each configuration trains in a fresh process; the figure is `trainer.fit`'s
wall time, which includes the callback's set-up and its close (the writer's
last shards and the index), relative to the same fit with no callback.
"""

from __future__ import annotations

import shutil
import tempfile

from . import configs
from .common import Clock, Row, child, interleaved, median, overhead_row

TARGETS = {"default rules.yaml": "<= 1.02", "w+g reductions every step": "<= 1.2",
           "w+g full tensors every step": "<= 2", "activations every step": "<= 1.5"}
# "empty": a Callback that does nothing, i.e. what Lightning charges any callback for its hook calls
CASES = {"no callback": "none", "empty Callback": "empty", "default rules.yaml": configs.DEFAULT, **configs.EVERY_STEP}


def mlp_module(poison=None):
    """The benchmarked MLP as a LightningModule, SGD at lr 0.01; `poison(module, loss)` may replace the loss."""
    import lightning.pytorch as pl
    import torch

    from .model import mlp

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            return poison(self, loss) if poison is not None else loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Module()


def fit(config, steps: int, out_dir: str, device: str = "cpu") -> dict:
    """Train in this (fresh) process; config "none" means no callback, "empty" a Callback doing nothing. On
    "cuda" the Trainer moves the model and each batch to the GPU."""
    import lightning.pytorch as pl
    import torch

    from .model import batches, single_thread

    single_thread()
    data = batches(steps)  # ready-made batches; batch_size=None hands them over as they are

    callbacks = [pl.Callback()] if config == "empty" else []
    if config not in ("none", "empty"):
        from tripwire.plugins.lightning import TripwireCallback

        callbacks.append(TripwireCallback(config, out_dir=out_dir))
    trainer = pl.Trainer(max_steps=steps, max_epochs=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, devices=1,
                         accelerator="gpu" if device == "cuda" else "cpu",
                         callbacks=callbacks)
    with Clock() as clock:
        trainer.fit(mlp_module(), torch.utils.data.DataLoader(data, batch_size=None))
    return {**clock.to_dict(), "steps": trainer.global_step}


def run(repeats: int, work: str, steps: int | None = None, device: str = "cpu", **_) -> list[Row]:
    steps = 2000 if steps is None else steps

    def case(config):
        def call():
            out_dir = tempfile.mkdtemp(dir=work)
            try:
                return child("lightning_overhead", "fit", config=config, steps=steps, out_dir=out_dir, device=device)
            finally:
                shutil.rmtree(out_dir, ignore_errors=True)
        return call

    results = interleaved({name: case(config) for name, config in CASES.items()}, repeats)
    base = results["no callback"]
    rows = [Row("lightning", f"no callback: fit, {steps} steps", median(r["seconds"] for r in base), "s",
                samples=[r["seconds"] for r in base])]
    return rows + [overhead_row("lightning", name, results[name], base, TARGETS.get(name, ""))
                   for name in CASES if name != "no callback"]
