"""Verdicts users can trust: what a rule judges is what its condition is about, on real Lightning and plain-torch
training. Each test is one of the false alarms or wrong captures tried on ordinary models; the zoo (test_zoo.py)
holds the whole architectures."""

import math

import numpy as np
import pytest
import torch

import helpers
import tripwire
from tripwire.core.history import History
from tripwire.core.rules.base import Rule
from tripwire.core.rules.engine import MAX_FINDINGS, RuleEngine
from tripwire.plugins.lightning import TripwireCallback
from tripwire.plugins.torch import TripwireProbe


def bn_module():
    """The model of the report: Linear(64,64) -> BatchNorm1d -> ReLU -> Linear(64,10), Adam 1e-3."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 10))
    return helpers.classifier(net, lr=1e-3, optimizer="adam")


def test_a_batchnorm_model_trains_to_the_end_under_the_default_config(tmp_path):
    """Its 1-D BatchNorm weights have no fan-in: that was stored as NaN and read as NaN in the weights at step 1."""
    callback = TripwireCallback(None, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, bn_module(), max_epochs=3)
    run = tripwire.open_run(callback.run_url)
    assert trainer.global_step == 3 * 43 and run.info["status"] == "finished"
    assert [v for v in run.verdicts() if v.counts] == []
    assert not (tmp_path / "run" / "checkpoints").exists()
    for mode in run.modes():  # a reduction that does not apply is absent: nothing stored is NaN
        for name in run.tensor_names(mode=mode):
            for reduction in run.tensor(name).reductions(mode=mode):
                assert np.isfinite(run.tensor(name).series(reduction, mode=mode)[1]).all(), (name, reduction)
    scale, shift = run.model.parameters["net.1.weight"], run.model.parameters["net.1.bias"]
    assert (scale.role, shift.role, run.model.parameters["net.0.weight"].followed_by) == \
        ("norm_scale", "norm_shift", "norm")
    assert "weights/net.1.bias" not in run.tensor_names()  # a normalisation shift is filed under biases/


def test_a_run_compared_with_itself_is_equivalent(tmp_path):
    """ReLU layers have no saturation (once stored as NaN, which never equals itself)."""
    config = {"sampling": {"every": 5}, "collections": {"activations": {}, "weights": {}, "gradients": {}},
              "rules": ["saturated_activation"]}
    callback = TripwireCallback(config, out_dir=tmp_path / "run")
    helpers.fit(callback, helpers.mlp_module(), max_epochs=1)
    assert "saturated_fraction" not in tripwire.open_run(callback.run_url).tensor("activations/net.1").reductions()
    assert tripwire.compare(callback.run_url, callback.run_url).equivalent


def test_gradient_accumulation_records_the_step_the_optimizer_took(tmp_path):
    """accumulate_grad_batches=4: a sampled step is the micro-batch that ends in optimizer.step(), its update is the
    step's, and its loss is the mean of its micro-batches' losses, not divided by 4."""
    config = {"sampling": {"every": 5}, "rules": [],
              "collections": {"losses": {}, "updates": {"reductions": ["l2"]}, "weights": {"reductions": ["l2"]}}}
    callback = TripwireCallback(config, out_dir=tmp_path / "run")
    seen = []  # (global step, loss) of every micro-batch

    class Noted(type(helpers.mlp_module())):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            seen.append((self.trainer.global_step, float(loss.detach())))
            return loss

    torch.manual_seed(0)
    trainer = helpers.fit(callback, Noted(), max_epochs=1, accumulate_grad_batches=4)
    run = tripwire.open_run(callback.run_url)
    steps, losses = run.tensor("losses/train").series()
    assert steps.tolist() == list(range(0, trainer.global_step, 5)) and len(steps) >= 2
    for step, loss in zip(steps, losses):
        micro = [value for global_step, value in seen if global_step == step]  # 4, or what the epoch had left
        assert len(micro) in (3, 4) and loss == pytest.approx(float(np.mean(micro)), rel=1e-5)
    assert (run.tensor("updates/net.0.weight").series("l2")[1] > 0).all()  # the optimizer's step, never a 0


def test_the_probe_leaves_token_ids_out_of_the_inputs_and_takes_a_loss_per_sample(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Flatten(), torch.nn.Linear(8 * 6, 32))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 32, (64, 7))
    config = {"sampling": {"every": 2}, "rules": ["input_not_normalized", "exploding_tensor"],
              "collections": {"losses": {}}}
    with TripwireProbe(model, optimizer, config, out_dir=tmp_path / "run") as probe:
        for _ in range(20):
            optimizer.zero_grad()
            losses = torch.nn.functional.cross_entropy(model(tokens[:, :6]), tokens[:, 6], reduction="none")
            losses.mean().backward()
            optimizer.step()
            probe.step(losses)  # one loss per sample: the step's loss is their mean
    run = tripwire.open_run(probe.run_url)
    assert "inputs/x" not in run.tensor_names() and [v for v in run.verdicts() if v.fired] == []
    stored = run.tensor("losses/train").series()[1]  # every step's (the unsampled ones read at the next sample)
    # every 2 steps, and step 1 for input_not_normalized, which reads the first three batches
    assert stored[-1] < stored[0] and len(stored) == 20 and run.steps() == [0, 1, *range(2, 20, 2)]


def test_a_frozen_layer_is_in_the_structure_and_a_hole_among_trained_ones_is_reported(tmp_path):
    module = helpers.mlp_module(hidden=(32, 32))
    module.net[2].requires_grad_(False)  # the middle layer, left frozen by a freezing loop
    callback = TripwireCallback({"rules": ["unchanged_tensor"]}, out_dir=tmp_path / "run")
    helpers.fit(callback, module, max_epochs=1)
    run = tripwire.open_run(callback.run_url)
    frozen = run.model.parameters["net.2.weight"]
    assert frozen.trainable is False and run.model.parameters["net.0.weight"].trainable
    assert "weights/net.2.weight" not in run.tensor_names()  # frozen tensors cost nothing to capture
    (verdict,) = [v for v in run.verdicts() if v.fired]
    assert verdict.step == 0 and verdict.evidence["frozen"] == ["net.2.weight"] and verdict.severity == "warning"

    fine_tuned = helpers.mlp_module(hidden=(32, 32))
    fine_tuned.net[0].requires_grad_(False)  # a frozen first part: fine-tuning, not a mistake
    callback = TripwireCallback({"rules": ["unchanged_tensor"]}, out_dir=tmp_path / "fine-tuned")
    helpers.fit(callback, fine_tuned, max_epochs=1)
    assert tripwire.open_run(callback.run_url).verdicts() == []


class Growing(Rule):
    """A test rule: the loss above 1 is one finding, above 2 another (a worse state); an error above 3."""

    name = "growing"

    def check(self, run, step):
        loss = run.tensor("losses/train").reduction(step)
        found = [self.fire(step, f"loss above {level}", finding=f"above {level}") for level in (1, 2) if loss > level]
        if loss > 3:
            found.append(self.fire(step, "loss above 3", severity="error", finding="above 2"))
        return found or None


def test_a_verdict_does_not_silence_its_rule_and_repeats_stay_bounded():
    from tripwire.core.config import RuleSpec

    engine = RuleEngine([RuleSpec(rule="test_verdicts:Growing", id="growing", params={}, actions=())])
    history = History(8)
    out = []
    for step, loss in enumerate([0.5, 1.5, 1.6, 2.5, 2.4, 3.5, 3.6, 0.4]):
        history.add(0, "train", step, {"losses/train": {"value": loss}})
        out += engine.evaluate(history, step, "train", 0)
    assert [(v.step, v.finding, v.severity) for v in out] == \
        [(1, "above 1", "warning"), (3, "above 2", "warning"), (5, "above 2", "error")]
    assert MAX_FINDINGS == 20


@pytest.mark.parametrize("batches, fires", [
    (lambda rng: rng.random((32, 1, 8, 8)), False),  # images scaled to [0, 1]
    (lambda rng: rng.random((32, 1, 8, 8)) * 2 - 1.39, False),  # Normalize(0.5, 0.5)-style, mean -0.39
    (lambda rng: np.eye(10)[rng.integers(0, 10, 32)], False),  # one-hot features
    (lambda rng: rng.normal(size=(4, 20)) * 3, False),  # a small batch of standardised data, spread 3
    (lambda rng: rng.normal(size=(32, 64)) * 255, True),  # standardised data x255
    (lambda rng: rng.random((32, 1, 8, 8)) * 255, True),  # raw 8-bit pixels
])
def test_input_not_normalized_accepts_bounded_data_and_judges_several_batches(batches, fires):
    from tripwire.core.reductions import reduce
    from tripwire.core.rules.inputs import STATISTICS, InputNotNormalized

    rng, history, rule = np.random.default_rng(0), History(8), InputNotNormalized()
    for step in range(3):
        history.add(0, "train", step, {"inputs/x": reduce(batches(rng).astype(np.float32), STATISTICS)})
        verdict = rule.check(history.at(step, "train", 0), step)
        assert verdict is None if step < 2 else bool(verdict) == fires  # judged over 3 batches


def test_a_config_of_a_clock_rule_alone_is_valid():
    config = tripwire.load_config({"rules": ["stalled_training"]})
    assert [r.rule for r in config.rules] == ["stalled_training"] and not config.plan().collections


def test_steps_a_grad_scaler_skips_are_no_blow_up(tmp_path):
    """fp16 mixed precision: a GradScaler starting at a scale the gradients overflow skips those steps by design
    (the gradients are inf after unscaling). Such a step changed nothing: tripwire records no weights, gradients
    or updates for it, so no rule judges it (the default config stopped this run at step 0)."""
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    config = {**tripwire.load_config(None).to_dict(), "sampling": {"every": 1}}
    callback = TripwireCallback(config, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, bn_module(), max_epochs=2, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    run = tripwire.open_run(callback.run_url)
    assert run.info["status"] == "finished" and trainer.global_step == 2 * 43
    assert [v for v in run.verdicts() if v.counts] == []
    skipped = [s for s in run.steps() if s not in set(run.tensor("gradients/net.0.weight").steps())]
    assert skipped and skipped[0] == 0 and scaler.get_scale() < 2.0 ** 24  # the first steps were skipped
    assert set(run.tensor("losses/train").steps()) >= set(skipped)  # their loss is kept


def test_a_nan_loss_skipped_then_a_divergence_later_is_reported_again(tmp_path):
    """A loop that skips a batch whose loss is NaN (step 20) and goes on; the loss diverges for good at 150. The
    first NaN must not spend the rule: a collection finite again that blows up again is a finding of its own."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    (x, y), _ = helpers.digits()
    x, y = torch.tensor(x[:64]), torch.tensor(y[:64])
    config = {"rules": [{"rule": "exploding_tensor", "actions": ["log"]}], "sampling": {"every": 10}}
    with TripwireProbe(net, optimizer, config, out_dir=tmp_path / "run") as probe:
        for step in range(200):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            if step == 20 or step >= 150:
                loss = loss * float("nan")
            if step != 20:  # the loop skips the NaN batch, as many do
                loss.backward()
                optimizer.step()
            probe.step(loss)
    found = [(v.step, v.finding) for v in tripwire.open_run(probe.run_url).verdicts() if v.rule == "exploding_tensor"]
    assert found[:2] == [(20, "losses"), (150, "losses#2")]


