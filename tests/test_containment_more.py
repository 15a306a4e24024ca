"""Containment, as a second adversary found it wanting: losses and metrics of any form, actions on storage that
hangs or refuses, custom rules that return what is not a verdict, runs that link out of their folder or hold
JSON objects too large to read, out_dir URLs that name a filesystem's root."""

import subprocess
import sys
import threading
import time

import pytest
import torch

import helpers
import tripwire
from test_containment import LOSSES, flaky, flaky_url, tiny_mlp, train, warnings_about  # noqa: F401 - a fixture
from tripwire import Requirement, Rule
from tripwire.plugins.lightning import TripwireCallback
from tripwire.plugins.torch import TripwireProbe


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "tripwire", *args], capture_output=True, text=True, timeout=timeout)


# -- a loss or a metric of any form -------------------------------------------------------------------------------------

def odd_losses():
    per_sample = torch.tensor([0.5, 1.5])
    return {"meta": torch.empty((), device="meta"), "nested": torch.nested.nested_tensor([per_sample, per_sample]),
            "sparse": per_sample.to_sparse(), "quantized": torch.quantize_per_tensor(per_sample, 0.5, 0, torch.quint8),
            "numpy": per_sample.numpy(), "number": 1.0}


@pytest.mark.parametrize("kind", list(odd_losses()))
def test_probe_step_takes_a_loss_and_metrics_of_any_form(tmp_path, caplog, kind):
    net, optimizer, x, y = tiny_mlp()
    loss = odd_losses()[kind]
    config = {"collections": {"losses": {}, "metrics": {}}, "sampling": {"every": 1}, "rules": ["exploding_tensor"]}
    with TripwireProbe(net, optimizer, config, out_dir=tmp_path / "run") as probe:
        for _ in range(4):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
            probe.step(loss, metrics={"accuracy": 0.5, "nothing": None, "word": "high"})
    run = tripwire.open_run(probe.run_url)
    assert run.info["status"] == "finished" and run.steps() == [0, 1, 2, 3] and not run.verdicts()
    assert run.tensor("metrics/accuracy").series()[1].tolist() == [0.5] * 4
    said = warnings_about(caplog, "is not captured")
    assert len([w for w in said if "metrics/nothing" in w]) == 1 and len([w for w in said if "metrics/word" in w]) == 1
    if kind == "meta":  # no values: said once, not captured
        assert len([w for w in said if "losses/train" in w]) == 1
    else:  # the mean of the values (a quantized tensor's are rounded to its scale of 0.5)
        assert run.tensor("losses/train").series()[1].tolist() == [1.0] * 4


# -- actions on storage that hangs or refuses ---------------------------------------------------------------------------

class FiresAtThree(Rule):
    severity = "error"

    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        return self.fire(step, "step three", finding="three") if step == 3 else None


def test_report_and_checkpoint_actions_never_hold_training_up_on_storage_that_hangs(flaky, caplog):
    """The report (report.json, report.html) and the checkpoint go through threads of their own: a step whose rule
    asks for them returns at once; the end of training waits at most writer.close_timeout_s for each."""
    net, optimizer, x, y = tiny_mlp()
    config = {**LOSSES, "writer": {"close_timeout_s": 1},
              "rules": [{"rule": f"{__name__}:FiresAtThree", "name": "three", "actions": ["report", "checkpoint"]}]}
    probe = TripwireProbe(net, optimizer, config, out_dir=flaky_url("actions"))
    slowest = []

    def after_step(p):
        if p.global_step == 3:  # storage stops answering just before the rule fires
            flaky.hold = threading.Event()

    train_started = time.monotonic()
    for _ in range(8):
        began = time.monotonic()
        train(probe, net, optimizer, x, y, 1, each_step=after_step)
        slowest.append(time.monotonic() - began)
    began = time.monotonic()
    probe.close()
    assert max(slowest) < 1.0, slowest
    assert time.monotonic() - began < 3 * 1 + 2.0  # writer, report: each at most close_timeout_s
    assert probe.global_step == 8 and time.monotonic() - train_started < 10


