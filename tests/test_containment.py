"""Containment: nothing tripwire meets can hurt training, and a run is one training.

Odd tensors (sparse, quantized, float8, nested, meta, complex), storage that fails or hangs from the start, rules
that are slow or raise anything, evidence that is not JSON: training goes on and ends in bounded time. A fixed
out_dir used again, or by two trainings at once, gives each training its own run; verdicts are stored once.
"""

import gc
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import flakyfs
import helpers
import tripwire
from tripwire import Requirement, Rule
from tripwire.core.recorder import OPEN_WAIT_S
from tripwire.plugins.lightning import TripwireCallback
from tripwire.plugins.torch import TripwireProbe

SCRIPT = Path(__file__).parent / "scripts" / "train_probe.py"
LOSSES = {"collections": {"losses": {}}, "sampling": {"every": 1}, "rules": []}


# -- small models and loops -----------------------------------------------------------------------------------------

def tiny_mlp(seed=0):
    """An MLP on 64 digits: a full batch, so the loss falls step after step."""
    torch.manual_seed(seed)
    (x, y), _ = helpers.digits(n_train=64)
    net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    return net, torch.optim.SGD(net.parameters(), lr=0.1), torch.tensor(x), torch.tensor(y, dtype=torch.long)


def train(probe, net, optimizer, x, y, steps, reduction="mean", each_step=None):
    """A plain loop; returns the losses."""
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y, reduction=reduction)
        loss.mean().backward()
        optimizer.step()
        if each_step is not None:
            each_step(probe)
        probe.step(loss)
        losses.append(loss.mean().item())
    return losses


def sparse_embedding_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(100, 8, sparse=True), torch.nn.Flatten(), torch.nn.Linear(32, 2))


def tokens(n, seed=0):
    """Rows of 4 token ids; the label says whether the first one is below 50."""
    x = torch.randint(0, 100, (n, 4), generator=torch.Generator().manual_seed(seed))
    return x, (x[:, 0] < 50).long()


class SparseClassifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = sparse_embedding_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Times(pl.Callback):
    """When the fit began, its first step began and its last step ended."""

    def __init__(self):
        self.fit_start = self.first_step = self.last_step_end = None

    def on_fit_start(self, trainer, pl_module):
        self.fit_start = time.monotonic()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.first_step = self.first_step or time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.last_step_end = time.monotonic()


def warnings_about(caplog, text):
    return [r.getMessage() for r in caplog.records if r.name == "tripwire" and r.levelno == logging.WARNING
            and text in r.getMessage()]


def errors_of(run):
    return [v for v in run.verdicts() if v.status == "error"]


# -- tensors of every kind ------------------------------------------------------------------------------------------

def test_a_sparse_embedding_trains_with_the_default_rules_in_a_plain_loop(tmp_path):
    net = sparse_embedding_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    x, y = tokens(64)
    with TripwireProbe(net, optimizer, out_dir=tmp_path / "run") as probe:
        losses = train(probe, net, optimizer, x, y, 30)
    assert net[0].weight.grad.layout == torch.sparse_coo  # the gradient tripwire met was sparse
    assert losses[-1] < 0.7 * losses[0]
    run = tripwire.open_run(probe.run_url)
    assert run.info["status"] == "finished" and not errors_of(run)
    steps, norms = run.tensor("gradients/0.weight").series("l2")
    assert len(steps) and steps[0] == 0 and norms[0] > 0
    assert "losses/train" in run.tensor_names()


def test_a_sparse_embedding_trains_with_the_default_rules_in_lightning(tmp_path):
    callback = TripwireCallback(None, out_dir=tmp_path / "run")
    x, y = tokens(256)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    trainer = helpers.fit(callback, SparseClassifier(), max_steps=30, max_epochs=10, loaders=(loader, None))
    assert trainer.global_step == 30
    run = tripwire.open_run(callback.run_url)
    assert run.info["status"] == "finished" and not errors_of(run)
    assert run.tensor("gradients/net.0.weight").series("l2")[1][0] > 0


def odd_tensors():
    dense = torch.tensor([[0.0, 3.0], [4.0, 0.0]])
    odd = {"coo": dense.to_sparse(), "csr": dense.to_sparse_csr(),
           "quantized": torch.quantize_per_tensor(dense, 0.5, 0, torch.quint8),
           "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
           "meta": torch.empty(2, 2, device="meta"), "complex": torch.complex(dense, dense)}
    if hasattr(torch, "float8_e4m3fn"):
        odd["float8"] = dense.to(torch.float8_e4m3fn)
    return odd