def test_a_slow_start_is_not_a_loss_that_never_went_down():
    """Flat for 200 steps, then learning: no `never` verdict before `min_steps` (300) steps; a loss flat for 300
    steps is one (error). Sampled every 10 steps, as with every rule on."""
    from tripwire.core.config import RuleSpec

    def verdicts(losses):
        engine = RuleEngine([RuleSpec(rule="loss_not_decreasing", id="loss_not_decreasing", params={}, actions=())])
        history, out = History(16), []
        for i, loss in enumerate(losses):
            history.add(0, "train", 10 * i, {"losses/train": {"value": loss}})
            out += [(v.step, v.finding) for v in engine.evaluate(history, 10 * i, "train", 0)]
        return out

    noise = np.random.default_rng(0).normal(0, 0.05, 40)
    slow = [1.0 + n if i < 20 else 0.5 + n for i, n in enumerate(noise)]
    assert [f for f in verdicts(slow) if f[1] == "never"] == []
    assert [s for s, f in verdicts(1.0 + noise) if f == "never"][0] == 300


def test_a_loss_that_creeps_down_under_noisy_batches_is_a_slow_start_not_one_that_never_went_down():
    """The figures of a Keras BiLSTM at Adam 3e-4 (a third-party idiom, one seed of three): its batch loss swings by
    0.03 about ln 2 while it creeps down by 0.03 in 1,400 steps, less than a tenth of the room above its floor,
    before it learns to 0.97 accuracy. The line through every sample falls by over 3 standard errors: a slow start
    (info), where it was "never went down" (error). A loss as noisy that stays level is still an error."""
    from tripwire.core.config import RuleSpec

    def verdicts(losses):
        spec = RuleSpec(rule="loss_not_decreasing", id="loss_not_decreasing", params={"min_steps": 1400}, actions=())
        engine, history, out = RuleEngine([spec]), History(16), []
        for i, loss in enumerate(losses):
            history.add(0, "train", 10 * i, {"losses/train": {"value": loss}})
            out += [(v.step, v.finding, v.severity) for v in engine.evaluate(history, 10 * i, "train", 0)]
        return out

    noise = np.random.default_rng(0).normal(0, 0.03, 141)
    creeping = np.log(2) - 0.03 * np.arange(141) / 140 + noise
    told = verdicts(creeping)
    assert (1400, "slow", "info") in told and [v for v in told if v[2] != "info"] == []
    assert [v for v in verdicts(np.log(2) + noise) if v[1] != "plateau"] == [(1400, "never", "error")]


