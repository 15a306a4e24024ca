"""What every benchmark family shares: fresh child processes, interleaved repeats, medians, rows of the table.

A configuration runs in a fresh interpreter (`python -m benchmarks.child`) so
that no configuration inherits another's imports, threads, caches or garbage;
with and without tripwire get the same process layout. Configurations are
repeated interleaved (A B C A B C …) so that a neighbour's load on a shared
machine falls on all of them alike, and the median is reported.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "BENCH-RESULT "


class BenchError(RuntimeError):
    """A benchmark could not run; the message is what the table shows instead of a figure."""


@dataclass
class Row:
    """One line of the table: a figure (a ratio or a time measured in this run), its target and its samples."""

    family: str
    name: str
    value: float | None
    unit: str  # "x" (ratio), "s", "steps", "MB/s", "fraction"
    target: str = ""  # e.g. "<= 1.02"; empty: reported, no target
    samples: list = field(default_factory=list)
    cpu: float | None = None  # the same ratio in CPU time of the process (all threads): what neighbours barely move
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.value is None or not self.target:
            return None
        op, bound = self.target.split()
        return self.value <= float(bound) if op == "<=" else self.value >= float(bound)

    def to_dict(self) -> dict:
        return {**asdict(self), "met": self.met}


def child(module: str, function: str, python: str | None = None, timeout: float = 900, env: dict | None = None,
          **kwargs) -> dict:
    """Call benchmarks.<module>.<function>(**kwargs) in a fresh interpreter and return its dict."""
    cmd = [python or sys.executable, "-m", "benchmarks.child", module, function, json.dumps(kwargs)]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "TF_CPP_MIN_LOG_LEVEL": "3",
                **(env or {})}
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{module}.{function} took longer than {timeout:.0f} s") from None
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = (done.stderr or done.stdout).strip().splitlines()[-12:]
    raise BenchError(f"{module}.{function} exited {done.returncode}: " + " | ".join(tail))


def interleaved(cases: dict, repeats: int) -> dict[str, list]:
    """Call each case's function once per round, in order, for `repeats` rounds: {case: [result per round]}."""
    results: dict[str, list] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, run in cases.items():
            results[name].append(run())
    return results


def median(values) -> float:
    return float(statistics.median(values))


def ratios(results: list[dict], baseline: list[dict], key: str = "seconds") -> list[float]:
    """Per-round ratios case/baseline: each pair ran next to each other, so slow phases of the machine cancel."""
    return [r[key] / b[key] for r, b in zip(results, baseline)]


def overhead_row(family: str, name: str, results: list[dict], baseline: list[dict], target: str = "") -> Row:
    """A with/without row: median wall-time ratio (the figure), median CPU-time ratio beside it."""
    wall = ratios(results, baseline)
    return Row(family, name, median(wall), "x", target, samples=wall,
               cpu=median(ratios(results, baseline, "cpu_seconds")))


class Clock:
    """Wall and CPU time of a block: `with Clock() as c: …` then c.seconds, c.cpu_seconds.

    A full garbage collection runs before the clock starts. Imports and set-up leave the collector a debt
    of a few hundred milliseconds (a full pass over torch's, Lightning's or TensorFlow's objects); without
    the collection it falls inside the clock of whichever configuration happens to cross the threshold
    first, which decides a ratio more than anything measured."""

    def __enter__(self):
        gc.collect()
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self._wall
        self.cpu_seconds = time.process_time() - self._cpu

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "cpu_seconds": self.cpu_seconds}