def test_save_tensor_takes_any_kind_of_tensor_and_step_takes_a_loss_per_sample(tmp_path, caplog):
    net, optimizer, x, y = tiny_mlp()
    odd = odd_tensors()
    config = {"rules": [{"rule": "exploding_tensor"}], "sampling": {"every": 1},
              "collections": {"losses": {}, "custom": {"save": "tensors"}}}

    def save_all(probe):
        for name, tensor in odd.items():
            probe.save_tensor(name, tensor)

    with TripwireProbe(net, optimizer, config, out_dir=tmp_path / "run") as probe:
        losses = train(probe, net, optimizer, x, y, 8, reduction="none", each_step=save_all)
    assert losses[-1] < losses[0]
    run = tripwire.open_run(probe.run_url)
    assert run.info["status"] == "finished" and run.steps() == list(range(8)) and not errors_of(run)
    steps, stored = run.tensor("losses/train").series()
    assert steps.tolist() == list(range(8)) and stored == pytest.approx(losses, rel=1e-5)  # the vector's mean
    assert run.tensor("custom/coo").value(3).tolist() == [[0.0, 3.0], [4.0, 0.0]]
    assert run.tensor("custom/csr").value(3).tolist() == [[0.0, 3.0], [4.0, 0.0]]
    assert run.tensor("custom/quantized").value(3).tolist() == [[0.0, 3.0], [4.0, 0.0]]
    assert run.tensor("custom/nested").value(3).tolist() == [1.0] * 5
    assert run.tensor("custom/complex").value(3).ravel() == pytest.approx([0.0, 3 * 2 ** 0.5, 4 * 2 ** 0.5, 0.0])
    if "float8" in odd:
        assert run.tensor("custom/float8").value(3).tolist() == [[0.0, 3.0], [4.0, 0.0]]
    assert "custom/meta" not in run.tensor_names()
    assert len(warnings_about(caplog, "custom/meta")) == 1  # skipped, said once in 8 steps


# -- storage that fails or does not answer from the start ----------------------------------------------------------

@pytest.fixture
def flaky():
    fs = flakyfs.FlakyFileSystem

    def reset():
        fs.failing, fs.slow_s, fs.slow_s_per_mb, fs.fail_shard_writes, fs.hold = False, 0.0, 0.0, 0, None
        fs.attempts = []

    reset()
    yield fs
    if fs.hold is not None:
        fs.hold.set()  # the writers blocked on it go on, and end
    helpers.wait_until(lambda: not [t for t in threading.enumerate() if t.name.startswith("tripwire-writer")], 30)
    reset()


DENIED = PermissionError(13, "Permission denied")


def flaky_url(name):
    return f"flaky://runs/{name}-{time.monotonic_ns()}"


def test_storage_that_refuses_writes_from_the_start_never_holds_up_a_lightning_fit(flaky, caplog):
    flaky.failing = DENIED
    times = Times()
    trainer = helpers.fit(TripwireCallback(LOSSES, out_dir=flaky_url("denied")), max_steps=20, callbacks=[times])
    done = time.monotonic()
    assert trainer.global_step == 20
    assert times.first_step - times.fit_start < OPEN_WAIT_S + 2.0
    assert done - times.last_step_end < 2.0  # the writer closes at once: nothing to wait for
    (warning,) = warnings_about(caplog, "cannot open the run")
    assert "PermissionError" in warning and "Permission denied" in warning


def test_storage_that_refuses_writes_from_the_start_never_holds_up_a_plain_loop(flaky, caplog):
    flaky.failing = DENIED
    net, optimizer, x, y = tiny_mlp()
    began = time.monotonic()
    probe = TripwireProbe(net, optimizer, LOSSES, out_dir=flaky_url("denied"))
    assert time.monotonic() - began < OPEN_WAIT_S + 2.0
    losses = train(probe, net, optimizer, x, y, 20)
    began = time.monotonic()
    probe.close()
    assert time.monotonic() - began < 2.0
    assert len(losses) == 20 and probe.global_step == 20
    assert warnings_about(caplog, "cannot open the run") and warnings_about(caplog, "Permission denied")


