"""The read API over a stored run: `tripwire.open_run(url)`.

Opening reads the manifest and the headers of the index and shards, nothing
else. A series is read entry by entry (one byte range per file that holds
it) and cached; `refresh()` reads only the headers of shards that appeared
since, and the next read of a series appends only their part. Files that are
not shards (corrupt, truncated, foreign) are skipped with a warning and
listed in `run.skipped`.

Every byte is checked (store format 2, docs/format.md): a header and the
small series section of each file are verified when the file is loaded, and
a file that fails is skipped whole; a full tensor, or the series section of
a large index, when it is read: a mismatch there raises `RunDamaged`, which
names the file. A shard missing from a worker's numbering, or cut short
under its index, is listed too. `run.damaged` is what of `run.skipped` is
damage rather than a foreign file.
"""

from __future__ import annotations

import functools
import os
import re
import time
import warnings
from collections import defaultdict

import numpy as np

from .errors import RunDamaged, RunNotFound, listing
from .headers import StoredFile, checked
from .model import ModelInfo
from .runfiles import CheckedFiles
from .shardfile import ShardFormatError, decode_header, header_length
from .store import (CHECKSUMMED_SINCE, FINAL_STATES, FORMAT_VERSION, INDEX_RE, MANIFEST, SHARD_RE, TEMP_PREFIX,
                    DamagedObject, Store, count_of, first_step_name, index_name, run_status, shard_name)
from .verdict import Verdict
from .view import View, merge_sorted

_PREFIX = 65536  # bytes read at once for a header
_STATUS_EVERY_S = 2.0  # wait_for_step reads the run's status at most this often


