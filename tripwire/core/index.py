"""The consolidated index: one file per worker that holds every series of shards <= upto contiguously.

Written when a writer closes, so that opening a finished run reads one header
and one byte range per series instead of one per shard. Full tensors are not
copied: the index lists where each one lies in its shard.

The writer keeps what it stored consolidated in memory (`Consolidated`) while
that stays small, and writes the index from there; a run too large for that,
or one resumed over shards of an earlier process, is read back from the store.
"""

from __future__ import annotations

import logging

import numpy as np

from .shardfile import MAX_HEADER, dtype_code, encode, entry_ranges
from .store import FORMAT_VERSION, SHARD_RE, Store, index_name
from .view import merge_sorted

log = logging.getLogger("tripwire")
MAX_KEPT_BYTES = 16 << 20  # series kept in memory for the index; past it, the index reads the shards back


def encode_index(worker: int, upto: int, steps: dict, series: dict, tensors: list, sizes: dict,
                 final: str | None = None) -> list:
    """The index as byte chunks: steps {mode: sorted int64}, series {(mode, name, reduction): (steps, values)}
    in capture order, tensors [[mode, name, step, shard, begin, end, dtype, shape, crc32]], sizes {seq: bytes} of
    the shards it covers (a reader tells a shard cut short from them), and `final`, the state the writer closed
    the run in (a reader trusts it where the final status could not be written)."""
    entries: dict[str, np.ndarray] = {}
    meta: dict = {"format_version": FORMAT_VERSION, "kind": "index", "worker": worker, "upto": upto,
                  "rows": {}, "steps": {}, "series": [], "tensors": tensors,
                  "shards": {str(seq): size for seq, size in sorted(sizes.items())},
                  **({"final": final} if final else {})}
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


def write_index(store: Store, worker: int, upto: int, kept: Consolidated | None = None,
                final: str | None = None) -> None:
    """The index of the worker's shards <= upto: from `kept` where it holds all of them, else read back.
    final: the state the run closes in, when the writer closes it."""
    if kept is not None and kept.complete:
        _put(store, index_name(worker, upto), kept.encode(upto, final))
        return
    from .run import Run

    run = Run(store)
    modes = sorted({m for w, m, _ in run._catalog if w == worker} | {m for w, m in run._step_chunks if w == worker})
    steps = {mode: run._steps(mode, worker) for mode in modes}
    series = {(mode, name, reduction): run._series(name, reduction, mode, worker)  # capture order
              for w, mode, name, reduction in run._chunks if w == worker}
    tensors = [[mode, name, step, rel, entry.begin, entry.end, entry.dtype, list(entry.shape), entry.crc]
               for (w, mode, name), located in run._tensor_loc.items() if w == worker
               for step, (rel, entry) in sorted(located.items())]
    listed = ((SHARD_RE.match(name), size) for name, size in store.list("shards").items())
    sizes = {int(m.group(2)): size for m, size in listed if m and int(m.group(1)) == worker and int(m.group(2)) <= upto}
    _put(store, index_name(worker, upto), encode_index(worker, upto, steps, series, tensors, sizes, final))


def _put(store: Store, rel: str, chunks: list) -> None:
    """Write the index, unless its header is longer than a reader accepts: then the shards serve."""
    if len(chunks[0]) > 8 + MAX_HEADER:
        log.info("tripwire: the index of %s would have a header of %d MiB, more than a reader accepts (%d MiB); "
                 "the run reads from its shards.", store.url, len(chunks[0]) >> 20, MAX_HEADER >> 20)
        return
    store.put(rel, chunks)


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
        self._sizes: dict[int, int] = {}  # seq -> bytes of each shard
        self._bytes = 0

    @staticmethod
    def summary(shard: str, meta: dict, entries: dict, chunks: list) -> tuple:
        """What the index needs of a shard (its metadata and entries as `encode` left them, and the chunks it
        made): its steps and series, where its full tensors lie and their checksums, its size; without holding
        the tensors."""
        ranges = entry_ranges(chunks, entries)
        steps = [(mode, entries[key]) for mode, key in meta["steps"].items()]
        series = [((mode, name, reduction), (entries[at], entries[values]))
                  for mode, name, reduction, values, at in meta["series"]]
        tensors = [[mode, name, step, shard, *ranges[key], dtype_code(entries[key]), list(entries[key].shape),
                    meta["crc32"][key]] for mode, name, step, key in meta["tensors"]]
        return steps, series, tensors, meta["section"] + 64 * len(tensors), (meta["seq"], sum(map(len, chunks)))

    def add(self, summary: tuple) -> None:
        """A shard written, as `summary` gave it."""
        if not self.complete:
            return
        steps, series, tensors, nbytes, (seq, size) = summary
        self._sizes[seq] = size
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
        self._steps, self._series, self._tensors, self._sizes = {}, {}, {}, {}

    def encode(self, upto: int, final: str | None = None) -> list:
        steps = {mode: np.unique(np.concatenate(parts)) for mode, parts in self._steps.items()}
        series = {key: merge_sorted(chunks) for key, chunks in self._series.items()}
        tensors = [location for located in self._tensors.values() for _, location in sorted(located.items())]
        return encode_index(self.worker, upto, steps, series, tensors, self._sizes, final)
