"""Verdicts in the user's own loggers: every logger of a Lightning Trainer (TensorBoard, CSV, MLflow), a Keras
TensorBoard callback in the same fit, an MLflow run active in the process; `loggers: false` turns them off. Read
back with the real readers: TensorBoard's event accumulator, the CSV file, a local MLflow tracking store."""

import csv

import pytest

import helpers
import tripwire
from tripwire.plugins.lightning import TripwireCallback

DEAD = {**tripwire.load_config(None).to_dict(), "sampling": {"every": 10}}  # the default rules, short runs


def dead_first_layer(net):
    import torch

    torch.nn.init.constant_(net[0].bias, -20.0)


def event_tags(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    found = {}
    for events in sorted(logdir.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events.parent), size_guidance={"tensors": 0, "scalars": 0})
        accumulator.Reload()
        tags = accumulator.Tags()
        for tag in tags.get("tensors", []):  # text, and TensorFlow's own scalars (as tensors)
            found[tag.removesuffix("/text_summary")] = [
                e.tensor_proto.string_val[0].decode() if e.tensor_proto.string_val else
                float(make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)]
        for tag in tags.get("scalars", []):
            found[tag] = [e.value for e in accumulator.Scalars(tag)]
    return found


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    # artifacts in the test's folder (an experiment's default is ./mlruns, beside whatever runs the tests)
    mlflow.set_experiment(experiment_id=mlflow.create_experiment("tests", artifact_location=str(tmp_path / "mlruns")))
    yield mlflow
    mlflow.set_tracking_uri(None)


def test_every_logger_of_a_lightning_trainer_gets_the_verdicts(tmp_path, mlflow_store):
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger

    loggers = [TensorBoardLogger(tmp_path / "tb"), CSVLogger(tmp_path / "csv"),
               MLFlowLogger(experiment_name="zoo", tracking_uri=mlflow_store.get_tracking_uri(),
                            artifact_location=str(tmp_path / "artifacts"))]
    callback = TripwireCallback(DEAD, out_dir=tmp_path / "run")
    helpers.fit(callback, helpers.mlp_module(init=dead_first_layer), max_epochs=1, logger=loggers)
    fired = [v for v in tripwire.open_run(callback.run_url).verdicts() if v.fired]
    assert fired

    tags = event_tags(tmp_path / "tb")
    assert any("[dead_relu] error" in text for text in tags["tripwire"])
    assert tags["tripwire/verdicts"][-1] == len(fired)
    assert any("dead ReLU units" in text for text in tags["tripwire/diagnosis"])

    (rows,) = [list(csv.DictReader(open(f))) for f in (tmp_path / "csv").rglob("metrics.csv")]
    counts = [float(r["tripwire/verdicts"]) for r in rows if r.get("tripwire/verdicts")]
    assert counts and counts[-1] == len(fired) and any(r.get("tripwire/dead_relu") == "2.0" for r in rows)

    run = mlflow_store.MlflowClient().get_run(loggers[2].run_id)
    assert run.data.tags["tripwire.status"] == "finished" and run.data.tags["tripwire.verdicts"] == str(len(fired))
    assert run.data.tags["tripwire.run_url"] == callback.run_url
    assert run.data.tags["tripwire.dead_relu"].startswith("error at step")
    artifacts = {a.path for a in mlflow_store.MlflowClient().list_artifacts(loggers[2].run_id, "tripwire")}
    assert "tripwire/diagnosis.txt" in artifacts


def test_an_active_mlflow_run_gets_tags_and_the_report_whatever_the_framework(tmp_path, mlflow_store):
    config = {**DEAD, "rules": [dict(r, actions=[*r["actions"], "report"]) for r in DEAD["rules"]]}
    with mlflow_store.start_run() as active:
        callback = TripwireCallback(config, out_dir=tmp_path / "run")
        helpers.fit(callback, helpers.mlp_module(init=dead_first_layer), max_epochs=1)
    client = mlflow_store.MlflowClient()
    run = client.get_run(active.info.run_id)
    assert run.data.tags["tripwire.status"] == "finished" and int(run.data.tags["tripwire.verdicts"]) > 0
    artifacts = {a.path for a in client.list_artifacts(active.info.run_id, "tripwire")}
    assert artifacts == {"tripwire/diagnosis.txt", "tripwire/report.html"}


def test_loggers_false_keeps_the_verdicts_out_of_the_loggers(tmp_path, mlflow_store):
    from lightning.pytorch.loggers import CSVLogger

    with mlflow_store.start_run() as active:
        callback = TripwireCallback({**DEAD, "loggers": False}, out_dir=tmp_path / "run")
        helpers.fit(callback, helpers.mlp_module(init=dead_first_layer), max_epochs=1,
                    logger=[CSVLogger(tmp_path / "csv")])
    assert not any(key.startswith("tripwire") for key in mlflow_store.MlflowClient().get_run(
        active.info.run_id).data.tags)
    (rows,) = [list(csv.DictReader(open(f))) for f in (tmp_path / "csv").rglob("metrics.csv")]
    assert not any(key.startswith("tripwire") for row in rows for key in row)


def test_a_keras_tensorboard_callback_in_the_same_fit_gets_the_verdicts(tmp_path):
    import keras

    from keras_models import fit, mlp
    from tripwire.plugins.keras import TripwireCallback as KerasCallback

    board = keras.callbacks.TensorBoard(log_dir=str(tmp_path / "logs"))
    callback = KerasCallback(DEAD, out_dir=tmp_path / "run")
    fit(callback, mlp(hidden=(32, 32), first_bias=-20.0), epochs=1, callbacks=[board])
    fired = [v for v in tripwire.open_run(callback.run_url).verdicts() if v.fired]
    tags = event_tags(tmp_path / "logs" / "train")
    assert any("dead_relu" in tag for tag in tags) and tags["tripwire/verdicts"][-1] == len(fired)


def test_the_trainer_s_report_to_integrations_get_the_verdicts(tmp_path, mlflow_store):
    """`report_to=["tensorboard", "mlflow"]`: the TensorBoardCallback's writer gets each verdict as text and the
    count, the run MLflowCallback starts gets the tags. The fault: a batch of labels all -100 (a NaN loss)."""
    from transformers import Trainer

    from benchmarks.zoo import data
    from benchmarks.zoo.transformers_cases import Rows, Stream, arguments, tiny_bert
    from tripwire.plugins.transformers import TripwireCallback as TrainerCallback

    (xt, yt), (xv, yv) = data.token_presence()
    yt = yt.copy()
    yt[3 * 32:4 * 32] = -100
    callback = TrainerCallback()
    args = arguments(str(tmp_path / "out"), max_steps=8, report_to=["tensorboard", "mlflow"])
    Trainer(model=tiny_bert(), args=args, train_dataset=Stream(xt, yt), eval_dataset=Rows(xv, yv),
            callbacks=[callback]).train()
    fired = [v for v in tripwire.open_run(callback.run_url).verdicts() if v.fired]
    assert any(v.rule == "exploding_tensor" and v.step == 3 for v in fired)
    tags = event_tags(tmp_path / "out")
    assert any("[exploding_tensor] error at step 3" in text for text in tags["tripwire"])
    assert tags["tripwire/verdicts"][-1] == len(fired)
    (run,) = mlflow_store.search_runs(output_format="list", search_all_experiments=True)
    assert run.data.tags["tripwire.exploding_tensor"] == "error at step 3"
    assert run.data.tags["tripwire.status"] == "stopped"
