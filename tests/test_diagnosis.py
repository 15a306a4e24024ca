"""A diagnosis, not a list of symptoms: one root cause per fault, with a fix that names the layer and the value, and
a NaN acted on at the step it appears. On real Lightning, plain-torch and XGBoost training (Keras: keras_cases.py,
on every backend)."""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import helpers
import tripwire
from tripwire.core.diagnosis import diagnose, explains, summary
from tripwire.core.verdict import Verdict
from tripwire.plugins.lightning import TripwireCallback
from tripwire.plugins.torch import TripwireProbe
from tripwire.plugins.torch.losswatch import LossWatch


def verdict(rule, step, finding="", severity="warning", onset=None, worker=0):
    return Verdict(rule=rule, step=step, message=f"{rule} {finding}", finding=finding, severity=severity,
                   onset=onset, worker=worker)


# -- the causal links, on verdicts as rules give them ----------------------------------------------------------------
def test_a_cause_explains_what_follows_it_and_not_what_came_before():
    lr = verdict("learning_rate", 0, "high")
    nan = verdict("exploding_tensor", 6, "weights", "error")
    assert explains(lr, nan) and not explains(nan, lr)
    late = verdict("learning_rate", 9, "high")
    assert not explains(late, verdict("exploding_tensor", 6, "weights", "error"))
    assert not explains(lr, verdict("exploding_tensor", 6, "weights", "error", worker=1))  # another worker's run


def test_a_rule_that_waits_for_several_samples_is_ordered_by_when_its_finding_began():
    """dead_relu fires at its third sample (step 20), after all_zero on the gradients at step 0; it began at 0 and
    leads: dead units explain zero gradients, not the reverse."""
    zero = verdict("all_zero", 0, "gradients/net.0.weight")
    dead = verdict("dead_relu", 20, "activations/net.1", "error", onset=0)
    flat = verdict("loss_not_decreasing", 160, "never", "error")
    found = diagnose([zero, dead, flat])
    assert len(found) == 1 and found[0].primary is dead and found[0].symptoms == (zero, flat)
    assert found[0].severity == "error" and found[0].began == 0 and found[0].cause == "dead ReLU units"


def test_unrelated_faults_stay_apart_and_info_is_worth_a_look():
    leak = verdict("feature_importance_overweight", 3, "leak")
    frozen = verdict("unchanged_tensor", 0, "frozen")
    plateau = verdict("overtraining", 50, "", "info")
    found = diagnose([leak, frozen, plateau, Verdict(rule="dead_relu", step=9, message="no", status="no_data")])
    assert [d.primary for d in found] == [frozen, leak, plateau]
    text = summary([leak, frozen, plateau])
    assert text.startswith("diagnosis 1 (warning): layers frozen by mistake, from step 0") and "diagnosis 2" in text
    assert "worth a look (info): overtraining" in text
    assert summary([]) == "no rule fired."


# -- on real training ---------------------------------------------------------------------------------------------------
def demo_module(lr=0.1, dead=False):
    """The demo's MLP (64-64-64-10, ReLU, SGD) on digits."""
    def init(net):
        if dead:
            torch.nn.init.constant_(net[0].bias, -20.0)

    return helpers.mlp_module(lr=lr, hidden=(64, 64), init=init)


def test_a_learning_rate_too_high_is_the_cause_of_the_blow_up_and_names_the_rate(tmp_path, caplog):
    callback = TripwireCallback(None, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, demo_module(lr=50.0), max_epochs=2)
    run = tripwire.open_run(callback.run_url)
    found = [d for d in diagnose(run.verdicts()) if d.counts]
    assert len(found) == 1 and run.info["status"] == "stopped" and trainer.global_step < 20
    lr = found[0].primary
    assert (lr.rule, lr.step, found[0].cause) == ("learning_rate", 0, "learning rate too high")
    assert "learning rate 50 with SGD" in lr.message and "x the weight norm" in lr.message
    assert "Try: a learning rate of" in lr.hint
    assert {v.rule for v in found[0].symptoms} >= {"exploding_tensor"}
    # the log gives the hint once, with the first verdict of the diagnosis; the rest name their cause
    said = [r.getMessage() for r in caplog.records if r.name == "tripwire"]
    assert sum("hint:" in line for line in said) == 1
    assert any("[exploding_tensor]" in line and "(follows from learning_rate at step 0)" in line for line in said)
    assert any(line.startswith("tripwire: training ended") and "diagnosis 1 (error): learning rate too high" in line
               for line in said)