def test_a_regression_whose_targets_take_few_values_is_not_judged_as_a_classifier(tmp_path):
    """Half-star ratings (1.0, 1.5, … 5.0) under a regression objective: the classification rules say the data is
    not theirs (no_data), whatever its values look like."""
    xgb = pytest.importorskip("xgboost")
    from sklearn.datasets import load_diabetes

    from tripwire.plugins.xgboost import TripwireCallback as XGBCallback

    x, target = load_diabetes(return_X_y=True)
    stars = np.round(1 + 8 * (target - target.min()) / np.ptp(target)) / 2  # 1.0 … 5.0 by halves
    config = {"sampling": {"every": 1}, "rules": ["class_imbalance", "confusion", "loss_setup"]}
    callback = XGBCallback(config, eval_data=(x[300:], stars[300:]))
    xgb.train({"objective": "reg:squarederror", "max_depth": 3, "nthread": 1}, xgb.DMatrix(x[:300], stars[:300]),
              30, evals=[(xgb.DMatrix(x[300:], stars[300:]), "val")], callbacks=[callback], verbose_eval=False)
    run = tripwire.open_run(callback.run_url)
    assert [v for v in run.verdicts() if v.fired] == []
    assert {v.rule for v in run.verdicts() if v.status == "no_data"} == {"class_imbalance", "confusion"}
    assert run.first_step.losses[0].kind == "regression"


def test_dead_relu_without_batches_large_enough_says_so(tmp_path):
    callback = TripwireCallback({"rules": ["dead_relu", "exploding_tensor"], "sampling": {"every": 5}},
                                out_dir=tmp_path / "run")
    helpers.fit(callback, helpers.mlp_module(), max_epochs=1, loaders=helpers.torch_loaders(batch_size=8))
    (verdict,) = tripwire.open_run(callback.run_url).verdicts()
    assert verdict.rule == "dead_relu" and verdict.status == "no_data" and "fewer than 16 samples" in verdict.message \
        and "LeakyReLU" in verdict.message


@pytest.mark.parametrize("labels", ["true", "shuffled"])
def test_most_units_dead_in_a_model_that_learns_is_info(tmp_path, labels):
    """80 % of a hidden ReLU layer's units dead from the start (biases of -20), the other 20 % alive: on the
    digits the units left carry a model that learns (DeepLocalize 47352366's fixed program, the TensorFlow
    tutorial's CNN at 97 % accuracy with 70-80 % of a convolution's channels dead, was warned): info once the
    training loss is below half of ln 10. On shuffled labels, where it learns nothing, a warning as before."""
    def kill_most(net):
        torch.nn.init.constant_(net[0].bias[:52], -20.0)

    config = {"rules": ["dead_relu"], "sampling": {"every": 50}}
    callback = TripwireCallback(config, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, helpers.mlp_module(hidden=(64,), init=kill_most), max_epochs=4,
                          loaders=None if labels == "true" else shuffled_loaders())
    found = {(v.step, v.severity) for v in tripwire.open_run(callback.run_url).verdicts() if v.rule == "dead_relu"
             and v.fired}
    assert found == {(100, "info" if labels == "true" else "warning")}  # first judged at the third sample
    val_loss = float(trainer.callback_metrics["val_loss"])
    assert val_loss < 0.7 if labels == "true" else val_loss > 0.95 * math.log(10)  # learns, or stays at chance


