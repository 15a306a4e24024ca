"""What one sampled step holds, what a plugin may copy of it, and how samples become a shard's entries: the
unit the writer queues, bounds and stores (docs/format.md describes the shard)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from .store import FORMAT_VERSION


@dataclass
class Sample:
    """Everything captured at one (step, mode) of one worker."""

    step: int
    mode: str
    values: dict  # tensor name -> {reduction: float}
    tensors: dict = field(default_factory=dict)  # tensor name -> np.ndarray (full values)
    # a sampled step, a row of the run (run.steps(), where the rules judge); False: scalars the framework handed
    # over between samples (Recorder.scalars), in the series but no row
    row: bool = True

    @property
    def nbytes(self) -> int:
        return 64 + 16 * sum(len(r) for r in self.values.values()) + sum(a.nbytes for a in self.tensors.values())


class TensorBudget:
    """What a plugin may copy of one sampled step's full tensors: the room in the writer's queue when the step
    began. A tensor past it is never copied (`left_out` names it), so the copies of a step cannot take memory
    past the bound; its reductions are taken all the same."""

    def __init__(self, room: int):
        self.room = room
        self.left_out: dict[str, int] = {}  # name -> bytes
        self.asked = 0  # bytes of every full tensor the step asked to copy, left out or not

    def take(self, name: str, nbytes: int) -> bool:
        """Whether to copy this tensor (and count it against the room)."""
        self.asked += nbytes
        if nbytes > self.room:
            self.left_out[name] = nbytes
            return False
        self.room -= nbytes
        return True


def shard_contents(samples: list[Sample], worker: int, seq: int) -> tuple[dict, dict]:
    """The shard's entries and metadata: steps per mode, one column per series, then the full tensors."""
    rows: dict[str, set] = collections.defaultdict(set)
    series: dict[tuple, tuple[list, list]] = {}
    tensors = []
    for s in samples:
        if s.row:
            rows[s.mode].add(s.step)
        for name, reductions in s.values.items():
            for reduction, value in reductions.items():
                steps, values = series.setdefault((s.mode, name, reduction), ([], []))
                steps.append(s.step)
                values.append(value)
        for name, array in s.tensors.items():
            tensors.append((s.mode, name, s.step, array))
    entries: dict[str, np.ndarray] = {}
    meta: dict = {"format_version": FORMAT_VERSION, "kind": "shard", "worker": worker, "seq": seq,
                  "rows": {m: len(v) for m, v in rows.items()}, "steps": {}, "series": [], "tensors": []}
    for i, (mode, steps) in enumerate(sorted(rows.items())):
        entries[f"m{i}"] = np.array(sorted(steps), dtype=np.int64)
        meta["steps"][mode] = f"m{i}"
    step_entries: dict[tuple, str] = {}
    for i, ((mode, name, reduction), (steps, values)) in enumerate(series.items()):
        key = tuple(steps)
        if key not in step_entries:
            step_entries[key] = f"s{len(step_entries)}"
            entries[step_entries[key]] = np.array(steps, dtype=np.int64)
        entries[f"v{i}"] = np.array(values, dtype=np.float64)
        meta["series"].append([mode, name, reduction, f"v{i}", step_entries[key]])
    meta["section"] = sum(a.nbytes for a in entries.values())
    for i, (mode, name, step, array) in enumerate(tensors):
        entries[f"t{i}"] = array
        meta["tensors"].append([mode, name, step, f"t{i}"])
    return entries, meta
