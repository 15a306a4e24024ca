"""The consolidated index: one file per worker that holds every series of shards <= upto contiguously.

Written when a writer closes, so that opening a finished run reads one header
and one byte range per series instead of one per shard. Full tensors are not
copied: the index lists where each one lies in its shard.

The writer keeps what it stored consolidated in memory (`Consolidated`) while
that stays small, and writes the index from there; a run too large for that,
or one resumed over shards of an earlier process, is read back from the store.
"""

from __future__ import annotations

import numpy as np

from .shardfile import dtype_code, encode
from .store import FORMAT_VERSION, Store, index_name
from .view import merge_sorted

MAX_KEPT_BYTES = 16 << 20  # series kept in memory for the index; past it, the index reads the shards back


def encode_index(worker: int, upto: int, steps: dict, series: dict, tensors: list) -> list:
    """The index as byte chunks: steps {mode: sorted int64}, series {(mode, name, reduction): (steps, values)}
    in capture order, tensors [[mode, name, step, shard, begin, end, dtype, shape]]."""
    entries: dict[str, np.ndarray] = {}
    meta: dict = {"format_version": FORMAT_VERSION, "kind": "index", "worker": worker, "upto": upto,
                  "rows": {}, "steps": {}, "series": [], "tensors": tensors}
    for i, mode in enumerate(sorted(steps)):
        entries[f"m{i}"] = steps[mode]
        meta["steps"][mode] = f"m{i}"
        meta["rows"][mode] = int(len(steps[mode]))
    step_entries: dict[bytes, str] = {}
    for i, ((mode, name, reduction), (at, values)) in enumerate(series.items()):
        key = at.tobytes()
        if key not in step_entries:
            step_entries[key] = f"s{len(step_entries)}"
            entries[step_entries[key]] = at
        entries[f"v{i}"] = values
        meta["series"].append([mode, name, reduction, f"v{i}", step_entries[key]])
    meta["section"] = sum(a.nbytes for a in entries.values())
    return encode(entries, meta)


def write_index(store: Store, worker: int, upto: int, kept: Consolidated | None = None) -> None:
    """The index of the worker's shards <= upto: from `kept` where it holds all of them, else read back."""
    if kept is not None and kept.complete:
        store.put(index_name(worker, upto), kept.encode(upto))
        return
    from .run import Run

    run = Run(store)
    modes = sorted({m for w, m, _ in run._catalog if w == worker} | {m for w, m in run._step_chunks if w == worker})
    steps = {mode: run._steps(mode, worker) for mode in modes}
    series = {(mode, name, reduction): run._series(name, reduction, mode, worker)  # capture order
              for w, mode, name, reduction in run._chunks if w == worker}
    tensors = [[mode, name, step, rel, entry.begin, entry.end, entry.dtype, list(entry.shape)]
               for (w, mode, name), located in run._tensor_loc.items() if w == worker
               for step, (rel, entry) in sorted(located.items())]
    store.put(index_name(worker, upto), encode_index(worker, upto, steps, series, tensors))


class Consolidated:
    """The shards one writer stored, consolidated as they are written: what `write_index` needs, without
    reading them back. Complete only while it holds every shard of the worker (the writer began the
    worker's first shard and lost none) and its series stay under MAX_KEPT_BYTES."""

    def __init__(self, worker: int, first_seq: int):
        self.worker = worker
        self.complete = first_seq == 0
        self._steps: dict[str, list] = {}
        self._series: dict[tuple, list] = {}
        self._tensors: dict[tuple, dict] = {}  # (mode, name) -> {step: location}, in capture order
        self._bytes = 0

    @staticmethod
    def summary(shard: str, meta: dict, entries: dict, ranges: dict) -> tuple:
        """What the index needs of a shard (its metadata, entries and their absolute byte ranges): its steps
        and series, and where its full tensors lie, without holding them."""
        steps = [(mode, entries[key]) for mode, key in meta["steps"].items()]
        series = [((mode, name, reduction), (entries[at], entries[values]))
                  for mode, name, reduction, values, at in meta["series"]]
        tensors = [[mode, name, step, shard, *ranges[key], dtype_code(entries[key]), list(entries[key].shape)]
                   for mode, name, step, key in meta["tensors"]]
        return steps, series, tensors, meta["section"] + 64 * len(tensors)

    def add(self, summary: tuple) -> None:
        """A shard written, as `summary` gave it."""
        if not self.complete:
            return
        steps, series, tensors, nbytes = summary
        for mode, at in steps:
            self._steps.setdefault(mode, []).append(at)
        for key, chunk in series:
            self._series.setdefault(key, []).append(chunk)
        for location in tensors:
            self._tensors.setdefault((location[0], location[1]), {})[location[2]] = location
        self._bytes += nbytes
        if self._bytes > MAX_KEPT_BYTES:
            self.lose()

    def lose(self) -> None:
        """A shard was not written, or there is too much to keep: the index will be read from the store."""
        self.complete = False
        self._steps, self._series, self._tensors = {}, {}, {}

    def encode(self, upto: int) -> list:
        steps = {mode: np.unique(np.concatenate(parts)) for mode, parts in self._steps.items()}
        series = {key: merge_sorted(chunks) for key, chunks in self._series.items()}
        tensors = [location for located in self._tensors.values() for _, location in sorted(located.items())]
        return encode_index(self.worker, upto, steps, series, tensors)