def test_dead_relu_judges_relu_layers_only(tmp_path):
    """A tanh MLP with every activation rule on: its layers have no dead_fraction (a tanh unit is not dead when
    it is never positive), so dead_relu has nothing to say."""
    callback = TripwireCallback({"rules": ["dead_relu", "saturated_activation"], "sampling": {"every": 10}},
                                out_dir=tmp_path / "run")
    helpers.fit(callback, helpers.mlp_module(hidden=(32, 32), activation="tanh", init=lambda net: [
        torch.nn.init.constant_(net[i].bias, -3.0) for i in (0, 2)]), max_epochs=1)
    run = tripwire.open_run(callback.run_url)
    assert "dead_fraction" not in run.tensor("activations/net.1").reductions()
    assert "saturated_fraction" in run.tensor("activations/net.1").reductions()
    assert not [v for v in run.verdicts() if v.rule == "dead_relu" and v.fired]


def shuffled_loaders():
    """Digits whose training labels were shuffled apart from their inputs."""
    (xt, yt), (xv, yv) = helpers.digits()
    shuffled = np.random.default_rng(0).permutation(yt)
    ds = lambda x, y: torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y, dtype=torch.long))  # noqa
    return (torch.utils.data.DataLoader(ds(xt, shuffled), batch_size=32, shuffle=True,
                                        generator=torch.Generator().manual_seed(0)),
            torch.utils.data.DataLoader(ds(xv, yv), batch_size=256))


@pytest.mark.parametrize("batchnorm", [False, True], ids=["plain", "batchnorm"])
def test_labels_shuffled_apart_from_a_model_that_memorises_them_give_a_validation_loss_at_chance(tmp_path,
                                                                                                batchnorm):
    """The hint names the labels; where the model has BatchNorm, also its running statistics, which can hold
    their start for long where the batches' variance is far below 1 (keras.io's Xception-like classifier on
    inputs scaled by 1/255: validation at chance for 528 steps, 99.5 % accurate with batch statistics)."""
    loaders = shuffled_loaders()
    callback = TripwireCallback({"rules": ["overfit"], "sampling": {"every": 10}}, out_dir=tmp_path / "run")
    module = helpers.mlp_module(hidden=(128,), optimizer="adam", lr=3e-3)
    if batchnorm:
        module.net.insert(1, torch.nn.BatchNorm1d(128))
    helpers.fit(callback, module, max_epochs=12, loaders=loaders)
    (verdict,) = [v for v in tripwire.open_run(callback.run_url).verdicts() if v.fired]
    assert verdict.finding == "chance" and "ln 10" in verdict.message and verdict.severity == "warning"
    assert "labels that do not match" in verdict.hint
    assert ("keep 90% of what they held" in verdict.hint) == batchnorm


def test_labels_shuffled_apart_from_a_model_that_cannot_memorise_them_leave_a_loss_stuck_while_weights_move(tmp_path):
    callback = TripwireCallback({"rules": ["loss_not_decreasing", "weight_update_ratio"], "sampling": {"every": 10}},
                                out_dir=tmp_path / "run")
    helpers.fit(callback, helpers.mlp_module(lr=0.05), max_epochs=8, loaders=shuffled_loaders())
    (verdict,) = [v for v in tripwire.open_run(callback.run_url).verdicts() if v.counts]
    assert (verdict.rule, verdict.finding) == ("loss_not_decreasing", "stuck") and "labels" in verdict.hint


def code_autoencoder(tmp_path, targets):
    """8-bit codes learned one sample a step (SGD 0.05) by an 8-8-8-8 ReLU MLP initialised at std 0.05 (DeepLocalize
    39217567's fixed program): the loss sits at ln 2 for about 3,500 steps before it falls. `targets`: the codes
    themselves, or the codes shuffled apart from their inputs (nothing to learn). Returns the verdicts that
    fired and the mean loss of the first and the last epoch."""
    codes = torch.tensor([[float(bit) for bit in np.binary_repr(i, 8)] for i in range(256)])
    y = codes if targets == "codes" else codes[torch.randperm(256, generator=torch.Generator().manual_seed(0))]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
                              torch.nn.Linear(8, 8))
    for layer in net[::2]:
        torch.nn.init.normal_(layer.weight, std=0.05)
        torch.nn.init.zeros_(layer.bias)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    config = {"sampling": {"every": 20}, "rules": [{"rule": "loss_not_decreasing",
                                                     "params": {"min_steps": 3000, "full_batch": 1}}],
              "collections": {name: {"reductions": ["l2"]} for name in ("weights", "gradients", "updates")}}
    order, losses = torch.Generator().manual_seed(1), []
    with TripwireProbe(net, optimizer, config, out_dir=tmp_path / targets) as probe:
        for _ in range(20):
            for i in torch.randperm(256, generator=order).tolist():
                optimizer.zero_grad()
                loss = torch.nn.functional.binary_cross_entropy_with_logits(net(codes[i:i + 1]), y[i:i + 1])
                loss.backward()
                optimizer.step()
                probe.step(loss)
                losses.append(loss.item())
    fired = [v for v in tripwire.open_run(tmp_path / targets).verdicts() if v.fired]
    return fired, np.mean(losses[:256]), np.mean(losses[-256:])


