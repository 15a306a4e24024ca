"""The writer: a background thread that turns samples into shards, never blocking training.

Training hands over `Sample`s with `put()` (O(1); no I/O). The thread writes
one shard per `flush_every_s` with whatever arrived, with retries and
backoff. Memory is bounded: bytes accepted but not yet written never exceed
`max_queue_mb`; past it a sample's full tensors are left out (the step is
counted as partial) and its reductions and scalars kept, within
SCALAR_SLACK more, past which the sample is dropped (counted); with
`on_full: block` training waits instead. On an object store the shard is handed
over as one bytes object (one PUT): while it is written that copy replaces
the samples it holds and is counted instead of them. When storage fails past
the retries the shard's steps are counted as lost and, per `on_error`, a
warning is given (`warn`), nothing (`ignore`), or the next `put()` raises
(`raise`). The lost, dropped and partial counts live in the worker's status object;
a writer that resumes a run starts from the counts stored there.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import threading
import time

from .errors import StorageError
from .index import Consolidated, write_index
from .sample import Sample, shard_contents
from .shardfile import MAX_HEADER, encode
from .store import SHARD_RE, Store, count_of, host_and_pid, sealed_json, shard_name, status_name, verdict_key_of, \
    verdict_name

log = logging.getLogger("tripwire")

RETRY_DELAYS_S = (0.2, 1.0, 3.0)
SCALAR_SLACK = 1 << 20  # past max_queue_mb, what samples of reductions and scalars alone may still take
STATUS_EVERY_S = 5.0
FLUSH_BYTES = 64 << 20  # flush early when this much is buffered


@dataclasses.dataclass
class _Object:
    """An object queued for the writer thread (Writer.put_object)."""

    rel: str
    data: bytes
    exclusive: bool
    done: str

    def write(self, store):
        return functools.partial(store.create if self.exclusive else store.put, self.rel, self.data)


class Writer:
    def __init__(self, store: Store, worker: int, config, *, opening=None, poll=None, poll_s: float = 0.25,
                 status: dict | None = None):
        """opening: called first on the writer's thread, returns the Store to write to (the recorder claims the
        run's folder there): storage that is slow, failing or missing at the start never holds training up."""
        self.store, self.worker, self.config = store, worker, config
        self._opening = opening
        self.opened = threading.Event()  # the run's folder is claimed and the writer knows where its shards go
        self.tried = threading.Event()  # the first attempt to open ended, either way
        self.seq = 0
        self._kept: Consolidated | None = None  # what the index at close is written from
        self._verdict_keys: set[str] = set()  # the verdicts the run holds (Verdict.key): each is stored once
        self.shards_written = 0
        self.dropped_steps = self.lost_steps = self.partial_steps = 0
        self._partial_step = None  # the last step counted in partial_steps
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
        self._warned_full = self._warned_partial = False
        self._failing = False
        self._lost_before_failing = 0
        self._thread = threading.Thread(target=self._loop, name=f"tripwire-writer-{worker}", daemon=True)
        self._thread.start()

    def _open(self) -> bool:
        """Writer thread, before anything is written: claim the run's folder, continue the numbering and the counts
        of an earlier writer of this worker (a resumed run), write the first status. Retried while storage does not
        answer (samples wait in the queue, within its bound); False if the writer closed first."""
        delays = itertools.chain(RETRY_DELAYS_S, itertools.repeat(RETRY_DELAYS_S[-1]))
        warned = False
        while not self._closing:
            try:
                if self._opening is not None:
                    self.store = self._opening()
                    self._opening = None
                self.seq = 1 + max((int(m.group(2)) for m in map(SHARD_RE.match, self.store.list("shards"))
                                    if m and int(m.group(1)) == self.worker), default=-1)
                previous = self._previous_status()
                self.dropped_steps += count_of(previous.get("dropped_steps"))
                self.partial_steps += count_of(previous.get("partial_steps"))
                self.lost_steps += count_of(previous.get("lost_steps"))
                self._lost_before_failing = self.lost_steps
                self._kept = Consolidated(self.worker, self.seq)
                self._verdict_keys = {key for key in map(verdict_key_of, self.store.list("verdicts")) if key}
                self._write_status(strict=True)
            except Exception as exc:  # noqa: BLE001 - storage that is missing, read-only or down at the start
                if not warned:
                    warned = True
                    log.warning("tripwire: cannot open the run at %s (%s: %s); training goes on, and what it "
                                "captures waits (within writer.max_queue_mb) until storage answers.", self.store.url,
                                type(exc).__name__, exc)
                self.error = exc
                self.tried.set()
                with self._cond:
                    self._cond.wait(next(delays))
                continue
            if warned:
                log.warning("tripwire: the run at %s is open now.", self.store.url)
            self.error = None
            self.opened.set()
            self.tried.set()
            return True
        return False

    def _previous_status(self) -> dict:
        try:
            previous = self.store.get_json(status_name(self.worker))
        except FileNotFoundError:
            return {}
        except ValueError as exc:  # unreadable: count from zero, and say so
            log.warning("tripwire: could not read the stored status of worker %d (%s); lost and dropped step "
                        "counts start from zero.", self.worker, exc)
            return {}
        return previous if isinstance(previous, dict) else {}

    # -- training thread ------------------------------------------------------------------------------------------
    def room(self) -> int:
        """Bytes of full tensors the queue can take now (all of it under `on_full: block`, where put waits)."""
        return self._limit if self.config.on_full == "block" else max(0, self._limit - self._pending)

    def put(self, sample: Sample) -> bool:
        """Queue a sample. Where it does not fit, its full tensors are left out and its reductions and scalars
        (a loss, a learning rate) are kept, within SCALAR_SLACK past the bound; False only if even those were
        dropped. Under `on_full: block` training waits instead, for a sample that can ever fit."""
        self._raise_if_failed()
        size = sample.nbytes
        with self._cond:
            while self._pending + size > self._limit:
                if self.config.on_full == "block" and size <= self._limit and not self._closing:
                    self._cond.wait(0.05)
                elif sample.tensors:
                    self._leave_out(sample.step, {n: a.nbytes for n, a in sample.tensors.items()})
                    sample.tensors = {}
                    size = sample.nbytes
                elif self._pending + size <= self._limit + SCALAR_SLACK:
                    break
                else:
                    self.dropped_steps += 1
                    if not self._warned_full:
                        self._warned_full = True
                        log.warning("tripwire: the writer queue is full (writer.max_queue_mb=%s) because %s, so "
                                    "whole samples are dropped now, their scalars too (counted in the run status "
                                    "as dropped_steps). %s", self.config.max_queue_mb, self._why_full(),
                                    self._fix_full())
                    return False
            self._pending += size
            self._queue.append(sample)
            if self._pending >= FLUSH_BYTES:
                self._cond.notify()
        return True

    def left_out(self, step: int, tensors: dict[str, int], asked: int = 0) -> None:
        """A plugin did not copy these full tensors ({name: bytes}) of a step: they did not fit (TensorBudget).
        asked: the bytes of all the full tensors the step asked for."""
        with self._cond:
            self._leave_out(step, tensors, asked)

    def _leave_out(self, step: int, tensors: dict[str, int], asked: int = 0) -> None:
        if step != self._partial_step:  # a step the plugin and then the queue left tensors out of counts once
            self._partial_step = step
            self.partial_steps += 1
        if not self._warned_partial:
            self._warned_partial = True
            log.warning("tripwire: %d full tensors of step %d (%.1f MiB, e.g. %s) do not fit in the writer queue "
                        "(writer.max_queue_mb=%s) because %s; they are not stored, the step's reductions and "
                        "scalars are (counted in the run status as partial_steps). %s", len(tensors), step,
                        sum(tensors.values()) / (1 << 20), next(iter(tensors)), self.config.max_queue_mb,
                        self._why_full(max(asked, sum(tensors.values()))), self._fix_full())

    def _why_full(self, nbytes: int = 0) -> str:
        if not self.opened.is_set():
            return "storage has not answered since training started"
        if nbytes > self._limit:
            return f"one step's full tensors ({nbytes / (1 << 20):.1f} MiB) are more than the whole queue holds"
        return "storage is slower than capture"

    @staticmethod
    def _fix_full() -> str:
        return ("Raise writer.max_queue_mb, save fewer full tensors (`save: tensors` of a collection), or sample "
                "less often.")

    def put_verdict(self, verdict) -> None:
        with self._cond:
            self._queue.append(verdict)
            self._cond.notify()

    def put_object(self, rel: str, data: bytes, exclusive: bool = True, done: str = "") -> None:
        """An object of the run written whole, in turn with samples and verdicts, off the training thread (storage
        that hangs holds this thread only): once (`exclusive`: the first-step record), or in place of one there (a
        checkpoint). `done` is logged once it is written."""
        with self._cond:
            self._queue.append(_Object(rel, data, exclusive, done))
            self._cond.notify()

    def close(self, state: str = "finished") -> bool:
        """Write what is queued, the index and the final status; then stop the thread. Waits at most
        `writer.close_timeout_s` for storage: True if everything was handed over in time."""
        with self._cond:
            self._closing = True
            self._status["state"] = state
            self._cond.notify()
        timeout = self.config.close_timeout_s
        self._thread.join(timeout)
        done = not self._thread.is_alive()
        if not done:
            log.warning("tripwire: storage at %s did not take the last of the run within %gs "
                        "(writer.close_timeout_s); the process goes on without it, and what was not written is lost.",
                        self.store.url, timeout)
        if state != "failed":  # training already failed: do not mask its exception
            self._raise_if_failed()
        return done

    def _raise_if_failed(self) -> None:
        if self.error is not None and self.config.on_error == "raise":
            raise StorageError(f"tripwire could not write to {self.store.url}: {self.error}. Training stops "
                               "because writer.on_error is 'raise'; use 'warn' to train on and count lost steps.")

    @property
    def pending_bytes(self) -> int:
        return self._pending

    # -- writer thread --------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        if not self._open():
            self._give_up()
            return
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
                elif isinstance(item, _Object):
                    if self._attempt(item.rel, item.write(self.store)) and item.done:
                        log.warning("tripwire: %s", item.done)
                elif item.key not in self._verdict_keys:
                    self._attempt(f"verdict at step {item.step}", functools.partial(self._store_verdict, item))
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
            if len(data[0]) > 8 + MAX_HEADER and len(samples) > 1:  # more than a reader accepts: two shards
                del entries, meta, data
                half = len(samples) // 2
                first = sum(s.nbytes for s in samples[:half])
                self._flush(samples[:half], first)
                self._flush(samples[half:], nbytes - first)
                return
            summary = Consolidated.summary(rel, meta, entries, data)
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
            if len(samples) > 1:  # find the sample at fault: the others are stored
                entries = meta = data = None  # noqa: F841 - let what was encoded go before the halves are
                half = len(samples) // 2
                first = sum(s.nbytes for s in samples[:half])
                self._flush(samples[:half], first)
                self._flush(samples[half:], nbytes - first)
                return
            sample = samples[0]
            if sample.tensors:  # its full tensors cannot be stored: its reductions and scalars are
                log.warning("tripwire: the full tensors of step %s (%s) cannot be stored (%s); its reductions and "
                            "scalars are (counted as partial_steps).", sample.step, ", ".join(sample.tensors), exc)
                self.partial_steps += 1
                self._flush([Sample(sample.step, sample.mode, sample.values)], nbytes)
                return
            log.error("tripwire: could not encode the sample of step %s (%s); it is lost.", sample.step, exc)
            self._kept.lose()
            self.lost_steps += 1
            self._release(nbytes)
            return
        written = self._attempt(f"shard {self.seq}", functools.partial(self.store.put, rel, data), steps=True)
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

    def _attempt(self, what: str, write, steps: bool = False) -> bool:
        """Run a write with retries; on final failure record it and report per on_error. True if written.
        steps: the write holds captured steps (a shard), which are lost and counted if it fails."""
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
                    "training goes on" + ("; these steps are lost and counted in the run status" if steps else ""))
            log.warning("tripwire: could not write %s to %s (%s: %s); %s (writer.on_error=%s).", what,
                        self.store.url, type(error).__name__, error, then, self.config.on_error)
        if not self._failing:
            self._lost_before_failing = self.lost_steps
        self._failing = True
        return False

    def _give_up(self) -> None:
        """The writer closed before the run could be opened: what it held is lost, and counted."""
        with self._cond:
            lost = sum(1 for item in self._queue if isinstance(item, Sample))
            self._queue.clear()
            self._pending = 0
        self.lost_steps += lost
        log.warning("tripwire: the run at %s could not be opened before training ended (%s); the %d samples "
                    "captured are lost.", self.store.url, self.error, lost)

    def _write_status(self, strict: bool = False) -> None:
        self._status.update(heartbeat=time.time(), last_step=self.last_step, shards=self.seq,
                            lost_steps=self.lost_steps, dropped_steps=self.dropped_steps,
                            partial_steps=self.partial_steps)
        if self.alive_at is not None:  # a step ran since: progress for the side process's clock rules
            self._status["last_data"] = max(self._status.get("last_data") or 0.0, self.alive_at)
        try:
            self.store.put_json(status_name(self.worker), self._status)
        except Exception as exc:  # noqa: BLE001 - status is refreshed on the next beat
            if strict:
                raise
            log.debug("tripwire: status write failed: %s", exc)

    def _store_verdict(self, verdict) -> None:
        self.store.create(verdict_name(verdict), sealed_json(verdict.to_dict()))  # found again: stored once
        self._verdict_keys.add(verdict.key)

    def _on_close(self) -> None:
        """The index (which also marks the state the run closed in) and the final status, each retried: a run
        that closed cleanly must never read as crashed because of one failed write."""
        state = self._status["state"]
        for delay in (*RETRY_DELAYS_S, None):
            try:
                if self.seq > 0:
                    write_index(self.store, self.worker, self.seq - 1, self._kept, final=state)
                break
            except Exception as exc:  # noqa: BLE001 - the shards stay readable without the index
                if delay is None:
                    log.warning("tripwire: could not write the run index (%s); the run reads from its shards.",
                                exc)
                else:
                    time.sleep(delay)
        for delay in (*RETRY_DELAYS_S, None):
            try:
                self._write_status(strict=True)
                return
            except Exception as exc:  # noqa: BLE001 - reported; the index's mark says how the run closed
                if delay is None:
                    log.warning("tripwire: could not write the final status of worker %d (%s: %s).", self.worker,
                                type(exc).__name__, exc)
                else:
                    time.sleep(delay)
