"""Family 4: reading. `import tripwire`; open a run and read one series (10,000 and 1,000,000 steps);
one tensor's full values next to smdebug's `create_trial` on the plain-loop runs of family 2.

Every read is timed in a fresh process (the run's files are in the page cache,
as they are right after training). The synthetic runs are written directly as
shards in the documented format (docs/format.md), 100 shards each, then
indexed with the writer's own `write_index` as a finished run is; the "live"
figures read a copy without the index, as a reader sees a run still training.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import numpy as np

from . import smdebug_env, torch_loop
from .common import ROOT, BenchError, Clock, Row, child, interleaved, median

SERIES = [(f"gradients/layer{i}.weight", r) for i in range(20) for r in ("mean", "std", "min", "max", "l2")]
SHARDS = 100
# `import tripwire` is lazy; the read API's first use also loads numpy and fsspec (which the store imports)
IMPORT_CODE = ("import time; t = time.perf_counter(); import tripwire; a = time.perf_counter(); tripwire.open_run; "
               "import fsspec; b = time.perf_counter(); print(a - t, b - t)")


def write_synthetic_run(url: str, steps: int) -> None:
    """A finished run of `steps` sampled train steps x 100 series (reductions only), in 100 shards + the index."""
    from tripwire import __version__
    from tripwire.core.config import load_config
    from tripwire.core.index import write_index
    from tripwire.core.shardfile import encode
    from tripwire.core.store import FORMAT_VERSION, Store, shard_name, status_name

    store = Store(url)
    config = load_config({"collections": {"gradients": {}}}).to_dict()
    store.put_json("run.json", {"format_version": FORMAT_VERSION, "run_id": url.rsplit("/", 1)[-1],
                                "framework": "benchmark", "framework_version": "", "tripwire_version": __version__,
                                "created": time.time(), "world_size": 1, "config": config})
    rng = np.random.default_rng(0)
    per_shard = steps // SHARDS
    for seq in range(SHARDS):
        shard_steps = np.arange(seq * per_shard, (seq + 1) * per_shard, dtype=np.int64)
        values = rng.standard_normal((len(SERIES), per_shard))
        entries = {"m0": shard_steps, "s0": shard_steps, **{f"v{i}": v for i, v in enumerate(values)}}
        meta = {"format_version": FORMAT_VERSION, "kind": "shard", "worker": 0, "seq": seq,
                "rows": {"train": per_shard}, "steps": {"train": "m0"},
                "series": [["train", name, red, f"v{i}", "s0"] for i, (name, red) in enumerate(SERIES)],
                "section": sum(a.nbytes for a in entries.values()), "tensors": []}
        store.put(shard_name(0, seq), encode(entries, meta))
    write_index(store, 0, SHARDS - 1)
    store.put_json(status_name(0), {"state": "finished", "started": time.time(), "heartbeat": time.time(),
                                    "last_step": steps - 1, "shards": SHARDS, "lost_steps": 0, "dropped_steps": 0})


def read_series(url: str, name: str, reduction: str, expect: int) -> dict:
    """Open a run and read one series, in this (fresh) process (imports are timed by `import_time`)."""
    import fsspec  # noqa: F401 - imports are timed by `import_time`, not here
    from tripwire import open_run

    with Clock() as clock:
        steps, values = open_run(url).tensor(name).series(reduction)
    if len(steps) != expect:
        raise RuntimeError(f"read {len(steps)} steps of {name}, expected {expect}")
    return clock.to_dict()


def read_values(url: str, name: str) -> dict:
    """Open a run and read one tensor's full values at every step it was saved."""
    import fsspec  # noqa: F401
    from tripwire import open_run

    with Clock() as clock:
        tensor = open_run(url).tensor(name)
        values = [tensor.value(s) for s in tensor.steps(tensors=True)]
    return {**clock.to_dict(), "steps": len(values)}


def import_time() -> dict:
    out = subprocess.run([sys.executable, "-c", IMPORT_CODE], cwd=ROOT, capture_output=True, text=True, check=True)
    bare, api = map(float, out.stdout.split())
    return {"seconds": bare, "with_open_run": api}


def run(repeats: int, work: str, shared: dict, steps: int | None = None, **_) -> list[Row]:
    small, large = f"{work}/run-10k", f"{work}/run-1m"
    big = 1_000_000 if steps is None else 100 * max(SHARDS, steps)
    write_synthetic_run(small, 10_000)
    write_synthetic_run(large, big)
    for url in (small, large):  # the same run as a reader sees it while it is written: shards, no index yet
        shutil.copytree(url, f"{url}-live", ignore=shutil.ignore_patterns("index"))
    name, reduction = SERIES[-1]
    cases = {"import tripwire": import_time}
    for label, url, n in (("10,000", small, 10_000), (f"{big:,}", large, big)):
        for state, suffix in (("finished", ""), ("live", "-live")):
            cases[f"open + one {label}-step series ({state})"] = (
                lambda u=url + suffix, n=n: child("reading", "read_series", url=u, name=name, reduction=reduction,
                                                  expect=n))
    cases.update(_full_value_cases(work, shared, steps))
    results = interleaved(cases, max(repeats, 5 if steps is None else repeats))
    imports = results.pop("import tripwire")
    rows = [Row("reading", "import tripwire", median(r["seconds"] for r in imports), "s", "<= 0.2",
                samples=[r["seconds"] for r in imports]),
            Row("reading", "import tripwire + what open_run loads (numpy, fsspec)",
                median(r["with_open_run"] for r in imports), "s",
                samples=[r["with_open_run"] for r in imports])]
    targets = {"10,000": "<= 0.1", f"{big:,}": "<= 1"}
    for key, values in results.items():
        if isinstance(values[0], dict) and "error" in values[0]:
            rows.append(Row("reading", key, None, "s", note=values[0]["error"]))
            continue
        seconds = [r["seconds"] for r in values]
        target = next((t for label, t in targets.items() if f"one {label}-step" in key), "")
        rows.append(Row("reading", key, median(seconds), "s", target, samples=seconds))
    return rows


def _full_value_cases(work: str, shared: dict, steps: int | None) -> dict:
    """tripwire and smdebug reading one gradient's full values from their family-2 runs (trained here if needed)."""
    steps = 2000 if steps is None else steps
    if "tripwire_full_run" not in shared:
        shared["tripwire_full_run"] = f"{work}/tripwire-full"
        child("torch_loop", "train", config=torch_loop.FULL, steps=steps, out_dir=shared["tripwire_full_run"])
    cases = {"tripwire: open + one gradient's full values, every step": lambda: child(
        "reading", "read_values", url=shared["tripwire_full_run"], name="gradients/0.weight")}
    label = "smdebug: create_trial + the same gradient's values, every step"
    try:
        python = smdebug_env.python()
        if "smdebug_full_run" not in shared:
            shared["smdebug_full_run"] = f"{work}/smdebug-full"
            child("smdebug_side", "train", python=python, case="every_step", steps=steps,
                  out_dir=shared["smdebug_full_run"])
    except BenchError as exc:
        reason = str(exc)
        cases[label] = lambda: {"error": reason}
        return cases
    cases[label] = lambda: child("smdebug_side", "read", python=python, out_dir=shared["smdebug_full_run"],
                                 name="gradient/Sequential_0.weight")
    return cases
