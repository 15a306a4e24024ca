"""The side process: `tripwire watch` evaluates a live run from another process and stops it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tripwire

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
    assert "[exploding_tensor] fired at step 30" in watch_out

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