def default_every(n: int) -> dict:
    """The packaged default rules, sampled every `n` steps (short runs, as in the demo)."""
    return {**tripwire.load_config(None).to_dict(), "sampling": {"every": n}}


def test_dead_relus_are_the_cause_and_the_fix_names_the_layer_and_its_biases(tmp_path):
    callback = TripwireCallback(default_every(10), out_dir=tmp_path / "run")
    helpers.fit(callback, demo_module(dead=True), max_epochs=1)
    found = [d for d in diagnose(tripwire.open_run(callback.run_url).verdicts()) if d.counts]
    assert len(found) == 1 and found[0].cause == "dead ReLU units" and found[0].began == 0
    dead = found[0].primary
    assert dead.rule == "dead_relu" and "activations/net.1 (the output of Linear net.0)" in dead.message
    assert "Every bias of Linear net.0 is negative (at most -20" in dead.hint and "initialise its biases to 0" in \
        dead.hint
    assert {"all_zero", "unchanged_tensor"} <= {v.rule for v in found[0].symptoms}


@pytest.mark.parametrize("harmed", [True, False], ids=["saturates", "trains"])
def test_raw_inputs_are_info_until_training_suffers_and_then_the_cause(tmp_path, harmed):
    """Raw 0..255 pixels are a risk: a ReLU MLP under Adam learns from them (worth a look, no alarm); under SGD at
    0.1 they blow its steps up and kill its units, and the diagnosis of those names the inputs as the cause."""
    module = helpers.mlp_module(hidden=(64, 64), optimizer="sgd" if harmed else "adam", lr=0.1 if harmed else 1e-3)
    callback = TripwireCallback(default_every(10), out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, module, max_epochs=2 if harmed else 8, loaders=helpers.torch_loaders(pixels=True))
    verdicts = tripwire.open_run(callback.run_url).verdicts()
    (raw,) = [v for v in verdicts if v.rule == "input_not_normalized"]
    assert raw.severity == "info" and raw.onset == 0
    found = diagnose(verdicts)
    if harmed:
        assert found[0].primary == raw and found[0].counts
        assert {"learning_rate", "dead_relu"} <= {v.rule for v in found[0].symptoms}
        assert summary(verdicts).startswith("diagnosis 1 (error): inputs not normalised, from step 0")
    else:
        assert trainer.callback_metrics["val_loss"] < 0.5 and not any(d.counts for d in found), summary(verdicts)
        assert summary(verdicts).startswith("worth a look (info): inputs not normalised")


def test_check_and_show_print_one_block_per_diagnosis(tmp_path):
    callback = TripwireCallback(default_every(10), out_dir=tmp_path / "run")
    helpers.fit(callback, demo_module(dead=True), max_epochs=1)
    check = subprocess.run([sys.executable, "-m", "tripwire", "check", callback.run_url], capture_output=True,
                           text=True, timeout=120)
    assert check.returncode == 1 and check.stdout.count("\ndiagnosis ") == 1, check.stdout
    assert "diagnosis 1 (error): dead ReLU units, from step 0" in check.stdout and "fix: Every bias" in check.stdout
    assert "[all_zero] warning at step 0" in check.stdout  # each verdict still listed, one line each
    show = subprocess.run([sys.executable, "-m", "tripwire", "show", callback.run_url], capture_output=True,
                          text=True, timeout=120)
    assert "by root cause:" in show.stdout and "diagnosis 1 (error): dead ReLU units" in show.stdout


