"""A Lightning training run in its own process, for the side-process and crash tests.

usage: train_lightning.py RUN_URL CONFIG_JSON RESULT_JSON [--nan-at STEP] [--sleep S] [--steps N]
                          [--stall-at STEP --stall-s S] [--hold-at STEP --hold-file PATH]
--hold-at: at the end of that step, wait until PATH exists (the test says when to go on).
Writes RESULT_JSON with each batch end's wall time, the final global step and the verdicts seen.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning.pytorch as pl  # noqa: E402

import helpers  # noqa: E402
from tripwire.plugins.lightning import TripwireCallback  # noqa: E402

args = argparse.ArgumentParser()
args.add_argument("run_url")
args.add_argument("config")
args.add_argument("result")
args.add_argument("--nan-at", type=int, default=None)
args.add_argument("--sleep", type=float, default=0.0)
args.add_argument("--steps", type=int, default=200)
args.add_argument("--stall-at", type=int, default=None)
args.add_argument("--stall-s", type=float, default=0.0)
args.add_argument("--hold-at", type=int, default=None)
args.add_argument("--hold-file", default=None)
a = args.parse_args()


class Timeline(pl.Callback):
    times: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times[trainer.global_step - 1] = time.time()
        time.sleep(a.sleep + (a.stall_s if trainer.global_step - 1 == a.stall_at else 0.0))
        if trainer.global_step - 1 == a.hold_at:
            deadline = time.monotonic() + 120
            while not os.path.exists(a.hold_file):
                assert time.monotonic() < deadline, f"{a.hold_file} did not appear"
                time.sleep(0.01)


module = helpers.mlp_module()
if a.nan_at is not None:
    base_step = module.training_step

    def training_step(batch, batch_idx):
        loss = base_step(batch, batch_idx)
        return loss * float("nan") if module.trainer.global_step >= a.nan_at else loss

    module.training_step = training_step

cb = TripwireCallback(json.loads(a.config), out_dir=a.run_url)
timeline = Timeline()
trainer = helpers.fit(cb, module, max_epochs=1000, max_steps=a.steps, callbacks=[timeline])
with open(a.result, "w") as f:
    json.dump({"global_step": trainer.global_step, "times": timeline.times, "end": time.time(),
               "verdicts": [v.to_dict() for v in cb.verdicts]}, f)
