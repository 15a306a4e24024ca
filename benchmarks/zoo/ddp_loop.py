"""A plain PyTorch DDP loop on CPU (gloo), two processes, a TripwireProbe on each rank: the zoo's DDP case.

usage: torchrun --standalone --nproc_per_node 2 -m benchmarks.zoo.ddp_loop OUT_DIR CONFIG_JSON EPOCHS [--bypass]
Each rank trains the ReLU MLP on its own half of the digits and records into OUT_DIR-<rank>; rank 0 writes
OUT_DIR-result.json: its run's URL, the optimizer steps and the validation accuracy. --bypass: the training forward
calls the inner module (`ddp_model.module(x)`), which no all-reduce follows, so the replicas drift apart.
"""

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tripwire.plugins.torch import TripwireProbe

from . import data
from .torch_cases import mlp


def main() -> None:
    args = argparse.ArgumentParser()
    args.add_argument("out_dir")
    args.add_argument("config")
    args.add_argument("epochs", type=int)
    args.add_argument("--bypass", action="store_true")
    a = args.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    (xt, yt), (xv, yv) = data.digits()
    x, y = torch.as_tensor(xt)[rank::world], torch.as_tensor(yt)[rank::world]  # each rank its own share
    model = torch.nn.parallel.DistributedDataParallel(mlp())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    forward = model.module if a.bypass else model
    steps = 0
    with TripwireProbe(model, optimizer, json.loads(a.config), out_dir=f"{a.out_dir}-{rank}") as probe:
        for _ in range(a.epochs):
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(steps))
            for i in range(0, len(x), 32):
                batch = order[i:i + 32]
                optimizer.zero_grad()
                loss = F.cross_entropy(forward(x[batch]), y[batch])
                loss.backward()
                optimizer.step()
                probe.step(loss)
                steps += 1
    if rank == 0:
        model.eval()
        with torch.no_grad():
            accuracy = (model.module(torch.as_tensor(xv)).argmax(-1) == torch.as_tensor(yv)).float().mean().item()
        with open(f"{a.out_dir}-result.json", "w") as f:
            json.dump({"run_url": probe.run_url, "steps": steps, "accuracy": accuracy}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
