"""training_relations across ranks: DDP replicas that drift apart (`replicas_differ`), in two-process DDP on CPU
(gloo). A plain loop whose forward calls the inner module (`ddp_model.module(x)`: no all-reduce) is an error at
the first step; its healthy twin, and Lightning's DDP, record 0 and stay silent. Under DDP the probe's ranks agree
on a stop, so a rank that stops leaves no other waiting in a collective."""

import json
import os
import subprocess
import sys
from pathlib import Path

from test_ddp import run_ddp

import tripwire

SCRIPT = Path(__file__).parent / "scripts" / "train_probe_ddp.py"
RELATIONS = {"workers": "all", "sampling": {"every": 10}, "rules": [{"rule": "training_relations"}]}


def probe_ddp(tmp_path, config, *extra, ranks=(0, 1), output=None):
    """The ranks' results; `output`, a list, receives what the processes printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SCRIPT.parents[2])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(SCRIPT), str(tmp_path / "run"), json.dumps(config), str(tmp_path / "result"),
                           *extra], capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if output is not None:
        output.append(proc.stdout + proc.stderr)
    return [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in ranks]


def differ(run) -> list:
    steps, values = run.tensor("relations/replicas_differ").series("value")
    return list(zip(steps.tolist(), values.tolist()))


def test_a_forward_past_the_ddp_wrapper_is_an_error_at_the_first_step_and_a_stop_on_one_rank_stops_both(tmp_path):
    config = {**RELATIONS, "rules": [*RELATIONS["rules"], {"rule": "exploding_tensor", "params": {
        "collections": ["losses"]}, "actions": ["log", "stop"]}]}
    results = probe_ddp(tmp_path, config, "--bypass", "--nan-rank", "1", "--nan-at", "5")
    for result in results:
        run = tripwire.open_run(result["run_url"])
        (verdict,) = [v for v in run.verdicts() if v.rule == "training_relations" and v.fired]
        assert (verdict.finding, verdict.step, verdict.severity) == ("replicas_differ", 0, "error")
        assert "1 rank(s)" in verdict.message and "ddp_model.module(x)" in verdict.hint
        assert differ(run) == [(0, 1.0), (1, 1.0), (2, 1.0), (10, 1.0)]
    # rank 1's NaN loss at step 5 (unsampled) is acted on at the next sampled step, 10, by both ranks: rank 0,
    # whose loss is finite, does not go on alone into a gather that rank 1 left
    assert [r["last_step"] for r in results] == [10, 10]
    assert [v["rule"] for v in results[0]["verdicts"] if v["status"] == "fired"] == ["training_relations"]
    assert {v["rule"] for v in results[1]["verdicts"] if v["status"] == "fired"} == {"training_relations",
                                                                                   "exploding_tensor"}


def test_healthy_ddp_loop_records_equal_replicas_and_stays_silent(tmp_path):
    for result in probe_ddp(tmp_path, RELATIONS, "--steps", "12"):
        run = tripwire.open_run(result["run_url"])
        assert [v for v in run.verdicts() if v.fired] == []
        assert differ(run) == [(0, 0.0), (1, 0.0), (2, 0.0), (10, 0.0)]
        assert list(run.model.parameters)[:2] == ["0.weight", "0.bias"]  # as the model names them: no `module.`


def test_a_probe_on_rank_0_alone_makes_no_collective(tmp_path):
    """The default `workers: zero`: rank 1 has no probe, and rank 0's never waits for it (this would hang in the
    gather at step 0 otherwise, until the subprocess timeout)."""
    config = {**RELATIONS, "workers": "zero"}
    (rank0,) = probe_ddp(tmp_path, config, "--steps", "12", "--probe-ranks", "0", ranks=(0,))
    run = tripwire.open_run(rank0["run_url"])
    assert [v for v in run.verdicts() if v.fired] == [] and "relations/replicas_differ" not in run.tensor_names()


def test_a_probe_on_every_rank_without_workers_all_is_told_that_its_ranks_decide_apart(tmp_path):
    """pytorch's DDP tutorial runs one script on every rank: a probe added to it with the default config is on
    every rank, and a rank that stops alone would leave the others waiting. Rank 1 says so, once; rank 0 (where
    a probe alone is what `workers: zero` is for) does not; with `workers: all`, neither."""
    output = []
    (tmp_path / "zero").mkdir()
    (tmp_path / "all").mkdir()
    probe_ddp(tmp_path / "zero", {**RELATIONS, "workers": "zero"}, "--steps", "3", output=output)
    probe_ddp(tmp_path / "all", RELATIONS, "--steps", "3", output=output)
    zero, every = output
    assert zero.count("a probe on rank 1 of 2 with `workers: zero`") == 1 and "rank 0 of 2" not in zero
    assert "workers: zero" not in every


def test_lightning_ddp_records_equal_replicas_and_stays_silent(tmp_path):
    config = {"sampling": {"every": 5}, "rules": [{"rule": "training_relations"}]}
    rank0, rank1 = run_ddp(tmp_path, config, "--steps", "12")
    assert rank0["global_step"] == rank1["global_step"] == 12
    run = tripwire.open_run(rank0["run_url"])
    assert run.workers() == [0]  # rank 1 records nothing by default, and takes part in the check all the same
    assert [v for v in run.verdicts() if v.fired] == []
    assert differ(run) == [(0, 0.0), (1, 0.0), (2, 0.0), (5, 0.0), (10, 0.0)]
