"""The Lightning plugin on real Lightning training: capture, rules firing and not, stop, resume, CLI."""

import csv
import subprocess
import sys

import numpy as np
import pytest
import torch

import helpers
import tripwire
from tripwire.core.evaluate import check
from tripwire.plugins.lightning import TripwireCallback


def fired(run_url):
    """Each rule's first verdict at warning or error (in step order): what a fault is caught by."""
    first = {}
    for v in tripwire.open_run(run_url).verdicts():
        if v.counts:
            first.setdefault(v.rule, v)
    return first


def first_nonfinite_step(run):
    steps = []
    for name in run.tensor_names():
        tensor = run.tensor(name)
        for reduction in tensor.reductions(mode="train") if name in run.tensor_names(mode="train") else []:
            s, v = tensor.series(reduction, mode="train")
            bad = s[~np.isfinite(v) | ((v > 0) if reduction == "nonfinite_count" else False)]
            steps += bad[:1].tolist()
    return min(steps)


def test_nan_stops_training_at_the_step_it_appears(tmp_path):
    """Sampled every 3 steps: the loss, on the host between samples, is judged at every step."""
    config = {"sampling": {"every": 3}, "rules": [{"rule": "exploding_tensor", "actions": ["log", "stop"]}],
              "collections": {"weights": {}, "gradients": {}}}
    cb = TripwireCallback(config, out_dir=tmp_path / "nan")
    trainer = helpers.fit(cb, helpers.mlp_module(lr=50.0), max_epochs=3)
    verdict = fired(cb.run_url)["exploding_tensor"]
    run = tripwire.open_run(cb.run_url)
    assert verdict.step == first_nonfinite_step(run)
    assert trainer.global_step == verdict.step + 1
    assert run.steps()[-1] == verdict.step and run.info["status"] == "stopped"
    assert cb.verdicts and cb.verdicts[0].step == verdict.step
    assert verdict.hint and "learning rate" in verdict.hint


def manual_optimisation(module, accumulate: int = 1):
    """`module` (a helpers.classifier) trained by manual optimisation, as a custom step is written: its
    training_step back-propagates, steps and clears itself (every `accumulate` batches, each loss divided by that
    number, as Lightning's docs accumulate), returns nothing, and notes the first step whose loss is not finite
    (`nan_at`)."""

    class Manual(type(module)):
        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            loss = torch.nn.functional.cross_entropy(self(batch[0]), batch[1])
            if not torch.isfinite(loss) and self.nan_at is None:
                self.nan_at = self.trainer.global_step
            self.manual_backward(loss / accumulate)
            if (batch_idx + 1) % accumulate == 0:
                optimizer.step()
                optimizer.zero_grad()

    module.__class__, module.automatic_optimization, module.nan_at = Manual, False, None
    return module


@pytest.mark.parametrize("lr", [50.0, 0.1])
def test_manual_optimisation_nan_stops_training_at_the_step_it_appears(tmp_path, lr):
    """Manual optimisation hands tripwire no closure and returns no loss: each manual_backward's loss is judged
    (on_before_backward), so a NaN between samples stops training at its step, as in automatic optimisation; the
    sampled steps record it as the step's loss."""
    config = {"sampling": {"every": 5}, "rules": [{"rule": "exploding_tensor", "actions": ["log", "stop"]}],
              "collections": {"weights": {}}}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    module = manual_optimisation(helpers.mlp_module(lr=lr))
    trainer = helpers.fit(cb, module, max_epochs=2)
    run = tripwire.open_run(cb.run_url)
    if lr == 0.1:
        assert module.nan_at is None and trainer.callback_metrics["val_loss"] < 0.6  # it learns (2.3 untrained)
        assert fired(cb.run_url) == {} and run.info["status"] == "finished"
        steps, losses = run.tensor("losses/train").series("value")
        assert steps.tolist() == list(range(0, trainer.global_step, 5)) and np.isfinite(losses).all()
        return
    verdict = fired(cb.run_url)["exploding_tensor"]
    assert module.nan_at % 5 != 0 and verdict.step == module.nan_at  # an unsampled step, told at that step
    assert trainer.global_step == verdict.step + 1 and run.info["status"] == "stopped"


