"""Two-process Transformers Trainer DDP on CPU (gloo), for the multi-rank tests; launched by torchrun.

usage: torchrun --standalone --nproc_per_node 2 train_transformers_ddp.py RUN_URL CONFIG_JSON RESULT_PREFIX
                [--nan-rank R --nan-at STEP] [--steps N] [--gpt2]
Trains the zoo's BERT classifier (or its GPT-2 language model); on rank R the model's loss is NaN from global step
STEP on. Each rank writes RESULT_PREFIX-<rank>.json.
"""

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from benchmarks.zoo import data  # noqa: E402
from benchmarks.zoo.transformers_cases import Rows, arguments, tiny_bert, tiny_gpt2  # noqa: E402
from tripwire.plugins.transformers import TripwireCallback  # noqa: E402

args = argparse.ArgumentParser()
args.add_argument("run_url")
args.add_argument("config")
args.add_argument("result")
args.add_argument("--nan-rank", type=int, default=None)
args.add_argument("--nan-at", type=int, default=None)
args.add_argument("--steps", type=int, default=20)
args.add_argument("--gpt2", action="store_true")
a = args.parse_args()
torch.set_num_threads(1)
rank = int(os.environ["RANK"])


class Step(TrainerCallback):
    """The global step of the step under way."""

    step = 0

    def on_step_begin(self, args, state, control, **kwargs):
        Step.step = state.global_step


model = tiny_gpt2() if a.gpt2 else tiny_bert()
if rank == a.nan_rank:
    forward = model.forward

    @functools.wraps(forward)  # the Trainer reads forward's signature to pick the columns it feeds
    def nan_from_step(*args, **kwargs):
        out = forward(*args, **kwargs)
        if model.training and Step.step >= a.nan_at:
            out["loss"] = out["loss"] * float("nan")
        return out

    model.forward = nan_from_step

(xt, yt), (xv, yv) = data.repeating_sequences() if a.gpt2 else data.token_presence()
cb = TripwireCallback(json.loads(a.config), out_dir=a.run_url)
trainer = Trainer(model=model, args=arguments(os.path.join(os.path.dirname(a.result), "out"), max_steps=a.steps,
                                              per_device_train_batch_size=16, ddp_backend="gloo"),
                  train_dataset=Rows(xt, yt), eval_dataset=Rows(xv, yv), callbacks=[Step(), cb])
trainer.train()
with open(f"{a.result}-{rank}.json", "w") as f:
    json.dump({"rank": rank, "global_step": trainer.state.global_step, "run_url": cb.run_url,
               "verdicts": [v.to_dict() for v in cb.verdicts]}, f)
if torch.distributed.is_initialized():  # gloo's threads end with the group, not at interpreter exit (an abort)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
# The run is closed and the result written: leave without the interpreter's teardown, where under load a C++
# thread of the distributed stack was still found running and the process aborted (SIGABRT) after its work
# was done (seen twice in full suite runs, never alone).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
