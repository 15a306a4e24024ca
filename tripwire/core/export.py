"""TensorBoard event files from a run: `tripwire export tensorboard RUN LOGDIR`, and live with `tensorboard: {dir}`.

Every series becomes a scalar (tag `name/reduction`, or the name for scalars
such as losses), every saved full tensor a histogram, every verdict a text
entry; the step is the run's global step. Each mode and worker gets its own
sub-logdir (`train`, `eval`, `train-worker1`), which TensorBoard shows as
separate runs. The files are written with the summary protos of `tensorboardX`
(small) or of `tensorboard` where it is installed (core.eventproto), so neither
TensorFlow nor torch is needed.

TensorBoard discards a file's events after a step that goes backwards, so
events are written in step order: the export sorts them, and the live sink
writes a late verdict (from the side process) at the latest step written,
with its own step in the text.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
import threading
import time

import numpy as np

from .errors import install
from .eventproto import Protos, protos
from .naming import MODE_RE, VALUE
from .progress import Progress
from .store import output_url

log = logging.getLogger("tripwire")
HISTOGRAM_BINS = 30
_files = itertools.count()


def cli(args, storage_options: dict) -> int:
    from .cli import say_damage
    from .run import open_run

    run = open_run(args.run, storage_options)
    counts = export_tensorboard(run, args.logdir)
    print(f"wrote {counts['scalars']} scalars, {counts['histograms']} histograms and {counts['verdicts']} verdicts "
          f"to {args.logdir}; view them with: tensorboard --logdir {args.logdir}")
    say_damage(run, "export")
    return 0


def export_tensorboard(run, logdir: str, storage_options: dict | None = None, backend: str | None = None) -> dict:
    """Write the run as event files under `logdir` (a path or fsspec URL); returns how many values of each kind.
    backend: "tensorboard" or "tensorboardX", whose protos write the files; None takes the one installed."""
    counts = {"scalars": 0, "histograms": 0, "verdicts": 0}
    verdicts = collections.defaultdict(list)
    for verdict in sorted(run.verdicts(), key=lambda v: v.step):
        verdicts[(verdict.mode, verdict.worker)].append(verdict)
    wall = float(run.info.get("created") or time.time())
    groups = {(m, w): _rows(run, m, w) for w in run.workers() for m in run.modes()
              if run.tensor_names(mode=m, worker=w)}
    groups.update({key: {} for key in verdicts if key not in groups})  # verdicts of a mode without data
    with Progress(sum(len(rows) for rows in groups.values()), "export") as bar:
        for (mode, worker), rows in groups.items():
            events = EventFile(f"{logdir.rstrip('/')}/{subdir(mode, worker)}", storage_options, backend)
            pending = list(verdicts.get((mode, worker), ()))
            for step in sorted(rows):
                values, names = rows[step]
                tensors = {n: run.tensor(n).value(step, mode=mode, worker=worker) for n in names}
                event = step_event(events.pb, step, wall, values, tensors)
                while pending and pending[0].step <= step:
                    event.summary.value.append(verdict_value(events.pb, pending.pop(0)))
                    counts["verdicts"] += 1
                events.write(event)
                counts["scalars"] += sum(len(r) for r in values.values())
                counts["histograms"] += len(tensors)
                bar.update()
            for verdict in pending:  # after the last sample (e.g. no_data at the end)
                events.write(text_event(events.pb, verdict, max(verdict.step, max(rows, default=0)), wall))
                counts["verdicts"] += 1
            events.close()
    return counts


def _rows(run, mode: str, worker: int) -> dict:
    """{step: ({name: {reduction: value}}, [names of the full tensors saved])} of one mode and worker."""
    rows: dict = collections.defaultdict(lambda: ({}, []))
    for name in run.tensor_names(mode=mode, worker=worker):
        tensor = run.tensor(name)
        for reduction in tensor.reductions(mode=mode, worker=worker):
            for step, value in zip(*(a.tolist() for a in tensor.series(reduction, mode, worker))):
                rows[step][0].setdefault(name, {})[reduction] = value
        for step in tensor.steps(mode=mode, worker=worker, tensors=True):
            rows[step][1].append(name)
    return rows


def subdir(mode: str, worker: int) -> str:
    """The sub-logdir of a mode and worker: one plain folder name (the reader admits no other modes; checked
    again here, where a name becomes a path)."""
    if not MODE_RE.fullmatch(mode) or not isinstance(worker, int) or worker < 0:
        raise ValueError(f"mode {mode!r:.40} and worker {worker!r:.20} do not name a folder")
    return mode if worker == 0 else f"{mode}-worker{worker}"


# -- events -------------------------------------------------------------------------------------------------------
def step_event(pb: Protos, step: int, wall: float, values: dict, tensors: dict):
    """One Event holding a step's scalars ({name: {reduction: value}}) and histograms ({name: array})."""
    summary = pb.summary.Summary()
    for name, reductions in values.items():
        for reduction, value in reductions.items():
            summary.value.add(tag=name if reduction == VALUE else f"{name}/{reduction}", simple_value=float(value))
    for name, array in tensors.items():
        histogram = _histogram(pb, np.asarray(array))
        if histogram is not None:
            summary.value.add(tag=name, histo=histogram)
    return pb.event.Event(wall_time=wall, step=int(step), summary=summary)


