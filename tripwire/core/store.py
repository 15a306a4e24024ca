"""The run store: where a run's objects live, and whole-object I/O through fsspec.

Layout of a run folder (docs/format.md is the full description):

    run.json                                  manifest, written once when the run starts
    status/<worker>.json                      each worker's state and heartbeat (replaced whole)
    shards/<worker>-<seq>.safetensors         one per flush per worker, immutable
    index/<worker>-<upto>.safetensors         consolidated series of shards <= upto, written at close
    verdicts/<worker>-<step>-<rule>-<id>.json one per verdict, immutable
    first_step/<worker>.json                  what the plugin saw of the loss at its first step, immutable
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

from .errors import OutsideRun
from .shardfile import crc_of

# 2: every header, data entry and JSON object carries a crc32 (docs/format.md); runs of format 1 still open
FORMAT_VERSION = 2
CHECKSUMMED_SINCE = 2
CRC_KEY = "crc32"
FINAL_STATES = ("finished", "stopped", "failed")  # the states a writer closes a run in
MANIFEST = "run.json"
SHARD_RE = re.compile(r"^(\d{5})-(\d{8})\.safetensors$")
INDEX_RE = re.compile(r"^(\d{5})-(\d{8})\.safetensors$")
TEMP_PREFIX = ".tmp-"
MAX_JSON_BYTES = 64 << 20  # a manifest, status, verdict or first-step record is far smaller


def shard_name(worker: int, seq: int) -> str:
    return f"shards/{worker:05d}-{seq:08d}.safetensors"


def index_name(worker: int, upto: int) -> str:
    return f"index/{worker:05d}-{upto:08d}.safetensors"


def first_step_name(worker: int) -> str:
    return f"first_step/{worker:05d}.json"


def status_name(worker: int) -> str:
    return f"status/{worker:05d}.json"


def verdict_name(verdict) -> str:
    """verdicts/<worker>-<step>-<rule>-<key>.json: the key says what the verdict is about, so whoever finds it
    again (a restarted watcher, a watcher over a finished run) finds its name taken and stores nothing."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", verdict.rule)[:64] or "rule"
    return f"verdicts/{verdict.worker:05d}-{verdict.step:012d}-{safe}-{verdict.key}.json"


def verdict_key_of(name: str) -> str | None:
    """The key a verdict's file name ends with (None for a name of another form)."""
    stem = name[:-5] if name.endswith(".json") else ""
    key = stem.rsplit("-", 1)[-1]
    return key if len(key) == 12 and all(c in "0123456789abcdef" for c in key) else None


class DamagedObject(ValueError):
    """An object of the run whose checksum does not match what it holds: it was changed after it was written."""


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sealed_json(obj) -> bytes:
    """A JSON object as stored: a mapping carries the crc32 of its canonical form under CRC_KEY."""
    if isinstance(obj, dict):
        obj = {**{k: v for k, v in obj.items() if k != CRC_KEY}, CRC_KEY: None}
        obj[CRC_KEY] = crc_of(_canonical({k: v for k, v in obj.items() if k != CRC_KEY}))
    return json.dumps(obj, indent=1, allow_nan=False).encode()


def opened_json(data: bytes, required: bool = False):
    """A stored JSON object, its checksum verified where it has one (and, with `required`, where it must):
    DamagedObject if it does not match; ValueError if it is not JSON."""
    obj = json.loads(data)
    if isinstance(obj, dict) and CRC_KEY in obj:
        obj = dict(obj)
        claimed = obj.pop(CRC_KEY)
        if claimed != crc_of(_canonical(obj)):
            raise DamagedObject(f"checksum {claimed!r:.20} does not match what it holds")
    elif required:
        raise DamagedObject("it carries no checksum, which its run's format requires")
    return obj


