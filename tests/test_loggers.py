"""Verdicts in the user's own loggers: every logger of a Lightning Trainer (TensorBoard, CSV, MLflow, W&B), a Keras
TensorBoard callback in the same fit, an MLflow run active in the process; `loggers: false` turns them off. Read
back with the real readers: TensorBoard's event accumulator, the CSV file, a local MLflow tracking store, an offline
W&B run's own transaction log (parsed with W&B's protos)."""

import csv
import json
import struct
import zlib

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


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B with no account and no network: offline runs, every folder of its in the test's own."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name in ("DIR", "CACHE_DIR", "CONFIG_DIR", "DATA_DIR"):
        (tmp_path / f"wandb-{name.lower()}").mkdir()
        monkeypatch.setenv(f"WANDB_{name}", str(tmp_path / f"wandb-{name.lower()}"))
    yield wandb
    wandb.finish()  # a test that failed before reading its run leaves none behind for the next
    wandb.teardown()


def wandb_records(save_dir):
    """Every record of the one offline W&B run under `save_dir`, as W&B's protos (`wandb_internal_pb2.Record`), read
    from the run's `.wandb` file: the transaction log `wandb sync` uploads. wandb 0.31 ships no Python reader of it
    (wandb-core writes it), so its framing is read here: a 7-byte header (":W&B", 0xBEE1, version 0), then LevelDB
    log blocks of 32 KiB, each chunk a CRC-32 of its type and data, a length and a type (1 whole record, 2 its first
    chunk, 3 a middle one, 4 its last); the CRC proves every chunk read as written."""
    from wandb.proto.wandb_internal_pb2 import Record

    (path,) = save_dir.rglob("offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:7] == struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
    records, chunks, at = [], [], 7
    while at + 7 <= len(data):
        if 32768 - at % 32768 < 7:  # a block's tail too short for a header is padding
            at += 32768 - at % 32768
            continue
        crc, length, kind = struct.unpack("<IHB", data[at:at + 7])
        if kind == 0:
            break
        chunk = data[at + 7:at + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc
        chunks.append(chunk)
        at += 7 + length
        if kind in (1, 4):
            records.append(Record.FromString(b"".join(chunks)))
            chunks = []
    assert records[-1].WhichOneof("record_type") == "exit"  # the whole run: its log ends with its exit
    return records


def wandb_items(items, into: dict) -> dict:
    """W&B's history or summary items into `into`: each value decoded from its JSON, under its key (a nested key, such
    as a table's ["tripwire/verdicts_table", "path"], as nested dicts)."""
    for item in items:
        *parents, key = item.nested_key or [item.key]
        at = into
        for parent in parents:
            at = at.setdefault(parent, {})
        at[key] = json.loads(item.value_json)
    return into


def wandb_recorded(save_dir) -> dict:
    """What the offline W&B run under `save_dir` recorded, by kind: its alerts (title, text, level), its history
    rows, its summary, the paths of its files. Finishes the run first, and waits for wandb-core to have written all of
    it (`wandb.finish` may return before: `wandb.teardown` waits)."""
    import wandb

    wandb.finish()
    wandb.teardown()
    found = {"alert": [], "history": [], "summary": {}, "files": []}
    for record in wandb_records(save_dir):
        kind = record.WhichOneof("record_type")
        if kind == "alert":
            found["alert"].append((record.alert.title, record.alert.text, record.alert.level))
        elif kind == "history":
            found["history"].append(wandb_items(record.history.item, {}))
        elif kind == "summary":
            wandb_items(record.summary.update, found["summary"])
        elif kind == "files":
            found["files"] += [f.path for f in record.files.files]
    return found


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


def test_a_wandb_logger_gets_alerts_numbers_a_table_the_diagnosis_and_the_report(tmp_path, wandb_offline):
    """lr=50: the loss turns NaN, exploding_tensor stops training; the report action writes a report."""
    from lightning.pytorch.loggers import WandbLogger

    config = {**DEAD, "rules": [dict(r, actions=[*r["actions"], "report"]) for r in DEAD["rules"]]}
    callback = TripwireCallback(config, out_dir=tmp_path / "run")
    helpers.fit(callback, helpers.mlp_module(lr=50.0), max_epochs=2,
                logger=WandbLogger(offline=True, save_dir=tmp_path / "wandb", project="zoo"))
    fired = [v for v in tripwire.open_run(callback.run_url).verdicts() if v.fired]
    nan = next(v for v in fired if v.rule == "exploding_tensor")

    recorded = wandb_recorded(tmp_path / "wandb")
    assert len(recorded["alert"]) == len(fired)
    assert ("tripwire: exploding_tensor (error)", nan.describe(), "ERROR") in recorded["alert"]
    counts = [row for row in recorded["history"] if "tripwire/verdicts" in row]
    assert [row["tripwire/verdicts"] for row in counts] == list(range(1, len(fired) + 1))
    assert {"trainer/global_step": nan.step, "tripwire/exploding_tensor": 2} in [
        {k: row.get(k) for k in ("trainer/global_step", "tripwire/exploding_tensor")} for row in counts]
    (table,) = [row["tripwire/verdicts_table"] for row in recorded["history"] if "tripwire/verdicts_table" in row]
    rows = json.loads(next((tmp_path / "wandb").rglob("files/" + table["path"])).read_text())
    assert rows["columns"] == ["step", "rule", "severity", "mode", "message"]
    assert [nan.step, "exploding_tensor", "error", "train", nan.message] in rows["data"]
    assert len(rows["data"]) == len(fired)

    summary = recorded["summary"]
    assert summary["tripwire/run_url"] == callback.run_url and summary["tripwire/status"] == "stopped"
    assert "exploding_tensor" in summary["tripwire/diagnosis"]
    assert "tripwire/report.html" in recorded["files"]
    (report,) = (tmp_path / "wandb").rglob("files/tripwire/report.html")
    assert not report.is_symlink() and report.read_text().startswith("<!DOCTYPE html>")


def test_a_healthy_fit_leaves_no_verdict_in_wandb(tmp_path, wandb_offline):
    from lightning.pytorch.loggers import WandbLogger

    callback = TripwireCallback(DEAD, out_dir=tmp_path / "run")
    helpers.fit(callback, helpers.mlp_module(), max_epochs=1,
                logger=WandbLogger(offline=True, save_dir=tmp_path / "wandb", project="zoo"))
    assert not [v for v in callback.verdicts if v.fired]
    recorded = wandb_recorded(tmp_path / "wandb")
    assert not recorded["alert"] and not any(k.startswith("tripwire") for row in recorded["history"] for k in row)
    assert recorded["summary"]["tripwire/status"] == "finished"
    assert recorded["summary"]["tripwire/diagnosis"].startswith("no rule fired.")


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


def test_loggers_false_keeps_the_verdicts_out_of_wandb(tmp_path, wandb_offline):
    from lightning.pytorch.loggers import WandbLogger

    callback = TripwireCallback({**DEAD, "loggers": False}, out_dir=tmp_path / "run")
    helpers.fit(callback, helpers.mlp_module(lr=50.0), max_epochs=1,
                logger=WandbLogger(offline=True, save_dir=tmp_path / "wandb", project="zoo"))
    assert [v for v in callback.verdicts if v.fired]
    recorded = wandb_recorded(tmp_path / "wandb")
    assert recorded["history"] and not recorded["alert"]  # Lightning's own numbers are there
    assert not any(k.startswith("tripwire") for kind in ("history", "summary")
                   for row in (recorded[kind] if kind == "history" else [recorded[kind]]) for k in row)


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
