"""Lightning DDP with 2 processes on CPU: per-rank shards, one stop for all ranks."""

import json
import subprocess
import sys
from pathlib import Path

import tripwire

SCRIPT = Path(__file__).parent / "scripts" / "train_ddp.py"


def run_ddp(tmp_path, config, *extra):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "run"), json.dumps(config),
                           str(tmp_path / "result"), *extra], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]


def test_fault_on_one_rank_stops_both_at_the_same_step(tmp_path):
    config = {"workers": "all", "sampling": {"every": 2}, "collections": {"losses": {}, "weights": {"every": 10}},
              "rules": [{"rule": "exploding_tensor", "params": {"collections": ["losses"]},
                         "actions": ["log", "stop"]}]}
    rank0, rank1 = run_ddp(tmp_path, config, "--nan-rank", "1", "--nan-at", "20", "--steps", "60")
    assert rank0["run_url"] == rank1["run_url"]
    assert rank0["global_step"] == rank1["global_step"] == 21
    assert not rank0["verdicts"] and rank1["verdicts"][0]["step"] == 20
    run = tripwire.open_run(rank0["run_url"])
    assert run.workers() == [0, 1] and run.info["world_size"] == 2 and run.info["status"] == "stopped"
    assert run.steps(worker=0) == run.steps(worker=1) == list(range(0, 21, 2))
    loss = run.tensor("losses/train")
    assert loss.reduction(18, worker=0) != loss.reduction(18, worker=1)  # each rank's own batch
    assert [v.worker for v in run.verdicts() if v.fired] == [1]


def test_default_captures_rank_zero_only(tmp_path):
    config = {"sampling": {"every": 5}, "collections": {"losses": {}}}
    rank0, rank1 = run_ddp(tmp_path, config, "--steps", "20")
    assert rank0["global_step"] == rank1["global_step"] == 20
    run = tripwire.open_run(rank0["run_url"])
    assert run.workers() == [0] and run.info["world_size"] == 2
    assert run.steps() == [0, 5, 10, 15] and run.info["status"] == "finished"
