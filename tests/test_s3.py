"""Runs on real object storage: s3fs against moto's S3 server on loopback (started by the fixtures)."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl

import helpers
import tripwire
from tripwire.core import writer as writer_module
from tripwire.plugins.lightning import TripwireCallback

SCRIPT = Path(__file__).parent / "scripts" / "train_lightning.py"


def test_lightning_run_on_s3_reads_back_like_a_local_one(s3_server):
    url = s3_server.bucket() + "/runs/exp1"
    config = {"collections": {"weights": {"save": "tensors"}, "losses": {}}, "sampling": {"every": 5},
              "rules": [{"rule": "exploding_tensor", "actions": ["log", "stop"]}],
              "storage_options": s3_server.storage_options}
    callback = TripwireCallback(config, out_dir=url)
    helpers.fit(callback, helpers.mlp_module(lr=50.0), max_epochs=1)
    run = tripwire.open_run(url, storage_options=s3_server.storage_options)
    assert run.info["status"] == "stopped" and run.verdicts()[0].rule == "exploding_tensor"
    stop = run.verdicts()[0].step  # the NaN loss is recorded at its step, sampled or not
    assert run.steps() == sorted({*range(0, stop + 1, 5), stop})
    assert run.tensor("weights/net.0.weight").value(0).shape == (32, 64)
    assert "storage_options" not in json.dumps(run.info["config"])  # credentials are never stored


def test_live_reading_and_watch_over_s3(s3_server):
    url = s3_server.bucket() + "/runs/live"
    config = {"evaluation": {"where": "side_process"}, "writer": {"flush_every_s": 0.3}, "sampling": {"every": 1},
              "rules": [{"rule": "exploding_tensor", "actions": ["log", "stop"]}]}
    trainer = subprocess.Popen([sys.executable, str(SCRIPT), url, json.dumps(config), "/dev/null", "--nan-at", "40",
                                "--sleep", "0.05", "--steps", "400"], env=s3_server.env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watcher = subprocess.Popen([sys.executable, "-m", "tripwire", "watch", url], env=s3_server.env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = None
    deadline = time.time() + 60
    while run is None and time.time() < deadline:
        try:
            run = tripwire.open_run(url, storage_options=s3_server.storage_options)
        except tripwire.RunNotFound:
            time.sleep(0.2)
    assert run is not None and run.wait_for_step(10, timeout=60)  # follows the live run
    out, _ = trainer.communicate(timeout=240)
    assert trainer.returncode == 0, out
    watch_out, _ = watcher.communicate(timeout=120)
    assert watcher.returncode == 1 and "error at step 40" in watch_out, watch_out
    run.refresh()
    assert 40 < run.steps()[-1] < 399 and run.info["status"] == "stopped"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StopServer(pl.Callback):
    """Stops the S3 server after a step, once the writer has stored every step so far, and starts it again
    `down_steps` later, once the writer has failed to store one."""

    def __init__(self, server_factory, callback, stop_at, down_steps):
        self.factory, self.callback, self.stop_at, self.down_steps = server_factory, callback, stop_at, down_steps
        self.server = server_factory()
        self.server.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step, writer = trainer.global_step - 1, self.callback._recorder.writer
        if step == self.stop_at:
            helpers.wait_until(lambda: writer.pending_bytes == 0)
            self.server.stop()
        elif step == self.stop_at + self.down_steps:
            helpers.wait_until(lambda: writer.lost_steps > 0)
            self.server = self.factory()
            self.server.start()


def test_s3_server_stopped_mid_run(monkeypatch, caplog):
    from moto.server import ThreadedMotoServer

    monkeypatch.setattr(writer_module, "RETRY_DELAYS_S", (0.1, 0.2))
    port = free_port()
    options = {"key": "testing", "secret": "testing", "client_kwargs": {
        "endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
        "config_kwargs": {"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 1}}}
    config = {"collections": {"losses": {}}, "sampling": {"every": 1}, "writer": {"flush_every_s": 0.1},
              "storage_options": options}
    callback = TripwireCallback(config, out_dir="s3://outage/run")
    outage = StopServer(lambda: ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False), callback, 30, 30)
    import s3fs

    s3fs.S3FileSystem(**options).call_s3("create_bucket", Bucket="outage")
    trainer = helpers.fit(callback, max_epochs=3, callbacks=[outage])
    outage.server.stop()
    outage.server = outage.factory()
    outage.server.start()
    try:
        assert trainer.global_step == 3 * 43  # training went on through the outage
        assert "could not write" in caplog.text and "works again" in caplog.text
        run = tripwire.open_run("s3://outage/run", storage_options=options)
        assert run.info["lost_steps"] > 0 and run.info["status"] == "finished"
        assert len(run.steps()) + run.info["lost_steps"] == 3 * 43
    finally:
        outage.server.stop()