def test_a_tensorboard_directory_on_storage_that_hangs_waits_no_longer_than_close_timeout(flaky):
    flaky.hold = threading.Event()
    net, optimizer, x, y = tiny_mlp()
    config = {**LOSSES, "writer": {"close_timeout_s": 1}, "tensorboard": {"dir": flaky_url("tensorboard")}}
    probe = TripwireProbe(net, optimizer, config, out_dir=flaky_url("run"))
    train(probe, net, optimizer, x, y, 5)
    began = time.monotonic()
    probe.close()
    assert time.monotonic() - began < 2 * 1 + 2.0


class FailsOnce(Rule):
    severity = "error"

    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        return self.fire(step, "checkpoint me", finding="once") if step == 2 else None


def test_a_checkpoint_storage_refuses_is_said_and_lightning_trains_on(flaky, caplog):
    import lightning.pytorch as pl

    config = {**LOSSES, "rules": [{"rule": f"{__name__}:FailsOnce", "name": "once", "actions": ["checkpoint"]}]}
    callback = TripwireCallback(config, out_dir=flaky_url("refused"))

    class Refuse(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                flaky.failing = PermissionError(13, "Permission denied (injected)")

    trainer = helpers.fit(callback, max_steps=6, callbacks=[Refuse()])
    assert trainer.global_step == 6 and warnings_about(caplog, "could not write")


# -- rules that return what is not a verdict ----------------------------------------------------------------------------

class ReturnsText(Rule):
    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        return "everything is fine"


class ListFinding(Rule):
    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        return self.fire(step, "found", finding=["a", "b"])


class RaisesDamage(Rule):
    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        raise tripwire.RunDamaged("made up")


class CyclicEvidence(Rule):
    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        loop = {"name": "loop"}
        loop["self"] = loop
        return self.fire(step, "a cycle", finding="cycle", loop=loop) if step == 0 else None


def test_rules_that_return_what_is_not_a_verdict_are_disabled_and_training_goes_on(tmp_path):
    net, optimizer, x, y = tiny_mlp()
    rules = ["ReturnsText", "ListFinding", "RaisesDamage", "CyclicEvidence"]
    config = {**LOSSES, "writer": {"on_error": "raise"},
              "rules": [{"rule": f"{__name__}:{name}", "name": name.lower()} for name in rules]}
    with TripwireProbe(net, optimizer, config, out_dir=tmp_path / "run") as probe:
        losses = train(probe, net, optimizer, x, y, 5)
    assert len(losses) == 5
    run = tripwire.open_run(probe.run_url)
    found = {v.rule: v for v in run.verdicts()}
    assert run.info["status"] == "finished" and not run.damaged
    for name in ("returnstext", "listfinding", "raisesdamage"):
        assert found[name].status == "error" and found[name].step == 0, found[name]
    assert "not a Verdict" in found["returnstext"].message
    assert found["cyclicevidence"].fired and found["cyclicevidence"].evidence["loop"]["name"] == "loop"


# -- runs that lead out of their folder, or hold objects too large to read ---------------------------------------------

def recorded(run_dir):
    """A finished run of a plain loop whose rule fired at step 3 (a verdict stored)."""
    net, optimizer, x, y = tiny_mlp()
    config = {**LOSSES, "rules": [{"rule": f"{__name__}:FiresAtThree", "name": "three", "actions": []}]}
    with TripwireProbe(net, optimizer, config, out_dir=run_dir) as probe:
        train(probe, net, optimizer, x, y, 5)
    return run_dir


@pytest.mark.parametrize("folder", ["shards", "verdicts", "status"])
def test_a_folder_linked_out_of_the_run_is_named_by_every_verb_not_called_a_bug(tmp_path, folder):
    run_dir = recorded(tmp_path / "run")
    outside = tmp_path / "outside"
    (run_dir / folder).rename(outside)
    (run_dir / folder).symlink_to(outside, target_is_directory=True)
    for args in (["show", run_dir], ["check", run_dir], ["export", "tensorboard", run_dir, tmp_path / "tb"],
                 ["report", run_dir, "-o", tmp_path / "r.html"]):
        out = cli(*map(str, args))
        assert out.returncode == 2 and "leads out of the run's folder" in out.stderr, (args, out.stderr)
        assert "bug in tripwire" not in out.stderr
    began = time.monotonic()
    watch = cli("watch", str(run_dir), "--ended-after", "1")
    assert watch.returncode == 2 and time.monotonic() - began < 30 and "leads out" in watch.stderr


def test_a_damaged_verdict_is_named_by_check_and_compare(tmp_path):
    run_dir, other = recorded(tmp_path / "run"), recorded(tmp_path / "other")
    (verdict,) = (run_dir / "verdicts").iterdir()
    verdict.write_bytes(verdict.read_bytes().replace(b"step three", b"step thr3e"))  # its checksum no longer holds
    check = cli("check", str(run_dir))
    assert check.returncode == 2 and verdict.name in check.stderr
    compare = cli("compare", str(run_dir), str(other))
    assert verdict.name in compare.stderr  # its exit says how the runs compare


def test_a_json_object_too_large_to_be_tripwire_s_is_damaged_and_read_no_further(tmp_path):
    run_dir = recorded(tmp_path / "run")
    status = run_dir / "status" / "00000.json"
    status.write_bytes(b'{"x": "' + b"a" * (70 << 20) + b'"}')
    code = ("import sys, warnings, tripwire; warnings.simplefilter('ignore'); run = tripwire.open_run(sys.argv[1]); "
            "damaged = run.damaged; "
            "peak = [line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')][0]; "
            "print(list(damaged), peak)")
    out = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, timeout=120)
    damaged, peak_kb = out.stdout.rsplit(" ", 1)
    assert "status/00000.json" in damaged and int(peak_kb) < 600 << 10, out.stdout + out.stderr


