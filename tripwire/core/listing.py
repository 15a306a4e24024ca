"""The runs under a root folder (`tripwire ls`, `tripwire report ROOT`): found by their manifests, at any depth.

Made for object stores, where every request costs a round trip: a run is
summarised from its manifest, its status objects, its verdicts and the
headers of its index files (no shard data is read; a shard's header only
where no index covers it yet, i.e. while a run is live), folder listings
use the store's delimiter (one request per folder, never a recursive
listing of the shards), the search stops descending at a run's folder, and
the runs are looked at concurrently.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from .progress import Progress
from .shardfile import decode_header, header_length
from .store import FINAL_STATES, INDEX_RE, MANIFEST, SHARD_RE, TEMP_PREFIX, opened_json, run_status

_THREADS = 16
_PREFIX = 65536  # bytes read at once for a header: most index and shard headers fit
_LONG_HEADERS = threading.BoundedSemaphore(2)  # headers longer than _PREFIX parsed at once, over all runs
MAX_HEADERS = 256  # shard headers read per run to count a live run's steps; beyond, its count is unknown


def list_runs(root: str, storage_options: dict | None = None) -> list[dict]:
    """One row per run under `root` (at any depth), oldest first: name, url, run_id, framework, status, created,
    steps (how many steps the run holds in mode train, or in its busiest mode if it has no train steps; the most
    of any worker; None where unknown), steps_by_mode ({mode: count}), last_step (the latest step of any mode),
    verdicts (fired at warning or error), info (fired at info), no_data, error (why the run could not be read, or
    None)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(root, **(storage_options or {}))
    path = path.rstrip("/")
    fs.invalidate_cache()
    local = "file" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol)
    with ThreadPoolExecutor(_THREADS) as pool:
        runs = _find(fs, pool, path)
        with Progress(len(runs), "listing runs") as bar:
            def summarise(found):
                row = _summarise(fs, *found)
                bar.update()
                return row

            rows = list(pool.map(summarise, runs))
    for row in rows:
        folder = row.pop("folder")
        row["name"] = folder[len(path):].strip("/") or "."
        row["url"] = folder if local else fs.unstrip_protocol(folder)
    return sorted(rows, key=lambda r: (r["created"] or 0, r["name"]))


def _entries(fs, folder: str) -> dict[str, dict]:
    """{name: fsspec info} of one folder, by one delimited listing; {} if it does not exist."""
    try:
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in fs.ls(folder, detail=True)}
    except (FileNotFoundError, NotADirectoryError):
        return {}


def run_names(root: str, storage_options: dict | None = None) -> list[str]:
    """The runs under `root` (at any depth), by their path below it, without reading them: what a verb given a
    folder of runs names instead."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(root, **(storage_options or {}))
    path = path.rstrip("/")
    with ThreadPoolExecutor(_THREADS) as pool:
        return sorted(folder[len(path):].strip("/") for folder, _ in _find(fs, pool, path))


def _find(fs, pool, root: str) -> list[tuple[str, dict]]:
    """(run folder, its entries) for every run at or below `root`, one level at a time (the folders of a level
    listed concurrently, one listing each); a run's own sub-folders are not searched, nor hidden folders."""
    local = "file" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol)
    seen: set[str] = set()
    runs, level = [], [root]
    while level:
        deeper = []
        for folder, entries in zip(level, pool.map(lambda f: _entries(fs, f), level)):
            if MANIFEST in entries and entries[MANIFEST].get("type") != "directory":
                runs.append((folder, entries))
                continue
            for name, e in sorted(entries.items()):
                if e.get("type") != "directory" or name.startswith("."):
                    continue
                sub = e["name"].rstrip("/")
                key = os.path.realpath(sub) if local else sub  # a symlink loop on a local disk is searched once
                if key not in seen:
                    seen.add(key)
                    deeper.append(sub)
        level = deeper
    return runs