class Run(View, CheckedFiles):
    """A run in a store. See the module docstring and DESIGN.md's contract."""

    def __init__(self, url, storage_options: dict | None = None):
        super().__init__()
        self.store = url if isinstance(url, Store) else Store(str(url), storage_options)
        self.url = self.store.url
        try:
            self._manifest = self.store.get_json(MANIFEST)
        except (FileNotFoundError, NotADirectoryError):
            raise RunNotFound(self._not_found_message()) from None
        except DamagedObject as exc:
            raise RunDamaged(f"{self.url}/{MANIFEST} is damaged: {exc}. The run cannot be opened without it; restore "
                             "it from a backup if there is one.") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise RunNotFound(f"{self.url}/{MANIFEST} is not a tripwire manifest ({exc}).") from None
        version = self._manifest.get("format_version", 0) if isinstance(self._manifest, dict) else None
        if not isinstance(version, int) or isinstance(version, bool):
            held = type(self._manifest).__name__ if version is None else f"format_version {version!r}"
            raise RunNotFound(f"{self.url}/{MANIFEST} is not a tripwire manifest (it holds {held}, not a mapping "
                              "with an integer format_version).")
        if version > FORMAT_VERSION:
            warnings.warn(f"{self.url} was written in store format {self._manifest.get('format_version')}; this "
                          f"tripwire reads format {FORMAT_VERSION}. Upgrade tripwire to read all of it.")
        self.skipped: dict[str, str] = {}
        self._foreign_files: set[str] = set()  # of skipped: files that are not tripwire's (by their names)
        self._sealed = version >= CHECKSUMMED_SINCE  # every JSON object of the run must carry its checksum
        self._files: dict[str, StoredFile] = {}
        self._listed: dict[int, set] = defaultdict(set)  # worker -> numbers of its shards listed so far
        self._top: dict[int, int] = {}  # worker -> the highest number of its shards that loaded
        self._closed: dict[int, tuple] = {}  # worker -> (upto, state) where its newest index marks the close
        self._index_upto: dict[int, int] = {}  # worker -> seq covered by its index
        self._chunks: dict[tuple, list] = defaultdict(list)  # (w, mode, name, red) -> [(file, values, steps)]
        self._step_chunks: dict[tuple, list] = defaultdict(list)  # (w, mode) -> [(file, entry)]
        self._tensor_loc: dict[tuple, dict] = defaultdict(dict)  # (w, mode, name) -> {step: (rel, Entry)}
        self._merged: dict[tuple, tuple] = {}  # key -> (chunks merged, steps, values)
        self._name_steps_cache: dict[tuple, tuple] = {}  # (worker, mode, name) -> (version, steps with any data)
        self._last_names_at: tuple = (None, set())  # ((version, step, mode, worker), names with data there)
        self._sections: dict[str, bytes] = {}
        self._first_steps: dict = {}  # worker -> FirstStep or None (unreadable), once read
        self._verdicts: dict[str, Verdict] = {}
        self.refresh()

    def __repr__(self):
        return f"Run({self.url!r})"

    def _not_found_message(self) -> str:
        """What is at the URL instead of a run: a file, a folder of runs (named), other files, or nothing."""
        from .listing import run_names

        if self.store.local and os.path.isfile(self.store.root):
            return (f"{self.url} is a file, not a run: a run is the folder the callback wrote to (its `out_dir`), "
                    f"which holds {MANIFEST}.")
        try:
            runs, entries = run_names(self.url), sorted(self.store.list(""))
        except Exception:  # noqa: BLE001 - only used to make the message more helpful
            runs, entries = [], []
        if runs:
            return (f"{self.url} is a folder of {len(runs)} run(s), not a run: {listing(runs)}. Name one of them "
                    f"(e.g. {self.url}/{runs[0]}); `tripwire ls {self.url}` lists them with their status.")
        found = f" The folder holds: {listing(entries)}." if entries else " Nothing is stored there."
        return (f"no tripwire run at {self.url} (no {MANIFEST}).{found} A run folder is the `out_dir` "
                "(or `output`) the callback wrote to; `tripwire ls ROOT` lists the runs under a folder.")

    # -- metadata -------------------------------------------------------------------------------------------------
    @property
    def info(self) -> dict:
        """Manifest plus live state: status, workers' status, lost, dropped and partial (full tensors left out)
        step counts."""
        statuses = self._statuses()
        info = dict(self._manifest)
        finals = {}
        for worker, (upto, state) in self._closed.items():
            written = count_of(statuses.get(worker, {}).get("shards"))
            if upto >= max(self._listed[worker], default=-1) and upto >= written - 1:
                finals[worker] = state
        info["status"] = run_status(statuses, stale_s=max(120.0, 20 * self._flush_every()), finals=finals,
                                    created=info.get("created"))
        self._check_tails(statuses)
        info["workers"] = {w: s for w, s in sorted(statuses.items())}
        info["lost_steps"] = sum(s.get("lost_steps", 0) for s in statuses.values())
        info["dropped_steps"] = sum(s.get("dropped_steps", 0) for s in statuses.values())
        info["partial_steps"] = sum(count_of(s.get("partial_steps")) for s in statuses.values())
        return info

    @functools.cached_property
    def model(self):
        """The model's structure as the plugin recorded it when training began (None for runs without one)."""
        return ModelInfo.from_dict(self._manifest.get("model"))

    def first_step_of(self, worker: int):
        """What the plugin saw of a worker's first step (`first_step/<worker>.json`), or None; read once found."""
        if worker not in self._first_steps:
            from .firststep import FirstStep

            rel = first_step_name(worker)
            try:
                found = FirstStep.from_dict(self.store.get_json(rel, required=self._sealed))
            except FileNotFoundError:
                return None
            except (ValueError, OSError) as exc:
                self._skip(rel, f"unreadable first step: {exc}")
                found = None
            if found is None:
                self._skip(rel, "not a first-step record")
            self._first_steps[worker] = found
        return self._first_steps[worker]

    def _flush_every(self) -> float:
        try:
            return float(self._manifest.get("config", {}).get("writer", {}).get("flush_every_s", 1.0))
        except (AttributeError, TypeError, ValueError):
            return 1.0

    def _statuses(self) -> dict[int, dict]:
        out = {}
        for name in self.store.list("status"):
            if name.startswith(TEMP_PREFIX):
                continue
            if not STATUS_RE.fullmatch(name):
                self._foreign(f"status/{name}")
                continue
            try:
                status = self.store.get_json(f"status/{name}", required=self._sealed)
                problem = _status_problem(status)
            except (ValueError, OSError) as exc:
                problem = str(exc)
            if problem:
                self._skip(f"status/{name}", f"unreadable status: {problem}")
            else:
                out[int(name[:-5])] = status
        return out

    def workers(self) -> list[int]:
        return super().workers() or sorted(self._statuses())

    def verdicts(self, worker: int | None = None) -> list[Verdict]:
        """Every verdict stored in the run (about one worker's data, or all), in step order."""
        prefix = "" if worker is None else f"{worker:05d}-"  # a verdict's name starts with its worker
        for name in self.store.list("verdicts"):
            if name in self._verdicts or not name.endswith(".json") or name.startswith(TEMP_PREFIX) \
                    or not name.startswith(prefix):
                continue
            try:
                self._verdicts[name] = Verdict.from_dict(self.store.get_json(f"verdicts/{name}",
                                                                             required=self._sealed))
            except (ValueError, TypeError, OSError) as exc:
                self._skip(f"verdicts/{name}", f"unreadable verdict: {exc}")
        return sorted((v for v in self._verdicts.values() if worker is None or v.worker == worker),
                      key=lambda v: (v.step, v.time))

    # -- following a live run -------------------------------------------------------------------------------------
    def refresh(self) -> int:
        """Read what a writer added since the last call; returns the number of new (mode, step) rows."""
        new_rows = 0
        if not self._files:  # an index is only used when nothing was read before it: each worker's latest
            latest: dict[int, tuple] = {}
            for name, size in sorted(self.store.list("index").items()):
                m = INDEX_RE.match(name)
                if not m:
                    self._foreign(f"index/{name}")
                    continue
                worker, upto = int(m.group(1)), int(m.group(2))
                if upto > latest.get(worker, (-1,))[0]:
                    latest[worker] = (upto, name, size)
            for worker, (upto, name, size) in sorted(latest.items()):
                loaded = self._load(f"index/{name}", size)
                if loaded is not None:
                    self._index_upto[worker] = upto
                    new_rows += loaded
                    index = self._files[f"index/{name}"].meta
                    if index.get("final") in FINAL_STATES:
                        self._closed[worker] = (upto, index["final"])
        listed = self.store.list("shards")
        for name, size in sorted(listed.items()):
            rel = f"shards/{name}"
            if rel in self._files or rel in self.skipped:
                continue
            m = SHARD_RE.match(name)
            if not m:
                self._foreign(rel)
                continue
            worker, seq = int(m.group(1)), int(m.group(2))
            self._listed[worker].add(seq)
            if seq <= self._index_upto.get(worker, -1):
                recorded = self._covered(worker).get(str(seq))
                if isinstance(recorded, int) and recorded != size:  # its tensors would fail when read
                    self._skip(rel, f"holds {size} bytes, its worker's index recorded {recorded}: cut short or "
                                    "replaced")
                continue
            loaded = self._load(rel, size)
            if loaded is not None:
                new_rows += loaded
                self._top[worker] = max(self._top.get(worker, -1), seq)
        for worker in set(self._top) | set(self._index_upto):  # numbered without gaps: a gap is a lost file
            top = max(self._top.get(worker, -1), max(map(int, self._covered(worker)), default=-1))
            for seq in sorted(set(range(top + 1)) - self._listed[worker]):
                self._skip(shard_name(worker, seq), "missing: later shards of its worker are there")
        return new_rows

    def _covered(self, worker: int) -> dict:
        """{seq (text): bytes} of the shards the worker's index covers, as it recorded them ({} without one)."""
        if worker not in self._index_upto:
            return {}
        sizes = self._files[index_name(worker, self._index_upto[worker])].meta.get("shards", {})
        return {k: v for k, v in sizes.items() if k.isdigit()} if isinstance(sizes, dict) else {}

    def wait_for_step(self, step: int, timeout: float | None = None, mode: str = "train",
                      worker: int | None = None) -> bool:
        """Wait until `step` (or a later one) is stored in `mode`, for `worker` or any worker (True); or until
        the run ends without it or the timeout passes (False).

        Cheap on object stores: each round is one `refresh()` (one listing of shards/, reading only new
        headers); the run's status (a listing of status/ and a small GET per worker) is read at most every
        2 s; the pause between rounds grows from 0.05 s to 1 s while nothing arrives."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay, next_status = 0.05, time.monotonic()
        while True:
            workers = [worker] if worker is not None else View.workers(self)
            if any(self._steps(mode, w).size and self._steps(mode, w)[-1] >= step for w in workers):
                return True
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            ended = False
            if now >= next_status:  # read before the refresh: nothing written before the end is missed
                ended, next_status = self.info["status"] != "running", now + _STATUS_EVERY_S
            if self.refresh():
                delay = 0.05
                if ended:
                    next_status = now  # look at what arrived, then at the status again
                continue
            if ended:
                return False
            pause = delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic()))
            time.sleep(min(pause, max(0.0, next_status - time.monotonic())) if pause > 0 else 0)
            delay = min(delay * 1.5, 1.0)

    # -- loading files --------------------------------------------------------------------------------------------
    def _load(self, rel: str, size: int) -> int | None:
        """Read a shard's or index's header, check all of it, and only then make its data visible.

        A file that fails any check is skipped whole (with a warning, in `skipped`): none of its steps,
        series or tensors appear, so a reader never meets a half-trusted file later."""
        try:
            prefix = self.store.get(rel, 0, min(size, _PREFIX)) if size else self.store.get(rel)
            n = header_length(prefix)
            head = prefix[8:8 + n] if len(prefix) >= 8 + n else self.store.get(rel, 8, 8 + n)
            if len(head) != n:
                raise ShardFormatError(f"header of {n} bytes, the file holds {len(head)} after the length")
            entries, meta = decode_header(head, size or None)
            file = StoredFile(rel, entries, meta)
            worker, steps, series, tensors, rows = checked(file)
            self._verify_section(file, prefix, [e for _, e in steps] + [e for s in series for e in s[3:]])
        except (ShardFormatError, KeyError, ValueError, TypeError, AttributeError, OSError) as exc:
            self._skip(rel, f"not a readable {rel.split('/')[0].rstrip('s')} ({type(exc).__name__}: {exc})")
            return None
        for mode, entry in steps:
            self._step_chunks[(worker, mode)].append((file, entry))
        for mode, name, reduction, values, steps_entry in series:
            self._chunks[(worker, mode, name, reduction)].append((file, values, steps_entry))
            self._catalog.setdefault((worker, mode, name), set()).add(reduction)
        for mode, name, step, where in tensors:
            self._tensor_loc[(worker, mode, name)][step] = where
            self._catalog.setdefault((worker, mode, name), set()).add(self.TENSOR)
        self._files[rel] = file
        self._version += 1
        return rows

    # -- View primitives ------------------------------------------------------------------------------------------
    def _series(self, name, reduction, mode, worker):
        key = (worker, mode, name, reduction)
        chunks = self._chunks.get(key, [])
        done, steps, values = self._merged.get(key, (0, None, None))
        if done < len(chunks) or steps is None:
            parts = [] if steps is None else [(steps, values)]
            parts += [(self._read(f, s).astype(np.int64), self._read(f, v).astype(np.float64))
                      for f, v, s in chunks[done:]]
            steps, values = merge_sorted(parts)
            self._merged[key] = (len(chunks), steps, values)
        return steps, values

    _between_rows = True  # Recorder.scalars stores series points between the sampled steps

    def _row_series(self, name, reduction, mode, worker):
        """The series at the rows alone (what the rules read, View.at): kept until new shards are read, since
        offline rules read the same series at every step."""
        steps, values = self._series(name, reduction, mode, worker)
        key = ("#rows", worker, mode, name, reduction)
        done, kept_steps, kept_values = self._merged.get(key, (None, None, None))
        if done != (self._version, len(steps)):
            keep = np.isin(steps, self._steps(mode, worker), assume_unique=True)
            kept_steps, kept_values = (steps, values) if keep.all() else (steps[keep], values[keep])
            self._merged[key] = ((self._version, len(steps)), kept_steps, kept_values)
        return kept_steps, kept_values

    def _steps(self, mode, worker):
        key = ("#steps", worker, mode)
        chunks = self._step_chunks.get((worker, mode), [])
        done, steps, _ = self._merged.get(key, (0, None, None))
        if done < len(chunks) or steps is None:
            parts = [] if steps is None else [steps]
            parts += [self._read(f, e).astype(np.int64) for f, e in chunks[done:]]
            steps = np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)
            self._merged[key] = (len(chunks), steps, None)
        return steps

    def _tensor_steps(self, name, mode, worker):
        return np.array(sorted(self._tensor_loc.get((worker, mode, name), {})), dtype=np.int64)

    def _names_at(self, step, mode, worker):
        """Offline, every rule asks for the names at each step: the last answer is kept for the next rule."""
        key = (self._version, step, mode, worker)
        if self._last_names_at[0] != key:
            names = {n for w, m, n in self._catalog
                     if m == mode and (worker is None or w == worker) and self._holds(n, step, mode, w)}
            self._last_names_at = (key, names)
        return self._last_names_at[1]

    def _name_steps(self, name, mode, worker):
        """Kept until new shards are read: offline rules ask it for every tensor at every step."""
        key = (worker, mode, name)
        version, steps = self._name_steps_cache.get(key, (None, None))
        if version != self._version:
            steps = super()._name_steps(name, mode, worker)
            self._name_steps_cache[key] = (self._version, steps)
        return steps

    def _value(self, name, step, mode, worker):
        rel, entry = self._tensor_loc[(worker, mode, name)][step]
        if rel in self.skipped:  # a file found damaged is skipped whole, also where its index points into it
            raise RunDamaged(f"{self.url}/{rel} is damaged ({self.skipped[rel]}); {name} at step {step} was stored "
                             "there. The rest of the run can be read (run.skipped lists every damaged file found).")
        return self._decode(rel, entry, self._get(rel, entry)).copy()


STATUS_RE = re.compile(r"\d{5}\.json")


def _status_problem(status) -> str | None:
    """Why a status object cannot be used (None if it can): the fields a reader computes with must have their type."""
    if not isinstance(status, dict):
        return f"a {type(status).__name__}, not a mapping"
    if not isinstance(status.get("state"), str):
        return f"state is {status.get('state')!r}, not a string"
    for key in ("heartbeat", "started"):
        if key in status and (not isinstance(status[key], (int, float)) or isinstance(status[key], bool)):
            return f"{key} is {status[key]!r}, not a time"
    for key in ("lost_steps", "dropped_steps", "shards"):
        if key in status and (not isinstance(status[key], int) or isinstance(status[key], bool) or status[key] < 0):
            return f"{key} is {status[key]!r}, not a count"
    return None


def open_run(url, storage_options: dict | None = None) -> Run:
    """Open a run (live or finished) at any fsspec URL."""
    return Run(str(url), storage_options)