def test_a_slow_start_whose_weights_drift_is_told_at_info_and_labels_that_do_not_match_stay_an_error(tmp_path):
    """At step 3,000 neither loss has gone down from ln 2. The codes' weights drift one way (their norm grew by
    ~10 % of the distance their steps travelled) and the loss falls soon after: a slow start, info, and no error
    later. Shuffled apart, the steps cancel and the norm hardly moves: nothing learns, an error."""
    fired, first, last = code_autoencoder(tmp_path, "codes")
    assert last < first - 0.02  # it does learn, after its plateau
    slow = [v for v in fired if v.rule == "loss_not_decreasing" and v.finding == "slow"]
    assert [v.step for v in slow] == [3000] and slow[0].severity == "info" and "slow start" in slow[0].message
    assert [v for v in fired if v.counts] == []
    fired, first, last = code_autoencoder(tmp_path, "shuffled")
    assert abs(last - first) < 0.01
    assert {v.finding for v in fired if v.counts} == {"never", "stuck"} and not any(v.finding == "slow" for v in fired)


@pytest.mark.parametrize("loss, fires", [(0.5, True), (1e-5, False)])
def test_zero_gradients_of_a_model_that_fits_its_data_exactly_are_convergence(loss, fires):
    """A sigmoid output driven to its targets exactly passes back gradients that round to 0: once the training loss
    is below a thousandth of its first value, all_zero leaves gradients alone and weight_update_ratio does not call
    the steps too small; before that, both are faults."""
    from tripwire.core.rules.tensors import AllZero
    from tripwire.core.rules.weights import WeightUpdateRatio

    history, zero, ratio = History(8), AllZero(), WeightUpdateRatio()
    for step, value in ((0, 1.0), (1, loss), (2, loss)):
        history.add(0, "train", step, {"losses/train": {"value": value},
                                      "gradients/w": {"zero_fraction": 1.0 if step else 0.0},
                                      "updates/w": {"l2": 1e-12 if step else 1e-3}, "weights/w": {"l2": 1.0}})
        found = [zero.check(history.at(step, "train", 0), step), ratio.check(history.at(step, "train", 0), step)]
    assert [bool(f) for f in found] == [fires, fires]


@pytest.mark.parametrize("later_rate, fires", [(1e-2, True), (1e-8, False)])
def test_steps_too_small_at_the_end_of_a_schedule_are_no_fault(later_rate, fires):
    """A ReduceLROnPlateau without min_lr cuts Adam's 1e-2 to 1e-8 over a long run after the model has learned
    (a healthy program in the helper's hunt): its updates are 1e-9 of the weights, as the schedule means them to
    be. Below a thousandth of the largest rate so far, weight_update_ratio does not call them too small, as
    unchanged_tensor does not call the weights unchanged; at the rate it started with, the same steps are a
    fault."""
    from tripwire.core.rules.weights import WeightUpdateRatio

    history, ratio = History(8), WeightUpdateRatio()
    for step in range(3):
        history.add(0, "train", step, {"losses/train": {"value": 1.0 if step == 0 else 0.5},
                                      "optimizer/lr": {"value": 1e-2 if step == 0 else later_rate},
                                      "updates/w": {"l2": 1e-3 if step == 0 else 1e-9}, "weights/w": {"l2": 1.0}})
        found = ratio.check(history.at(step, "train", 0), step)
    assert bool(found) == fires