def _histogram(pb: Protos, array: np.ndarray):
    values = array.astype(np.float64, copy=False).ravel()
    values = values[np.isfinite(values)]
    if values.size == 0:
        return None
    counts, edges = np.histogram(values, bins=HISTOGRAM_BINS)
    return pb.summary.HistogramProto(min=float(values.min()), max=float(values.max()), num=float(values.size),
                                     sum=float(values.sum()), sum_squares=float(np.dot(values, values)),
                                     bucket_limit=edges[1:].tolist(), bucket=counts.astype(np.float64).tolist())


def verdict_value(pb: Protos, verdict):
    """A verdict as a TensorBoard text value (markdown), tag `verdicts/<rule>`."""
    label = {"fired": verdict.severity, "no_data": "had no data", "error": "failed"}.get(verdict.status,
                                                                                       verdict.status)
    text = (f"**{verdict.rule}** {label} at step {verdict.step} ({verdict.mode}, worker {verdict.worker}): "
            f"{verdict.message}" + (f"\n\n*hint:* {verdict.hint}" if verdict.hint else ""))
    metadata = pb.summary.SummaryMetadata(plugin_data=pb.summary.SummaryMetadata.PluginData(
        plugin_name="text", content=pb.text.TextPluginData(version=0).SerializeToString()))
    tensor = pb.tensor.TensorProto(dtype="DT_STRING", string_val=[text.encode()],
                                   tensor_shape=pb.tensor_shape.TensorShapeProto(
                                       dim=[pb.tensor_shape.TensorShapeProto.Dim(size=1)]))
    return pb.summary.Summary.Value(tag=f"verdicts/{verdict.rule}", metadata=metadata, tensor=tensor)


def text_event(pb: Protos, verdict, step: int, wall: float):
    summary = pb.summary.Summary(value=[verdict_value(pb, verdict)])
    return pb.event.Event(wall_time=wall, step=int(step), summary=summary)


class EventFile:
    """One TensorBoard event file (a TFRecord of Event protos) under a logdir, written through fsspec.
    `pb`: the protos its events are made of (backend None: those installed)."""

    def __init__(self, logdir: str, storage_options: dict | None = None, backend: str | None = None):
        import fsspec

        self.pb = protos(backend)
        fs, path = fsspec.core.url_to_fs(logdir, **(storage_options or {}))
        fs.makedirs(path, exist_ok=True)
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
                f"{next(_files)}.tripwire")
        self._file = fs.open(f"{path.rstrip('/')}/{name}", "wb")
        self.write(self.pb.event.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write(self, event) -> None:
        self._file.write(self.pb.record(event.SerializeToString()))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# -- live, during training ----------------------------------------------------------------------------------------
class TensorBoardSink:
    """Writes a recorder's samples and verdicts as TensorBoard events while training runs.

    `put()` is one deque append on the training thread; a thread of its own converts and writes once a second,
    so training never waits on it. `verdicts` is the recorder's own list: new entries are written as they appear.
    """

    def __init__(self, logdir: str, run_url: str, worker: int, verdicts: list, flush_every_s: float = 1.0):
        self.logdir = output_url(logdir, run_url.rstrip("/").rsplit("/", 1)[-1]).rstrip("/")
        self.worker, self._verdicts, self._flush_every_s = worker, verdicts, flush_every_s
        self._queue: collections.deque = collections.deque()
        self._files: dict = {}
        self._last_step: dict = {}
        self._verdicts_done = 0
        self._failed = False  # once writing failed, samples are no longer queued
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"tripwire-tensorboard-{worker}", daemon=True)
        self._thread.start()

    def put(self, step: int, mode: str, values: dict, tensors: dict | None) -> None:
        if not self._failed:
            self._queue.append((step, mode, values, tensors or {}))

    def close(self, timeout: float = 60.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            while True:
                stopping = self._stop.wait(self._flush_every_s)
                self._drain()
                if stopping:
                    break
        except Exception as exc:  # noqa: BLE001 - TensorBoard output must never take training down
            self._failed = True
            self._queue.clear()
            hint = f" ({install('tensorboard')})" if isinstance(exc, ImportError) else ""
            log.warning("tripwire: live TensorBoard output to %s stopped%s: %s: %s", self.logdir, hint,
                        type(exc).__name__, exc)
        finally:
            for events in self._files.values():
                events.close()

    def _drain(self) -> None:
        while self._queue:
            step, mode, values, tensors = self._queue.popleft()
            events = self._file(mode)
            events.write(step_event(events.pb, step, time.time(), values, tensors))
            self._last_step[mode] = max(step, self._last_step.get(mode, step))
        while self._verdicts_done < len(self._verdicts):
            verdict = self._verdicts[self._verdicts_done]
            self._verdicts_done += 1
            step = max(verdict.step, self._last_step.get(verdict.mode, verdict.step))
            events = self._file(verdict.mode)
            events.write(text_event(events.pb, verdict, step, time.time()))
        for events in self._files.values():
            events.flush()

    def _file(self, mode: str) -> EventFile:
        if mode not in self._files:
            self._files[mode] = EventFile(f"{self.logdir}/{subdir(mode, self.worker)}")
        return self._files[mode]
