"""The Transformers plugin on real `transformers.Trainer` training: tiny models built from configs (random
initialisation, nothing downloaded) on synthetic token ids. Capture and names, silence on healthy models, faults
caught, NaN at its step, stop, checkpoint, resume, gradient accumulation, two-process DDP."""

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Trainer

import tripwire
from benchmarks.zoo import data
from benchmarks.zoo.harness import all_rules
from benchmarks.zoo.transformers_cases import Rows, Stream, accuracy, arguments, tiny_bert, tiny_gpt2
from tripwire import Requirement, Rule
from tripwire.plugins.transformers import TripwireCallback

SCRIPT = Path(__file__).parent / "scripts" / "train_transformers_ddp.py"


def fit(callback, tmp_path, model=None, train=None, val=None, resume=None, loss_func=None, trainer=Trainer,
        **overrides) -> Trainer:
    """The BERT classifier on token presence (or `model` on `train`), the Trainer's output in tmp_path/out;
    loss_func: the Trainer's compute_loss_func; trainer: the Trainer's class."""
    metrics = accuracy if model is None or model.config.model_type == "bert" else None
    if train is None:
        (xt, yt), (xv, yv) = data.token_presence()
        train, val = Rows(xt, yt), Rows(xv, yv)
    trainer = trainer(model=model if model is not None else tiny_bert(),
                      args=arguments(str(tmp_path / "out"), **overrides), train_dataset=train, eval_dataset=val,
                      compute_metrics=metrics, callbacks=[callback] if callback is not None else [],
                      compute_loss_func=loss_func)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def counted(run_url) -> list:
    """Verdicts at warning or error."""
    return [v for v in tripwire.open_run(run_url).verdicts() if v.counts]


def fired(run_url) -> dict:
    """Each rule's first verdict at warning or error."""
    first = {}
    for v in counted(run_url):
        first.setdefault(v.rule, v)
    return first


@pytest.mark.parametrize("config", ["default", "all_rules"])
def test_a_bert_classifier_learns_and_no_rule_warns(tmp_path, config):
    """Runs go beside the Trainer's checkpoints, under output_dir/tripwire, where neither out_dir nor the config's
    own `output` says otherwise."""
    cb = TripwireCallback(None if config == "default" else all_rules("transformers"))
    trainer = fit(cb, tmp_path)
    assert trainer.evaluate()["eval_accuracy"] >= 0.9
    assert cb.run_url == str(tmp_path / "out" / "tripwire")
    run = tripwire.open_run(cb.run_url)
    assert counted(cb.run_url) == [] and run.info["status"] == "finished"
    assert run.info["framework"] == "transformers" and run.info["framework_version"] == "transformers 5.24.0"
    names = set(run.tensor_names())
    assert {"losses/train", "labels", "gradients/bert.encoder.layer.0.attention.self.query.weight",
            "weights/classifier.weight", "metrics/loss", "metrics/grad_norm", "metrics/learning_rate",
            "metrics/val_loss", "metrics/val_accuracy"} <= names
    assert not [n for n in names if n.startswith("inputs/")]  # token ids are no measurements
    if config == "all_rules":  # the rules that read predictions and val_loss had them
        assert "predictions" in names and run.tensor("predictions").reduction(0, "nonfinite_count") == 0
        assert not [v for v in run.verdicts() if v.status == "no_data" and v.rule in ("overfit", "oscillating_loss",
                                                                                       "class_imbalance")]
    assert run.steps(mode="eval") == [12, 24, 36, 48, 60, 72]  # each epoch's evaluation, at its global step
    kernel = run.model.parameters["classifier.weight"]
    assert (kernel.layer_type, kernel.role, kernel.shape, kernel.trainable) == ("dense", "kernel", (2, 32), True)
    (loss,) = json.loads((Path(cb.run_url) / "first_step" / "00000.json").read_text())["losses"]
    assert (loss["loss"], loss["output"], loss["units"], loss["labels"]["integer"]) == \
        ("cross_entropy", "linear", 2, True)


