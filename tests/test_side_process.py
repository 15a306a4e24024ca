"""The side process: `tripwire watch` evaluates a live run from another process and stops it."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import helpers
import tripwire
from tripwire.core.store import sealed_json

SCRIPT = Path(__file__).parent / "scripts" / "train_lightning.py"
SIDE = {"evaluation": {"where": "side_process"}, "writer": {"flush_every_s": 0.2},
        "sampling": {"every": 1}, "rules": [{"rule": "exploding_tensor", "actions": ["log", "stop"]}]}


def train(run_url, config, result, *extra):
    return subprocess.Popen([sys.executable, str(SCRIPT), str(run_url), json.dumps(config), str(result), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def shard_holding(run_dir: Path, step: int) -> Path:
    """The shard file (not the index written at close) that holds a train step."""
    from tripwire.core.shardfile import decode_header, header_length

    for path in sorted((run_dir / "shards").iterdir()):
        data = path.read_bytes()
        entries, meta = decode_header(data[8:8 + header_length(data)])
        steps = entries[meta["steps"]["train"]].decode(data[entries[meta["steps"]["train"]].begin:
                                                            entries[meta["steps"]["train"]].end])
        if step in steps:
            return path
    raise AssertionError(f"no shard holds step {step}")


def test_watch_stops_a_live_run_from_another_process(tmp_path):
    run_dir, result = tmp_path / "run", tmp_path / "result.json"
    trainer = train(run_dir, SIDE, result, "--nan-at", "30", "--sleep", "0.05", "--steps", "400")
    watcher = subprocess.Popen([sys.executable, "-m", "tripwire", "watch", str(run_dir)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = trainer.communicate(timeout=180)
    assert trainer.returncode == 0, out
    watch_out, _ = watcher.communicate(timeout=60)
    assert watcher.returncode == 1, watch_out  # a rule fired: exit code of `check`
    assert "[exploding_tensor] error at step 30" in watch_out

    outcome = json.loads(result.read_text())
    (verdict,) = [v for v in tripwire.open_run(str(run_dir)).verdicts() if v.fired]
    assert verdict.step == 30 and verdict.source == "side_process"
    assert outcome["verdicts"][0]["step"] == 30  # the training process picked it up
    assert 30 < outcome["global_step"] < 400
    # stopped within 2 s (asserted loosely) of the shard holding step 30 appearing in the store
    flushed = shard_holding(run_dir, 30).stat().st_mtime
    assert outcome["times"][str(outcome["global_step"] - 1)] - flushed < 4.0
    assert tripwire.open_run(str(run_dir)).info["status"] == "stopped"


def test_spawned_watcher_killed_mid_run_leaves_training_running(tmp_path):
    psutil = pytest.importorskip("psutil")
    run_dir, result = tmp_path / "run", tmp_path / "result.json"
    config = {**SIDE, "evaluation": {"where": "side_process", "spawn": True}}
    trainer = train(run_dir, config, result, "--sleep", "0.02", "--steps", "150")
    deadline = time.time() + 60
    children = []
    while time.time() < deadline and not children:
        children = [c for c in psutil.Process(trainer.pid).children() if "watch" in " ".join(c.cmdline())]
        time.sleep(0.1)
    assert children, "the callback did not spawn `tripwire watch`"
    time.sleep(1.0)
    os.kill(children[0].pid, signal.SIGKILL)
    out, _ = trainer.communicate(timeout=180)
    assert trainer.returncode == 0, out
    assert json.loads(result.read_text())["global_step"] == 150
    assert "watcher exited" in out
    assert tripwire.open_run(str(run_dir)).info["status"] == "finished"


def test_spawned_watcher_stops_training_and_exits_with_it(tmp_path):
    psutil = pytest.importorskip("psutil")
    run_dir, result = tmp_path / "run", tmp_path / "result.json"
    config = {**SIDE, "evaluation": {"where": "side_process", "spawn": True}}
    trainer = train(run_dir, config, result, "--nan-at", "20", "--sleep", "0.03", "--steps", "400")
    out, _ = trainer.communicate(timeout=180)
    assert trainer.returncode == 0, out
    outcome = json.loads(result.read_text())
    assert outcome["verdicts"] and outcome["verdicts"][0]["step"] == 20
    assert 20 < outcome["global_step"] < 400
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]


# -- the watcher outlives storage outages, ends runs whose writers vanished, keeps check's exit codes ----------

TESTS = Path(__file__).parent


def watch_cli(url, *args, env=None, stderr=None):
    """`tripwire watch` in its own process, able to read `outage://` URLs (tests/outagefs.py)."""
    code = "import sys, outagefs; from tripwire.core.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", code, "watch", str(url), *args], stdout=subprocess.PIPE,
                            stderr=stderr or subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(TESTS), **(env or {})})


def recorded_run(run_dir, rules, steps=3, finish=True):
    """A run written by a real Recorder (side_process: the training process evaluates nothing)."""
    from tripwire.core.recorder import Recorder

    config = {"evaluation": {"where": "side_process"}, "collections": {"losses": {}}, "rules": rules,
              "writer": {"flush_every_s": 0.1}}
    recorder = Recorder(config, run_url=str(run_dir), framework="test")
    recorder.start()
    for step in range(steps):
        recorder.record(step, "train", {"losses/train": {"value": 1.0 / (step + 1)}})
    if finish:
        recorder.finish()
    return recorder


def wait_for_text(path: Path, text: str, timeout: float = 60.0) -> None:
    helpers.wait_until(lambda: path.exists() and text in path.read_text(), timeout)


def test_watch_retries_a_storage_outage_and_goes_on(tmp_path):
    run_dir, result, go, outage = tmp_path / "run", tmp_path / "result.json", tmp_path / "go", tmp_path / "outage"
    trainer = train(run_dir, SIDE, result, "--nan-at", "30", "--sleep", "0.05", "--steps", "400",
                    "--hold-at", "5", "--hold-file", str(go))
    log_path = tmp_path / "watch.log"
    with open(log_path, "w") as log_file:
        watcher = watch_cli(f"outage://{run_dir}", env={"TRIPWIRE_TEST_OUTAGE": str(outage)}, stderr=log_file)
        helpers.wait_until(lambda: (run_dir / "watcher" / "heartbeat.json").exists())  # attached
        outage.touch()
        wait_for_text(log_path, "fails")  # it noticed, and waits the outage out instead of dying
        assert watcher.poll() is None
        outage.unlink()
        wait_for_text(log_path, "answers again")
        go.touch()
        out, _ = trainer.communicate(timeout=180)
        watch_out, _ = watcher.communicate(timeout=60)
    assert trainer.returncode == 0, out
    err = log_path.read_text()
    assert watcher.returncode == 1, watch_out + err
    assert "[exploding_tensor] error at step 30" in watch_out and "Traceback" not in err
    outcome = json.loads(result.read_text())
    assert outcome["verdicts"][0]["step"] == 30 and 30 < outcome["global_step"] < 400


def test_watch_gives_up_after_a_bounded_outage_with_exit_2(tmp_path):
    run_dir, outage = tmp_path / "run", tmp_path / "outage"
    recorder = recorded_run(run_dir, [{"rule": "exploding_tensor"}], finish=False)  # a live run
    try:
        watcher = watch_cli(f"outage://{run_dir}", "--give-up-after", "1",
                            env={"TRIPWIRE_TEST_OUTAGE": str(outage)})
        helpers.wait_until(lambda: (run_dir / "watcher" / "heartbeat.json").exists())
        outage.touch()
        out, _ = watcher.communicate(timeout=60)
    finally:
        recorder.finish()
    assert watcher.returncode == 2, out
    assert "fails" in out and "gave up" in out and "Traceback" not in out


@pytest.mark.parametrize("quiet", [False, True])
def test_watch_exit_codes_match_check_also_when_quiet(tmp_path, quiet):
    run_dir = tmp_path / "run"
    recorded_run(run_dir, [{"rule": "custom_rules:Broken"}])  # raises on its second step: an `error` verdict
    flags = ["--trust-run"] + (["--quiet"] if quiet else [])  # the run's own custom rule: ours to import
    watcher = watch_cli(run_dir, *flags)
    out, _ = watcher.communicate(timeout=60)
    assert watcher.returncode == 2, out  # as `check`: 2 when a rule failed and none fired
    assert ("failed" in out) != quiet
    check = subprocess.run([sys.executable, "-m", "tripwire", "check", str(run_dir), "--trust-run"], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(TESTS)})
    assert check.returncode == 2


@pytest.mark.parametrize("gone", ["unknown", "crashed"])
def test_watch_ends_a_run_whose_writers_vanished(tmp_path, gone):
    import socket

    run_dir = tmp_path / "run"
    recorded_run(run_dir, [{"rule": "exploding_tensor"}])
    status_file = run_dir / "status" / "00000.json"
    status = json.loads(status_file.read_text())
    if gone == "unknown":  # a writer on another machine, not heard from for long
        status.update(state="running", host="elsewhere", heartbeat=time.time() - 3600)
    else:  # a writer on this machine whose process is gone
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        status.update(state="running", host=socket.gethostname(), pid=dead.pid)
    status_file.write_bytes(sealed_json(status))
    for index in (run_dir / "index").iterdir():  # a writer that vanished wrote no final index either
        index.unlink()
    assert tripwire.open_run(str(run_dir)).info["status"] == gone
    watcher = watch_cli(run_dir, "--ended-after", "1")
    out, _ = watcher.communicate(timeout=60)  # without an end for such runs it would wait forever
    assert watcher.returncode == 0, out
    assert f"is {gone}" in out and "treating it as ended" in out


# -- the training process says when no watcher is attached, or when it stops ---------------------------------

class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def count(self, text):
        return sum(text in m for m in self.messages)


@pytest.fixture
def messages():
    handler = _Messages()
    logger = logging.getLogger("tripwire")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def _holding_at(step, until):
    import lightning.pytorch as pl

    class Hold(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step - 1 == step:
                until()

    return Hold()


NO_WATCHER = "no watcher attached"


def test_side_process_without_a_watcher_warns_once_and_trains_on(tmp_path, messages):
    from tripwire.plugins.lightning import TripwireCallback

    config = {**SIDE, "evaluation": {"where": "side_process", "watcher_timeout_s": 0.5}}
    cb = TripwireCallback(config, out_dir=str(tmp_path / "run"))
    hold = _holding_at(3, lambda: helpers.wait_until(lambda: messages.count(NO_WATCHER)))
    trainer = helpers.fit(cb, max_steps=20, callbacks=[hold])
    assert trainer.global_step == 20
    assert messages.count(NO_WATCHER) == 1 and "tripwire watch" in messages.messages[0]
    assert tripwire.open_run(str(tmp_path / "run")).info["status"] == "finished"


def test_watcher_that_stops_beating_is_reported_once(tmp_path, messages):
    from tripwire.plugins.lightning import TripwireCallback

    run_dir = tmp_path / "run"
    config = {**SIDE, "evaluation": {"where": "side_process", "watcher_timeout_s": 3}}
    cb = TripwireCallback(config, out_dir=str(run_dir))
    watcher = subprocess.Popen([sys.executable, "-m", "tripwire", "watch", str(run_dir)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stopped = "stopped refreshing its heartbeat"

    def kill_the_watcher_once_attached():
        helpers.wait_until(lambda: cb._recorder._watcher.attached)
        watcher.kill()
        watcher.wait()
        helpers.wait_until(lambda: messages.count(stopped))

    trainer = helpers.fit(cb, max_steps=20, callbacks=[_holding_at(3, kill_the_watcher_once_attached)])
    assert trainer.global_step == 20
    assert messages.count(stopped) == 1 and not messages.count(NO_WATCHER)
    assert tripwire.open_run(str(run_dir)).info["status"] == "finished"


@pytest.mark.parametrize("value", [0, -1, "soon", True])
def test_watcher_timeout_is_validated(value):
    with pytest.raises(tripwire.ConfigError, match="evaluation.watcher_timeout_s"):
        tripwire.load_config({**SIDE, "evaluation": {"where": "side_process", "watcher_timeout_s": value}})
    assert tripwire.load_config(SIDE).evaluation.watcher_timeout_s == 60.0