def recommender_fit(out, steps=1000):
    """keras.io's collaborative-filtering recipe in a plain loop: user and movie embeddings (50, He-normal) and
    biases, sigmoid(the embeddings' dot product + biases) under binary cross-entropy against ratings of 0.5-5
    stars scaled to [0, 1] (users and movies differ in mean rating, plus a low-rank taste), Adam 1e-3, batches of
    64."""
    rng = np.random.default_rng(0)
    users, movies, n = 600, 900, 60000
    taste_u, taste_m = rng.normal(size=(users, 4)), rng.normal(size=(movies, 4))
    u, m = rng.integers(0, users, n), rng.integers(0, movies, n)
    stars = np.clip(np.round(2 * (3.5 + rng.normal(0, 0.45, users)[u] + rng.normal(0, 0.55, movies)[m]
                                  + 0.25 * (taste_u[u] * taste_m[m]).sum(1) + rng.normal(0, 0.7, n))) / 2, 0.5, 5)
    y = torch.tensor((stars - 0.5) / 4.5, dtype=torch.float32)
    u, m = torch.tensor(u), torch.tensor(m)
    torch.manual_seed(0)

    class Recommender(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.user, self.movie = torch.nn.Embedding(users, 50), torch.nn.Embedding(movies, 50)
            self.user_bias, self.movie_bias = torch.nn.Embedding(users, 1), torch.nn.Embedding(movies, 1)
            for table, rows in ((self.user, users), (self.movie, movies)):  # as Keras initialises them
                torch.nn.init.normal_(table.weight, std=(2 / rows) ** 0.5)  # he_normal, fan-in the table's rows
            for table in (self.user_bias, self.movie_bias):
                torch.nn.init.uniform_(table.weight, -0.05, 0.05)

        def forward(self, u, m):
            # keras.io's ops.tensordot(user_vector, movie_vector, 2) sums over the batch too: one number shared
            # by every rating in it, which makes the batch losses noisy
            dot = (self.user(u) * self.movie(m)).sum()
            return torch.sigmoid(dot + self.user_bias(u) + self.movie_bias(m)).squeeze(1)

    model = Recommender()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    bce = torch.nn.functional.binary_cross_entropy

    def held_out():  # in batches of 64, as it trains (the dot product is the batch's)
        with torch.no_grad():
            return float(np.mean([bce(model(u[i:i + 64], m[i:i + 64]), y[i:i + 64]) for i in range(54000, n, 64)]))

    before = held_out()
    config = {"rules": ["loss_not_decreasing"], "sampling": {"every": 10}}
    with TripwireProbe(model, optimizer, config, out_dir=out) as probe:
        for step in range(steps):
            i = slice(64 * step % 54000, 64 * step % 54000 + 64)
            loss = bce(model(u[i], m[i]), y[i])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            probe.step(loss)
    return probe, before, held_out()


def test_a_loss_whose_soft_targets_keep_it_far_from_zero_is_judged_against_its_floor(tmp_path):
    """Ratings scaled to [0, 1] under binary cross-entropy: a perfect model still scores their entropy (0.49 here),
    and one that learns goes from ln 2 towards 0.6, a few percent of its start in a thousand steps. Measured
    against its start, that was "has not gone down since training began" (error) on keras.io's recipe with every
    rule on; against the room above the targets' entropy it went down."""
    probe, before, after = recommender_fit(tmp_path / "run")
    assert after < before - 0.03  # it learns, on held-out ratings
    assert [v.message for v in probe.verdicts if v.rule == "loss_not_decreasing" and v.fired and v.counts] == []


def test_a_validation_loss_that_swings_while_training_is_steady_is_no_oscillation(tmp_path):
    """A residual MLP (LayerNorm, GELU) on upsampled digits under bfloat16 autocast on the CPU, AdamW 1e-3: 97 %
    held-out accuracy, a training loss falling every epoch, and a validation loss of 397 samples that a few
    confident mistakes move (0.22 -> 0.34 -> 0.13 -> 0.19 -> 0.13): two swings in ten evaluations, which
    oscillating_loss (default config) told as training that does not settle."""
    torch.manual_seed(0)
    (x, y), (xv, yv) = helpers.digits(pixels=True)
    def big(a):  # 8x8 -> 28x28, as MNIST
        return torch.nn.functional.pad(torch.tensor(a / 255).reshape(-1, 8, 8).repeat_interleave(3, 1)
                                       .repeat_interleave(3, 2), (2, 2, 2, 2)).flatten(1)
    x, xv, y, yv = big(x), big(xv), torch.tensor(y), torch.tensor(yv)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.out = torch.nn.Linear(784, 256), torch.nn.Linear(256, 10)
            self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.Linear(256, 256),
                                                                  torch.nn.GELU()) for _ in range(3))

        def forward(self, x):
            x = torch.relu(self.inp(x))
            for block in self.blocks:
                x = x + block(x)
            return self.out(x)

    net = Net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    with TripwireProbe(net, optimizer, None, out_dir=tmp_path / "run") as probe:
        for epoch in range(10):
            for i in torch.randperm(len(y)).split(32):
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = torch.nn.functional.cross_entropy(net(x[i]), y[i])
                loss.backward()
                optimizer.step()
                probe.step(loss)
            with torch.no_grad():
                probe.log_eval({"val_loss": float(torch.nn.functional.cross_entropy(net(xv), yv))})
    with torch.no_grad():
        assert (net(xv).argmax(1) == yv).float().mean() > 0.9
    val = tripwire.open_run(probe.run_url).tensor("metrics/val_loss").series(mode="eval")[1]
    assert max(val[2:]) > 1.3 * min(val[2:])  # it does swing
    assert [v.message for v in probe.verdicts if v.counts] == []


def test_a_validation_loss_that_jumps_while_a_one_cycle_raises_the_rate_is_no_overfit(tmp_path):
    """A CNN with BatchNorm on digits (bilinear to 28x28), Adam under OneCycleLR (max_lr 1e-2, stepped every step),
    10 epochs, two evaluations an epoch: at the top of the cycle the validation loss jumps from its best, 1.94, to
    4.26 and comes back to 0.66 as the rate comes down (over 80 % held-out accuracy). overfit (default config) told
    it as overfitting at the third evaluation up."""
    import lightning.pytorch as pl
    from sklearn.datasets import load_digits

    pl.seed_everything(0)
    digits = load_digits()
    x = torch.nn.functional.interpolate(torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16,
                                        size=(28, 28), mode="bilinear").clamp(0, 1)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    y = torch.tensor(digits.target)
    train = torch.utils.data.TensorDataset(x[order[:1500]], y[order[:1500]])
    val = torch.utils.data.TensorDataset(x[order[1500:]], y[order[1500:]])

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 10))

        def training_step(self, batch, i):
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def validation_step(self, batch, i):
            out = self.net(batch[0])
            self.log("val_loss", torch.nn.functional.cross_entropy(out, batch[1]))
            self.log("val_acc", (out.argmax(1) == batch[1]).float().mean())

        def configure_optimizers(self):
            optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
            cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2,
                                                        total_steps=self.trainer.estimated_stepping_batches)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cycle, "interval": "step"}}

    callback = TripwireCallback(None, out_dir=tmp_path / "run")
    trainer = pl.Trainer(accelerator="cpu", max_epochs=10, enable_progress_bar=False, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, callbacks=[callback],
                         val_check_interval=0.5)
    trainer.fit(Net(), torch.utils.data.DataLoader(train, batch_size=32, shuffle=True),
                torch.utils.data.DataLoader(val, batch_size=128))
    assert trainer.callback_metrics["val_acc"] > 0.8
    val_loss = tripwire.open_run(callback.run_url).tensor("metrics/val_loss").series(mode="eval")[1]
    # the jump at the top of the cycle (1.94 -> 4.26, above 1.94 for eight evaluations), then well below it
    assert max(val_loss) > 2 * min(val_loss[:5]) and val_loss[-1] < 0.5 * min(val_loss[:5])
    assert [v.message for v in callback.verdicts if v.counts] == []