# -- out_dir ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("out_dir", ["file:///", "file://", "local:///", "file:"])
def test_an_out_dir_naming_a_filesystem_root_by_url_is_refused(out_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    net, optimizer, _, _ = tiny_mlp()
    with pytest.raises(ValueError, match="out_dir"):
        TripwireProbe(net, optimizer, LOSSES, out_dir=out_dir)
    with pytest.raises(ValueError, match="out_dir"):
        TripwireCallback(LOSSES, out_dir=out_dir)
    assert not list(tmp_path.iterdir())


# -- what a step did not fit ----------------------------------------------------------------------------------------

def test_a_step_larger_than_the_queue_is_said_so_and_counted_once(tmp_path, caplog):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                              torch.nn.ReLU(), torch.nn.Linear(2048, 10))  # ~4.3M parameters, 17 MiB of weights
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    (x, y), _ = helpers.digits(n_train=32)
    x, y = torch.tensor(x), torch.tensor(y)
    config = {"collections": {"losses": {}, "weights": {"save": "tensors"}, "gradients": {"save": "tensors"}},
              "sampling": {"every": 1}, "rules": [], "writer": {"max_queue_mb": 16}}
    with TripwireProbe(net, optimizer, config, out_dir=tmp_path / "run") as probe:
        train(probe, net, optimizer, x, y, 6)
    run = tripwire.open_run(probe.run_url)
    assert run.info["partial_steps"] == 6 and len(run.tensor("losses/train").steps()) == 6
    (warning,) = warnings_about(caplog, "do not fit in the writer queue")
    assert "are more than the whole queue holds" in warning and "slower than capture" not in warning


def test_every_test_docs_reliability_names_exists():
    from pathlib import Path
    import re

    root = Path(__file__).parents[1]
    names = set(re.findall(r"\b(test_[a-z0-9_]+)\b", (root / "docs" / "reliability.md").read_text()))
    defined = {m for f in (root / "tests").glob("*.py") for m in re.findall(r"def (test_\w+)", f.read_text())}
    files = {f.stem for f in (root / "tests").glob("test_*.py")}
    assert names - defined - files == set()

