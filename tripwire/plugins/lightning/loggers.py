"""The sinks (tripwire.core.sinks) of a Lightning Trainer's own loggers, by what each can take through its public
API: an MLflow client and run (MLFlowLogger) gets tags and the report; a W&B run (WandbLogger) alerts, numbers, a
table, its summary and the report; a summary writer (TensorBoardLogger's `experiment`) text and a scalar; any other
logger (CSVLogger, …) numbers through `log_metrics`."""

from __future__ import annotations

import logging

from tripwire.core.sinks import MetricsSink, MlflowSink, WandbSink, WriterSink


log = logging.getLogger("tripwire")


def sinks_of(loggers) -> list:
    out = []
    for logger in loggers or ():
        name = type(logger).__name__
        try:
            experiment = logger.experiment
        except Exception as exc:  # noqa: BLE001 - a logger tripwire cannot reach is left out, training goes on
            log.warning("tripwire: the %s is left out of tripwire's verdicts: %s: %s", name, type(exc).__name__, exc)
            continue
        if type(experiment).__name__ == "MlflowClient" and getattr(logger, "run_id", None):
            out.append(MlflowSink(experiment, logger.run_id))
        elif callable(getattr(experiment, "alert", None)):  # a wandb Run: the one logger that raises alerts
            out.append(WandbSink(experiment, logger.log_metrics))
        elif callable(getattr(experiment, "add_text", None)) and callable(getattr(experiment, "add_scalar", None)):
            out.append(WriterSink(experiment, name))
        else:
            out.append(MetricsSink(logger.log_metrics, name))
    return out