# -- the optimizer and what it trains ------------------------------------------------------------------------------------
def head_left_out(pl_module):
    """The optimizer built over the first layer only (as after replacing the head): the rest gets gradients, no
    step."""
    def configure_optimizers():
        return torch.optim.SGD(pl_module.net[0].parameters(), lr=0.1)

    pl_module.configure_optimizers = configure_optimizers
    return pl_module


@pytest.mark.parametrize("faulty", [True, False], ids=["optimizer_misses_layers", "healthy"])
def test_parameters_with_a_gradient_that_no_optimizer_holds(tmp_path, faulty):
    module = helpers.mlp_module()
    if faulty:
        module = head_left_out(module)
    callback = TripwireCallback({"rules": ["untrained_parameters"], "sampling": {"every": 10}},
                                out_dir=tmp_path / "run")
    helpers.fit(callback, module, max_epochs=1)
    found = {v.finding: v for v in tripwire.open_run(callback.run_url).verdicts() if v.fired}
    if faulty:
        stray = found["no_optimizer"]
        assert stray.severity == "warning" and stray.step == 0 and "net.2.weight, net.2.bias" in stray.message
    else:
        assert found == {}


def test_frozen_layers_are_listed_once_as_info(tmp_path):
    module = helpers.mlp_module(hidden=(32, 32))
    module.net[0].requires_grad_(False)  # a frozen first layer: fine-tuning, or a mistake the user can see
    callback = TripwireCallback({"rules": ["untrained_parameters"], "sampling": {"every": 10}},
                                out_dir=tmp_path / "run")
    helpers.fit(callback, module, max_epochs=1)
    fired = [v for v in tripwire.open_run(callback.run_url).verdicts() if v.fired]
    assert [(v.finding, v.severity) for v in fired] == [("frozen", "info")] and "net.0" in fired[0].message
    # its hint is about freezing, not the warning's "they get a gradient, but no optimizer holds them"
    assert "Frozen layers keep the values they started with" in fired[0].hint and "no optimizer" not in fired[0].hint


# -- NaN at the step it appears -------------------------------------------------------------------------------------------
NAN_AT = 37  # a step no default schedule samples (every 100)


def nan_module(nan_at=NAN_AT):
    """An MLP whose loss is NaN from step `nan_at` on (a log(0) that a batch reaches), as a user's code makes it."""
    module = helpers.mlp_module()
    step = module.training_step

    def training_step(batch, batch_idx):
        loss = step(batch, batch_idx)
        return loss * float("nan") if module.global_step >= nan_at else loss

    module.training_step = training_step
    return module


@pytest.mark.parametrize("nan_at", [NAN_AT, 3], ids=["unsampled", "sampled_for_weights_only"])
def test_lightning_stops_at_the_step_the_loss_became_nan_under_the_default_config(tmp_path, nan_at):
    """Step 37 is not sampled at all; step 3 is sampled for the weights alone (poor_weight_initialization)."""
    callback = TripwireCallback(None, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, nan_module(nan_at), max_epochs=3)
    run = tripwire.open_run(callback.run_url)
    nan = next(v for v in run.verdicts() if v.rule == "exploding_tensor")
    assert (nan.step, nan.mode, run.info["status"]) == (nan_at, "train", "stopped")
    assert trainer.global_step == nan_at + 1  # no step ran after it
    assert math.isnan(run.tensor("losses/train").reduction(nan_at))
    assert (tmp_path / "run" / "checkpoints" / f"step{nan_at}.ckpt").exists()


def test_a_finite_loss_between_samples_costs_no_sample(tmp_path):
    callback = TripwireCallback(None, out_dir=tmp_path / "run")
    helpers.fit(callback, helpers.mlp_module(), max_epochs=3)
    run = tripwire.open_run(callback.run_url)
    # stored at every step, in the loss's series alone: no row, so the rules judge the sampled steps
    assert run.steps() == [*range(10), 100] and run.tensor("losses/train").steps() == list(range(3 * 43))


