"""Lightning DDP with 2 processes on CPU: per-rank shards, one stop for all ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tripwire

SCRIPT = Path(__file__).parent / "scripts" / "train_ddp.py"


def run_ddp(tmp_path, config, *extra, env=None):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "run"), json.dumps(config),
                           str(tmp_path / "result"), *extra], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, **(env or {})})
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


def test_raise_on_one_rank_raises_rule_fired_on_every_rank_at_the_same_step(tmp_path):
    config = {"workers": "all", "sampling": {"every": 2}, "collections": {"losses": {}},
              "rules": [{"rule": "exploding_tensor", "params": {"collections": ["losses"]}, "actions": ["raise"]}]}
    rank0, rank1 = run_ddp(tmp_path, config, "--nan-rank", "1", "--nan-at", "20", "--steps", "60")
    assert rank0["global_step"] == rank1["global_step"] == 21  # both raised at the end of step 20
    for outcome in (rank0, rank1):
        raised = outcome["raised"]
        assert raised and raised["rule"] == "exploding_tensor" and raised["step"] == 20 and raised["rank"] == 1
        assert "on rank 1" in raised["message"]
    assert not rank0["verdicts"] and rank1["verdicts"][0]["step"] == 20
    run = tripwire.open_run(rank0["run_url"])
    assert run.info["status"] == "stopped" and {w["state"] for w in run.info["workers"].values()} == {"stopped"}
    assert [v.worker for v in run.verdicts() if v.fired] == [1]


def test_side_process_verdict_is_applied_once_by_its_own_rank(tmp_path):
    calls = tmp_path / "calls.jsonl"
    config = {"workers": "all", "sampling": {"every": 1}, "collections": {"losses": {}},
              "evaluation": {"where": "side_process", "spawn": True}, "writer": {"flush_every_s": 0.2},
              "rules": [{"rule": "exploding_tensor", "params": {"collections": ["losses"]},
                         "actions": ["log", {"call": "custom_rules:record"}, "stop"]}]}
    rank0, rank1 = run_ddp(tmp_path, config, "--nan-rank", "1", "--nan-at", "10", "--hold-at", "10",
                           "--steps", "200",  # the spawned watcher loads the config, so it imports custom_rules too
                           env={"TRIPWIRE_TEST_CALLS": str(calls), "PYTHONPATH": str(SCRIPT.parent.parent)})
    assert rank0["global_step"] == rank1["global_step"] < 200  # the watcher's verdict stopped both ranks
    assert [v["worker"] for v in rank1["verdicts"]][:1] == [1]
    assert all(v["worker"] == 0 for v in rank0["verdicts"])  # each rank takes only its own worker's verdicts
    called = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [c["worker"] for c in called].count(1) == 1  # `call` ran once, not once per rank
    assert len({(c["worker"], c["step"], c["rule"]) for c in called}) == len(called)
    run = tripwire.open_run(rank0["run_url"])
    assert run.info["status"] == "stopped"
    assert [v.step for v in run.verdicts(worker=1) if v.fired] == [10]


@pytest.mark.parametrize("workers", ["all", "zero"])
def test_fsdp_shards_are_read_as_whole_parameters_and_never_break_training(tmp_path, workers):
    """FSDP2 (fully_shard), two CPU processes: each rank holds half of every parameter (a DTensor). The relations'
    flags read each rank's shard; with a probe on every rank (`workers: all`) the stored reductions of a sharded
    gradient are those of the whole gradient (the ranks' shard reductions gathered and combined); with one probe on
    rank 0 alone, no collective is made (the other rank would never join it), and rank 0's shard is read. The
    healthy model learns and nothing fires."""
    port = str(29400 + (os.getpid() % 200) + (workers == "all"))
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "scripts" / "train_fsdp.py"),
                           str(tmp_path / "run"), str(tmp_path / "result"), workers, port], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1))
    assert rank0["accuracy"] > 0.8
    run = tripwire.open_run(rank0["run_url"])
    assert [v for v in run.verdicts() if v.counts] == []
    gradient = run.tensor("gradients/0.weight")
    stored = {r: gradient.tail(r)[1][0] for r in ("l2", "mean", "std", "max")}
    whole = {r: rank0[f"grad_{r}"] for r in ("l2", "mean", "std", "max")}
    if workers == "all":
        assert stored == pytest.approx(whole, rel=1e-4, abs=1e-7)
        assert tripwire.open_run(rank1["run_url"]).tensor("gradients/0.weight").tail("l2")[1][0] == \
            pytest.approx(whole["l2"], rel=1e-4)
    else:  # rank 0's half of the rows
        assert stored["l2"] < whole["l2"] and stored != pytest.approx(whole, rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("strategy", ["ddp", "model_parallel"])
def test_lightning_sharded_strategy_is_read_as_ddp_is_and_a_healthy_run_is_silent(tmp_path, strategy):
    """Lightning's ModelParallelStrategy (FSDP2: each Linear and the module fully_shard-ed over two CPU ranks in
    `configure_model`) against Lightning's DDP on the same model and data, every rank captured, the default rules:
    what is stored of a gradient is the whole gradient's (each rank's shard reductions combined across ranks),
    on every rank, as under DDP; the model learns and no rule fires a warning or an error. (Lightning's FSDPStrategy,
    FSDP1, refuses a CPU: it needs a GPU to test.)"""
    config = tripwire.load_config(Path(__file__).parent.parent / "rules.yaml").to_dict()
    rank0, rank1 = run_ddp(tmp_path, {**config, "workers": "all"}, "--steps", "120", "--strategy", strategy,
                           "--gradient-at", "100")
    assert rank0["val_loss"] < 0.5  # from ln 10 = 2.3 untrained
    run = tripwire.open_run(rank0["run_url"])
    assert [v for v in run.verdicts() if v.counts] == []
    gradient = run.tensor("gradients/net.0.weight")
    for worker in (0, 1):
        stored = {r: gradient.reduction(100, r, worker=worker) for r in ("l2", "abs_mean")}
        assert stored == pytest.approx(rank0["gradient"], rel=1e-4)
    assert run.tensor("weights/net.0.weight").reduction(100, "l2", worker=1) == \
        pytest.approx(run.tensor("weights/net.0.weight").reduction(100, "l2", worker=0), rel=1e-6)


def test_ddp_spawn_pickles_the_callback_into_each_process(tmp_path):
    """`strategy="ddp_spawn"` pickles the Trainer and its callbacks into the processes it starts: the callback's
    capture plan held a per-instance cache pickle refused, so the fit died before its first step."""
    for attempt in range(2):
        proc = subprocess.run([sys.executable, str(Path(__file__).parent / "scripts" / "train_ddp_spawn.py"),
                               str(tmp_path / f"run-{attempt}")], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)
        # a teardown race of the spawned processes: once in a full suite, rank 1 (which records nothing) aborted at
        # its exit after the fit had ended on both ranks ("terminate called without an active exception" while
        # Lightning destroys the gloo process group at exit; not seen again in 16 runs of the script, with and
        # without the callback): that attempt is run again; a failure before the end of the fit is not
        output = proc.stdout + proc.stderr
        raced = "terminated with signal SIGABRT" in output and "`Trainer.fit` stopped" in output
        if not raced:
            break
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    before, after = (float(v) for v in proc.stdout.split("learned ")[1].split()[:2])
    assert after < before / 2
    run = tripwire.open_run(str(tmp_path / f"run-{attempt}"))
    assert run.info["status"] == "finished" and run.info["world_size"] == 2 and run.workers() == [0]
    assert run.steps() and not [v for v in run.verdicts() if v.fired and v.severity in ("warning", "error")]