class Store:
    """One run folder at an fsspec URL."""

    def __init__(self, url: str, storage_options: dict | None = None):
        import fsspec

        self.url = str(url).rstrip("/")
        self.fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.local = "file" in _protocols(self.fs)
        self._made: set[str] = set()
        self._inside: set[str] = set()  # local paths found to lie inside the run's folder

    def _confined(self, path: str) -> str:
        """A local path, if it lies inside the run's folder once symlinks are resolved: a run never makes tripwire
        read or write outside it (a crafted run's `watcher/` linked to elsewhere). OutsideRun otherwise."""
        if not self.local or path in self._inside:
            return path
        root = os.path.realpath(self.root)
        real = os.path.realpath(path)
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise OutsideRun(f"{path} leads out of the run's folder {self.root} (a symbolic link); tripwire does "
                             "not follow it. Replace the link with the folder it points to, or remove it.")
        self._inside.add(path)
        return path

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
            self._confined(folder)  # before it is made: a link in the way would have it made elsewhere
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

    def create(self, rel: str, data: bytes) -> bool:
        """Write an object only where none is: False if one is there. Exclusive on a local disk (the object is
        linked into place, which fails where another writer got there first); elsewhere a look, then a PUT."""
        if not self.local:
            if self.exists(rel):
                return False
            self.put(rel, data)
            return True
        path = self.path(rel)
        folder = path.rsplit("/", 1)[0]
        os.makedirs(self._confined(folder), exist_ok=True)
        temp = f"{folder}/{TEMP_PREFIX}{uuid.uuid4().hex}"
        with open(temp, "wb") as f:
            f.write(data)
        try:
            os.link(temp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(temp)

    def get(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.fs.cat_file(self._confined(self.path(rel)), start=start, end=end)

    def put_json(self, rel: str, obj) -> None:
        self.put(rel, sealed_json(obj))

    def get_json(self, rel: str, required: bool = False):
        """The object, its checksum verified (see `opened_json`); DamagedObject for one over MAX_JSON_BYTES, which
        tripwire never writes (it is not read whole: a crafted file must not take the reader's memory)."""
        data = self.get(rel, 0, MAX_JSON_BYTES + 1)
        if len(data) > MAX_JSON_BYTES:
            raise DamagedObject(f"it holds more than {MAX_JSON_BYTES >> 20} MiB, more than any JSON object tripwire "
                                "writes")
        return opened_json(data, required)

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def list(self, folder: str) -> dict[str, int]:
        """{name: size} of the objects in a folder of the run (fresh, not from a listing cache)."""
        path = self.path(folder)
        if self.local and os.path.lexists(path):
            self._confined(path)
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


def check_run_url(url: str) -> str:
    """The URL, if it names a folder a run can own: not empty, not a filesystem's, bucket's or home's root, not
    the working directory itself. Raises ValueError saying what to pass instead."""
    text = str(url).strip()
    protocol, _, path = text.rpartition("://")
    if not protocol and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*:/*", text):  # "file:", "s3:/": a protocol alone
        protocol, path = text.split(":", 1)[0], ""
    bare = path.strip().rstrip("/")
    local = protocol in ("", "file", "local")
    named = os.path.abspath(os.path.expanduser(bare)) if local and bare else bare
    if not bare or bare in (".", "~") or (local and named in (os.path.abspath(os.sep), os.path.expanduser("~"),
                                                             os.getcwd())) or (not local and "/" not in bare):
        raise ValueError(f"out_dir {url!r} names no folder of its own for a run: a run writes many files, which "
                         "would mix with whatever is there. Pass a folder such as 'runs/exp1' (or "
                         "'s3://bucket/runs/exp1').")
    return text


def count_of(value) -> int:
    """A count read from a stored object: a positive int, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def host_and_pid() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def run_status(statuses: dict[int, dict], now: float | None = None, stale_s: float = 120.0,
               finals: dict[int, str] | None = None, created=None) -> str:
    """The run's state from its workers' status objects.

    finished / stopped / failed once every worker has closed; running while they write;
    crashed where a worker's process on this host is gone without closing; unknown where
    a worker elsewhere has not been heard from for `stale_s` seconds. finals: {worker: state} where the
    worker's newest index says it closed the run in that state and covers every shard it wrote: a worker
    whose final status could not be written counts as closed, not crashed. created: the manifest's time; a run
    claimed less than `stale_s` ago whose writer has not written its first status yet is running.
    """
    statuses = {w: s for w, s in statuses.items() if isinstance(s, dict)}  # foreign objects say nothing
    now = time.time() if now is None else now
    if not statuses:
        return "running" if now - _number(created) <= stale_s else "unknown"
    here = socket.gethostname()
    states = set()
    for worker, s in statuses.items():
        state = s.get("state")
        if state == "running":
            gone = s.get("host") == here and not _alive(s.get("pid"))
            stale = now - _number(s.get("heartbeat")) > stale_s
            if (gone or stale) and worker in (finals or {}):
                state = finals[worker]
            elif gone or stale:
                state = "crashed" if gone else "unknown"
        states.add(state)
    for state in ("failed", "crashed", "unknown", "running", "stopped"):
        if state in states:
            return state
    return "finished"


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
