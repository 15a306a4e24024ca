"""Two-process Lightning DDP on CPU (gloo), for the multi-rank tests.

usage: train_ddp.py RUN_URL CONFIG_JSON RESULT_PREFIX [--nan-rank R --nan-at STEP] [--steps N]
                    [--hold-at STEP] [--strategy ddp|model_parallel] [--gradient-at STEP]
Lightning's ddp strategy re-launches this script for rank 1. Each rank writes RESULT_PREFIX-<rank>.json,
with the RuleFired it raised, if any. --hold-at: every rank waits at the end of that step until the
side-process watcher has stored a fired verdict and this rank's writer thread has looked at the verdicts
since (a condition, not a clock). --strategy model_parallel: Lightning's ModelParallelStrategy, each Linear
and the module sharded over both ranks by FSDP2's fully_shard in `configure_model` (the parameters are
DTensors, each rank holding half). --gradient-at: the whole gradient of `net.0.weight` at that step, as the
optimizer is handed it, is in the result (l2, abs_mean), for the tests to compare what tripwire stored with.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import time  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

import helpers  # noqa: E402
import tripwire  # noqa: E402
from tripwire.plugins.lightning import TripwireCallback  # noqa: E402

args = argparse.ArgumentParser()
args.add_argument("run_url")
args.add_argument("config")
args.add_argument("result")
args.add_argument("--nan-rank", type=int, default=None)
args.add_argument("--nan-at", type=int, default=None)
args.add_argument("--steps", type=int, default=60)
args.add_argument("--hold-at", type=int, default=None)
args.add_argument("--strategy", choices=("ddp", "model_parallel"), default="ddp")
args.add_argument("--gradient-at", type=int, default=None)
a = args.parse_args()
torch.set_num_threads(1)

module = helpers.mlp_module()
if a.nan_at is not None:
    base_step = module.training_step

    def training_step(batch, batch_idx):
        loss = base_step(batch, batch_idx)
        trainer = module.trainer
        if trainer.global_rank == a.nan_rank and trainer.global_step >= a.nan_at:
            return loss * float("nan")
        return loss

    module.training_step = training_step

if a.strategy == "model_parallel":
    from torch.distributed.fsdp import fully_shard

    def configure_model():
        mesh = module.device_mesh["data_parallel"]
        for layer in module.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)

    module.configure_model = configure_model
    strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
else:
    strategy = "ddp"


class Keep(pl.Callback):
    """Keeps the trainer (fit raises before returning it when a rule raises), holds at --hold-at and reads the
    whole gradient at --gradient-at."""

    trainer = None
    gradient = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == a.gradient_at:
            grad = pl_module.net[0].weight.grad
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad  # a collective: every rank calls it
            Keep.gradient = {"l2": float(grad.norm()), "abs_mean": float(grad.abs().mean())}

    def on_train_start(self, trainer, pl_module):
        Keep.trainer = trainer

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step - 1 != a.hold_at:
            return
        folder = os.path.join(cb.run_url, "verdicts")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            names = {n for n in (os.listdir(folder) if os.path.isdir(folder) else ()) if n[:1].isdigit()}
            seen = cb._recorder._seen_verdicts if cb._recorder is not None else None
            mine = {n for n in names if n.startswith(f"{trainer.global_rank:05d}-")}
            if names and seen is not None and mine <= seen:
                return
            time.sleep(0.01)
        raise AssertionError("no verdict from the watcher within 120 s")


cb = TripwireCallback(json.loads(a.config), out_dir=a.run_url)
raised = None
try:
    helpers.fit(cb, module, max_epochs=1000, max_steps=a.steps, strategy=strategy, devices=2,
                use_distributed_sampler=True, callbacks=[Keep()])
except tripwire.RuleFired as exc:
    raised = {"rank": exc.rank, "rule": exc.verdict.rule, "step": exc.verdict.step, "message": str(exc)}
trainer = Keep.trainer
with open(f"{a.result}-{trainer.global_rank}.json", "w") as f:
    json.dump({"rank": trainer.global_rank, "global_step": trainer.global_step, "run_url": cb.run_url,
               "verdicts": [v.to_dict() for v in cb.verdicts], "raised": raised, "gradient": Keep.gradient,
               "val_loss": float(trainer.callback_metrics["val_loss"]) if "val_loss" in trainer.callback_metrics
               else None}, f)