def test_storage_that_hangs_from_the_start_never_holds_up_a_lightning_fit(flaky, caplog):
    flaky.hold = threading.Event()
    times = Times()
    config = {**LOSSES, "writer": {"close_timeout_s": 2}}
    trainer = helpers.fit(TripwireCallback(config, out_dir=flaky_url("hangs")), max_steps=20, callbacks=[times])
    done = time.monotonic()
    assert trainer.global_step == 20
    assert times.first_step - times.fit_start < OPEN_WAIT_S + 2.0
    assert done - times.last_step_end < 2.0 + 2.0  # writer.close_timeout_s, and slack
    assert len(warnings_about(caplog, "has not answered within")) == 1
    assert len(warnings_about(caplog, "writer.close_timeout_s")) == 1


def test_storage_that_hangs_from_the_start_never_holds_up_a_plain_loop(flaky, caplog):
    flaky.hold = threading.Event()
    net, optimizer, x, y = tiny_mlp()
    began = time.monotonic()
    probe = TripwireProbe(net, optimizer, {**LOSSES, "writer": {"close_timeout_s": 2}}, out_dir=flaky_url("hangs"))
    assert time.monotonic() - began < OPEN_WAIT_S + 2.0
    assert len(train(probe, net, optimizer, x, y, 20)) == 20
    began = time.monotonic()
    probe.close()
    assert 1.5 < time.monotonic() - began < 2.0 + 2.0  # it waited for storage, as long as it was told
    assert warnings_about(caplog, "has not answered within") and warnings_about(caplog, "writer.close_timeout_s")


