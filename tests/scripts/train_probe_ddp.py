"""A plain PyTorch DDP loop on CPU (gloo) with a TripwireProbe on each rank; launched by torchrun.

usage: torchrun --standalone --nproc_per_node 2 train_probe_ddp.py RUN_PREFIX CONFIG_JSON RESULT_PREFIX
                [--bypass] [--nan-rank R --nan-at STEP] [--steps N] [--probe-ranks R,...]
Each rank trains on its own share of the digits and records into RUN_PREFIX-<rank>. --bypass: the training forward
calls the inner module (`ddp_model.module(x)`), so no all-reduce follows and the replicas drift apart. --nan-rank:
that rank's loss is NaN from step STEP on. --probe-ranks: the ranks that make a probe (default: every rank). Each
rank with a probe writes RESULT_PREFIX-<rank>.json.
"""

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import helpers  # noqa: E402
from tripwire.plugins.torch import TripwireProbe  # noqa: E402

args = argparse.ArgumentParser()
args.add_argument("run_prefix")
args.add_argument("config")
args.add_argument("result")
args.add_argument("--bypass", action="store_true")
args.add_argument("--nan-rank", type=int, default=None)
args.add_argument("--nan-at", type=int, default=None)
args.add_argument("--steps", type=int, default=20)
args.add_argument("--probe-ranks", default=None)
a = args.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()

torch.manual_seed(0)
(x, y), _ = helpers.digits()
x, y = torch.tensor(x)[rank::2], torch.tensor(y, dtype=torch.long)[rank::2]  # each rank its own share
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
forward = model.module if a.bypass else model
step = 0
probed = a.probe_ranks is None or str(rank) in a.probe_ranks.split(",")
maybe_probe = TripwireProbe(model, optimizer, json.loads(a.config), out_dir=f"{a.run_prefix}-{rank}") if probed \
    else contextlib.nullcontext()
with maybe_probe as probe:
    for step in range(a.steps):
        i = 32 * (step % 20)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward(x[i:i + 32]), y[i:i + 32])
        loss.backward()
        optimizer.step()
        if rank == a.nan_rank and step >= a.nan_at:
            loss = loss * float("nan")
        if probe is not None:
            probe.step(loss)
            if probe.should_stop:
                break
if probe is not None:
    with open(f"{a.result}-{rank}.json", "w") as f:
        json.dump({"rank": rank, "last_step": step, "run_url": probe.run_url,
                   "verdicts": [v.to_dict() for v in probe.verdicts]}, f)
dist.barrier()  # no rank tears gloo down while the other's last collective is still in its threads (SIGABRT)
dist.destroy_process_group()
