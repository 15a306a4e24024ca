"""The runs under a root folder (`tripwire ls`, `tripwire report ROOT`): found by their manifests, two levels down.

Made for object stores, where every request costs a round trip: a run is
summarised from its manifest, its status objects and its verdicts alone (no
shard is opened), folder listings use the store's delimiter (one request per
folder, never a recursive listing of the shards), and the runs are looked at
concurrently.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from .progress import Progress
from .store import MANIFEST, TEMP_PREFIX, run_status

DEPTH = 2  # the root itself, its sub-folders and theirs
_THREADS = 16


def list_runs(root: str, storage_options: dict | None = None) -> list[dict]:
    """One row per run under `root`, oldest first: name, url, run_id, framework, status, created, last_step,
    verdicts (fired), no_data, error (why the run could not be read, or None)."""
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


def _find(fs, pool, root: str) -> list[tuple[str, dict]]:
    """(run folder, its entries) for every run at or below `root`, one level at a time; a run's own sub-folders
    are not searched."""
    runs, level = [], [root]
    for depth in range(DEPTH + 1):
        deeper = []
        for folder, entries in zip(level, pool.map(lambda f: _entries(fs, f), level)):
            if MANIFEST in entries and entries[MANIFEST].get("type") != "directory":
                runs.append((folder, entries))
            elif depth < DEPTH:
                deeper += [e["name"].rstrip("/") for name, e in sorted(entries.items())
                           if e.get("type") == "directory" and not name.startswith(".")]
        level = deeper
    return runs


def _summarise(fs, folder: str, entries: dict) -> dict:
    row = {"folder": folder, "run_id": None, "framework": None, "status": "unreadable", "created": None,
           "last_step": None, "verdicts": 0, "no_data": 0, "error": None}
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
                objects[name] = json.loads(blob) if isinstance(blob, bytes) else None
            except ValueError:
                objects[name] = None
        manifest = objects.get(MANIFEST)
        if not isinstance(manifest, dict):
            raise ValueError(f"{MANIFEST} is not a tripwire manifest")
        statuses = {n: s for n, s in objects.items() if n.startswith("status/") and isinstance(s, dict)}
        verdicts = [v for n, v in objects.items() if n.startswith("verdicts/") and isinstance(v, dict)]
        flush_s = float(manifest.get("config", {}).get("writer", {}).get("flush_every_s", 1.0))
        steps = [s["last_step"] for s in statuses.values() if isinstance(s.get("last_step"), int)]
        row.update(run_id=manifest.get("run_id"), framework=manifest.get("framework"), created=manifest.get("created"),
                   status=run_status({i: s for i, s in enumerate(statuses.values())}, stale_s=max(120.0, 20 * flush_s)),
                   last_step=max(steps, default=None),
                   verdicts=sum(v.get("status") == "fired" for v in verdicts),
                   no_data=sum(v.get("status") == "no_data" for v in verdicts))
    except Exception as exc:  # noqa: BLE001 - one broken run must not hide the others
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row
