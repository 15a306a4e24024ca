"""Family 2: a plain PyTorch loop with tripwire's TripwireProbe next to the same loop with smdebug's Hook.

Each side is compared with the bare loop run by its own interpreter: smdebug
runs in its own venv (numpy<2), so its baseline does too. The two sides'
configurations alternate in one interleaved sequence. Timed: from the
probe's (hook's) creation to its close, i.e. everything the tool adds.
"""

from __future__ import annotations

import shutil
import tempfile

from . import configs, smdebug_env
from .common import BenchError, Clock, Row, child, interleaved, median, overhead_row

FULL = configs.EVERY_STEP["w+g full tensors every step"]
TRIPWIRE = {"plain loop": "none", "tripwire default rules.yaml": configs.DEFAULT, "tripwire w+g full every step": FULL}
SMDEBUG = {"plain loop (smdebug venv)": "none", "smdebug default (save_interval=100)": "default",
           "smdebug w+g full every step": "every_step"}


def train(config, steps: int, out_dir: str, device: str = "cpu") -> dict:
    """The plain loop in this (fresh) process, with TripwireProbe unless config is "none"; on "cuda" the model and
    the batches are on the GPU before the clock starts, and the clock waits for the GPU's last kernel."""
    import torch

    from .model import batches, mlp, plain_loop, single_thread

    single_thread()
    model, data = mlp().to(device), [(x.to(device), y.to(device)) for x, y in batches(steps)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    if config != "none":
        from tripwire.plugins.torch import TripwireProbe
    with Clock() as clock:
        probe = None if config == "none" else TripwireProbe(model, optimizer, config, out_dir=out_dir)
        plain_loop(model, optimizer, data, loss_fn, probe.step if probe is not None else None)
        if probe is not None:
            probe.close()
        if device == "cuda":
            torch.cuda.synchronize()
    return clock.to_dict()


def run(repeats: int, work: str, shared: dict, steps: int | None = None, device: str = "cpu", **_) -> list[Row]:
    """Rows for both tools; keeps the last full-tensor run of each in `shared` for the reading family. On a GPU,
    tripwire alone (smdebug's venv holds a CPU build of torch)."""
    steps = 2000 if steps is None else steps
    cases, smd_reason = {}, ""
    for name, config in TRIPWIRE.items():
        cases[name] = _case(work, shared, name, "torch_loop", "train", config=config, steps=steps, device=device)
    try:
        if device != "cpu":
            raise BenchError("smdebug is measured on the CPU only")
        python = smdebug_env.python()
        for name, case in SMDEBUG.items():
            cases[name] = _case(work, shared, name, "smdebug_side", "train", python=python, case=case, steps=steps)
    except BenchError as exc:
        smd_reason = str(exc)
    try:
        results = interleaved(cases, repeats)
    except BenchError as exc:  # smdebug's hook failing on this torch: report why, measure tripwire alone
        if not cases.keys() - TRIPWIRE.keys():
            raise
        smd_reason = str(exc)
        results = interleaved({k: v for k, v in cases.items() if k in TRIPWIRE}, repeats)
    base = results["plain loop"]
    rows = [Row("torch loop", f"plain loop, {steps} steps", median(r["seconds"] for r in base), "s",
                samples=[r["seconds"] for r in base])]
    rows += [overhead_row("torch loop", name, results[name], base) for name in list(TRIPWIRE)[1:]]
    if smd_reason:
        return rows + [Row("torch loop", name, None, "x", note=smd_reason) for name in list(SMDEBUG)[1:]]
    smd_base = results["plain loop (smdebug venv)"]
    return rows + [overhead_row("torch loop", name, results[name], smd_base) for name in list(SMDEBUG)[1:]]


def _case(work: str, shared: dict, name: str, module: str, function: str, python: str | None = None, **kwargs):
    """One configuration: a fresh out_dir per call; the full-tensor runs are kept for reading, the rest deleted."""
    keep = {"tripwire w+g full every step": "tripwire_full_run", "smdebug w+g full every step": "smdebug_full_run"}

    def call():
        out_dir = tempfile.mkdtemp(dir=work)
        result = child(module, function, python=python, out_dir=out_dir, **kwargs)
        if name in keep:
            shutil.rmtree(shared.get(keep[name], ""), ignore_errors=True)
            shared[keep[name]] = out_dir
        else:
            shutil.rmtree(out_dir, ignore_errors=True)
        return result
    return call