def _summarise(fs, folder: str, entries: dict) -> dict:
    row = {"folder": folder, "run_id": None, "framework": None, "status": "unreadable", "created": None,
           "steps": None, "steps_by_mode": {}, "last_step": None, "verdicts": 0, "info": 0, "no_data": 0,
           "error": None}
    try:
        names = [MANIFEST]
        for sub in ("status", "verdicts"):
            if sub in entries:
                names += [f"{sub}/{n}" for n, e in sorted(_entries(fs, f"{folder}/{sub}").items())
                          if n.endswith(".json") and not n.startswith(TEMP_PREFIX) and e.get("type") != "directory"]
        blobs = fs.cat([f"{folder}/{n}" for n in names], on_error="return")
        objects = {}
        for name in names:
            blob = blobs.get(f"{folder}/{name}")
            try:
                objects[name] = opened_json(blob) if isinstance(blob, bytes) else None
            except ValueError:  # not JSON, or damaged (DamagedObject)
                objects[name] = None
        manifest = objects.get(MANIFEST)
        if not isinstance(manifest, dict):
            raise ValueError(f"{MANIFEST} is not a tripwire manifest")
        statuses = {int(n[7:12]): s for n, s in objects.items()
                    if n.startswith("status/") and n[7:12].isdigit() and isinstance(s, dict)}
        verdicts = [v for n, v in objects.items() if n.startswith("verdicts/") and isinstance(v, dict)]
        flush_s = float(manifest.get("config", {}).get("writer", {}).get("flush_every_s", 1.0))
        steps = [s["last_step"] for s in statuses.values() if isinstance(s.get("last_step"), int)]
        by_mode, finals = _step_counts(fs, folder, entries, statuses)
        row.update(run_id=manifest.get("run_id"), framework=manifest.get("framework"), created=manifest.get("created"),
                   status=run_status(statuses, stale_s=max(120.0, 20 * flush_s), finals=finals,
                                     created=manifest.get("created")),
                   last_step=max(steps, default=None),
                   verdicts=sum(v.get("status") == "fired" and v.get("severity", "warning") != "info"
                                for v in verdicts),
                   info=sum(v.get("status") == "fired" and v.get("severity") == "info" for v in verdicts),
                   no_data=sum(v.get("status") == "no_data" for v in verdicts))
        if by_mode is not None:
            row["steps_by_mode"] = by_mode
            row["steps"] = by_mode.get("train", max(by_mode.values(), default=0))
    except Exception as exc:  # noqa: BLE001 - one broken run must not hide the others
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


def _step_counts(fs, folder: str, entries: dict, statuses: dict) -> tuple[dict[str, int] | None, dict[int, str]]:
    """{mode: steps} (the most of any worker) from headers alone, or None where that would cost too much; and
    {worker: state} where the worker's newest index marks how it closed the run and covers what it wrote.

    Each worker's newest index holds its distinct steps per mode (`rows`); shards written after it (a live run,
    or one that never wrote an index) add theirs. shards/ is listed only where a worker's status says it wrote
    shards its index does not cover, or where a worker has no index."""
    indexes: dict[int, tuple[int, str]] = {}  # worker -> (upto, path) of its newest index
    if "index" in entries:
        for name in _entries(fs, f"{folder}/index"):
            m = INDEX_RE.match(name)
            if m and int(m.group(2)) >= indexes.get(int(m.group(1)), (-1, ""))[0]:
                indexes[int(m.group(1))] = (int(m.group(2)), f"{folder}/index/{name}")
    written = {w: s["shards"] for w, s in statuses.items() if isinstance(s.get("shards"), int)}  # the next seq
    covered = bool(written) and all(indexes.get(w, (-1, ""))[0] >= n - 1 for w, n in written.items())
    shards = []
    if "shards" in entries and not covered:
        for name in _entries(fs, f"{folder}/shards"):
            m = SHARD_RE.match(name)
            if m and int(m.group(2)) > indexes.get(int(m.group(1)), (-1, ""))[0]:
                shards.append((int(m.group(1)), f"{folder}/shards/{name}"))
    later = {w for w, _ in shards}
    files = [(w, path) for w, (_, path) in indexes.items()] + (shards if len(shards) <= MAX_HEADERS else [])
    counts: dict[tuple[int, str], int] = {}
    finals: dict[int, str] = {}
    for (worker, path), meta in zip(files, _metas(fs, [path for _, path in files])):
        rows = meta.get("rows", {})
        for mode, n in (rows.items() if isinstance(rows, dict) else ()):
            if isinstance(n, int) and n >= 0:
                counts[(worker, str(mode))] = counts.get((worker, str(mode)), 0) + n
        if path.startswith(f"{folder}/index/") and worker not in later and meta.get("final") in FINAL_STATES \
                and indexes[worker][0] >= written.get(worker, 0) - 1:
            finals[worker] = meta["final"]
    if len(shards) > MAX_HEADERS:
        return None, finals
    out: dict[str, int] = {}
    for (_, mode), n in counts.items():
        out[mode] = max(out.get(mode, 0), n)
    return dict(sorted(out.items())), finals


def _metas(fs, paths: list[str]) -> list[dict]:
    """The tripwire metadata of each file's header: one ranged read each, a second where a header is longer
    than the first read; an unreadable file gives {}."""
    if not paths:
        return []
    out = []
    prefixes = fs.cat_ranges(paths, [0] * len(paths), [_PREFIX] * len(paths), on_error="return")
    for path, prefix in zip(paths, prefixes):
        try:
            if isinstance(prefix, BaseException):
                raise prefix
            n = header_length(prefix)
            if len(prefix) >= 8 + n:
                out.append(decode_header(prefix[8:8 + n])[1])
                continue
            with _LONG_HEADERS:  # a long header costs several times its size while parsed: few at once
                out.append(decode_header(fs.cat_file(path, start=8, end=8 + n))[1])
        except (ValueError, OSError, TypeError):
            out.append({})
    return out
