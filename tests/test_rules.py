"""Every built-in rule for neural networks on real Lightning training: fires on the fault, quiet when healthy.
Plus custom rules, the raise and call actions, the generated rule docs."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import helpers
import tripwire
from tripwire.plugins.lightning import TripwireCallback


def verdicts(rule, module, params=None, every=5, **fit_kwargs):
    """Train with one rule; its verdicts (all statuses) as stored in the run."""
    config = {"rules": [{"rule": rule, "params": params or {}}], "sampling": {"every": every}}
    callback = TripwireCallback(config, out_dir=fit_kwargs.pop("out_dir"))
    helpers.fit(callback, module, **fit_kwargs)
    return tripwire.open_run(callback.run_url).verdicts()


def init_weights(std=None, bias=None, layer=None, constant=None):
    def init(net):
        linears = [m for m in net if isinstance(m, torch.nn.Linear)]
        for m in linears if layer is None else [net[layer]]:
            if std is not None:
                torch.nn.init.normal_(m.weight, std=std)
            if constant is not None:
                torch.nn.init.constant_(m.weight, constant)
            if bias is not None:
                torch.nn.init.constant_(m.bias, bias)
    return init


FAULTS = {
    # rule: (faulty module and fit kwargs, healthy module and fit kwargs)
    "exploding_gradient": (lambda: dict(module=helpers.mlp_module(hidden=(64,) * 5, init=init_weights(std=0.5))),
                           lambda: dict(module=helpers.mlp_module(hidden=(64,) * 5))),
    "saturated_activation": (lambda: dict(module=helpers.mlp_module(hidden=(64, 64), activation="tanh",
                                                                    init=init_weights(bias=30.0, layer=0))),
                             lambda: dict(module=helpers.mlp_module(hidden=(64, 64), activation="tanh"))),
    "weight_update_ratio": (lambda: dict(module=helpers.mlp_module(lr=1e-10)),
                            lambda: dict(module=helpers.mlp_module())),
    "all_zero": (lambda: dict(module=helpers.mlp_module(init=init_weights(constant=0.0))),
                 lambda: dict(module=helpers.mlp_module())),
    "unchanged_tensor": (lambda: dict(module=helpers.mlp_module(lr=0.0)),
                         lambda: dict(module=helpers.mlp_module())),
    "tensor_variance": (lambda: dict(module=helpers.mlp_module(init=init_weights(std=5.0))),
                        lambda: dict(module=helpers.mlp_module())),
    "input_not_normalized": (lambda: dict(module=helpers.mlp_module(), loaders=helpers.torch_loaders(scale=255.0)),
                             lambda: dict(module=helpers.mlp_module())),
    # every step sampled: each window between two evaluations holds five training losses (one is no mean)
    "oscillating_loss": (lambda: dict(module=helpers.mlp_module(lr=1.5), max_epochs=3, val_check_interval=5, every=1),
                         lambda: dict(module=helpers.mlp_module(lr=0.1), max_epochs=3, val_check_interval=5, every=1)),
}


@pytest.mark.parametrize("faulty", [True, False], ids=["fault", "healthy"])
@pytest.mark.parametrize("rule", list(FAULTS))
def test_rule_fires_on_fault_only(tmp_path, rule, faulty):
    setup = FAULTS[rule][0 if faulty else 1]()
    found = verdicts(rule, out_dir=tmp_path / "run", **{"max_epochs": 1, **setup})
    if not faulty:
        assert found == [], [v.message for v in found]
        return
    # one verdict per finding (a tensor, a side of a threshold), each at warning or error (raw inputs: info, a risk
    # that the diagnosis names as the cause of the warnings it brings), none repeated
    assert found and {v.status for v in found} == {"fired"}, found
    assert all(v.counts for v in found) if rule != "input_not_normalized" else \
        {v.severity for v in found} == {"info"}, found
    assert len({(v.finding, v.severity) for v in found}) == len(found)
    assert found[0].hint == tripwire.load_config({"rules": [rule]}).rules[0].create().hint


@pytest.mark.parametrize("faulty", [True, False], ids=["large_last_layer", "healthy"])
def test_exploding_gradient_through_the_layer_ratio(tmp_path, faulty):
    """Last-layer weights 10x too large under a small learning rate: the first layer's gradient stays >100x the
    last's, every norm below max_norm; judged at 3 samples in a row (at a learning rate of 0.1 the ratio is 122 at
    step 0 and 19 by step 5: the steps mend it, nothing to warn of)."""
    init = init_weights(std=10.0, layer=2) if faulty else None
    found = verdicts("exploding_gradient", helpers.mlp_module(init=init, lr=0.005), out_dir=tmp_path / "run",
                     max_epochs=1)
    if not faulty:
        assert found == []
        return
    (v,) = found
    assert v.status == "fired" and (v.onset, v.step) == (0, 10) and v.severity == "warning"
    assert v.evidence["first"] == "net.0" and v.evidence["last"] == "net.2"  # layers, from the model's structure
    assert v.evidence["ratio"] > 70 and "max_norm" not in v.evidence
    assert f"{v.evidence['ratio']:.0f}x the last layer's" in v.message and "above 70x at 3 samples" in v.message


@pytest.mark.parametrize("faulty", [True, False], ids=["tiny_train_set", "healthy"])
def test_overtraining(tmp_path, faulty):
    """Fires when a loss stops beating its best so far, with a message that agrees with its numbers; the healthy
    run is evaluated more often than the patience, so the rule could fire on it."""
    if faulty:  # 40 training samples: the validation loss turns up after a few epochs
        setup = dict(module=helpers.mlp_module(hidden=(256,), optimizer="adam", lr=0.01), max_epochs=30,
                     loaders=helpers.torch_loaders(n_train=40, batch_size=8))
    else:  # still learning: 24 evaluations, against patience_train 5 and patience_validation 10
        setup = dict(module=helpers.mlp_module(), max_epochs=3, val_check_interval=5)
    run_dir = tmp_path / "run"
    found = verdicts("overtraining", every=1, out_dir=run_dir, **setup)
    evaluations = tripwire.open_run(str(run_dir)).steps(mode="eval")
    if not faulty:
        assert len(evaluations) > 10 and found == []
        return
    (v,) = found
    e = v.evidence
    assert v.status == "fired" and v.mode == "eval" and e["loss"] == "validation"
    assert e["evaluations_since"] >= e["patience"] == 10 and e["best_step"] in evaluations
    assert e["best_step"] < v.step and e["lowest_since"] >= e["best"] * 0.99  # no improvement beyond delta since
    assert f"{e['best']:.4g} at step {e['best_step']}" in v.message and f"lowest since: {e['lowest_since']:.4g}" in \
        v.message


def test_overtraining_counts_improvements_relative_to_the_best_so_far():
    from tripwire.core.rules.progress import _best_so_far

    assert _best_so_far(np.array([1.0, 0.5, 0.1, 0.01, 0.001, 0.0001]), 0.01) == (5, 0)  # tiny but still 10x better
    assert _best_so_far(np.array([1.0, 0.5, 0.499, 0.498, 0.6]), 0.01) == (1, 3)  # < 1% better: no new best
    assert _best_so_far(np.array([]), 0.01) is None


@pytest.mark.parametrize("faulty", [True, False], ids=["sigmoid_bias_30", "healthy"])
def test_saturated_sigmoid(tmp_path, faulty):
    init = init_weights(bias=30.0, layer=0) if faulty else None
    module = helpers.mlp_module(hidden=(64, 64), activation="sigmoid", init=init)
    found = verdicts("saturated_activation", module, out_dir=tmp_path / "run", max_epochs=1)
    if not faulty:
        assert found == []
        return
    (v,) = found  # judged over two samples of 32: at the second sample, step 5
    assert v.status == "fired" and v.step == 5 and v.evidence["layer"] == "activations/net.1"
    assert "activations/net.1 are saturated at 2 samples in a row" in v.message


@pytest.mark.parametrize("faulty", [True, False], ids=["lr50", "healthy"])
def test_weight_update_ratio_too_large(tmp_path, faulty):
    """lr 50: the first SGD step changes the weights by more than 10x their norm."""
    found = verdicts("weight_update_ratio", helpers.mlp_module(lr=50.0 if faulty else 0.1), out_dir=tmp_path / "run",
                     max_epochs=1)
    if not faulty:
        assert found == []
        return
    assert found and all("too large" in v.message and v.finding.endswith(":large") for v in found)
    first = found[0]
    assert first.status == "fired" and first.step == 5  # the ratio held at two samples in a row: steps 0 and 5
    assert first.evidence["tensor"] == "updates/net.0.weight" and all(r > 10 for r in first.evidence["ratios"])


@pytest.mark.parametrize("faulty", [True, False], ids=["class_3_never_predicted", "healthy"])
def test_class_imbalance_misprediction(tmp_path, faulty):
    """Balanced classes, but the output unit of class 3 starts at a bias of -100: the model never predicts 3."""

    def silence_class_3(net):
        torch.nn.init.constant_(net[-1].bias[3:4], -100.0)

    module = helpers.mlp_module(init=silence_class_3 if faulty else None)
    found = verdicts("class_imbalance", module, every=2, out_dir=tmp_path / "run", max_epochs=3,
                     loaders=helpers.torch_loaders(batch_size=64))
    if not faulty:
        assert found == []
        return
    (v,) = found
    # judged once the model has learned, and only after the class stood out over 2 pools of 500 fresh labels
    assert v.status == "fired" and v.severity == "warning" and 32 <= v.step <= 64
    assert v.evidence["mispredicted"]["3"] == 1.0 and v.evidence["overall_error"] < 0.25
    assert "of class 3 are predicted as another class" in v.message


@pytest.mark.parametrize("faulty", [True, False], ids=["class_3_ignored", "healthy"])
def test_a_token_classifier_s_class_must_be_missed_over_a_thousand_sequences(tmp_path, faulty):
    """Labels per token ([n, T]: 8 sequences of 8 digits a step, each digit its own token). The tokens of one
    sequence are one draw of the data: a class stands out over `patience` x `samples` fresh sequences, 125 steps of
    8, not 1000 tokens (16 steps, where a healthy seq2seq model that learns one class after the rest was told).
    A class the loss never sees (mapped to the ignored index) is still told; a healthy tagger is silent."""
    from tripwire.plugins.torch import TripwireProbe

    torch.manual_seed(0)
    (x, y), _ = helpers.digits()
    x, y = torch.tensor(x[:1344]).reshape(-1, 8, 64), torch.tensor(y[:1344], dtype=torch.long).reshape(-1, 8)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    config = {"sampling": {"every": 1}, "rules": ["class_imbalance", "confusion"]}
    with TripwireProbe(net, optimizer, config, out_dir=tmp_path / "run") as probe:
        for step in range(300):
            xb, yb = x[8 * step % 168:][:8], y[8 * step % 168:][:8]
            logits = net(xb)
            target = yb.masked_fill(yb == 3, -100) if faulty else yb  # class 3 mapped to the ignored index
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 10), target.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            probe.step(loss, labels=yb, predictions=logits)
    run = tripwire.open_run(probe.run_url)
    accuracy = float((net(x).argmax(-1) == y).float().mean())
    told = [v for v in run.verdicts() if v.counts]
    if not faulty:
        assert accuracy > 0.9 and told == []
        return
    assert 0.8 < accuracy < 0.91  # everything but the class never learned
    assert {v.finding for v in told} == {"missed:3"} and all(v.step >= 124 for v in told)


@pytest.mark.parametrize("faulty", [True, False], ids=["1:50 labels", "healthy"])
def test_class_imbalance(tmp_path, faulty):
    """Labels from the batch, predictions from the LightningModule's forward output."""
    if faulty:
        setup = dict(module=helpers.mlp_module(classes=2), loaders=helpers.torch_loaders(batch_size=64, minority=50))
    else:
        setup = dict(module=helpers.mlp_module(), loaders=helpers.torch_loaders(batch_size=64))
    found = verdicts("class_imbalance", every=2, out_dir=tmp_path / "run", max_epochs=4, **setup)
    assert [(v.status, v.severity) for v in found] == ([("fired", "info")] if faulty else [])  # a property of the data
    if faulty:
        counts = found[0].evidence["counts"]
        assert "class 0 has" in found[0].message and counts["0"] > 10 * counts["1"]