def test_a_gpt2_language_model_learns_and_no_rule_warns(tmp_path):
    (xt, yt), (xv, yv) = data.repeating_sequences()
    cb = TripwireCallback(out_dir=tmp_path / "run")
    trainer = fit(cb, tmp_path, tiny_gpt2(), Rows(xt, yt), Rows(xv, yv), learning_rate=1e-2, num_train_epochs=10)
    assert trainer.evaluate()["eval_loss"] < math.log(32) / 2
    assert cb.run_url == str(tmp_path / "run") and counted(cb.run_url) == []
    run = tripwire.open_run(cb.run_url)
    assert run.model.parameters["lm_head.weight"].tied_to == "transformer.wte.weight"
    kernel = run.model.parameters["transformer.h.0.attn.c_attn.weight"]  # GPT-2's Conv1D: a dense layer [in, out]
    assert (kernel.layer_type, kernel.role, kernel.shape, kernel.fan_in, kernel.fan_out) == \
        ("dense", "kernel", (32, 96), 32, 96)


def test_a_sampled_step_is_the_global_step_it_began_at_and_unsampled_steps_leave_nothing(tmp_path):
    """The step is state.global_step at on_step_begin; gradients are read after clipping; the learning rate is the
    one its optimizer step used (the scheduler steps before on_step_end); no hook outlives training."""
    config = {"sampling": {"every": 4}, "collections": {"losses": {}, "optimizer": {}, "activations": {},
                                                        "gradients": {"reductions": ["l2"]}}, "rules": []}
    model = tiny_bert()
    trainer = fit(TripwireCallback(config, out_dir=tmp_path / "run"), tmp_path, model, num_train_epochs=1,
                  max_grad_norm=0.01)
    assert trainer.state.global_step == 12
    run = tripwire.open_run(tmp_path / "run")
    norms = [run.tensor(name).reduction(0, "l2") for name in run.tensor_names(collection="gradients")]
    assert math.sqrt(sum(n * n for n in norms)) == pytest.approx(0.01, rel=1e-3)  # read after clipping
    assert run.tensor("losses/train").steps() == list(range(12))  # every step's, stored at the next sample
    assert run.steps() == [0, 4, 8]
    assert run.tensor("activations/bert.encoder.layer.0.intermediate.dense").steps() == [0, 4, 8]
    steps, rates = run.tensor("optimizer/lr").series()
    assert rates[0] == 3e-3 and rates[1] == pytest.approx(3e-3 * (1 - 4 / 12))  # linear decay, from step 0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert "forward" not in model.__dict__  # the first step's look at the loss is undone