def test_manual_accumulation_tells_no_step_loss_from_its_scaled_losses(tmp_path):
    """Accumulating by hand, the losses handed to manual_backward are divided by the batches a step spans: a mean of
    them would be a step's loss 4 times too small (and the first evaluation 4 times its start), so none is told."""
    cb = TripwireCallback({"sampling": {"every": 5}, "rules": ["exploding_tensor", "first_evaluation"]},
                          out_dir=tmp_path / "run")
    module = manual_optimisation(helpers.mlp_module(lr=0.4), accumulate=4)
    trainer = helpers.fit(cb, module, max_epochs=4)
    assert trainer.global_step == 4 * (43 // 4) and trainer.callback_metrics["val_loss"] < 0.6  # it learns
    run = tripwire.open_run(cb.run_url)
    assert "losses/train" not in run.tensor_names() and run.steps("train")[:3] == [0, 5, 10]
    assert fired(cb.run_url) == {}


def test_healthy_run_fires_nothing_with_the_default_config(tmp_path):
    cb = TripwireCallback(None, out_dir=tmp_path / "healthy")
    trainer = helpers.fit(cb, max_epochs=3)
    run = tripwire.open_run(cb.run_url)
    assert trainer.global_step == 3 * 43 and [v for v in run.verdicts() if v.counts] == []
    # every 100 steps; poor_weight_initialization adds the weights' spread in the first 10 steps
    assert run.info["status"] == "finished" and run.steps() == [*range(10), 100]
    weight = run.tensor("weights/net.0.weight")
    assert weight.steps() == [*range(10), 100] and run.tensor("gradients/net.0.weight").steps() == [0, 100]
    # steps 1-9 are sampled for poor_weight_initialization and 1-4 for learning_rate alone: they take those rules'
    # reductions (std; l2 of weights and updates), and the NaN count
    assert weight.series("std")[0].tolist() == [*range(10)] and weight.series("l2")[0].tolist() == [*range(5), 100]
    assert weight.series("nonfinite_count")[0].tolist() == [*range(10), 100]
    assert {"losses/train", "gradients/net.0.weight", "activations/net.1"} <= set(run.tensor_names())
    assert run.info["config"]["rules"][0]["rule"] == "exploding_tensor"
    kernel = run.model.parameters["net.0.weight"]  # the model's structure, recorded when training began
    assert (kernel.layer_type, kernel.role, kernel.shape, kernel.fan_in, kernel.trainable) == \
        ("dense", "kernel", (32, 64), 64, True)
    assert run.info["model"]["name"] == "Classifier"


@pytest.mark.parametrize("faulty", [True, False], ids=["deep_sigmoid", "relu"])
def test_vanishing_gradient(tmp_path, faulty):
    module = helpers.mlp_module(hidden=(32,) * 10, activation="sigmoid") if faulty else helpers.mlp_module()
    cb = TripwireCallback({"rules": ["vanishing_gradient"], "sampling": {"every": 10}}, out_dir=tmp_path / "run")
    helpers.fit(cb, module, max_epochs=1)
    assert ("vanishing_gradient" in fired(cb.run_url)) == faulty


def dead_first_layer(net):
    torch.nn.init.constant_(net[0].bias, -20.0)


@pytest.mark.parametrize("faulty", [True, False], ids=["negative_bias", "healthy"])
def test_dead_relu(tmp_path, faulty):
    module = helpers.mlp_module(hidden=(32, 32), init=dead_first_layer if faulty else None)
    cb = TripwireCallback({"rules": ["dead_relu"], "sampling": {"every": 10}}, out_dir=tmp_path / "run")
    helpers.fit(cb, module, max_epochs=1)
    verdicts = fired(cb.run_url)
    assert ("dead_relu" in verdicts) == faulty
    if faulty:
        verdict = verdicts["dead_relu"]  # every unit dead at three samples in a row (steps 0, 10, 20): an error
        assert verdict.step == 20 and verdict.severity == "error" and "activations/net.1" in verdict.message


@pytest.mark.parametrize("faulty", [True, False], ids=["lr0", "healthy"])
def test_loss_not_decreasing(tmp_path, faulty):
    # 43 steps: judged from step 20 on (min_steps), where the default waits 300 steps for a slow start
    cb = TripwireCallback({"rules": [{"rule": "loss_not_decreasing", "params": {"min_steps": 20}}],
                           "sampling": {"every": 2}}, out_dir=tmp_path / "run")
    helpers.fit(cb, helpers.mlp_module(lr=0.0 if faulty else 0.1), max_epochs=1)
    verdicts = fired(cb.run_url)
    assert ("loss_not_decreasing" in verdicts) == faulty
    if faulty:  # the first step with three windows of 5 samples: the first, the one before the newest, the newest
        verdict = verdicts["loss_not_decreasing"]
        assert verdict.step == 28 and verdict.severity == "error" and "has not gone down" in verdict.message


@pytest.mark.parametrize("faulty", [True, False], ids=["tiny_train_set", "healthy"])
def test_overfit(tmp_path, faulty):
    cb = TripwireCallback({"rules": ["overfit"], "sampling": {"every": 1}}, out_dir=tmp_path / "run")
    if faulty:  # 100 training samples, a wide model: the validation loss climbs 23% above its best
        module = helpers.mlp_module(hidden=(256, 256), optimizer="adam", lr=0.003)
        helpers.fit(cb, module, max_epochs=40, loaders=helpers.torch_loaders(n_train=100, batch_size=8))
    else:
        helpers.fit(cb, helpers.mlp_module(), max_epochs=1)
    verdicts = fired(cb.run_url)
    assert ("overfit" in verdicts) == faulty
    if not faulty:  # it was evaluated: the validation loss is there
        assert tripwire.open_run(cb.run_url).steps(mode="eval") == [43]


def test_rule_without_its_data_says_no_data(tmp_path):
    cb = TripwireCallback({"rules": ["overfit"]}, out_dir=tmp_path / "run")
    helpers.fit(cb, max_epochs=1, limit_val_batches=0)
    (verdict,) = tripwire.open_run(cb.run_url).verdicts()
    assert verdict.status == "no_data" and verdict.rule == "overfit" and "metrics" in verdict.message


def test_activation_hooks_exist_only_on_sampled_steps(tmp_path):
    import lightning.pytorch as pl

    seen = {}

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen[trainer.global_step] = sum(len(m._forward_hooks) for m in pl_module.modules())

    cb = TripwireCallback({"collections": {"activations": {}}, "sampling": {"every": 4}}, out_dir=tmp_path / "run")
    module = helpers.mlp_module(hidden=(16, 16))
    helpers.fit(None, module, max_steps=12, callbacks=[cb, Spy()])
    assert {s for s, n in seen.items() if n} == {0, 4, 8}
    # 5 leaf modules: Linear, ReLU, Linear, ReLU, Linear; at the first sampled step also one per Linear, which
    # notes the layer each ReLU takes (FirstStep.producers), and one per Linear and per ReLU module, which look
    # for ReLUs applied as functions (tripwire.plugins.torch.functional): there are none, so none after
    assert [n for s, n in sorted(seen.items()) if s % 4 == 0] == [5 + 3 + 5, 5, 5]
    assert sum(len(m._forward_hooks) for m in module.modules()) == 0
    run = tripwire.open_run(cb.run_url)
    assert run.tensor_names(collection="activations") == [f"activations/net.{i}" for i in range(5)]


@pytest.mark.parametrize("accumulate", [1, 3])
def test_between_samples_lightning_does_not_call_the_callback(tmp_path, accumulate):
    """Between two sampled steps Lightning calls none of the callback's hooks: the optimizers' step hook wakes
    it for the next sampled step. With gradient accumulation a global step spans several batches, and every
    sampled step is still captured, at the global step Lightning counts."""
    calls = []

    class Counted(TripwireCallback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            calls.append(trainer.global_step)
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    cb = Counted({"collections": {"losses": {}, "gradients": {}, "activations": {}}, "sampling": {"every": 5},
                  "rules": []}, out_dir=tmp_path / "run")
    trainer = helpers.fit(cb, max_steps=23, accumulate_grad_batches=accumulate)
    assert trainer.global_step == 23
    run = tripwire.open_run(cb.run_url)
    assert run.tensor("gradients/net.0.weight").steps() == [0, 5, 10, 15, 20]
    # each micro-batch's forward pass names its activations alike (not as later calls of the same modules), and
    # the first sampled step saw which layer each ReLU takes
    assert run.tensor_names("activations") == ["activations/net.0", "activations/net.1", "activations/net.2"]
    assert run.first_step.producers == {"net.1": "net.0"}
    # the loss of every step where a step is one batch; with accumulation, of the sampled steps (the mean of their
    # micro-batches: the loss a step returns is its last micro-batch's alone)
    assert run.steps() == [0, 5, 10, 15, 20]
    assert run.tensor("losses/train").steps() == (list(range(23)) if accumulate == 1 else run.steps())
    # called at each sampled step's batches and at the first batch after them, to see that it is not sampled
    assert sorted(set(calls)) == [0, 1, 5, 6, 10, 11, 15, 16, 20, 21]
    assert len(calls) == 5 * (accumulate + 1)


def test_the_loss_of_every_step_is_stored_and_the_rules_read_the_sampled_steps(tmp_path):
    """The loss each training step returns is stored at every step (read once per sampled step, so the steps
    between never wait for the device), equal to the loss Lightning hands its callbacks; the rules judge the
    sampled steps alone, as before."""
    import lightning.pytorch as pl

    returned = {}

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            returned[trainer.global_step - 1] = float(outputs["loss"])

    # a rule that says, at step 40, which steps of the loss it reads
    cb = TripwireCallback({"sampling": {"every": 10}, "collections": {"losses": {}},
                           "rules": [{"rule": "custom_rules:LossSteps", "params": {"at": 40}}]},
                          out_dir=tmp_path / "run")
    helpers.fit(None, max_steps=45, callbacks=[cb, Spy()])
    steps, values = tripwire.open_run(cb.run_url).tensor("losses/train").series()
    assert steps.tolist() == list(range(45)) and np.allclose(values, [returned[s] for s in range(45)], rtol=1e-6)
    assert [v.message for v in cb.verdicts] == ["steps 0 10 20 30 40"]
    # offline (and in the side process) the rules read the same steps: the sampled ones, the run's rows
    run = tripwire.open_run(cb.run_url)
    assert run.steps() == [0, 10, 20, 30, 40]
    checked = check(run, {"rules": [{"rule": "custom_rules:LossSteps", "params": {"at": 40}}]})
    assert [v.message for v in checked if v.fired] == ["steps 0 10 20 30 40"]


def test_pytorch_lightning_trainer_gets_a_callback_of_its_kind(tmp_path):
    import pytorch_lightning

    cb = TripwireCallback({"rules": [{"rule": "exploding_tensor", "actions": ["stop"]}], "sampling": {"every": 2}},
                          out_dir=tmp_path / "run")
    assert isinstance(cb, pytorch_lightning.Callback)
    import lightning.pytorch

    assert isinstance(cb, lightning.pytorch.Callback)
    trainer = helpers.fit(cb, helpers.mlp_module(lr=50.0, pl=pytorch_lightning), max_epochs=2, pl=pytorch_lightning)
    verdict = fired(cb.run_url)["exploding_tensor"]
    assert trainer.global_step == verdict.step + 1
    assert tripwire.open_run(cb.run_url).info["framework_version"].startswith("pytorch_lightning")


def test_checkpoint_action_writes_a_lightning_checkpoint(tmp_path):
    config = {"sampling": {"every": 2}, "rules": [{"rule": "exploding_tensor", "actions": ["checkpoint", "stop"]}]}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    helpers.fit(cb, helpers.mlp_module(lr=50.0), max_epochs=2)
    step = fired(cb.run_url)["exploding_tensor"].step
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / f"step{step}.ckpt", weights_only=False)
    assert checkpoint["global_step"] == step + 1 and "state_dict" in checkpoint


def test_stop_lets_lightning_finish_validation_checkpoints_and_loggers(tmp_path):
    """`stop` goes through trainer.should_stop: the end-of-training validation still runs, ModelCheckpoint still
    writes, the logger still gets its last row; a stop that raised out of fit would skip all three."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    validated = []

    class Validations(pl.Callback):
        def on_validation_end(self, trainer, pl_module):
            validated.append((trainer.global_step, "val_loss" in trainer.callback_metrics))

    config = {"sampling": {"every": 3}, "rules": [{"rule": "exploding_tensor", "actions": ["stop"]}]}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = helpers.fit(cb, helpers.mlp_module(lr=50.0), max_epochs=3, callbacks=[saver, Validations()],
                          enable_checkpointing=True, logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=1)
    verdict = fired(cb.run_url)["exploding_tensor"]
    assert trainer.global_step == verdict.step + 1 < 43 and tripwire.open_run(cb.run_url).info["status"] == "stopped"
    assert validated == [(verdict.step + 1, True)]  # one validation, after the stop
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert last["global_step"] == verdict.step + 1 and saver.best_model_path.endswith(f"step={verdict.step + 1}.ckpt")
    (metrics,) = (tmp_path / "csv").glob("*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    assert rows and int(rows[-1]["step"]) == verdict.step and rows[-1]["val_loss"] != ""


def test_checkpoint_action_writes_through_fsspec_to_a_memory_run():
    import uuid

    import fsspec

    url = f"memory://tripwire-tests/{uuid.uuid4().hex}/run"
    config = {"sampling": {"every": 2}, "rules": [{"rule": "exploding_tensor", "actions": ["checkpoint", "stop"]}]}
    cb = TripwireCallback(config, out_dir=url)
    module = helpers.mlp_module(lr=50.0)
    helpers.fit(cb, module, max_epochs=2)
    step = fired(cb.run_url)["exploding_tensor"].step
    fs = fsspec.filesystem("memory")
    (path,) = fs.glob(f"{url}/checkpoints/*.ckpt")
    assert path.endswith(f"step{step}.ckpt")
    with fs.open(path, "rb") as f:
        checkpoint = torch.load(f, weights_only=False)
    assert checkpoint["global_step"] == step + 1
    assert set(checkpoint["state_dict"]) == set(module.state_dict())
    fs.rm(url.rsplit("/", 1)[0], recursive=True)


@pytest.mark.filterwarnings("ignore:The dirpath has changed")  # resumed into a fresh folder, on purpose
def test_resume_from_checkpoint_appends_to_the_same_run(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    config = {"collections": {"losses": {}}, "sampling": {"every": 10}}
    first = TripwireCallback(config, out_dir=tmp_path / "run")
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    helpers.fit(first, max_epochs=1, callbacks=[saver], enable_checkpointing=True)
    second = TripwireCallback(config)  # no out_dir: the run comes from the checkpoint
    helpers.fit(second, max_epochs=2, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt2")],
                enable_checkpointing=True, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert second.run_url == first.run_url
    run = tripwire.open_run(first.run_url)
    assert run.steps() == list(range(0, 86, 10)) and run.tensor("losses/train").steps() == list(range(86))


def test_bad_config_fails_before_training(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text("rules:\n  - rule: vanishing_gradient\n    params: {threshhold: 1}\n")
    with pytest.raises(tripwire.ConfigError, match=r"rules.yaml:3: rules\[0\].params.threshhold"):
        TripwireCallback(str(path))


def cli(*args):
    return subprocess.run([sys.executable, "-m", "tripwire", *args], capture_output=True, text=True, timeout=120)


def test_check_exit_codes(tmp_path):
    healthy = TripwireCallback({"rules": ["exploding_tensor"], "sampling": {"every": 5}}, out_dir=tmp_path / "ok")
    helpers.fit(healthy, max_epochs=1)
    faulty = TripwireCallback({"rules": ["exploding_tensor"], "sampling": {"every": 5}}, out_dir=tmp_path / "bad")
    helpers.fit(faulty, helpers.mlp_module(lr=50.0), max_epochs=1)

    ok = cli("check", healthy.run_url)
    assert ok.returncode == 0 and "0 finding(s) at warning or error" in ok.stdout
    bad = cli("check", faulty.run_url)
    assert bad.returncode == 1 and "[exploding_tensor] error at step" in bad.stdout and "fix:" in bad.stdout
    missing = cli("check", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "no tripwire run at" in missing.stderr
    (tmp_path / "bad.yaml").write_text("rules: [nope]\n")
    bad_config = cli("check", healthy.run_url, "--config", str(tmp_path / "bad.yaml"))
    assert bad_config.returncode == 2 and "unknown rule 'nope'" in bad_config.stderr
    # the same run checked with another config: rules over data it holds
    (tmp_path / "dead.yaml").write_text("rules: [{rule: loss_not_decreasing, params: {window: 2}}]\n")
    assert cli("check", faulty.run_url, "--config", str(tmp_path / "dead.yaml")).returncode in (0, 1)

    show = cli("show", faulty.run_url)
    assert show.returncode == 0 and "status     finished" in show.stdout and "exploding_tensor" in show.stdout
    rules = cli("rules", "dead_relu")
    assert rules.returncode == 0 and "threshold_layer = 70.0" in rules.stdout and "hint:" in rules.stdout


@pytest.mark.parametrize("with_logger", [True, False], ids=["logger", "no_logger"])
def test_a_run_goes_where_lightning_puts_its_own_output(tmp_path, with_logger):
    """No out_dir and no `output` of the user's: the logger's folder (as ModelCheckpoint does), else
    default_root_dir; a second fit there gets a run beside the first."""
    from lightning.pytorch.loggers import CSVLogger

    urls = []
    for _ in range(2):
        callback = TripwireCallback({"rules": ["exploding_tensor"], "sampling": {"every": 20}})
        logger = CSVLogger(tmp_path / "logs") if with_logger else False
        helpers.fit(callback, max_steps=5, default_root_dir=tmp_path, logger=logger)
        urls.append(callback.run_url)
    if with_logger:
        assert urls == [str(tmp_path / "logs" / "lightning_logs" / f"version_{i}" / "tripwire") for i in (0, 1)]
    else:
        assert urls == [str(tmp_path / "tripwire"), str(tmp_path / "tripwire-1")]


def test_a_high_learning_rate_whose_steps_clipping_caps_is_no_alarm(tmp_path):
    """Lightning's LSTM demo (lightning.pytorch.demos.lstm) trains SGD at lr 20, pytorch's word language model's
    recipe, which clips the gradient norm at 0.25: learning_rate called the rate alone 20x too high. Where the
    first steps' updates are measured they decide: here they change the kernels by a few percent."""
    import lightning.pytorch as L
    from lightning.pytorch.demos.lstm import LightningLSTM, SimpleLSTM

    class SmallLSTM(LightningLSTM):
        def __init__(self):
            super().__init__(vocab_size=20)
            self.model = SimpleLSTM(vocab_size=20, ninp=32, nhid=32, nlayers=2)

        def prepare_data(self):  # the demo downloads WikiText-2; this one makes its tokens
            return None

        def train_dataloader(self):
            tokens = torch.arange(1200) % 19  # a sequence to learn: each token's successor is known
            x, y = tokens[:-1].unfold(0, 20, 20), tokens[1:].unfold(0, 20, 20)
            return torch.utils.data.DataLoader(list(zip(x, y)), batch_size=4, drop_last=True)

    torch.manual_seed(0)
    callback = TripwireCallback(None, out_dir=tmp_path / "run")
    trainer = L.Trainer(max_epochs=6, gradient_clip_val=0.25, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = SmallLSTM()
    trainer.fit(model)
    losses = tripwire.open_run(callback.run_url).tensor("losses/train").series("value")[1]
    assert losses[-1] < 0.3 * losses[0], losses
    assert [v.message for v in callback.verdicts if v.fired and v.counts] == []


def test_a_backbone_unfrozen_during_the_fit_is_captured_from_then_on(tmp_path):
    """Lightning's BackboneFinetuning freezes `self.backbone` before the fit and, at the epoch asked, makes it
    trainable and hands it to the optimizer as a new parameter group: its weights and gradients are captured
    from that epoch on (they were never captured: what an optimizer held was found once, at the first sample)."""
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import BackboneFinetuning

    torch.manual_seed(0)

    class FineTuned(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU())
            self.head = torch.nn.Linear(32, 10)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.head(self.backbone(x)), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.head(self.backbone(x)), y))

        def configure_optimizers(self):
            return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.01)

    module = FineTuned()
    start = module.backbone[0].weight.detach().clone()
    config = {"sampling": {"every": 10}, "collections": {"weights": {}, "gradients": {}, "losses": {}}, "rules": []}
    callback = TripwireCallback(config, out_dir=tmp_path / "run")
    helpers.fit(callback, module, max_epochs=3, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)])
    run = tripwire.open_run(callback.run_url)
    assert not torch.equal(start, module.backbone[0].weight)  # the backbone did train, from epoch 1 (step 43)
    assert run.tensor("gradients/backbone.0.weight").steps() == [50, 60, 70, 80, 90, 100, 110, 120]
    assert run.tensor("gradients/head.weight").steps()[0] == 0
    losses = run.tensor("losses/train").series("value")[1]
    assert losses[-10:].mean() < 0.3 * losses[0]
