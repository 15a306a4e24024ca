"""The writer: a background thread that turns samples into shards, never blocking training.

Training hands over `Sample`s with `put()` (O(1); no I/O). The thread writes
one shard per `flush_every_s` with whatever arrived, with retries and
backoff. Memory is bounded: bytes accepted but not yet written never exceed
`max_queue_mb`; past it a sample is dropped (counted) or, with
`on_full: block`, training waits. On an object store the shard is handed
over as one bytes object (one PUT): while it is written that copy replaces
the samples it holds and is counted instead of them. When storage fails past
the retries the shard's steps are counted as lost and, per `on_error`, a
warning is given (`warn`), nothing (`ignore`), or the next `put()` raises
(`raise`). The lost and dropped counts live in the worker's status object;
a writer that resumes a run starts from the counts stored there.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .errors import StorageError
from .index import Consolidated, write_index
from .shardfile import encode, entry_ranges
from .store import FORMAT_VERSION, Store, host_and_pid, shard_name, status_name, verdict_name

log = logging.getLogger("tripwire")

RETRY_DELAYS_S = (0.2, 1.0, 3.0)
STATUS_EVERY_S = 5.0
FLUSH_BYTES = 64 << 20  # flush early when this much is buffered


@dataclass
class Sample:
    """Everything captured at one (step, mode) of one worker."""

    step: int
    mode: str
    values: dict  # tensor name -> {reduction: float}
    tensors: dict = field(default_factory=dict)  # tensor name -> np.ndarray (full values)

    @property
    def nbytes(self) -> int:
        return 64 + 16 * sum(len(r) for r in self.values.values()) + sum(a.nbytes for a in self.tensors.values())


class Writer:
    def __init__(self, store: Store, worker: int, config, *, first_seq: int = 0, poll=None, poll_s: float = 0.25,
                 status: dict | None = None):
        self.store, self.worker, self.config = store, worker, config
        self.seq = first_seq
        self._kept = Consolidated(worker, first_seq)  # what the index at close is written from
        self.shards_written = 0
        previous = self._previous_status(store, worker)  # a resumed run keeps counting where it left off
        self.dropped_steps = _count(previous.get("dropped_steps"))
        self.lost_steps = _count(previous.get("lost_steps"))
        self.error: BaseException | None = None
        self.last_step: int | None = None
        self.alive_at: float | None = None  # when the training process last reported a step (Recorder.alive)
        self._status = {"state": "running", "started": time.time(), **host_and_pid(), **(status or {})}
        self._poll, self._poll_s = poll, poll_s
        self._limit = int(config.max_queue_mb * (1 << 20))
        self._pending = 0
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._warned_full = False
        self._failing = False
        self._lost_before_failing = self.lost_steps
        self._write_status()
        self._thread = threading.Thread(target=self._loop, name=f"tripwire-writer-{worker}", daemon=True)
        self._thread.start()

    @staticmethod
    def _previous_status(store: Store, worker: int) -> dict:
        try:
            previous = store.get_json(status_name(worker))
        except FileNotFoundError:
            return {}
        except Exception as exc:  # noqa: BLE001 - unreadable or storage down: count from zero, and say so
            log.warning("tripwire: could not read the stored status of worker %d (%s); lost and dropped step "
                        "counts start from zero.", worker, exc)
            return {}
        return previous if isinstance(previous, dict) else {}

    # -- training thread ------------------------------------------------------------------------------------------
    def put(self, sample: Sample) -> bool:
        """Queue a sample; False if it was dropped because the queue is full."""
        self._raise_if_failed()
        size = sample.nbytes
        with self._cond:
            while self._pending + size > self._limit:
                if self.config.on_full == "drop" or size > self._limit or self._closing:
                    self.dropped_steps += 1
                    if not self._warned_full:
                        self._warned_full = True
                        log.warning("tripwire: the writer queue is full (writer.max_queue_mb=%s): storage is slower "
                                    "than capture, so samples are dropped (counted in the run status). Sample less "
                                    "often, capture reductions instead of full tensors, or raise max_queue_mb.",
                                    self.config.max_queue_mb)
                    return False
                self._cond.wait(0.05)
            self._pending += size
            self._queue.append(sample)
            if self._pending >= FLUSH_BYTES:
                self._cond.notify()
        return True

    def put_verdict(self, verdict) -> None:
        with self._cond:
            self._queue.append(verdict)
            self._cond.notify()

    def close(self, state: str = "finished", timeout: float = 120.0) -> None:
        """Write what is queued, the final status and (via `on_closed`) the index; then stop the thread."""
        with self._cond:
            self._closing = True
            self._status["state"] = state
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("tripwire: the writer did not finish within %ss; what it had not written is lost.", timeout)
        if state != "failed":  # training already failed: do not mask its exception
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.error is not None and self.config.on_error == "raise":
            raise StorageError(f"tripwire could not write to {self.store.url}: {self.error}. Training stops "
                               "because writer.on_error is 'raise'; use 'warn' to train on and count lost steps.")

    @property
    def pending_bytes(self) -> int:
        return self._pending

    # -- writer thread --------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        buffer: list[Sample] = []
        buffered = 0
        next_flush = time.monotonic() + self.config.flush_every_s
        next_poll = next_status = time.monotonic()
        while True:
            with self._cond:
                if not self._queue and not self._closing:
                    self._cond.wait(min(self._poll_s if self._poll else 1.0,
                                        max(0.0, next_flush - time.monotonic())) or 0.001)
                items = list(self._queue)
                self._queue.clear()
                closing = self._closing
            for item in items:
                if isinstance(item, Sample):
                    buffer.append(item)
                    buffered += item.nbytes
                    self._status["last_data"] = time.time()
                else:
                    self._attempt(f"verdict at step {item.step}", lambda v=item: self.store.put_json(
                        verdict_name(v.worker, v.step, v.rule), v.to_dict()))
            items = item = None  # only the buffer holds the samples now, so a flush can let them go
            now = time.monotonic()
            if buffer and (closing or now >= next_flush or buffered >= FLUSH_BYTES):
                self._flush(buffer, buffered)
                buffer, buffered = [], 0
                next_status = now  # the status follows each shard: readers judge liveness by it
            if buffer == [] and now >= next_flush:
                next_flush = now + self.config.flush_every_s
            if self._poll and now >= next_poll:
                next_poll = now + self._poll_s
                try:
                    self._poll()
                except Exception as exc:  # noqa: BLE001 - polling is best effort; storage may be down
                    log.debug("tripwire: verdict poll failed: %s", exc)
            if closing:
                self._on_close()
                return
            if now >= next_status:
                next_status = now + STATUS_EVERY_S
                self._write_status()

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self._pending -= nbytes
            self._cond.notify_all()

    def _flush(self, samples: list[Sample], nbytes: int) -> None:
        """Write the samples as one shard; `nbytes` of them are counted in pending_bytes until it is written."""
        steps = {(s.mode, s.step) for s in samples}
        last = max(s.step for s in samples)
        rel = shard_name(self.worker, self.seq)
        try:
            entries, meta = shard_contents(samples, self.worker, self.seq)
            data = encode(entries, meta)
            summary = Consolidated.summary(rel, meta, entries, entry_ranges(data, entries))
            del entries  # the chunks hold what is written; the samples' arrays go with them
            if not self.store.local:
                # An object store takes one PUT of one bytes object: a full copy of the shard. Let the samples
                # it copies go, and count the copy in their place (at most their size: the shard's header, a
                # few KiB of JSON, is not counted), so memory stays what pending_bytes says.
                data = b"".join(data)
                samples.clear()
                self._release(max(0, nbytes - len(data)))
                nbytes = min(nbytes, len(data))
        except Exception as exc:  # noqa: BLE001 - a sample we cannot encode must not kill the writer
            log.error("tripwire: could not encode %d samples (%s); they are lost.", len(steps), exc)
            self._kept.lose()
            self.lost_steps += len(steps)
            self._release(nbytes)
            return
        written = self._attempt(f"shard {self.seq}", functools.partial(self.store.put, rel, data))
        del data  # before the bytes are released: the copy (or the samples' chunks) goes now
        self._release(nbytes)
        if written:
            self._kept.add(summary)
            self.seq += 1
            self.shards_written += 1
            self.last_step = last
        else:
            self._kept.lose()
            self.lost_steps += len(steps)

    def _attempt(self, what: str, write) -> bool:
        """Run a write with retries; on final failure record it and report per on_error. True if written."""
        for delay in (*RETRY_DELAYS_S, None):
            try:
                write()
                if self._failing:
                    self._failing = False
                    log.warning("tripwire: storage at %s works again; %d steps were lost meanwhile (%d in all, "
                                "counted in the run status).", self.store.url,
                                self.lost_steps - self._lost_before_failing, self.lost_steps)
                    self._write_status()
                return True
            except Exception as exc:  # noqa: BLE001 - any storage failure is handled the same way
                error = exc
                if delay is None or self._closing and delay > RETRY_DELAYS_S[0]:
                    break
                time.sleep(delay)
        self.error = error
        if not self._failing and self.config.on_error != "ignore":
            then = ("training stops at its next step" if self.config.on_error == "raise" else
                    "training goes on; these steps are lost and counted in the run status")
            log.warning("tripwire: could not write %s to %s (%s: %s); %s (writer.on_error=%s).", what,
                        self.store.url, type(error).__name__, error, then, self.config.on_error)
        if not self._failing:
            self._lost_before_failing = self.lost_steps
        self._failing = True
        return False

    def _write_status(self) -> None:
        self._status.update(heartbeat=time.time(), last_step=self.last_step, shards=self.seq,
                            lost_steps=self.lost_steps, dropped_steps=self.dropped_steps)
        if self.alive_at is not None:  # a step ran since: progress for the side process's clock rules
            self._status["last_data"] = max(self._status.get("last_data") or 0.0, self.alive_at)
        try:
            self.store.put_json(status_name(self.worker), self._status)
        except Exception as exc:  # noqa: BLE001 - status is refreshed on the next beat
            log.debug("tripwire: status write failed: %s", exc)

    def _on_close(self) -> None:
        if self.seq > 1:
            try:
                write_index(self.store, self.worker, self.seq - 1, self._kept)
            except Exception as exc:  # noqa: BLE001 - the shards stay readable without the index
                log.warning("tripwire: could not write the run index (%s); the run reads from its shards.", exc)
        self._write_status()


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def shard_contents(samples: list[Sample], worker: int, seq: int) -> tuple[dict, dict]:
    """The shard's entries and metadata: steps per mode, one column per series, then the full tensors."""
    rows: dict[str, set] = collections.defaultdict(set)
    series: dict[tuple, tuple[list, list]] = {}
    tensors = []
    for s in samples:
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
