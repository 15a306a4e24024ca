"""Verdicts where the user already looks: the loggers of their framework, and an active MLflow run.

A sink is told of each fired verdict as the training process learns of it, and of the run's end. Each plugin
hands the recorder the sinks of its framework's own loggers, made through their public APIs (Lightning's
`trainer.loggers`: TensorBoard, MLflow, Weights & Biases, CSV, …; Keras' TensorBoard callback, the Trainer's
`report_to` integrations); an MLflow run that is active in the process (`mlflow.active_run()`, where mlflow is
imported) gets one whatever the framework. A sink that fails is said once and dropped: a logger never hurts
training. The config's `loggers: false` turns them off.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile

log = logging.getLogger("tripwire")
LEVELS = {"info": 0.0, "warning": 1.0, "error": 2.0}  # a verdict's severity as a number a logger can plot
ALERT_LEVELS = {"info": "INFO", "warning": "WARN", "error": "ERROR"}  # W&B's AlertLevel values, by severity


class Sink:
    """What a logger is told: the run's URL when it starts, each fired verdict, the end."""

    name = "logger"

    def start(self, run_url: str) -> None:
        pass

    def verdict(self, verdict, fired: int) -> None:
        """A fired verdict; `fired` counts the run's fired verdicts so far, this one included."""

    def close(self, run_url: str, status: str, summary: str, report: str | None) -> None:
        """The run ended with `status`; `summary` is its diagnosis in words, `report` a local copy of its HTML
        report where there is one."""


class MetricsSink(Sink):
    """A logger that takes numbers by step (Lightning's `log_metrics`, a CSVLogger's rows): the count of verdicts
    so far, and each verdict's severity under its rule."""

    def __init__(self, log_metrics, name: str = "logger"):
        self._log_metrics, self.name = log_metrics, name

    def verdict(self, verdict, fired: int) -> None:
        self._log_metrics({"tripwire/verdicts": float(fired), f"tripwire/{verdict.rule}": LEVELS[verdict.severity]},
                          verdict.step)


class WriterSink(Sink):
    """A TensorBoard summary writer (torch's, tensorboardX's, the Trainer's `tb_writer`): each verdict as text under
    `tripwire`, and the count of verdicts as the scalar `tripwire/verdicts`."""

    def __init__(self, writer, name: str = "tensorboard"):
        self._writer, self.name = writer, name

    def verdict(self, verdict, fired: int) -> None:
        self._writer.add_text("tripwire", verdict.describe(), verdict.step)
        self._writer.add_scalar("tripwire/verdicts", float(fired), verdict.step)
        self._writer.flush()

    def close(self, run_url: str, status: str, summary: str, report: str | None) -> None:
        self._writer.add_text("tripwire/diagnosis", f"{run_url} ({status})\n\n{summary}", 0)
        self._writer.flush()


class EventFileSink(Sink):
    """A TensorBoard log directory that tripwire writes an event file of its own into (Keras' TensorBoard callback
    writes its own beside it; TensorBoard reads both)."""

    name = "tensorboard"

    def __init__(self, logdir: str):
        self.logdir = logdir
        self._file = None

    def verdict(self, verdict, fired: int) -> None:
        import time

        from .export import EventFile, step_event, text_event
        from .naming import VALUE

        if self._file is None:
            self._file = EventFile(self.logdir)
        pb = self._file.pb
        self._file.write(text_event(pb, verdict, verdict.step, time.time()))
        self._file.write(step_event(pb, verdict.step, time.time(), {"tripwire/verdicts": {VALUE: float(fired)}}, {}))
        self._file.flush()

    def close(self, run_url: str, status: str, summary: str, report: str | None) -> None:
        if self._file is not None:
            self._file.close()


