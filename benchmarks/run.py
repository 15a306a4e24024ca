"""`make bench`: run the benchmark families, print one table, write it as JSON (benchmarks/results/latest.json).

    python -m benchmarks.run                                   # everything (about 15-20 minutes)
    python -m benchmarks.run --only lightning,reading --repeats 3
    python -m benchmarks.run --steps 300                       # a quick pass over smaller sizes
    python -m benchmarks.run --only lightning,torch --device cuda   # the overhead on a GPU

Every figure is a ratio or a time measured in this run; each configuration
runs `--repeats` times, interleaved with the others, and the median is shown.
docs/benchmarks.md says what each figure means.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from importlib import metadata

from . import frameworks, lightning_overhead, reaction, reading, steps, throughput, torch_loop
from .common import ROOT, BenchError, Row

FAMILIES = {
    "lightning": lightning_overhead.run,
    "torch": torch_loop.run,
    "steps": steps.run,
    "throughput": throughput.run,
    "reading": reading.run,
    "reaction": reaction.run,
    "keras": frameworks.run_keras,
    "xgboost": frameworks.run_xgboost,
}
RESULTS = ROOT / "benchmarks" / "results"


def gpu() -> str:
    """The GPU's name as nvidia-smi gives it (the parent process does not start CUDA itself)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else "?"


def machine(device: str) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    versions = {}
    for package in ("torch", "lightning", "numpy", "tensorflow-cpu", "keras", "xgboost-cpu", "tripwire"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "device": device, **({"gpu": gpu()} if device == "cuda" else {}), **versions}


def fmt(row: Row) -> tuple:
    if row.value is None:
        value = "n/a"
    elif row.unit == "x":
        value = f"{row.value:.3f}x"
    elif row.unit == "s":
        value = f"{row.value:.3f} s"
    elif row.unit in ("MB/s", "steps"):
        value = f"{row.value:,.0f} {row.unit}"
    else:
        value = f"{row.value:.2f}"
    met = {True: "met", False: "MISSED", None: ""}[row.met]
    cpu = f"{row.cpu:.3f}x" if row.cpu is not None else ""
    return row.family, row.name, value, cpu, row.target.replace("<=", "≤").replace(">=", "≥"), met, row.note


def table(rows: list[Row]) -> str:
    header = ("family", "figure", "median", "cpu time", "target", "", "note")
    lines = [header] + [fmt(r) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    out = []
    for i, line in enumerate(lines):
        note = line[-1] if len(line[-1]) < 140 else line[-1][:137] + "..."
        out.append("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + note)
        if i == 0:
            out.append("-" * len(out[0]))
    return "\n".join(line.rstrip() for line in out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    parser.add_argument("--only", help=f"comma-separated families: {', '.join(FAMILIES)}")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration (median; default 3)")
    parser.add_argument("--steps", type=int, help="training steps instead of the documented sizes (quick runs)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the lightning and torch families train (default cpu)")
    parser.add_argument("--out", default=str(RESULTS / "latest.json"), help="where to write the JSON")
    args = parser.parse_args(argv)
    chosen = args.only.split(",") if args.only else list(FAMILIES)
    unknown = [f for f in chosen if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown family {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.device == "cuda" and set(chosen) - {"lightning", "torch"}:
        parser.error("--device cuda measures the lightning and torch families only: add --only lightning,torch")

    started, load_before = time.time(), os.getloadavg()
    work = tempfile.mkdtemp(prefix="tripwire-bench-")
    shared: dict = {}  # what one family leaves for another (the plain-loop runs the reading family reads)
    rows: list[Row] = []
    try:
        for family in chosen:
            print(f"[{time.strftime('%H:%M:%S')}] {family} …", file=sys.stderr, flush=True)
            try:
                rows += FAMILIES[family](repeats=args.repeats, work=work, shared=shared, steps=args.steps,
                                         device=args.device)
            except BenchError as exc:
                rows.append(Row(family, "(family)", None, "", note=f"n/a: {exc}"))
            except Exception as exc:  # noqa: BLE001 - one broken family must not hide the others' figures
                traceback.print_exc()
                rows.append(Row(family, "(family)", None, "", note=f"failed: {type(exc).__name__}: {exc}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    info = {**machine(args.device), "load_average_before": load_before, "load_average_after": os.getloadavg()}
    text = table(rows)
    on_gpu = f", on {info['gpu']}" if "gpu" in info else ""
    print(f"tripwire benchmarks — {info['cpu']}, {info['cores']} cores{on_gpu}, python {info['python']}, "
          f"torch {info.get('torch', '?')}; load average {load_before[0]:.2f} before, "
          f"{info['load_average_after'][0]:.2f} after; median of {args.repeats}, interleaved")
    print(text)
    report = {"started": started, "seconds": time.time() - started, "args": vars(args), "machine": info,
              "rows": [r.to_dict() for r in rows]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    temp = f"{args.out}.tmp"
    with open(temp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(temp, args.out)
    print(f"written to {os.path.relpath(args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
