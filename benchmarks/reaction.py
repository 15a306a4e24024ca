"""Family 5: reaction. Steps and seconds from a NaN appearing in training to training stopped.

The Lightning MLP trains with the default rules.yaml (exploding_tensor: log,
checkpoint, stop; the loss is captured every 100 steps, and judged for NaN at
every step between them); from step NAN_AT the loss is NaN. In-process, the
rule runs in the training process: the stop comes at NAN_AT itself. Side process:
the same config with `evaluation: {where: side_process}`, `tripwire watch RUN`
started as a subprocess next to training. Seconds: from the start of the
step whose loss is NaN to the verdict, and to the end of the last step trained (which includes the
actions: the log line and the checkpoint).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

from .common import ROOT, BenchError, Row, child, interleaved, median

NAN_AT = 155  # between two samples of the loss (every 100)
MAX_STEPS = 20_000


def config(where: str) -> dict:
    from tripwire import load_config

    default = load_config(None).to_dict()
    return {**default, "evaluation": {**default["evaluation"], "where": where}}


def train(where: str, out_dir: str, max_steps: int = MAX_STEPS) -> dict:
    """Train in this (fresh) process until tripwire stops it; returns when the NaN came and when training ended."""
    import lightning.pytorch as pl
    import torch

    from tripwire.plugins.lightning import TripwireCallback

    from .lightning_overhead import mlp_module
    from .model import batches, single_thread

    single_thread()
    data = batches(1000)
    times = {}

    def poison(module, loss):
        if module.trainer.global_step == NAN_AT:
            times["nan"] = time.time()  # wall clock: verdicts carry time.time()
        return loss * float("nan") if module.trainer.global_step >= NAN_AT else loss

    class StepEnd(pl.Callback):
        """After tripwire's own hook (and its actions), the end of each step."""

        def on_train_batch_end(self, *args):
            times["last"] = time.time()

    callback = TripwireCallback(config(where), out_dir=out_dir)
    trainer = pl.Trainer(max_steps=max_steps, max_epochs=-1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
                         callbacks=[callback, StepEnd()])
    trainer.fit(mlp_module(poison), torch.utils.data.DataLoader(data, batch_size=None))
    last = trainer.global_step - 1
    fired = [v for v in callback.verdicts if v.fired]
    return {"steps": last - NAN_AT, "seconds": times["last"] - times["nan"], "stopped": last < max_steps - 1,
            "verdict_seconds": fired[0].time - times["nan"] if fired else None}


def in_process(work: str) -> dict:
    return child("reaction", "train", where="in_process", out_dir=tempfile.mkdtemp(dir=work))


def side_process(work: str) -> dict:
    out_dir = tempfile.mkdtemp(dir=work) + "/run"
    watcher = subprocess.Popen([sys.executable, "-m", "tripwire", "watch", out_dir, "--quiet"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        result = child("reaction", "train", where="side_process", out_dir=out_dir)
        watcher.wait(timeout=60)
    finally:
        if watcher.poll() is None:
            watcher.kill()
        output = watcher.communicate()[0]
    if not result["stopped"]:
        raise BenchError(f"`tripwire watch` did not stop training within {MAX_STEPS} steps (watcher exit "
                         f"{watcher.returncode}: {output.strip()[-300:]})")
    return result


def run(repeats: int, work: str, **_) -> list[Row]:
    cases = {"in-process": lambda: in_process(work), "side process (tripwire watch)": lambda: side_process(work)}
    try:
        results = interleaved(cases, repeats)
    except BenchError as exc:
        results = {"in-process": interleaved({"in-process": cases["in-process"]}, repeats)["in-process"]}
        reason = f"n/a: {exc}"
    rows = []
    for name in cases:
        if name not in results:
            rows += [Row("reaction", f"{name}: {what}", None, unit, note=reason) for what, unit in
                     (("steps from NaN to stop", "steps"), ("seconds from NaN to verdict", "s"),
                      ("seconds from NaN to stop", "s"))]
            continue
        steps, seconds, verdict = ([r[k] for r in results[name]] for k in ("steps", "seconds", "verdict_seconds"))
        rows += [Row("reaction", f"{name}: steps from NaN to stop", median(steps), "steps", samples=steps,
                     note=f"NaN from step {NAN_AT}; the loss is sampled every 100 steps"),
                 Row("reaction", f"{name}: seconds from NaN to verdict", median(verdict), "s", samples=verdict),
                 Row("reaction", f"{name}: seconds from NaN to stop", median(seconds), "s",
                     "<= 2" if name.startswith("side") else "", samples=seconds)]
    return rows
