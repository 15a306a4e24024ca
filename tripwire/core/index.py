"""The consolidated index: one file per worker that holds every series of shards <= upto contiguously.

Written when a writer closes, so that opening a finished run reads one header
and one byte range per series instead of one per shard. Full tensors are not
copied: the index lists where each one lies in its shard.
"""

from __future__ import annotations

import numpy as np

from .shardfile import encode
from .store import FORMAT_VERSION, Store, index_name


def write_index(store: Store, worker: int, upto: int) -> None:
    from .run import Run

    run = Run(store)
    entries: dict[str, np.ndarray] = {}
    meta: dict = {"format_version": FORMAT_VERSION, "kind": "index", "worker": worker, "upto": upto,
                  "rows": {}, "steps": {}, "series": [], "tensors": []}
    modes = sorted({m for w, m, _ in run._catalog if w == worker} | {m for w, m in run._step_chunks if w == worker})
    for i, mode in enumerate(modes):
        steps = run._steps(mode, worker)
        entries[f"m{i}"] = steps
        meta["steps"][mode] = f"m{i}"
        meta["rows"][mode] = int(len(steps))
    step_entries: dict[bytes, str] = {}
    series_keys = [k for k in run._chunks if k[0] == worker]  # capture order: readers list names in it
    for i, (_, mode, name, reduction) in enumerate(series_keys):
        steps, values = run._series(name, reduction, mode, worker)
        key = steps.tobytes()
        if key not in step_entries:
            step_entries[key] = f"s{len(step_entries)}"
            entries[step_entries[key]] = steps
        entries[f"v{i}"] = values
        meta["series"].append([mode, name, reduction, f"v{i}", step_entries[key]])
    meta["section"] = sum(a.nbytes for a in entries.values())
    for (w, mode, name), located in run._tensor_loc.items():
        if w != worker:
            continue
        for step, (rel, entry) in sorted(located.items()):
            meta["tensors"].append([mode, name, step, rel, entry.begin, entry.end, entry.dtype, list(entry.shape)])
    store.put(index_name(worker, upto), encode(entries, meta))