def test_a_process_whose_storage_never_answers_exits_in_bounded_time(tmp_path):
    pytest.importorskip("s3fs")
    with socket.socket() as blackhole:  # takes connections (the kernel's backlog) and never answers one
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(64)
        endpoint = f"http://127.0.0.1:{blackhole.getsockname()[1]}"
        options = {"key": "testing", "secret": "testing",
                   "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "NO_PROXY": "127.0.0.1,localhost"}
        config = {**LOSSES, "writer": {"close_timeout_s": 2}}
        began = time.monotonic()
        proc = subprocess.run([sys.executable, str(SCRIPT), "s3://nowhere/run", json.dumps(config), "--steps", "10",
                               "--storage-options", json.dumps(options)],
                              capture_output=True, text=True, env=env, timeout=120)
        took = time.monotonic() - began
    assert proc.returncode == 0, proc.stderr
    assert "trained 10 steps" in proc.stdout and "closed s3://nowhere/run" in proc.stdout
    assert "has not answered within" in proc.stderr and "writer.close_timeout_s" in proc.stderr
    assert took < 25, f"the process took {took:.1f} s to exit"


# -- rules that are slow, raise anything, or give evidence that is not JSON ----------------------------------------

class Slow(Rule):
    """Takes 50 ms per evaluation. `Slow.evaluations` counts them in this process."""

    evaluations = 0

    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        Slow.evaluations += 1
        time.sleep(0.05)
        return None


class CollectedDuring(Rule):
    """Quick itself, but a garbage collection of 50 ms runs during each evaluation (as a full collection of a large
    training process's heap falls on whichever code allocates when it is due)."""

    evaluations = 0

    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        CollectedDuring.evaluations += 1
        slow_collection = lambda phase, info: time.sleep(0.05) if phase == "start" else None  # noqa: E731
        gc.callbacks.append(slow_collection)
        try:
            gc.collect(0)
        finally:
            gc.callbacks.remove(slow_collection)
        return None


class Exits(Rule):
    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        raise SystemExit(3)


class Interrupts(Rule):
    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        raise KeyboardInterrupt


class SetEvidence(Rule):
    """Fires once, with evidence that JSON cannot hold as it is (a set)."""

    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        return self.fire(step, "layers found", finding="once", layers={"b", "a"})


def test_a_slow_rule_is_disabled_and_training_time_stays_bounded(tmp_path, caplog):
    Slow.evaluations = 0
    net, optimizer, x, y = tiny_mlp()
    config = {**LOSSES, "rules": [{"rule": f"{__name__}:Slow", "name": "slow"}]}
    with TripwireProbe(net, optimizer, config, out_dir=tmp_path / "run") as probe:
        began = time.monotonic()
        train(probe, net, optimizer, x, y, 100)
        took = time.monotonic() - began
    assert Slow.evaluations < 40  # disabled after about 1 s of its time: 20 evaluations, not 100
    assert took < 4.0, f"100 steps took {took:.1f} s"  # at least 5 s had the rule run at every step
    (warning,) = warnings_about(caplog, "[slow]")
    assert "evaluation.rule_budget" in warning
    (verdict,) = tripwire.open_run(probe.run_url).verdicts()
    assert verdict.rule == "slow" and verdict.status == "error" and verdict.step == Slow.evaluations - 1


def test_the_garbage_collector_s_time_is_not_charged_to_the_rule_it_interrupts(tmp_path, caplog):
    CollectedDuring.evaluations = 0
    net, optimizer, x, y = tiny_mlp()
    config = {**LOSSES, "rules": [{"rule": f"{__name__}:CollectedDuring", "name": "collected"}]}
    with TripwireProbe(net, optimizer, config, out_dir=tmp_path / "run") as probe:
        train(probe, net, optimizer, x, y, 60)  # 3 s of collections: 20 evaluations would pass the 1 s floor
    assert CollectedDuring.evaluations == 60
    assert not warnings_about(caplog, "[collected]")
    assert not list(tripwire.open_run(probe.run_url).verdicts())


def test_rules_raising_system_exit_or_keyboard_interrupt_are_disabled_and_training_goes_on(tmp_path):
    config = {**LOSSES, "rules": [{"rule": f"{__name__}:Exits", "name": "exits"},
                                  {"rule": f"{__name__}:Interrupts", "name": "interrupts"}]}
    callback = TripwireCallback(config, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, max_steps=20)
    assert trainer.global_step == 20
    run = tripwire.open_run(callback.run_url)
    assert run.info["status"] == "finished" and run.steps() == list(range(20))
    verdicts = sorted(run.verdicts(), key=lambda v: v.rule)
    assert [(v.rule, v.status, v.step) for v in verdicts] == [("exits", "error", 0), ("interrupts", "error", 0)]
    assert "SystemExit" in verdicts[0].message and "KeyboardInterrupt" in verdicts[1].message


def test_evidence_that_is_not_json_is_stored_and_raises_nothing(tmp_path):
    net, optimizer, x, y = tiny_mlp()
    config = {**LOSSES, "rules": [{"rule": f"{__name__}:SetEvidence", "name": "set_evidence"}],
              "writer": {"on_error": "raise"}}
    with TripwireProbe(net, optimizer, config, out_dir=tmp_path / "run") as probe:
        train(probe, net, optimizer, x, y, 5)
    assert [v.step for v in probe.verdicts] == [0]
    run = tripwire.open_run(probe.run_url)
    (verdict,) = run.verdicts()
    assert verdict.rule == "set_evidence" and verdict.fired and verdict.evidence["layers"] == ["a", "b"]
    assert run.info["status"] == "finished" and run.steps() == list(range(5))


# -- a run is one training ------------------------------------------------------------------------------------------

def test_a_second_plain_loop_into_the_same_out_dir_gets_a_run_beside_the_first(tmp_path, caplog):
    out = tmp_path / "exp1"
    net, optimizer, x, y = tiny_mlp()
    with TripwireProbe(net, optimizer, LOSSES, out_dir=out) as first:
        first_losses = train(first, net, optimizer, x, y, 10)
    assert first.run_url == str(out) and not warnings_about(caplog, "holds a run already")
    net, optimizer, x, y = tiny_mlp(seed=1)
    with TripwireProbe(net, optimizer, LOSSES, out_dir=out) as second:
        second_losses = train(second, net, optimizer, x, y, 15)
    assert second.run_url == f"{out}-1"
    (warning,) = warnings_about(caplog, "holds a run already")
    assert f"{out}-1" in warning
    assert tripwire.open_run(str(out)).tensor("losses/train").series()[1] == pytest.approx(first_losses, rel=1e-6)
    assert tripwire.open_run(f"{out}-1").tensor("losses/train").series()[1] == pytest.approx(second_losses, rel=1e-6)


def test_a_second_lightning_fit_into_the_same_out_dir_gets_a_run_beside_the_first(tmp_path, caplog):
    out = tmp_path / "exp1"
    first = TripwireCallback(LOSSES, out_dir=out)
    helpers.fit(first, max_steps=10)
    before = tripwire.open_run(str(out)).tensor("losses/train").series()
    second = TripwireCallback(LOSSES, out_dir=out)
    helpers.fit(second, helpers.mlp_module(lr=0.5), max_steps=12)
    assert (first.run_url, second.run_url) == (str(out), f"{out}-1")
    (warning,) = warnings_about(caplog, "holds a run already")
    assert f"{out}-1" in warning
    steps, values = tripwire.open_run(str(out)).tensor("losses/train").series()
    assert steps.tolist() == before[0].tolist() == list(range(10)) and values.tolist() == before[1].tolist()
    assert tripwire.open_run(f"{out}-1").steps() == list(range(12))


def test_append_adds_to_the_run_at_out_dir(tmp_path, caplog):
    out = tmp_path / "exp1"
    net, optimizer, x, y = tiny_mlp()
    with TripwireProbe(net, optimizer, LOSSES, out_dir=out) as first:
        losses = train(first, net, optimizer, x, y, 10)
    with TripwireProbe(net, optimizer, LOSSES, out_dir=out, append=True) as resumed:
        resumed.global_step = 10  # the loop goes on from its own checkpoint
        losses += train(resumed, net, optimizer, x, y, 10)
    assert resumed.run_url == str(out) and not Path(f"{out}-1").exists()
    assert not warnings_about(caplog, "holds a run already")
    steps, values = tripwire.open_run(str(out)).tensor("losses/train").series()
    assert steps.tolist() == list(range(20)) and values == pytest.approx(losses, rel=1e-6)


def test_two_trainings_started_at_once_into_one_out_dir_get_a_run_each(tmp_path):
    out = tmp_path / "exp1"
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(out), json.dumps(LOSSES), "--steps", str(steps),
                               "--ready", str(tmp_path / f"ready-{steps}"), "--go", str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for steps in (20, 30)]
    try:
        helpers.wait_until(lambda: all((tmp_path / f"ready-{s}").exists() for s in (20, 30)), timeout=120)
        go.touch()  # both make their probe now
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    urls = [line.split(" ", 1)[1] for text in outputs for line in text.splitlines() if line.startswith("closed ")]
    assert sorted(urls) == [str(out), f"{out}-1"]
    runs = [tripwire.open_run(url) for url in urls]
    # each holds its own training's steps (20 or 30), nothing of the other's
    assert sorted(run.steps() for run in runs) == [list(range(20)), list(range(30))]
    assert all(run.info["status"] == "finished" for run in runs)
    assert not Path(f"{out}-2").exists()