def test_a_nan_loss_stops_training_at_the_step_it_appears_and_the_trainer_checkpoints(tmp_path):
    """A batch whose labels are all -100 has a NaN loss; the Trainer's logs hide it (logging_nan_inf_filter), the
    model's loss shows it. The default config stops at that step and asks the Trainer for its checkpoint."""
    (xt, yt), (xv, yv) = data.token_presence()
    yt = yt.copy()
    yt[7 * 32:8 * 32] = -100  # the 8th batch of a stream, step 7: not a sampled step of the default config
    cb = TripwireCallback()
    trainer = fit(cb, tmp_path, train=Stream(xt, yt), val=Rows(xv, yv), max_steps=12, logging_steps=1)
    verdict = fired(cb.run_url)["exploding_tensor"]
    assert verdict.step == 7 and trainer.state.global_step == 8
    # the step's forward replayed before the update: every module's output finite, the mean over no label is not
    assert "It began in the loss: the model's output was finite" in verdict.message
    run = tripwire.open_run(cb.run_url)
    assert run.info["status"] == "stopped" and run.steps()[-1] == 7
    assert np.isnan(run.tensor("losses/train").reduction(7))
    assert np.isfinite(run.tensor("metrics/loss").reduction(7))  # what the Trainer logged for that step
    state = json.loads((tmp_path / "out" / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["global_step"] == 8 and state["stateful_callbacks"]["TripwireCallback"]["attributes"] == \
        {"run_url": cb.run_url}


def test_the_trainer_s_own_grad_norm_is_judged_for_spikes_at_the_steps_it_logs(tmp_path):
    """With a log every step, gradient_spike reads the grad_norm the Trainer logs (before it clips): a shard of
    flipped labels after 150 steps of a stream is told at the step it began, after `patience` steps."""
    (xt, yt), (xv, yv) = data.token_presence()
    x, y = np.resize(xt, (200 * 32, xt.shape[1])), np.resize(yt, 200 * 32)
    y[150 * 32:162 * 32] = 1 - y[150 * 32:162 * 32]
    cb = TripwireCallback({"rules": [{"rule": "gradient_spike"}]})
    fit(cb, tmp_path, train=Stream(x, y), val=Rows(xv, yv), max_steps=200, logging_steps=1, eval_strategy="no")
    assert [(v.step, v.onset) for v in counted(cb.run_url)] == [(159, 150)]
    steps, norms = tripwire.open_run(cb.run_url).tensor("metrics/grad_norm").series("value")
    assert len(steps) == 200 and np.median(norms[150:160]) > 2 * np.median(norms[100:150])


class StopsUpdating(torch.optim.AdamW):
    """AdamW whose step does nothing after `working` steps."""

    def __init__(self, params, working):
        super().__init__(params, lr=3e-3)
        self.working, self.calls = working, 0

    def step(self, closure=None):
        self.calls += 1
        return super().step(closure) if self.calls <= self.working else None


def test_a_step_that_stops_updating_is_an_error_within_a_step(tmp_path):
    (xt, yt), (xv, yv) = data.token_presence()
    model, cb = tiny_bert(), TripwireCallback()
    Trainer(model=model, args=arguments(str(tmp_path / "out"), max_steps=30), train_dataset=Rows(xt, yt),
            eval_dataset=Rows(xv, yv), callbacks=[cb], optimizers=(StopsUpdating(model.parameters(), 15), None)).train()
    # the default config samples steps 0-9 and every 100th: the first no-op step, 15, and the next are not sampled
    verdict = fired(cb.run_url)["training_relations"]
    assert (verdict.finding, verdict.step, verdict.severity) == ("step_changed_nothing", 16, "error")


class FirstRowOnly(Rows):
    """A dataset whose __getitem__ forgets its index: every batch holds the first row, again and again."""

    def __getitem__(self, i):
        return super().__getitem__(0)


def test_a_loader_that_repeats_one_batch_is_a_warning_within_a_step(tmp_path):
    (xt, yt), (xv, yv) = data.token_presence()
    cb = TripwireCallback()
    fit(cb, tmp_path, train=FirstRowOnly(xt, yt), val=Rows(xv, yv), max_steps=5)
    verdict = fired(cb.run_url)["training_relations"]  # batches 0, 1 and 2 are equal: told at step 2
    assert (verdict.finding, verdict.step, verdict.severity) == ("repeated_batch", 2, "warning")


def test_a_learning_rate_far_too_high_is_named_and_stop_and_checkpoint_act_on_it(tmp_path):
    """AdamW at 100 makes no NaN in this model (bounded steps, LayerNorm): learning_rate names it at step 0, a
    warning; with `{stop: warning}` training stops after that step, with the Trainer's resumable checkpoint."""
    config = {"rules": [{"rule": "learning_rate", "actions": ["log", "checkpoint", {"stop": "warning"}]}]}
    cb = TripwireCallback(config)
    trainer = fit(cb, tmp_path, learning_rate=100.0)
    verdict = fired(cb.run_url)["learning_rate"]
    assert verdict.step == 0 and "learning rate 100 with AdamW" in verdict.message
    assert trainer.state.global_step == 1 and tripwire.open_run(cb.run_url).info["status"] == "stopped"
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= set(os.listdir(checkpoint))


def test_the_encoder_frozen_by_mistake(tmp_path):
    """One layer frozen between trained ones is a mistake (unchanged_tensor); the whole encoder frozen is how a
    head is fine-tuned on a pretrained model, so untrained_parameters lists it, at info."""
    model = tiny_bert()
    model.bert.encoder.layer[1].requires_grad_(False)
    cb = TripwireCallback(out_dir=tmp_path / "layer")
    fit(cb, tmp_path, model, num_train_epochs=1)
    verdict = fired(cb.run_url)["unchanged_tensor"]
    assert verdict.step == 0 and "bert.encoder.layer.1.attention.self.query.weight" in verdict.message
    model = tiny_bert()
    model.bert.encoder.requires_grad_(False)
    cb = TripwireCallback(out_dir=tmp_path / "encoder")
    fit(cb, tmp_path, model, num_train_epochs=1)
    assert counted(cb.run_url) == []
    (frozen,) = [v for v in tripwire.open_run(cb.run_url).verdicts() if v.rule == "untrained_parameters"]
    assert frozen.severity == "info" and "bert.encoder.layer.0.attention.self.query" in frozen.message


def test_labels_that_are_not_class_ids(tmp_path):
    """Float labels make a Transformers classifier take a multi-label loss (binary cross-entropy per class); given
    as one-hot rows divided by 255, like pixels, no target reaches 0.5. As a [batch] vector of floats the model
    raises itself, before any step."""
    (xt, yt), (xv, yv) = data.token_presence()
    scaled = lambda y: np.eye(2, dtype=np.float32)[y] / 255  # noqa: E731
    cb = TripwireCallback()
    fit(cb, tmp_path, train=Rows(xt, scaled(yt)), val=Rows(xv, scaled(yv)), num_train_epochs=1)
    verdict = fired(cb.run_url)["loss_setup"]
    assert verdict.step == 0 and "binary_cross_entropy_with_logits" in verdict.message
    assert "never reach 0.5" in verdict.message


@pytest.mark.parametrize("model", ["bert", "gpt2", "bert_label_smoothing"])
def test_gradient_accumulation_gives_one_sample_per_optimizer_step_and_the_step_s_loss(tmp_path, model):
    """Two micro-batches per step: one sample per optimizer step, its loss the step's, not divided by 2. GPT-2's
    loss divides its sum by the Trainer's count of the step's tokens (num_items_in_batch): the micro-batches' losses
    are shares, summed, as the Trainer logs them. BERT's classifier takes the mean of its batch, whatever the count:
    the mean of the two (the Trainer, which takes the count as used, logs their sum). With label smoothing the
    Trainer computes the loss, as a share of the step's where it counted the items: the loss it logs."""
    config = {"sampling": {"every": 1}, "collections": {"losses": {}, "gradients": {}, "metrics": {}}, "rules": []}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    if model == "gpt2":
        (xt, yt), (xv, yv) = data.repeating_sequences()
        built, train, val, chance = tiny_gpt2(), Rows(xt, yt), Rows(xv, yv), math.log(32)
    else:
        built, train, val, chance = None, None, None, math.log(2)
    smoothing = {"label_smoothing_factor": 0.1} if model == "bert_label_smoothing" else {}
    trainer = fit(cb, tmp_path, built, train, val, num_train_epochs=1, per_device_train_batch_size=16,
                  gradient_accumulation_steps=2, logging_steps=1, **smoothing)
    assert trainer.state.global_step == 12
    run = tripwire.open_run(cb.run_url)
    assert run.steps() == list(range(12)) and run.tensor("losses/train").steps() == list(range(12))
    losses = run.tensor("losses/train").series()[1]
    assert losses[0] == pytest.approx(chance, rel=0.1)  # an untrained model's loss: chance
    if model != "bert":
        np.testing.assert_allclose(losses, run.tensor("metrics/loss").series()[1], rtol=1e-5)


@dataclass
class StopsAt(Rule):
    """An error at `step` and after: a decision to stop, at a step of the test's choosing."""

    step: int = 10

    name = "stops_at"

    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        return self.fire(step, "stop here", severity="error") if step >= self.step else None


def test_a_stopped_training_resumed_from_its_checkpoint_appends_to_the_same_run(tmp_path):
    """The run's URL travels in the Trainer's checkpoint (TrainerState.stateful_callbacks)."""
    config = {"sampling": {"every": 5}, "collections": {"losses": {}},
              "rules": [{"rule": "test_transformers:StopsAt", "actions": ["checkpoint", "stop"]}]}
    first = TripwireCallback(config)
    fit(first, tmp_path, max_steps=20)
    assert first.run_url == str(tmp_path / "out" / "tripwire")
    second = TripwireCallback({"sampling": {"every": 5}, "collections": {"losses": {}}, "rules": []})
    trainer = fit(second, tmp_path, max_steps=20, resume=str(tmp_path / "out" / "checkpoint-11"))
    assert trainer.state.global_step == 20 and second.run_url == first.run_url
    run = tripwire.open_run(first.run_url)
    assert run.steps() == [0, 5, 10, 15] and run.info["status"] == "finished"
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-11", "tripwire"]  # no second run beside it


def test_restoring_callback_states_makes_the_checkpoint_s_callback_which_appends_with_its_config(tmp_path):
    """With restore_callback_states_from_checkpoint, Transformers replaces the callback passed by one made from the
    checkpoint's state: the config of the training that saved it (here: one that stops again), the same run."""
    config = {"sampling": {"every": 5}, "collections": {"losses": {}},
              "rules": [{"rule": "test_transformers:StopsAt", "actions": ["checkpoint", "stop"]}]}
    first = TripwireCallback(config)
    fit(first, tmp_path, max_steps=20)
    trainer = fit(TripwireCallback({"collections": {"losses": {}}, "rules": []}), tmp_path, max_steps=20,
                  resume=str(tmp_path / "out" / "checkpoint-11"), restore_callback_states_from_checkpoint=True)
    (restored,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, TripwireCallback)]
    assert restored.run_url == first.run_url
    assert [spec.rule for spec in restored.config.rules] == ["test_transformers:StopsAt"]
    assert trainer.state.global_step == 16 and tripwire.open_run(first.run_url).steps() == [0, 5, 10, 15]


def test_a_second_training_into_the_same_output_dir_gets_a_run_beside_the_first(tmp_path):
    config = {"collections": {"losses": {}}, "rules": []}
    first, second = TripwireCallback(config), TripwireCallback(config)
    fit(first, tmp_path, max_steps=2)
    fit(second, tmp_path, max_steps=2)
    assert second.run_url == first.run_url + "-1"


def test_raise_closes_the_run_and_raises_rule_fired_out_of_train(tmp_path):
    config = {"sampling": {"every": 5}, "collections": {"losses": {}},
              "rules": [{"rule": "test_transformers:StopsAt", "actions": ["raise"]}]}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    with pytest.raises(tripwire.RuleFired) as raised:
        fit(cb, tmp_path, max_steps=20)
    assert raised.value.verdict.step == 10
    run = tripwire.open_run(cb.run_url)
    assert run.info["status"] == "stopped" and run.steps() == [0, 5, 10]


def test_storage_that_refuses_writes_never_holds_up_training_and_a_raising_rule_is_disabled(tmp_path, caplog):
    import flakyfs

    flakyfs.FlakyFileSystem.failing = PermissionError(13, "Permission denied")
    config = {"collections": {"losses": {}}, "sampling": {"every": 2},
              "rules": [{"rule": "custom_rules:Broken"}, "exploding_tensor"]}
    try:
        trainer = fit(TripwireCallback(config, out_dir=f"flaky://runs/hf-{os.getpid()}"), tmp_path, max_steps=10)
    finally:
        flakyfs.FlakyFileSystem.failing = False
    assert trainer.state.global_step == 10
    assert any("cannot open the run" in r.getMessage() for r in caplog.records if r.name == "tripwire")
    assert any("raised ZeroDivisionError" in r.getMessage() for r in caplog.records if r.name == "tripwire")


def cross_entropy(outputs, labels, num_items_in_batch=None):
    """A compute_loss_func: the mean cross-entropy of the batch (NaN over a batch whose labels are all -100)."""
    return torch.nn.functional.cross_entropy(outputs.logits, labels)


class OwnLossTrainer(Trainer):
    """A Trainer subclass with a compute_loss of its own, as users write for a weighted loss."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = cross_entropy(outputs, labels)
        return (loss, outputs) if return_outputs else loss


@pytest.mark.parametrize("loss", ["label_smoothing", "compute_loss_func", "own_compute_loss"])
def test_a_loss_the_trainer_computes_itself_is_recorded_and_a_nan_in_it_stops_training_at_its_step(tmp_path, loss):
    """With label smoothing, a compute_loss_func or a compute_loss of its own the Trainer takes the labels away from
    the model and computes the loss: it is read from the Trainer's compute_loss, labels and all, and a NaN in it (a
    batch whose labels are all -100) is caught at the step it appears, between samples, where the loss began."""
    (xt, yt), (xv, yv) = data.token_presence()
    yt = yt.copy()
    yt[7 * 32:8 * 32] = -100
    cb = TripwireCallback({"sampling": {"every": 5}, "collections": {"losses": {}, "labels": {}},
                           "rules": [{"rule": "exploding_tensor", "actions": ["stop"]}]}, out_dir=tmp_path / "run")
    options = {"label_smoothing": {"label_smoothing_factor": 0.1}, "compute_loss_func": {"loss_func": cross_entropy},
               "own_compute_loss": {"trainer": OwnLossTrainer}}[loss]
    trainer = fit(cb, tmp_path, train=Stream(xt, yt), val=Rows(xv, yv), max_steps=12, **options)
    run = tripwire.open_run(cb.run_url)
    assert run.tensor("losses/train").steps() == list(range(8))  # every step's, kept between samples
    assert run.tensor("losses/train").reduction(0) == pytest.approx(math.log(2), rel=0.1)  # untrained: chance
    assert np.isnan(run.tensor("losses/train").reduction(7))
    assert run.tensor("labels").steps() == [0, 5] and run.tensor("labels").reduction(5, "max") == 1
    (verdict,) = [v for v in run.verdicts() if v.counts]
    assert verdict.rule == "exploding_tensor" and verdict.step == 7 and trainer.state.global_step == 8
    assert "It began in the loss: the model's output was finite" in verdict.message
    assert "compute_loss" not in trainer.__dict__  # the wrapper is gone with the training


def run_ddp(tmp_path, config, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SCRIPT.parents[2])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(SCRIPT), str(tmp_path / "run"), json.dumps(config), str(tmp_path / "result"),
                           *extra], capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]


def test_ddp_each_rank_writes_its_own_data_and_a_stop_on_one_rank_stops_both_at_the_same_step(tmp_path):
    config = {"workers": "all", "sampling": {"every": 2}, "collections": {"losses": {}},
              "rules": [{"rule": "exploding_tensor", "params": {"collections": ["losses"]},
                         "actions": ["log", "stop"]}]}
    rank0, rank1 = run_ddp(tmp_path, config, "--nan-rank", "1", "--nan-at", "6", "--steps", "20")
    assert rank0["run_url"] == rank1["run_url"] == str(tmp_path / "run")
    assert rank0["global_step"] == rank1["global_step"] == 7
    assert not rank0["verdicts"] and rank1["verdicts"][0]["step"] == 6
    run = tripwire.open_run(rank0["run_url"])
    assert run.workers() == [0, 1] and run.info["world_size"] == 2 and run.info["status"] == "stopped"
    assert run.steps(worker=0) == run.steps(worker=1) == [0, 2, 4, 6]
    loss = run.tensor("losses/train")
    assert loss.reduction(4, worker=0) != loss.reduction(4, worker=1)  # each rank's own batch
    assert 0.3 < loss.reduction(0, worker=0) < 1.2  # each rank's own loss, near ln(2) for 2 classes
    assert [v.worker for v in run.verdicts() if v.fired] == [1]


def test_ddp_a_language_model_s_loss_is_each_rank_s_own(tmp_path):
    """Transformers' causal LM loss divides by the count of every rank's tokens (average_tokens_across_devices),
    and the Trainer multiplies it back by the world size: so does tripwire. Under the default `workers: zero`
    only rank 0 writes."""
    rank0, rank1 = run_ddp(tmp_path, {"sampling": {"every": 5}, "collections": {"losses": {}}}, "--gpt2",
                           "--steps", "10")
    assert rank0["global_step"] == rank1["global_step"] == 10
    run = tripwire.open_run(rank0["run_url"])
    assert run.workers() == [0] and run.steps() == [0, 5]
    assert run.tensor("losses/train").reduction(0) == pytest.approx(math.log(32), rel=0.1)


def test_a_long_evaluation_is_no_stalled_training(tmp_path):
    """The evaluation takes 4.2 s (batches of 8, another callback waiting 0.35 s after each of twelve), over a 2 s
    threshold: evaluation batches are progress. One epoch: the pause between two epochs is not what this is about."""
    import time

    from transformers import TrainerCallback

    class SlowEvaluation(TrainerCallback):
        def on_prediction_step(self, args, state, control, **kwargs):
            time.sleep(0.35)

    (xt, yt), (xv, yv) = data.token_presence()
    config = {"rules": [{"rule": "stalled_training", "params": {"threshold_s": 2.0}}], "collections": {"losses": {}},
              "writer": {"flush_every_s": 0.2}}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    Trainer(model=tiny_bert(), args=arguments(str(tmp_path / "out"), per_device_eval_batch_size=8, num_train_epochs=1),
            train_dataset=Rows(xt, yt), eval_dataset=Rows(xv[:96], yv[:96]),
            callbacks=[cb, SlowEvaluation()]).train()
    assert [v.rule for v in tripwire.open_run(cb.run_url).verdicts() if v.fired] == []


def test_attention_gradients_small_during_warmup_are_not_vanishing(tmp_path):
    """A hunt's tiny BERT, 3 imbalanced classes under a class-weighted loss in compute_loss, 40 warmup steps:
    initialised at std 0.02, its attention is near uniform at first, and its queries' and keys' gradients sit near
    1e-7 while the rate rises. vanishing_gradient warned at step 20 (samples 0, 10, 20, all in the warmup) on a run
    that reaches a balanced accuracy of 1.0: not judged while the learning rate is rising."""
    from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

    torch.manual_seed(1)
    rng = np.random.default_rng(1)

    def make(n):  # class 0: neither marker; 1: token 7 somewhere; 2: token 9 somewhere
        ids, y = rng.integers(10, 40, size=(n, 16)), rng.choice(3, size=n, p=[0.7, 0.2, 0.1])
        for i in np.flatnonzero(y):
            ids[i, rng.integers(1, 16)] = 7 if y[i] == 1 else 9
        ids[:, 0] = 1
        return [{"input_ids": torch.tensor(row), "labels": torch.tensor(label)} for row, label in zip(ids, y)]

    train, valid = make(2000), make(600)
    counts = np.bincount([int(r["labels"]) for r in train], minlength=3)
    weight = torch.tensor(len(train) / (3 * counts), dtype=torch.float32)

    class Weighted(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            loss = torch.nn.functional.cross_entropy(outputs.logits, labels, weight=weight)
            return (loss, outputs) if return_outputs else loss

    model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                     intermediate_size=64, vocab_size=40, max_position_embeddings=32,
                                                     num_labels=3))
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), num_train_epochs=6, per_device_train_batch_size=32,
                             learning_rate=2e-3, warmup_steps=40, weight_decay=0.01, save_strategy="no",
                             report_to=[], use_cpu=True, seed=1, disable_tqdm=True)
    cb = TripwireCallback({"rules": ["vanishing_gradient"], "sampling": {"every": 10}}, out_dir=tmp_path / "run")
    trainer = Weighted(model=model, args=args, train_dataset=train, callbacks=[cb])
    trainer.train()
    with torch.no_grad():
        predicted = model(input_ids=torch.stack([r["input_ids"] for r in valid])).logits.argmax(-1).numpy()
    truth = np.array([int(r["labels"]) for r in valid])
    assert min(float(np.mean(predicted[truth == c] == c)) for c in range(3)) > 0.9
    assert [v for v in tripwire.open_run(cb.run_url).verdicts() if v.fired] == []
