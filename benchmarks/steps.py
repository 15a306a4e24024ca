"""Family `steps`: what one unsampled step of the plain loop costs with the probe, measured inside one process.

The torch family's whole-process ratios move by ±10 % between runs on a shared machine, more than the every-step
checks cost. Here loops of STEPS steps alternate in one fresh interpreter, round after round: the bare loop, the
loop with four hooks that do nothing (the model's forward pre- and post-hook, the optimizer's step pre- and
post-hook: what torch charges any probe for seeing the step), the loop with TripwireProbe and the default
config, and the same without its training_relations rule (what the every-step relation checks cost is the
difference). Each loop gives the median time of its unsampled steps (the default config samples steps 0-9 and
every 100th; those and the three after each are left out); each round's ratio is to the bare loop of that round,
the relations' to the probe without them.
"""

from __future__ import annotations

import tempfile

from .common import Row, child, median

STEPS = 800
VARIANTS = ("bare", "empty hooks", "probe", "probe without relations")


def measure(rounds: int, out_dir: str) -> dict:
    """{variant: [median unsampled step time in seconds, per round]}, the variants alternating in each round."""
    import logging

    from .model import batches, single_thread

    single_thread()
    logging.getLogger("tripwire").setLevel(logging.ERROR)  # the bench's random labels never learn: said at close
    data = batches(STEPS)
    results: dict = {variant: [] for variant in VARIANTS}
    for round_ in range(rounds):  # each round starts with another variant: a loop can slow the one after it
        for variant in VARIANTS[round_ % len(VARIANTS):] + VARIANTS[:round_ % len(VARIANTS)]:
            results[variant].append(_unsampled_step(variant, data, out_dir))
    return results


def _unsampled_step(variant: str, data: list, out_dir: str) -> float:
    import gc
    import statistics
    import time

    import torch

    from tripwire.plugins.torch import TripwireProbe

    from .model import mlp

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    probe, handles = None, []
    if variant == "empty hooks":
        handles = [model.register_forward_pre_hook(lambda module, args: None),
                   model.register_forward_hook(lambda module, args, kwargs, output: None, with_kwargs=True),
                   optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: None),
                   optimizer.register_step_post_hook(lambda optimizer, args, kwargs: None)]
    elif variant.startswith("probe"):
        config = _without_relations() if variant == "probe without relations" else None
        probe = TripwireProbe(model, optimizer, config, out_dir=tempfile.mkdtemp(dir=out_dir))
    gc.collect()
    times = []
    for x, y in data:
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if probe is not None:
            probe.step(loss)
        times.append(time.perf_counter() - start)
    if probe is not None:
        probe.close()
    for handle in handles:
        handle.remove()
    return statistics.median(t for i, t in enumerate(times) if i >= 10 and i % 100 > 3)


def _without_relations() -> dict:
    """The packaged rules.yaml without its training_relations rule: nothing captures relations, so the probe
    makes none of its every-step relation checks; the rest as the default has it."""
    from importlib.resources import files

    import yaml

    config = yaml.safe_load(files("tripwire").joinpath("rules.yaml").read_text())
    config["rules"] = [r for r in config["rules"] if (r if isinstance(r, str) else r["rule"]) != "training_relations"]
    return config


def run(repeats: int, work: str, **_) -> list[Row]:
    results = child("steps", "measure", rounds=max(5 * repeats, 15), out_dir=work)  # a noisy VM: many short rounds
    rows = []
    for variant, baseline, name, target in (
            ("empty hooks", "bare", "four hooks that do nothing (torch's dispatch)", ""),
            ("probe", "bare", "TripwireProbe, default rules.yaml", "<= 1.01"),
            ("probe", "probe without relations",
             "the every-step relation checks (the probe with and without training_relations)", "<= 1.01")):
        pairs = list(zip(results[variant], results[baseline]))
        ratios = [t / b for t, b in pairs]
        added = median(t - b for t, b in pairs)
        rows.append(Row("steps", f"unsampled step: {name}", median(ratios), "x", target, samples=ratios,
                        note=f"{added * 1e6:+.0f} us on a {median(results[baseline]) * 1e6:.0f} us step"))
    return rows
