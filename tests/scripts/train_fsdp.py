"""A plain loop under FSDP (torch.distributed.fsdp.fully_shard), two processes on the CPU (gloo), with a probe on
each rank (`workers: all`, or on rank 0 alone with `workers: zero`). Writes result-<rank>.json: the run, whether
it learned, and the full gradient norm of the first layer after the last step (a collective), to hold the stored
reduction of the sharded gradient to."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

STEPS = 41  # sampled every 10: the last step, 40, is a sample


def train(rank: int, out: str, result: str, workers: str, port: str) -> None:
    from sklearn.datasets import load_digits
    from torch.distributed.fsdp import fully_shard

    import tripwire
    from tripwire.plugins.torch import TripwireProbe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor((x - x.mean(0)) / (x.std(0) + 1e-6), dtype=torch.float32)
    y = torch.tensor(y)
    config = {**tripwire.load_config(None).to_dict(), "workers": workers, "sampling": {"every": 10},
              "collections": {"losses": {}, "gradients": {"reductions": ["l2", "mean", "std", "max"]}}}
    probe = TripwireProbe(model, optimizer, config, out_dir=f"{out}-{rank}") if workers == "all" or rank == 0 \
        else None  # a run of each rank's own, as the probe under DDP
    for step in range(STEPS):
        i = (64 * step + 32 * rank) % 1280
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
        loss.backward()
        optimizer.step()
        if probe is not None:
            probe.step(loss)
    if probe is not None:
        probe.close()
    grad = model[0].weight.grad.full_tensor()
    accuracy = float((model(x[1280:]).argmax(1) == y[1280:]).float().mean())
    Path(f"{result}-{rank}.json").write_text(json.dumps({
        "run_url": probe.run_url if probe is not None else None, "accuracy": accuracy,
        "grad_l2": float(grad.norm()), "grad_mean": float(grad.mean()), "grad_std": float(grad.std(correction=0)),
        "grad_max": float(grad.max())}))
    dist.barrier()  # no rank tears gloo down while the other's last collective is still in its threads (SIGABRT)
    dist.destroy_process_group()


if __name__ == "__main__":
    out, result, workers, port = sys.argv[1:5]
    mp.spawn(train, args=(out, result, workers, port), nprocs=2)