@pytest.mark.parametrize("fault", ["constant", "too_large", "too_small", "healthy", "fixed_scale"])
def test_poor_weight_initialization(tmp_path, fault):
    """fixed_scale: normal(0, 0.02), BERT's initialiser, on a 32-wide layer (25x below Glorot there) trains."""
    init = {"constant": init_weights(constant=0.05, layer=0), "too_large": init_weights(std=1.0, layer=2),
            "too_small": init_weights(std=1e-4, layer=2), "healthy": None,
            "fixed_scale": init_weights(std=0.02, layer=2)}[fault]
    found = verdicts("poor_weight_initialization", helpers.mlp_module(hidden=(32, 32), init=init), every=100,
                     out_dir=tmp_path / "run", max_epochs=1)
    if fault in ("healthy", "fixed_scale"):
        assert found == []
        return
    (v,) = found
    assert v.step == 0 and v.evidence["tensor"] == ("weights/net.0.weight" if fault == "constant" else
                                                    "weights/net.2.weight")
    if fault == "constant":  # units that never train apart: a fault whatever follows
        assert "all weights of weights/net.0.weight are equal" in v.message and v.severity == "warning"
    else:  # std 1 on a 32-wide layer: var 1 against He's 2/32; std 1e-4: var 1e-8 against 1/96. A risk that many
        # models train through: info, the cause of the warnings where it does harm
        side = "large" if fault == "too_large" else "small"
        assert f"too {side} for its layer" in v.message and "fan-in 32" in v.message and v.severity == "info"