def recorded_run(run_dir, rules, losses):
    """A finished run written by a real Recorder (side_process: the training process evaluates nothing)."""
    from tripwire.core.recorder import Recorder

    config = {"evaluation": {"where": "side_process"}, "collections": {"losses": {}}, "rules": rules,
              "writer": {"flush_every_s": 0.1}}
    recorder = Recorder(config, run_url=str(run_dir), framework="test")
    recorder.start()
    for step, loss in enumerate(losses):
        recorder.record(step, "train", {"losses/train": {"value": loss}})
    recorder.finish()


def test_a_watcher_restarted_or_a_check_after_it_stores_each_verdict_once(tmp_path):
    run_dir = tmp_path / "run"
    recorded_run(run_dir, [{"rule": "exploding_tensor"}, {"rule": "loss_not_decreasing"}],
                 [1.0, 1.1, float("nan"), 1.3, 1.4, 1.5])

    def stored():
        return sorted(p.name for p in (run_dir / "verdicts").iterdir())

    first = subprocess.run([sys.executable, "-m", "tripwire", "watch", str(run_dir)], capture_output=True,
                           text=True, timeout=120)
    assert first.returncode == 1, first.stdout + first.stderr  # a rule fired
    found = stored()
    assert any("exploding_tensor" in name for name in found)
    again = subprocess.run([sys.executable, "-m", "tripwire", "watch", str(run_dir)], capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 1, again.stdout + again.stderr
    check = subprocess.run([sys.executable, "-m", "tripwire", "check", str(run_dir)], capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 1 and "exploding_tensor" in check.stdout, check.stdout + check.stderr
    assert stored() == found
    verdicts = tripwire.open_run(str(run_dir)).verdicts()
    assert len(verdicts) == len(found) == len({(v.rule, v.finding, v.severity) for v in verdicts})


# -- out_dir names a folder of the run's own ------------------------------------------------------------------------

@pytest.mark.parametrize("out_dir", ["", "/", "~"])
def test_an_out_dir_that_is_no_folder_of_its_own_is_refused(out_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where "" and "~" would lead, should the check ever be lost
    monkeypatch.setenv("HOME", str(tmp_path))
    net, optimizer, _, _ = tiny_mlp()
    with pytest.raises(ValueError, match="out_dir"):
        TripwireProbe(net, optimizer, LOSSES, out_dir=out_dir)
    with pytest.raises(ValueError, match="out_dir"):
        TripwireCallback(LOSSES, out_dir=out_dir)
    assert not net._forward_pre_hooks and not list(tmp_path.iterdir())  # the refused probe left nothing behind