def test_stochastic_weight_averaging_s_batchnorm_pass_is_no_step_without_gradients(tmp_path):
    """Lightning's StochasticWeightAveraging ends with one more epoch of forwards that recompute BatchNorm's
    statistics for the averaged weights, backward skipped by design; its one optimizer step had nothing to apply,
    and training_relations told it as an error (an optimizer stepping without gradients)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    callback = TripwireCallback({"rules": ["training_relations"], "sampling": {"every": 1}}, out_dir=tmp_path / "run")
    module = bn_module()
    trainer = helpers.fit(callback, module, max_epochs=4,
                          callbacks=[StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=2)])
    assert trainer.current_epoch == 5  # the extra epoch ran
    (_, _), (xv, yv) = helpers.digits()
    module.eval()
    with torch.no_grad():  # the averaged weights, with their statistics, learned
        assert (module.net(torch.tensor(xv)).argmax(1).numpy() == yv).mean() > 0.8
    assert [v.message for v in callback.verdicts if v.counts] == []


def forward_forward_fit(out, steps_per_layer=250):
    """pytorch/examples' mnist_forward_forward, on digits upsampled to 28x28: each layer has its own Adam (lr 0.03)
    and a loss of its own (goodness of real against wrongly labelled samples), and is trained after the one
    before it, through its own forward (the model's is never called). Returns (probe, validation error before,
    after)."""
    torch.manual_seed(1)
    (x, y), (xv, yv) = helpers.digits()
    def images(a):
        a = torch.tensor(a).view(-1, 8, 8).repeat_interleave(3, 1).repeat_interleave(3, 2)
        return torch.nn.functional.pad(a, (2, 2, 2, 2)).flatten(1)
    x, xv, y, yv = images(x), images(xv), torch.tensor(y), torch.tensor(yv)

    def overlay(x, y):
        x = x.clone()
        x[:, :10] = 0.0
        x[range(len(x)), y] = x.max()
        return x

    class Layer(torch.nn.Linear):
        def __init__(self, n_in, n_out):
            super().__init__(n_in, n_out)
            self.opt = torch.optim.Adam(self.parameters(), lr=0.03)

        def forward(self, x):
            return torch.relu(torch.mm(x / (x.norm(2, 1, keepdim=True) + 1e-4), self.weight.T) + self.bias)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(784, 500), Layer(500, 500)])

        def predict(self, x):
            goodness = []
            for label in range(10):
                h, g = overlay(x, torch.full((len(x),), label)), 0
                for layer in self.layers:
                    h = layer(h)
                    g = g + h.pow(2).mean(1)
                goodness.append(g)
            return torch.stack(goodness, 1).argmax(1)

    net = Net()
    wrong = y.clone()
    for i in range(len(y)):  # a wrong label for each sample
        wrong[i] = (y[i] + 1 + torch.randint(9, ()).item()) % 10
    positive, negative = overlay(x, y), overlay(x, wrong)
    with torch.no_grad():
        before = float((net.predict(xv) != yv).float().mean())
    with TripwireProbe(net, [layer.opt for layer in net.layers], out_dir=out) as probe:
        for layer in net.layers:  # one layer after another, on the last one's outputs
            for _ in range(steps_per_layer):
                good, bad = layer.forward(positive).pow(2).mean(1), layer.forward(negative).pow(2).mean(1)
                loss = torch.log1p(torch.exp(torch.cat([2 - good, bad - 2]))).mean()
                layer.opt.zero_grad()
                loss.backward()
                layer.opt.step()
                probe.step(loss)
            positive, negative = layer.forward(positive).detach(), layer.forward(negative).detach()
    with torch.no_grad():
        after = float((net.predict(xv) != yv).float().mean())
    return probe, before, after

def test_forward_forward_training_one_layer_after_another_is_silent_and_seen(tmp_path):
    """Under the default config: the probe sees each layer's weights at the steps its optimizer steps (they were
    never captured: the step began at probe.step, after the update); at the switch to the second layer the loss
    of another objective starts high, which is no spike to roll back from (it was told at step 309); Adam's first
    step rescales the first layer's small initialisation once (1.2x its norm, then 0.7x), no learning rate too
    high."""
    probe, before, after = forward_forward_fit(tmp_path / "run")
    assert after < before / 4
    run = tripwire.open_run(probe.run_url)
    assert not [(v.rule, v.step, v.message) for v in run.verdicts() if v.fired and v.severity != "info"]
    first, second = (run.tensor(f"weights/layers.{i}.weight").steps() for i in (0, 1))
    assert first[:2] == [0, 1] and max(first) < 250 <= min(second)  # each while its optimizer steps


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_a_summed_reconstruction_loss_is_not_compared_with_a_classifier_s_chance(tmp_path, reduction):
    """pytorch/examples' VAE sums its binary cross-entropy over every pixel (reduction="sum"): a sample's loss is
    64 pixels' worth, far above ln 2 however well the model reconstructs. With the KL term warmed up (beta from 0 to
    1), the validation ELBO (beta 1) rises from its best while the training loss falls: overfit's "never below
    chance" called that memorising labels (a port: 165 per sample against ln 2). Summed by the loss, or by the loop
    from the loss's terms (reduction "none")."""
    torch.manual_seed(0)
    (xt, _), (xv, _) = helpers.digits(pixels=True)
    train, valid = torch.tensor(xt / 255), torch.tensor(xv / 255)

    class VAE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.mean, self.log_var = torch.nn.Linear(64, 64), torch.nn.Linear(64, 4), \
                torch.nn.Linear(64, 4)
            self.decoder = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))

        def forward(self, x):
            h = torch.relu(self.encoder(x))
            mu, log_var = self.mean(h), self.log_var(h)
            z = mu + torch.randn_like(mu) * torch.exp(0.5 * log_var)
            return torch.sigmoid(self.decoder(z)), mu, log_var

    def elbo_terms(x):
        out, mu, log_var = model(x)
        kl = -0.5 * torch.sum(1 + log_var - mu.pow(2) - log_var.exp())
        return torch.nn.functional.binary_cross_entropy(out, x, reduction=reduction).sum(), kl

    model = VAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    config = {"rules": ["overfit", "first_evaluation"], "sampling": {"every": 10}}
    with TripwireProbe(model, optimizer, config, out_dir=tmp_path / "run") as probe:
        for epoch in range(30):
            for batch in train.split(32):
                beta = min(1.0, probe.global_step / 600)
                reconstruction, kl = elbo_terms(batch)
                loss = (reconstruction + beta * kl) / len(batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                probe.step(loss)
            with torch.no_grad():
                probe.log_eval({"val_loss": float(sum(elbo_terms(valid))) / len(valid)})
    run = tripwire.open_run(probe.run_url)
    losses = run.tensor("losses/train").series()[1]
    assert losses[-20:].mean() < 0.6 * losses[0]
    assert [v.message for v in run.verdicts() if v.fired] == []


def test_weights_an_lbfgs_fit_stops_changing_once_converged_are_told_at_info(tmp_path):
    """torch's L-BFGS ends a step without an update once its tolerance is met: a full-batch logistic regression
    (the temperature-scaling idiom, optimizer.step(closure)) converges in a few outer steps and its weights stay
    bit-identical from there. unchanged_tensor called that an error ('did not change over their last 3 samples')
    under the default config; the same weights left unchanged from the start stay an error."""
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    x = torch.tensor((x - x.mean(0)) / x.std(0), dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.float32)
    config = {"rules": ["unchanged_tensor"], "sampling": {"every": 10}, "collections": {"weights": {}}}

    def fit(name, lr):
        torch.manual_seed(0)
        model = torch.nn.Linear(30, 1)
        optimizer = torch.optim.LBFGS(model.parameters(), lr=lr, max_iter=20, line_search_fn="strong_wolfe"
                                      if lr else None)

        def closure():
            optimizer.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(1), y)
            loss.backward()
            return loss

        with TripwireProbe(model, optimizer, config, out_dir=tmp_path / name) as probe:
            for _ in range(40):
                probe.step(optimizer.step(closure))
        accuracy = float(((model(x).squeeze(1) > 0).float() == y).float().mean())
        return accuracy, [v for v in tripwire.open_run(probe.run_url).verdicts() if v.fired]

    accuracy, verdicts = fit("converged", 1.0)
    assert accuracy > 0.97
    assert [(v.severity, v.finding) for v in verdicts] == [("info", "converged")]
    assert "LBFGS" in verdicts[0].message and "weights/weight" in verdicts[0].message
    accuracy, verdicts = fit("still", 0.0)
    assert accuracy < 0.9 and [v.severity for v in verdicts] == ["error"]