@pytest.mark.parametrize("inputs", [2, 64])
def test_tensor_variance_lets_a_layer_of_a_few_inputs_have_large_weights(tmp_path, inputs):
    """Weights of std 4 (variance 16, above 10): a layer that sums two inputs needs weights that large to saturate
    its units (100x He's 2/2 is its bound); one that sums 64 does not (10 is)."""
    def init(net):
        torch.nn.init.normal_(net[2].weight, std=4.0)

    found = verdicts("tensor_variance", helpers.mlp_module(hidden=(inputs, 16), init=init), every=10,
                     out_dir=tmp_path / "run", max_epochs=1)
    assert [v.finding for v in found if v.fired] == ([] if inputs == 2 else ["weights/net.2.weight:above"])


def test_poor_weight_initialization_judges_each_kernel_by_its_own_layer(tmp_path):
    """Layers of very different widths, each at its framework's default initialisation, and a kernel followed by
    BatchNorm initialised 1000x too small (its scale does not matter): nothing to report. Only the weights' std and
    variance in the first steps are captured for it."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 10))
    torch.nn.init.normal_(net[4].weight, std=1e-4)
    callback = TripwireCallback({"rules": ["poor_weight_initialization"]}, out_dir=tmp_path / "run")
    helpers.fit(callback, helpers.classifier(net), max_epochs=3)
    run = tripwire.open_run(callback.run_url)
    assert run.verdicts() == []
    assert run.model.parameters["net.4.weight"].followed_by == "norm"
    # read only in its first 10 steps, so captured only there (nothing at step 100, the configured schedule)
    assert run.tensor("weights/net.0.weight").steps() == [*range(10)]
    assert run.tensor("weights/net.0.weight").reductions() == ["std", "var"]


def test_healthy_cnn_and_mlp_fire_nothing_with_the_default_rules(tmp_path):
    # three epochs for the CNN: by the fifth it really overfits the digits (training loss 0.01, validation loss
    # 20 % above its best for three evaluations), which overfit rightly reports
    for name, module, epochs in (("cnn", helpers.cnn_module(), 3), ("mlp", helpers.mlp_module(hidden=(64, 32)), 5)):
        callback = TripwireCallback(None, out_dir=tmp_path / name)
        helpers.fit(callback, module, max_epochs=epochs)
        run = tripwire.open_run(callback.run_url)
        assert [v for v in run.verdicts() if v.status != "no_data"] == [], name
        assert {"activations/net.2", "gradients/net.1.weight"} <= set(run.tensor_names()) if name == "cnn" else True


SCRIPT = Path(__file__).parent / "scripts" / "train_lightning.py"


def train_under_stall_rule(tmp_path, where, *script_args):
    """Train in a subprocess (scripts/train_lightning.py) with stalled_training at a 2 s threshold, judged in
    process or by `tripwire watch`; the run and the path of the script's result file."""
    config = {"rules": [{"rule": "stalled_training", "params": {"threshold_s": 2.0}}],
              "collections": {"losses": {}}, "sampling": {"every": 1}, "writer": {"flush_every_s": 0.2},
              "evaluation": {"where": where}}
    run_dir, result = tmp_path / "run", tmp_path / "result.json"
    trainer = subprocess.Popen([sys.executable, str(SCRIPT), str(run_dir), json.dumps(config), str(result),
                                *script_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watcher = None
    if where == "side_process":
        watcher = subprocess.Popen([sys.executable, "-m", "tripwire", "watch", str(run_dir)],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = trainer.communicate(timeout=120)
    assert trainer.returncode == 0, out
    if watcher:
        watch_out, _ = watcher.communicate(timeout=60)
        assert watcher.returncode in (0, 1), watch_out  # 1: the rule fired
    return tripwire.open_run(str(run_dir)), result


@pytest.mark.parametrize("where", ["in_process", "side_process"])
def test_stalled_training(tmp_path, where):
    run, _ = train_under_stall_rule(tmp_path, where, "--steps", "40", "--stall-at", "20", "--stall-s", "5")
    (verdict,) = [v for v in run.verdicts() if v.fired]
    assert verdict.rule == "stalled_training" and verdict.step == 20 and verdict.evidence["seconds"] > 2


@pytest.mark.parametrize("where", ["in_process", "side_process"])
def test_stalled_training_quiet_on_a_slow_steady_run(tmp_path, where):
    """12 steps of 0.25 s: 3 s in all, more than the 2 s threshold, but never 2 s without a step."""
    run, result = train_under_stall_rule(tmp_path, where, "--steps", "12", "--sleep", "0.25")
    times = sorted(json.loads(result.read_text())["times"].values())
    assert times[-1] - times[0] > 2.0 and max(b - a for a, b in zip(times, times[1:])) < 2.0
    assert run.info["status"] == "finished" and run.steps() == list(range(12))
    assert run.verdicts() == []


@pytest.mark.parametrize("evaluating", [True, False], ids=["long_evaluation", "stalled"])
def test_a_long_evaluation_between_training_steps_is_no_stalled_training(tmp_path, evaluating):
    """A plain loop that evaluates for 3 s (twelve eval-mode batches of 0.25 s) between training steps, under a 2 s
    threshold: evaluation batches are progress. The same 3 s spent without a batch of either kind is a stall."""
    import time

    from tripwire.plugins.torch import TripwireProbe

    class Slow(torch.nn.Module):  # an evaluation batch takes 0.25 s
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def forward(self, x):
            if not self.training:
                time.sleep(0.25)
            return self.net(x)

    torch.manual_seed(0)
    model = Slow()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"rules": [{"rule": "stalled_training", "params": {"threshold_s": 2.0}}], "collections": {"losses": {}},
              "writer": {"flush_every_s": 0.2}}
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    with TripwireProbe(model, optimizer, config, out_dir=tmp_path / "run") as probe:
        for step in range(10):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            probe.step(loss)
            if step == 4:
                model.eval()
                with torch.no_grad():
                    for _ in range(12):
                        model(x) if evaluating else time.sleep(0.25)
                model.train()
    fired = [v.rule for v in tripwire.open_run(probe.run_url).verdicts() if v.fired]
    assert fired == ([] if evaluating else ["stalled_training"])


def test_a_long_validation_in_lightning_is_no_stalled_training(tmp_path):
    """Lightning's validation loop after the epoch, 4.2 s of batches of 0.35 s, over a 2 s threshold. One epoch: the
    pause between two epochs (the loaders' iterators) is no progress either, and not what this test is about."""
    import time

    module = helpers.mlp_module()
    steps = module.validation_step

    def slow_validation_step(batch, batch_idx):
        time.sleep(0.35)
        return steps(batch, batch_idx)

    module.validation_step = slow_validation_step
    config = {"rules": [{"rule": "stalled_training", "params": {"threshold_s": 2.0}}], "collections": {"losses": {}},
              "writer": {"flush_every_s": 0.2}}
    callback = TripwireCallback(config, out_dir=tmp_path / "run")
    loaders = helpers.torch_loaders()
    small_val = torch.utils.data.DataLoader(loaders[1].dataset, batch_size=40)  # 12 batches: 4.2 s
    helpers.fit(callback, module, max_epochs=1, loaders=(loaders[0], small_val))
    assert [v.rule for v in tripwire.open_run(callback.run_url).verdicts() if v.fired] == []


def test_unchanged_tensor_names_the_layer_left_out_of_the_optimizer(tmp_path):
    """A blind spot: net.0 gets gradients but is not in the optimizer, so only it stays put while the rest trains."""
    module = helpers.mlp_module(hidden=(32, 32))
    trained = [p for name, p in module.named_parameters() if not name.startswith("net.0.")]
    module.configure_optimizers = lambda: torch.optim.SGD(trained, lr=0.1)
    found = verdicts("unchanged_tensor", module, out_dir=tmp_path / "run", max_epochs=1)
    (v,) = found
    assert v.status == "fired" and v.step == 10 and v.severity == "warning"  # the third sample (every 5)
    assert v.evidence["unchanged"] == ["weights/net.0.weight"]
    assert v.evidence["still_training"] == ["weights/net.2.weight", "weights/net.4.weight"]
    assert v.message.startswith("1 of 3 tensors did not change") and "net.0" in v.message and \
        "net.2" not in v.message
    assert not tripwire.open_run(tmp_path / "run").model.parameters["net.0.weight"].trainable  # in no optimizer
    # offline, over the stored run, the rule reads its look back from the series and comes to the same verdict
    from tripwire.core.evaluate import check

    (offline,) = [f for f in check(tripwire.open_run(tmp_path / "run")) if f.fired]
    assert (offline.step, offline.evidence["unchanged"]) == (v.step, v.evidence["unchanged"])


def test_report_action_writes_the_verdict_into_the_run(tmp_path):
    config = {"rules": [{"rule": "dead_relu", "actions": ["report"]}], "sampling": {"every": 10}}
    callback = TripwireCallback(config, out_dir=tmp_path / "run")
    helpers.fit(callback, helpers.mlp_module(init=init_weights(bias=-20.0, layer=0)), max_epochs=1)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    (stored,) = report["verdicts"]  # every unit dead at three samples in a row: steps 0, 10 and 20
    assert report["fired"] == 1 and report["rules_fired"] == ["dead_relu"] and report["first_fired_step"] == 20
    assert stored["rule"] == "dead_relu" and stored["step"] == 20 and stored["status"] == "fired"
    assert stored["severity"] == "error"
    assert "activations/net.1" in stored["message"] and "Every bias of Linear net.0 is negative" in stored["hint"]
    assert stored == tripwire.open_run(callback.run_url).verdicts()[0].to_dict()


def test_no_report_without_the_report_action(tmp_path):
    config = {"rules": [{"rule": "dead_relu", "actions": ["log"]}], "sampling": {"every": 10}}
    callback = TripwireCallback(config, out_dir=tmp_path / "run")
    helpers.fit(callback, helpers.mlp_module(init=init_weights(bias=-20.0, layer=0)), max_epochs=1)
    assert [v.rule for v in callback.verdicts] == ["dead_relu"] and not (tmp_path / "run" / "report.json").exists()


def test_log_action_logs_the_verdict_and_its_hint(tmp_path, caplog):
    config = {"rules": [{"rule": "dead_relu", "actions": ["log"]}], "sampling": {"every": 10}}
    callback = TripwireCallback(config, out_dir=tmp_path / "run")
    with caplog.at_level("WARNING", logger="tripwire"):
        helpers.fit(callback, helpers.mlp_module(init=init_weights(bias=-20.0, layer=0)), max_epochs=1)
    (verdict,) = callback.verdicts
    (record,) = [r for r in caplog.records if r.name == "tripwire" and "[dead_relu]" in r.getMessage()]
    text = record.getMessage()
    assert record.levelname == "ERROR" and "[dead_relu] error at step 20" in text and verdict.message in text
    assert "hint: " + verdict.hint in text


def test_custom_rule_from_the_users_module(tmp_path):
    config = {"rules": [{"rule": "custom_rules:LossAbove", "params": {"threshold": 0.5}, "actions": ["log"]}],
              "sampling": {"every": 5}}
    callback = TripwireCallback(config, out_dir=tmp_path / "run")
    helpers.fit(callback, max_epochs=1)
    (verdict,) = tripwire.open_run(callback.run_url).verdicts()
    assert verdict.rule == "custom_rules:LossAbove" and verdict.step == 0 and "loss" in verdict.message
    with pytest.raises(tripwire.ConfigError, match=r"params.treshold: unknown key.*Did you mean 'threshold'"):
        TripwireCallback({"rules": [{"rule": "custom_rules:LossAbove", "params": {"treshold": 1}}]})
    with pytest.raises(tripwire.ConfigError, match="cannot import module 'no_such_module'"):
        TripwireCallback({"rules": ["no_such_module:Rule"]})
    with pytest.raises(tripwire.ConfigError, match="is not a subclass of tripwire.Rule"):
        TripwireCallback({"rules": ["custom_rules:record"]})


def test_a_rule_that_raises_is_reported_once_disabled_and_training_goes_on(tmp_path, monkeypatch):
    import custom_rules

    monkeypatch.setattr(custom_rules.Broken, "evaluations", 0)
    callback = TripwireCallback({"rules": ["custom_rules:Broken"], "sampling": {"every": 5}}, out_dir=tmp_path / "r")
    trainer = helpers.fit(callback, max_epochs=1)
    assert trainer.global_step == 43
    assert custom_rules.Broken.evaluations == 2  # not evaluated again at the 7 later sampled steps
    (verdict,) = tripwire.open_run(callback.run_url).verdicts()
    assert verdict.status == "error" and verdict.step == 5 and "ZeroDivisionError: bug in a user rule" in \
        verdict.message and "custom_rules.py" in verdict.evidence["traceback"]


def test_raise_action_raises_rule_fired_out_of_fit(tmp_path):
    config = {"rules": [{"rule": "exploding_tensor", "actions": ["raise"]}], "sampling": {"every": 2}}
    callback = TripwireCallback(config, out_dir=tmp_path / "run")
    with pytest.raises(tripwire.RuleFired) as caught:
        helpers.fit(callback, helpers.mlp_module(lr=50.0), max_epochs=2)
    assert caught.value.verdict.rule == "exploding_tensor"
    run = tripwire.open_run(callback.run_url)
    assert run.info["status"] == "stopped" and run.verdicts()[0].step == caught.value.verdict.step


def test_call_action_hands_the_verdict_to_user_code(tmp_path, monkeypatch):
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("TRIPWIRE_TEST_CALLS", str(calls))
    config = {"rules": [{"rule": "dead_relu", "actions": [{"call": "custom_rules:record"}, "log"]}],
              "sampling": {"every": 10}}
    callback = TripwireCallback(config, out_dir=tmp_path / "run")
    helpers.fit(callback, helpers.mlp_module(init=init_weights(bias=-20.0, layer=0)), max_epochs=1)
    (line,) = calls.read_text().splitlines()
    assert json.loads(line)["rule"] == "dead_relu" and json.loads(line)["step"] == 20


def test_rule_docs_are_generated_from_the_rules():
    from tripwire.core.rulesdoc import markdown
    from tripwire.core.rules.registry import rule_names

    root = Path(__file__).parents[1]
    docs = (root / "docs" / "rules.md").read_text()
    zoo = json.loads((root / "benchmarks" / "results" / "zoo.json").read_text())  # `make zoo` writes it
    assert docs == markdown(zoo), ("docs/rules.md is stale: python -m tripwire.core.rulesdoc --zoo "
                                   "benchmarks/results/zoo.json > docs/rules.md")
    assert "**On the zoo.** False alarms: 0 of" in docs
    for name in rule_names():
        assert f"## {name}\n" in docs
    out = subprocess.run([sys.executable, "-m", "tripwire", "rules", "vanishing_gradient"], capture_output=True,
                         text=True, timeout=60)
    assert "threshold = 1e-07" in out.stdout and "hint: Gradients vanish" in out.stdout
    assert "ReLU" in out.stdout and "source: smdebug" in out.stdout


def test_every_rule_documents_itself():
    from tripwire.core.rules.registry import builtin_rules

    for name, cls in builtin_rules().items():
        assert cls.__doc__ and cls.condition and cls.hint and cls.source, name


@pytest.mark.parametrize("factor, fires", [(lambda step: (100 - step) // 100, 1),  # integer division: 0 from step 1
                                           (lambda step: min(1, step // 20), 1),  # a warmup stuck at 0: at step 1
                                           (lambda step: min(1.0, step / 20), None),  # a warmup from 0
                                           (lambda step: 1 - step / 100, None)],  # the decay meant
                         ids=["integer_division", "warmup_integer_division", "warmup", "linear_decay"])
def test_a_learning_rate_of_0_after_the_start_is_an_error(tmp_path, factor, fires):
    """A LambdaLR factor written with integer division gives lr 0 from step 1 (a decay) or for its whole warmup:
    the run trains on, changing nothing. A warmup starts at 0 and rises; a decay reaches 0 at the end: neither is
    judged. `fires`: the step of the error."""
    from tripwire.plugins.torch import TripwireProbe

    torch.manual_seed(0)
    (x, y), _ = helpers.digits()
    x, y = torch.tensor(x), torch.tensor(y)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    with TripwireProbe(net, optimizer, {"rules": [{"rule": "learning_rate"}]}, out_dir=tmp_path / "run") as probe:
        for step in range(60):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x[32 * step % 1280:][:32]), y[32 * step % 1280:][:32])
            loss.backward()
            optimizer.step()
            schedule.step()
            probe.step(loss)
    found = [(v.finding, v.step, v.severity) for v in tripwire.open_run(probe.run_url).verdicts() if v.fired]
    assert found == ([("zero", fires, "error")] if fires is not None else [])


def test_a_short_last_batch_does_not_make_dead_relu_inapplicable(tmp_path):
    """1347 training digits in batches of 32 end each epoch on a batch of 3, too few to tell a dead unit: that step
    is not judged, and the run, judged at every full batch, is not said to be out of the rule's reach."""
    config = {"rules": ["dead_relu", "exploding_tensor"], "sampling": {"every": 1}}  # both take the activations
    callback = TripwireCallback(config, out_dir=tmp_path / "run")
    helpers.fit(callback, helpers.mlp_module(), max_epochs=1)
    run = tripwire.open_run(callback.run_url)
    assert run.tensor("activations/net.1").tail("dead_fraction")[0] == [41]  # the 43rd step (42) has 3 samples
    assert [v for v in run.verdicts() if v.rule == "dead_relu"] == []


def test_batches_all_too_small_make_dead_relu_inapplicable(tmp_path):
    found = verdicts("dead_relu", helpers.mlp_module(), every=1, out_dir=tmp_path / "run", max_epochs=1,
                     loaders=helpers.torch_loaders(batch_size=8))
    assert [v.status for v in found] == ["no_data"]  # nothing it could judge (no activation is reduced for it)


@pytest.mark.parametrize("batch, told_by", [(32, 400), (4, 8 * 400), (1, None)])
def test_a_loss_that_never_went_down_waits_for_the_samples_a_small_batch_takes(tmp_path, batch, told_by):
    """A loss on its first plateau: at batches of 32 "nothing learns" once min_steps (300) are past; a batch of 4
    waits 8 times as long, and a batch of 1 (whose healthy runs can sit there for thousands of steps: a StackOverflow
    program that learns by its 25,000th) is not judged within these 4,000 steps."""
    from tripwire.core.firststep import FirstStep, loss_use
    from tripwire.core.recorder import Recorder

    recorder = Recorder({"collections": {"losses": {}}, "rules": ["loss_not_decreasing"]},
                        run_url=str(tmp_path / "run"), framework="test")
    recorder.start()
    labels = np.eye(8)[np.arange(batch) % 8]  # the first batch's targets: `batch` rows
    recorder.first_step(FirstStep(0, (loss_use("binary_cross_entropy", "sigmoid", labels=labels),)))
    noise = np.random.default_rng(0).normal(0, 0.01, 400)
    for step, jitter in zip(range(0, 4000, 10), noise):
        recorder.record(step, "train", {"losses/train": {"value": 0.693 + jitter}})
    recorder.finish()
    never = [v for v in tripwire.open_run(str(tmp_path / "run")).verdicts() if v.finding == "never"]
    if told_by is None:
        assert never == []
    else:
        assert never and never[0].severity == "error" and told_by * 3 // 4 <= never[0].step <= told_by


def test_a_validation_loss_that_rises_where_the_training_loss_is_not_known_is_no_overfit():
    """keras.io's timeseries classifier (Conv1D, BatchNorm, 25 steps an epoch, default config) was told overfitting
    at step 850: its validation loss rose for three epochs (BatchNorm's moving statistics; the training set read in
    inference mode rose as much) and came back to a new best. The training loss between those evaluations was not
    stored (the default samples every 100 steps): the rule said 'while the training loss did not' without knowing.
    Where it is known and falls, the same rise is told."""
    from tripwire.core.history import History
    from tripwire.core.rules.overfit import Overfit

    def verdicts(train_steps):
        history, rule, told = History(64, 64), Overfit(), []
        for step in train_steps:
            history.add(0, "train", step, {"losses/train": {"value": 0.2 * math.exp((700 - step) / 50)}})
        for step, value in zip(range(750, 900, 25), (0.40, 0.35, 0.93, 2.00, 2.50, 2.60)):
            history.add(0, "eval", step, {"metrics/val_loss": {"value": value}})
            verdict = rule.check(history.at(step, "eval", 0), step)
            told += [verdict.step] if verdict is not None else []
        return told

    assert verdicts([*range(10), 700, 800]) == []  # none stored between 800 and the evaluations after it
    assert verdicts(range(700, 900, 5)) == [850, 875]


def test_a_validation_loss_that_jumps_while_the_training_loss_stands_still_is_no_overfit():
    """keras.io's timeseries classifier run for 100 epochs (default config) was told overfitting at epoch 77: its
    validation loss went 0.25 -> 1.06 -> 2.1 while the training loss held at 0.134, and came back to 0.236 once
    ReduceLROnPlateau halved the learning rate. In inference mode the model read its own training samples as badly
    (0.66 accurate), and the validation set at 0.88 with batch statistics: BatchNorm's moving statistics out of step
    with the weights, not a fit of the training set. A rise is told only where the training loss fell, since the
    rise began, by min_delta of where it was (its training loss kept as that evaluation was made: the training
    process holds the last few training losses only)."""
    from tripwire.core.history import History
    from tripwire.core.rules.overfit import Overfit

    def verdicts(train):
        history, rule, told = History(64, 64), Overfit(), []
        values = (0.69, 0.5, 0.3, 0.25, 0.26, 0.45, 0.59, 1.06, 1.8)
        for step, value in zip(range(90, 900, 90), values):
            for trained in range(step - 90, step + 1):  # more than the memory holds between a rise and its verdict
                history.add(0, "train", trained, {"losses/train": {"value": train(trained)}})
            history.add(0, "eval", step, {"metrics/val_loss": {"value": value}})
            verdict = rule.check(history.at(step, "eval", 0), step)
            told += [verdict.step] if verdict is not None else []
        return told

    # falling until the best (step 360), then still within 2% of where the rise began
    assert verdicts(lambda step: max(0.134, 0.6 - step / 750) - step * 1e-6) == []
    assert verdicts(lambda step: 0.6 * math.exp(-step / 300)) == [720, 810]


def test_a_validation_loss_coming_back_down_from_a_swing_is_no_overfit():
    """keras.io's imbalanced classification (a class-weighted loss, every rule on) was told overfitting at step
    192: after its best, 0.0040 at step 120, the validation loss swung to 0.023 and came back down, 0.020, 0.011,
    three evaluations above the best while falling. A streak that ends below where it began is coming back down;
    one that keeps rising is told."""
    from tripwire.core.history import History
    from tripwire.core.rules.overfit import Overfit

    def verdicts(values):
        history, rule, told = History(64, 64), Overfit(), []
        for step in range(0, 200, 4):
            history.add(0, "train", step, {"losses/train": {"value": 1e-3 / (1 + step)}})
        for step, value in zip(range(24, 24 * (len(values) + 1), 24), values):
            history.add(0, "eval", step, {"metrics/val_loss": {"value": value}})
            verdict = rule.check(history.at(step, "eval", 0), step)
            told += [verdict.step] if verdict is not None else []
        return told

    assert verdicts([0.0093, 0.0158, 0.0209, 0.0087, 0.0040, 0.0229, 0.0196, 0.0108]) == []
    assert verdicts([0.0093, 0.0158, 0.0209, 0.0087, 0.0040, 0.0129, 0.0196, 0.0208]) == [192]


def test_a_validation_loss_swinging_beside_single_sampled_training_losses_is_not_told_oscillating():
    """keras.io's imbalanced classification under the default config (a sample every 100 steps, an evaluation
    every 24) was told oscillating at step 408: the training loss 'between evaluations' was one sampled batch's
    (2.9e-5, 1.5e-6, 4.2e-7, then 9.8e-6 for a batch with a misread fraud case, class-weighted), which swung where
    the training settled. One batch is no mean; where windows hold several samples and they swing, it is told."""
    from tripwire.core.history import History
    from tripwire.core.rules.progress import OscillatingLoss

    val = [0.009, 0.016, 0.021, 0.009, 0.004, 0.023, 0.020, 0.011, 0.010, 0.009, 0.025, 0.011, 0.013, 0.008, 0.004,
           0.005, 0.009]  # swings at 72-96, 120-144, 240-264 and 336-408
    singles = {0: 2.9e-5, 100: 1.5e-6, 200: 4.2e-7, 300: 9.8e-6, 400: 3e-7}

    def verdicts(train: dict):
        history, rule, told = History(64, 64), OscillatingLoss(), []
        for step, value in train.items():
            history.add(0, "train", step, {"losses/train": {"value": value}})
        for step, value in zip(range(24, 24 * (len(val) + 1), 24), val):
            history.add(0, "eval", step, {"metrics/val_loss": {"value": value}})
            verdict = rule.check(history.at(step, "eval", 0), step)
            told += [verdict.step] if verdict is not None else []
        return told

    assert verdicts(singles) == []
    swinging = {24 * k + offset: (2.0 if k % 2 else 0.5) for k in range(17) for offset in (6, 18)}  # two a window
    assert verdicts(swinging)[:1] == [312]