def test_the_probe_stops_at_the_step_the_loss_became_nan(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y), _ = helpers.digits()
    x, y = torch.tensor(x), torch.tensor(y)
    with TripwireProbe(model, optimizer, out_dir=tmp_path / "run") as probe:
        for step in range(200):
            batch = slice(32 * step % 1300, 32 * step % 1300 + 32)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch], reduction="none")  # per sample
            if step >= NAN_AT:
                loss = loss * float("nan")
            loss.mean().backward()
            optimizer.step()
            probe.step(loss)
            if probe.should_stop:
                break
    run = tripwire.open_run(probe.run_url)
    assert step == NAN_AT and run.info["status"] == "stopped"
    assert [v.step for v in run.verdicts() if v.rule == "exploding_tensor"] == [NAN_AT]


def test_loss_watch_reads_a_loss_per_sample_and_plain_numbers():
    watch = LossWatch()
    assert watch.see(0, torch.tensor([0.5, 1.0])) is None and watch.see(1, 2.0) is None and watch.see(2, None) is None
    step, value = watch.see(3, torch.tensor([0.5, float("inf")]))
    assert step == 3 and not math.isfinite(value)
    assert watch.see(4, float("nan"))[0] == 4


def test_xgboost_stops_at_the_round_its_training_loss_became_nan(tmp_path):
    xgb = pytest.importorskip("xgboost")
    from sklearn.datasets import load_breast_cancer

    from tripwire.plugins.xgboost import TripwireCallback as XGBCallback

    x, y = load_breast_cancer(return_X_y=True)
    train, val = xgb.DMatrix(x[:400], y[:400]), xgb.DMatrix(x[400:], y[400:])

    def metric(predictions, data):  # NaN on the training set from round 12 on (a log of a negative number)
        metric.rounds += data.num_row() == 400
        return "error", float("nan") if data.num_row() == 400 and metric.rounds > 12 else \
            float(np.mean((predictions > 0.5) != data.get_label()))

    metric.rounds = 0
    callback = XGBCallback(None, out_dir=tmp_path / "run")
    booster = xgb.train({"max_depth": 2, "disable_default_eval_metric": 1}, train, 100, custom_metric=metric,
                        evals=[(train, "train"), (val, "val")], callbacks=[callback], verbose_eval=False)
    run = tripwire.open_run(callback.run_url)
    nan = next(v for v in run.verdicts() if v.rule == "exploding_tensor")
    assert (nan.step, nan.mode, booster.num_boosted_rounds(), run.info["status"]) == (12, "train", 13, "stopped")


def test_a_loss_summed_over_the_batch_is_named_in_the_learning_rate_fix(tmp_path):
    """MSELoss(reduction='sum') with a rate chosen for the mean: each step is the batch size times too large."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x, y = torch.tensor((x - x.mean(0)) / x.std(0), dtype=torch.float32), torch.tensor((y - y.mean()) / y.std(),
                                                                                        dtype=torch.float32)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with TripwireProbe(model, optimizer, {"rules": ["learning_rate"]}, out_dir=tmp_path / "run") as probe:
        for step in range(5):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[64 * step:64 * step + 64]).view(-1),
                                                y[64 * step:64 * step + 64], reduction="sum")
            loss.backward()
            optimizer.step()
            probe.step(loss)
    (verdict,) = [v for v in tripwire.open_run(probe.run_url).verdicts() if v.fired]
    assert verdict.finding == "high" and "reduction='sum'" in verdict.hint


def test_a_rule_of_the_users_is_named_by_its_class():
    (found,) = diagnose([verdict("my_project.rules:LargeGradient", 3)])
    assert found.cause == "LargeGradient"
    (builtin,) = diagnose([verdict("some_rule_of_ours", 4)])
    assert builtin.cause == "some rule of ours"