def test_several_validation_loaders_are_judged_by_the_first(tmp_path):
    """With several validation loaders Lightning logs val_loss as val_loss/dataloader_idx_<k>: the rules that read
    metrics/val_loss found none and said nothing at all (a port of a LightningModule validating on a clean and a
    noisy set). The first loader's is the validation set they judge."""
    train, valid = shuffled_loaders()
    callback = TripwireCallback({"rules": ["overfit"], "sampling": {"every": 10}}, out_dir=tmp_path / "run")
    module = helpers.mlp_module(hidden=(128,), optimizer="adam", lr=3e-3)
    helpers.fit(callback, module, max_epochs=12, loaders=(train, [valid, valid]))
    (verdict,) = [v for v in tripwire.open_run(callback.run_url).verdicts() if v.fired]
    assert verdict.finding == "chance" and verdict.message.startswith("metrics/val_loss/dataloader_idx_0 ")


def test_a_term_of_the_validation_loss_is_not_the_validation_loss():
    """Only the first loader's series stands in for metrics/val_loss: one logged under it as a term of the loss
    (val_loss/kl of a VAE, which rises as the model learns to use its latent space) is not judged as the loss."""
    from tripwire.core.rules.overfit import logged_as

    history = History()
    history.add(0, "eval", 10, {"metrics/val_loss/kl": {"value": 1.0}, "metrics/val_loss/recon": {"value": 2.0}})
    assert logged_as(history, "metrics/val_loss", "eval") is None
    history.add(0, "eval", 20, {"metrics/val_loss/dataloader_idx_0": {"value": 1.0},
                                "metrics/val_loss/dataloader_idx_1": {"value": 2.0}})
    assert logged_as(history, "metrics/val_loss", "eval") == "metrics/val_loss/dataloader_idx_0"
