"""A plain PyTorch loop with a TripwireProbe in its own process, for the containment tests.

usage: train_probe.py RUN_URL CONFIG_JSON [--steps N] [--storage-options JSON] [--ready PATH --go PATH]
--ready/--go: once imported, create PATH `--ready` and wait until `--go` exists before the probe is made (the test
starts several trainings at the same moment).
Prints "trained N steps" when the loop ends, then "closed RUN_URL" once the probe is closed.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import helpers  # noqa: E402
from tripwire.plugins.torch import TripwireProbe  # noqa: E402

args = argparse.ArgumentParser()
args.add_argument("run_url")
args.add_argument("config")
args.add_argument("--steps", type=int, default=20)
args.add_argument("--storage-options", default=None)
args.add_argument("--ready", default=None)
args.add_argument("--go", default=None)
a = args.parse_args()

torch.manual_seed(0)
(x, y), _ = helpers.digits(n_train=64)
x, y = torch.tensor(x), torch.tensor(y, dtype=torch.long)
net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
if a.ready:
    open(a.ready, "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(a.go):
        assert time.monotonic() < deadline, f"{a.go} did not appear"
        time.sleep(0.001)
options = json.loads(a.storage_options) if a.storage_options else None
probe = TripwireProbe(net, optimizer, json.loads(a.config), out_dir=a.run_url, storage_options=options)
for step in range(a.steps):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    optimizer.step()
    probe.step(loss)
print(f"trained {a.steps} steps", flush=True)
probe.close()
print(f"closed {probe.run_url}", flush=True)