class MlflowSink(Sink):
    """An MLflow run, through its client: tags `tripwire.run_url`, `tripwire.verdicts` (the count),
    `tripwire.status`; at the end the diagnosis as `tripwire/diagnosis.txt` and the HTML report as
    `tripwire/report.html`."""

    name = "mlflow"

    def __init__(self, client, run_id: str):
        self._client, self._run_id = client, run_id

    def start(self, run_url: str) -> None:
        self._client.set_tag(self._run_id, "tripwire.run_url", run_url)
        self._client.set_tag(self._run_id, "tripwire.status", "running")

    def verdict(self, verdict, fired: int) -> None:
        self._client.set_tag(self._run_id, "tripwire.verdicts", str(fired))
        self._client.set_tag(self._run_id, f"tripwire.{verdict.rule}", f"{verdict.severity} at step {verdict.step}")

    def close(self, run_url: str, status: str, summary: str, report: str | None) -> None:
        self._client.set_tag(self._run_id, "tripwire.status", status)
        self._client.log_text(self._run_id, summary, "tripwire/diagnosis.txt")
        if report is not None:
            self._client.log_artifact(self._run_id, report, "tripwire")


class WandbSink(MetricsSink):
    """A Weights & Biases run (WandbLogger's `experiment`), through the run's public API: each verdict as an alert
    (which W&B passes on to Slack or email where the user set that up; one a minute per rule and severity, W&B's
    default wait) and as the numbers of a MetricsSink, through the logger's own `log_metrics` (WandbLogger puts
    the step in `trainer/global_step`: W&B's own step, which only goes forward, is never asked to go back); at the
    end the table `tripwire/verdicts_table` (step, rule, severity, mode, message), the summary keys
    `tripwire/run_url`, `tripwire/status` and `tripwire/diagnosis`, and the HTML report as the run's file
    `tripwire/report.html`. An offline run keeps all of it for `wandb sync`."""

    COLUMNS = ["step", "rule", "severity", "mode", "message"]

    def __init__(self, run, log_metrics):
        super().__init__(log_metrics, "wandb")
        self._run, self._fired = run, []

    def start(self, run_url: str) -> None:
        self._run.summary["tripwire/run_url"] = run_url

    def verdict(self, verdict, fired: int) -> None:
        self._fired.append(verdict)
        super().verdict(verdict, fired)
        self._run.alert(title=f"tripwire: {verdict.rule} ({verdict.severity})"[:63], text=verdict.describe(),
                        level=ALERT_LEVELS[verdict.severity])

    def close(self, run_url: str, status: str, summary: str, report: str | None) -> None:
        if self._fired:
            import wandb  # imported already: the run is one of its

            rows = [[v.step, v.rule, v.severity, v.mode, v.message] for v in self._fired]
            self._run.log({"tripwire/verdicts_table": wandb.Table(columns=self.COLUMNS, data=rows)})
        self._run.summary.update({"tripwire/status": status, "tripwire/diagnosis": summary})
        if report is not None:  # a copy in the run's own folder: `run.save` of the temporary file would link to it
            saved = os.path.join(self._run.dir, "tripwire", "report.html")
            os.makedirs(os.path.dirname(saved), exist_ok=True)
            shutil.copyfile(report, saved)
            self._run.save(saved, base_path=self._run.dir, policy="now")


def active_mlflow_sink() -> MlflowSink | None:
    """A sink for the MLflow run active in this process, where the user's code imported mlflow and started one."""
    mlflow = sys.modules.get("mlflow")
    run = mlflow.active_run() if mlflow is not None and hasattr(mlflow, "active_run") else None
    if run is None:
        return None
    return MlflowSink(mlflow.MlflowClient(), run.info.run_id)


def siblings(callback) -> list:
    """The other callbacks of the framework call that is calling `callback` now. Keras and the Trainer hand a
    callback no list of them: it is their callback list that calls it (Keras' CallbackList, the Trainer's
    CallbackHandler), a few frames up, holding them as `callbacks`. None where that cannot be seen."""
    frame = sys._getframe(1)
    for _ in range(6):
        frame = frame.f_back
        if frame is None:
            break
        found = getattr(frame.f_locals.get("self"), "callbacks", None)
        if isinstance(found, list) and any(c is callback for c in found):
            return [c for c in found if c is not callback]
    return []


def local_report(store) -> str | None:
    """A local copy of the run's report.html (written by the `report` action), for loggers that take files."""
    try:
        data = store.get("report.html")
    except (FileNotFoundError, OSError):
        return None
    folder = tempfile.mkdtemp(prefix="tripwire-report-")
    path = os.path.join(folder, "report.html")
    with open(path, "wb") as f:
        f.write(data)
    return path
