"""The run store: where a run's objects live, and whole-object I/O through fsspec.

Layout of a run folder (docs/format.md is the full description):

    run.json                                  manifest, written once when the run starts
    status/<worker>.json                      each worker's state and heartbeat (replaced whole)
    shards/<worker>-<seq>.safetensors         one per flush per worker, immutable
    index/<worker>-<upto>.safetensors         consolidated series of shards <= upto, written at close
    verdicts/<worker>-<step>-<rule>-<id>.json one per verdict, immutable
    checkpoints/, report.json, report.html    written by actions

Every object appears whole or not at all: local files are written to a
temporary name and renamed; object stores get one PUT.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid

FORMAT_VERSION = 1
MANIFEST = "run.json"
SHARD_RE = re.compile(r"^(\d{5})-(\d{8})\.safetensors$")
INDEX_RE = re.compile(r"^(\d{5})-(\d{8})\.safetensors$")
TEMP_PREFIX = ".tmp-"


def shard_name(worker: int, seq: int) -> str:
    return f"shards/{worker:05d}-{seq:08d}.safetensors"


def index_name(worker: int, upto: int) -> str:
    return f"index/{worker:05d}-{upto:08d}.safetensors"


def status_name(worker: int) -> str:
    return f"status/{worker:05d}.json"


def verdict_name(worker: int, step: int, rule: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", rule)[:64] or "rule"
    return f"verdicts/{worker:05d}-{step:012d}-{safe}-{uuid.uuid4().hex[:8]}.json"


class Store:
    """One run folder at an fsspec URL."""

    def __init__(self, url: str, storage_options: dict | None = None):
        import fsspec

        self.url = str(url).rstrip("/")
        self.fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.local = "file" in _protocols(self.fs)
        self._made: set[str] = set()

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def url_of(self, rel: str) -> str:
        """The URL of an object of the run, for code that opens URLs itself (framework checkpoint writers)."""
        return f"{self.url}/{rel}"

    def put(self, rel: str, data) -> None:
        """Write an object whole: temp file + rename locally, a single PUT elsewhere. `data`: bytes or chunks."""
        chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
        path = self.path(rel)
        folder = path.rsplit("/", 1)[0]
        if folder not in self._made:
            self.fs.makedirs(folder, exist_ok=True)
            self._made.add(folder)
        if self.local:
            temp = f"{folder}/{TEMP_PREFIX}{uuid.uuid4().hex}"
            try:
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                try:
                    _write_all(fd, chunks)
                finally:
                    os.close(fd)
                os.replace(temp, path)
            except BaseException:
                if os.path.exists(temp):
                    os.unlink(temp)
                raise
        else:  # one PUT of one bytes object; bytes handed in whole are not copied again
            self.fs.pipe_file(path, data if isinstance(data, bytes) else b"".join(chunks))

    def get(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.fs.cat_file(self.path(rel), start=start, end=end)

    def put_json(self, rel: str, obj) -> None:
        self.put(rel, json.dumps(obj, indent=1, allow_nan=False).encode())

    def get_json(self, rel: str):
        return json.loads(self.get(rel))

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def list(self, folder: str) -> dict[str, int]:
        """{name: size} of the objects in a folder of the run (fresh, not from a listing cache)."""
        path = self.path(folder)
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out = {}
        for e in entries:
            if e.get("type") == "directory":
                continue
            out[e["name"].rstrip("/").rsplit("/", 1)[-1]] = int(e.get("size") or 0)
        return out


def _write_all(fd: int, chunks) -> None:
    """Write the chunks in order with as few system calls as possible (a shard of full tensors holds
    thousands): a list of them up to IOV_MAX (1024 on Linux and macOS) per writev, resuming after a partial
    write; chunks handed in one by one (an iterator), or where there is no writev (Windows), one write each."""
    if not isinstance(chunks, list) or not hasattr(os, "writev"):
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            while len(view):
                view = view[os.write(fd, view):]
        return
    views = [view for view in (memoryview(c).cast("B") for c in chunks) if len(view)]
    at = 0
    while at < len(views):
        written = os.writev(fd, views[at:at + 1024])
        while written and written >= len(views[at]):
            written -= len(views[at])
            at += 1
        if written:
            views[at] = views[at][written:]


def _protocols(fs) -> tuple:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def output_url(template: str, run_id: str) -> str:
    return template.replace("{run_id}", run_id)


def host_and_pid() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def run_status(statuses: dict[int, dict], now: float | None = None, stale_s: float = 120.0) -> str:
    """The run's state from its workers' status objects.

    finished / stopped / failed once every worker has closed; running while they write;
    crashed where a worker's process on this host is gone without closing; unknown where
    a worker elsewhere has not been heard from for `stale_s` seconds.
    """
    statuses = {w: s for w, s in statuses.items() if isinstance(s, dict)}  # foreign objects say nothing
    if not statuses:
        return "unknown"
    states = {s.get("state") for s in statuses.values() if isinstance(s.get("state"), str)}
    if "failed" in states:
        return "failed"
    live = [s for s in statuses.values() if s.get("state") == "running"]
    if not live:
        return "stopped" if "stopped" in states else "finished"
    now = time.time() if now is None else now
    here = socket.gethostname()
    for s in live:
        if s.get("host") == here and not _alive(s.get("pid")):
            return "crashed"
    if any(now - _number(s.get("heartbeat")) > stale_s for s in live):
        return "unknown"
    return "running"


def _number(x) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else 0.0


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
