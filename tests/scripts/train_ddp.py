"""Two-process Lightning DDP on CPU (gloo), for the multi-rank tests.

usage: train_ddp.py RUN_URL CONFIG_JSON RESULT_PREFIX [--nan-rank R --nan-at STEP] [--steps N]
Lightning's ddp strategy re-launches this script for rank 1. Each rank writes RESULT_PREFIX-<rank>.json.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import helpers  # noqa: E402
from tripwire.plugins.lightning import TripwireCallback  # noqa: E402

args = argparse.ArgumentParser()
args.add_argument("run_url")
args.add_argument("config")
args.add_argument("result")
args.add_argument("--nan-rank", type=int, default=None)
args.add_argument("--nan-at", type=int, default=None)
args.add_argument("--steps", type=int, default=60)
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

cb = TripwireCallback(json.loads(a.config), out_dir=a.run_url)
trainer = helpers.fit(cb, module, max_epochs=1000, max_steps=a.steps, strategy="ddp", devices=2,
                      use_distributed_sampler=True)
with open(f"{a.result}-{trainer.global_rank}.json", "w") as f:
    json.dump({"rank": trainer.global_rank, "global_step": trainer.global_step, "run_url": cb.run_url,
               "verdicts": [v.to_dict() for v in cb.verdicts]}, f)
