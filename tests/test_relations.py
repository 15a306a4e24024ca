"""training_relations: bugs that show no bad number, caught at the step they first show — a missing zero_grad()
(at step 1), training in eval mode, zero_grad() between backward() and step(), an optimizer step that stopped
updating, the training set passed as XGBoost's validation set — in the plain-torch probe, Lightning's manual
optimisation and XGBoost; each buggy loop has a healthy twin that must stay silent (accumulation, zero_grad
between forward and backward, a GAN's two optimizers, BatchNorm frozen in eval mode on purpose, a fused optimizer,
an optimizer subclass that calls its parent's step, steps a GradScaler skips)."""

import lightning.pytorch as pl
import pytest
import torch
import xgboost as xgb
from torch import nn

import helpers
import tripwire
from test_probe import SAM
from tripwire.plugins.lightning import TripwireCallback
from tripwire.plugins.torch import TripwireProbe
from tripwire.plugins.torch.relations import BatchWatch, UpdateWatch
from tripwire.plugins.xgboost import TripwireCallback as XGBoostCallback

F = nn.functional
CONFIG = {"sampling": {"every": 10}, "rules": [{"rule": "training_relations"}]}


def digits():
    (x, y), _ = helpers.digits()
    return torch.tensor(x), torch.tensor(y, dtype=torch.long)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 10))


def loop(out, clear="before_forward", accumulate=1, mode=None, steps=40, optimizer=None, stepping=True,
         after_step=None):
    """A plain loop on digits; `clear`: where zero_grad() is called (None: nowhere); `mode(model)` sets the mode
    before training; `optimizer(parameters)` makes the optimizer (SGD by default); `stepping`: False, the loop
    never calls optimizer.step(); `after_step(step)` runs after it (a scheduler). Returns (the run, the final
    training accuracy)."""
    x, y = digits()
    model = net()
    optimizer = (optimizer or (lambda parameters: torch.optim.SGD(parameters, lr=0.05)))(model.parameters())
    if mode is not None:
        mode(model)
    with TripwireProbe(model, optimizer, CONFIG, out_dir=out) as probe:
        for step in range(steps):
            i = 32 * (step % 40)
            if clear == "before_forward" and step % accumulate == 0:
                optimizer.zero_grad()
            loss = F.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
            if clear == "before_backward":
                optimizer.zero_grad()
            loss.backward()
            if clear == "before_step":
                optimizer.zero_grad()
            if stepping and (step + 1) % accumulate == 0:
                optimizer.step()
            if after_step is not None:
                after_step(step)
            probe.step(loss)
    model.eval()
    accuracy = float((model(x).argmax(1) == y).float().mean())
    return tripwire.open_run(probe.run_url), accuracy


def findings(run) -> list:
    return [(v.finding, v.step, v.severity) for v in run.verdicts() if v.rule == "training_relations" and v.fired]


def test_a_missing_zero_grad_is_an_error_at_step_1(tmp_path):
    run, _ = loop(tmp_path / "run", clear=None)
    assert findings(run) == [("stale_gradients", 1, "error")]
    (verdict,) = [v for v in run.verdicts() if v.rule == "training_relations"]
    assert verdict.evidence["count"] == 6 and "6 parameter(s)" in verdict.message  # every parameter of the model
    assert "zero_grad()" in verdict.hint


def test_an_optimizer_step_never_called_is_an_error_at_step_2(tmp_path):
    """zero_grad() and backward() at every step, optimizer.step() forgotten: nothing trains while every tensor looks
    healthy. Step 1 clears step 0's gradients unapplied, step 2 step 1's: told there. Accumulation over more steps
    than the first four keeps its gradients (below: silent)."""
    run, accuracy = loop(tmp_path / "run", stepping=False)
    assert accuracy < 0.2  # at chance: it did not train
    assert findings(run) == [("gradients_discarded", 2, "error")]
    (verdict,) = [v for v in run.verdicts() if v.rule == "training_relations"]
    assert "6 parameter(s)" in verdict.message and "optimizer.step()" in verdict.hint
    run, accuracy = loop(tmp_path / "accumulated", accumulate=8)
    assert accuracy > 0.8 and findings(run) == []


@pytest.mark.parametrize("per_batch", [True, False], ids=["scheduler_per_batch", "scheduler_per_epoch"])
def test_a_learning_rate_below_the_weights_precision_is_named(tmp_path, per_batch):
    """StepLR(step_size=3, gamma=0.5) written for epochs and stepped at every batch: at step 20 the rate is below 1%
    of its start, seen at step 24 (it is read at every 8th step) and told at step 48, when it has been there as
    long; by step 100 it is 1e-12 and every update rounds away in float32. The sampled step that finds the step
    changed nothing names the rate, not a broken optimizer; the twin that steps it per epoch (40 batches) learns
    and is silent."""
    schedulers = []

    def sgd_with_step_lr(parameters):
        optimizer = torch.optim.SGD(parameters, lr=0.05, momentum=0.9)
        schedulers.append(torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5))
        return optimizer

    run, accuracy = loop(tmp_path / "run", optimizer=sgd_with_step_lr, steps=200,
                         after_step=lambda step: (per_batch or step % 40 == 39) and schedulers[0].step())
    if not per_batch:
        assert accuracy > 0.8 and findings(run) == []
        return
    collapsed, (finding, step, severity) = findings(run)
    assert collapsed == ("rate_collapsed", 48, "warning")
    assert (finding, severity) == ("update_rounds_away", "error") and step <= 100
    assert all("scheduler" in v.hint for v in run.verdicts() if v.rule == "training_relations")


def sgd_scheduled(schedule):
    """An SGD optimizer whose learning rate `schedule(optimizer)` moves, and the step that moves it (its
    argument: the step's loss)."""
    stepping = []

    def make(parameters):
        optimizer = torch.optim.SGD(parameters, lr=0.1, momentum=0.9)
        scheduler = schedule(optimizer)
        stepping.append(scheduler.step)
        return optimizer

    return make, stepping


class DecayByHand:
    """The loop's own decay, no torch scheduler: the rate x 0.1 at calls 20, 40 and 60 (plateaus seen by hand)."""

    def __init__(self, optimizer):
        self.optimizer, self.calls = optimizer, 0

    def step(self):
        self.calls += 1
        if self.calls in (20, 40, 60):
            for group in self.optimizer.param_groups:
                group["lr"] *= 0.1


@pytest.mark.parametrize("schedule", ["cosine_to_0", "linear_to_0", "step_decay", "plateau", "by_hand",
                                      "per_epoch"])
def test_a_schedule_that_ends_near_0_is_no_collapse(tmp_path, schedule):
    """Rates that reach 1% of their peak at the end of training, as planned, are no collapse: a cosine and a linear
    decay to 0 at the last step, a step decay whose last stage is shorter than the ones before. Rates lowered
    early by what follows the training's progress are not judged: a ReduceLROnPlateau that cut the rate to 1e-5
    of its start in the first steps (`mode="max"` on a falling loss: every step is a plateau), the loop's own
    decay (1e-3 of its start from step 60), an ExponentialLR stepped per epoch of 10 steps (1 % by step 70)."""
    steps = 200
    make = {"cosine_to_0": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps),
            "linear_to_0": lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.0, total_iters=steps),
            "step_decay": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [80, 140, 180], gamma=0.1),
            "plateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, "max", factor=0.1, patience=0),
            "by_hand": DecayByHand,
            "per_epoch": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.5)}
    optimizer, stepping = sgd_scheduled(make[schedule])

    def after_step(step):
        if schedule == "plateau":
            stepping[0](1.0 / (step + 1))
        elif schedule != "per_epoch" or step % 10 == 9:
            stepping[0]()

    run, accuracy = loop(tmp_path / "run", optimizer=optimizer, steps=steps, after_step=after_step)
    assert findings(run) == []
    assert schedule in ("plateau", "by_hand") or accuracy > 0.9


@pytest.mark.parametrize("clear, accumulate", [("before_forward", 1), ("before_backward", 1), ("before_forward", 4)])
def test_healthy_loops_break_no_relation(tmp_path, clear, accumulate):
    run, accuracy = loop(tmp_path / "run", clear=clear, accumulate=accumulate, steps=80)
    assert accuracy > 0.8  # they learn
    assert findings(run) == []
    # the mode and the optimizer's step are judged at the steps an optimizer took: with accumulation over 4, no
    # sampled step (0, 1, 2, 10, 20, …) is one
    stepped = {"relations/eval_mode", "relations/no_gradients", "relations/step_changed_nothing",
               "relations/no_gradient_path"}
    judged = {"relations/stale_gradients"} | (stepped if accumulate == 1 else {"relations/skipped_steps"})
    assert set(run.tensor_names("relations")) == judged


@pytest.mark.parametrize("clears_d", [True, False], ids=["dcgan", "discriminator_never_cleared"])
def test_a_gan_whose_container_the_loop_never_calls_is_judged_from_its_first_backward(tmp_path, clears_d):
    """pytorch/examples' DCGAN loop, the probe given both networks in a container the loop never calls. When the
    step began at the discriminator's optimizer step, after its backward passes, gradient hooks made then saw only
    the generator's backward, which lands on the discriminator's applied gradient (cleared at the next iteration,
    never applied): "8 parameters not cleared", an error on a healthy GAN. The gradients are watched from the end
    of the step before (and the step now begins at the first network's forward); a discriminator that is never
    cleared is still an error at step 1."""
    torch.manual_seed(0)
    x, _ = digits()
    generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 64), nn.Tanh())
    discriminator = nn.Sequential(nn.Linear(64, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1), nn.Sigmoid())
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    real = x / 8 - 1  # digits' 0..16 to [-1, 1]
    with TripwireProbe(nn.ModuleDict({"G": generator, "D": discriminator}), [opt_d, opt_g], CONFIG,
                       out_dir=tmp_path / "run") as probe:
        for step in range(30):
            batch = real[32 * step:32 * step + 32]
            if clears_d:
                discriminator.zero_grad()
            error_real = F.binary_cross_entropy(discriminator(batch), torch.ones(32, 1))
            error_real.backward()
            fake = generator(torch.randn(32, 8))
            error_fake = F.binary_cross_entropy(discriminator(fake.detach()), torch.zeros(32, 1))
            error_fake.backward()
            opt_d.step()
            generator.zero_grad()
            error_g = F.binary_cross_entropy(discriminator(fake), torch.ones(32, 1))
            error_g.backward()
            opt_g.step()
            probe.step(error_real + error_fake)
    run = tripwire.open_run(probe.run_url)
    assert findings(run) == ([] if clears_d else [("stale_gradients", 1, "error")])


class StopsUpdating(torch.optim.SGD):
    """SGD whose step does nothing after `working` steps (`working` None: it always works, through its parent's
    step, so that torch's step hooks run twice per step)."""

    def __init__(self, params, working=None):
        super().__init__(params, lr=0.05)
        self.working, self.calls = working, 0

    def step(self, closure=None):
        self.calls += 1
        return super().step(closure) if self.working is None or self.calls <= self.working else None


def test_zero_grad_between_backward_and_step_is_an_error_at_step_0(tmp_path):
    run, accuracy = loop(tmp_path / "run", clear="before_step")
    assert accuracy < 0.3  # nothing was learned
    assert findings(run) == [("no_gradients", 0, "error")]
    (verdict,) = [v for v in run.verdicts() if v.rule == "training_relations"]
    assert "6 parameter(s)" in verdict.message and "between loss.backward() and optimizer.step()" in verdict.hint


def test_a_loss_at_its_minimum_has_no_gradient_and_breaks_nothing(tmp_path):
    """Lightning's own DemoModel (lightning.pytorch.demos): its loss, relu(l1(x)).sum() on batches of one, reaches
    its minimum, 0, by switching every unit off, and its gradient is then exactly 0: training_relations called it an
    error ("none of the parameters had a gradient"). A zero gradient is a fault only where the loss is not at 0."""
    from lightning.pytorch.demos.boring_classes import DemoModel, RandomDataset

    torch.manual_seed(0)
    model = DemoModel()
    callback = TripwireCallback({"rules": ["training_relations"], "sampling": {"every": 1},
                                 "collections": {"losses": {}}}, out_dir=tmp_path / "run")
    trainer = pl.Trainer(max_steps=200, callbacks=[callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(RandomDataset(32, 64), batch_size=1))
    run = tripwire.open_run(callback.run_url)
    losses = run.tensor("losses/train").series("value")[1]
    assert losses[:10].mean() > 1 and (losses == 0).sum() >= 20  # it learns: most steps end at the minimum
    assert [v.message for v in run.verdicts() if v.fired] == []


@pytest.mark.parametrize("clear", ["before_forward", "before_step"])
def test_a_chunk_at_its_minimum_among_chunks_with_gradients_breaks_nothing(tmp_path, clear):
    """A linear SVM stepped once per chunk of 4 samples, four chunks a step: once its hinge loss is 0 on a chunk
    (every sample beyond the margin), that chunk's gradient is exactly 0 while the step's loss, the chunks' mean,
    is not: "none of the parameters had a gradient", an error on a model that learns. An optimizer that applied a
    gradient at another of its steps is not one whose gradients are cleared; cleared before every step, it is."""
    generator = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (640,), generator=generator).float() * 2 - 1
    x = torch.randn(640, 2, generator=generator) + 1.5 * y[:, None]
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"sampling": {"every": 1}, "rules": ["training_relations"], "collections": {"losses": {}}}
    some_at_zero = 0  # steps with a chunk at 0 and a mean above it
    with TripwireProbe(model, optimizer, config, out_dir=tmp_path / "run") as probe:
        for step in range(40):
            losses = []
            for i in range(16 * step, 16 * step + 16, 4):
                if clear == "before_forward":
                    optimizer.zero_grad()
                loss = F.relu(1 - y[i:i + 4] * model(x[i:i + 4]).squeeze(1)).mean()
                loss.backward()
                if clear == "before_step":
                    optimizer.zero_grad()
                optimizer.step()
                losses.append(float(loss))
            some_at_zero += min(losses) == 0 < max(losses)
            probe.step(sum(losses) / 4)
    accuracy = float(((model(x).squeeze(1) > 0).float() * 2 - 1 == y).float().mean())
    run = tripwire.open_run(probe.run_url)
    if clear == "before_forward":
        assert accuracy > 0.9 and some_at_zero >= 5 and findings(run) == []
    else:
        assert accuracy < 0.9 and findings(run) == [("no_gradients", 0, "error")]


def test_a_step_that_stops_updating_is_an_error_within_a_step(tmp_path):
    run, _ = loop(tmp_path / "run", optimizer=lambda parameters: StopsUpdating(parameters, working=15))
    # the first no-op step is 15, unsampled (every 10): told at its second in a row, not at the next sample (20)
    assert findings(run) == [("step_changed_nothing", 16, "error")]
    steps, values = run.tensor("relations/step_changed_nothing").series("value")
    assert steps.tolist()[:4] == [0, 1, 2, 10] and values.tolist()[:4] == [0, 0, 0, 0]


def test_a_step_that_stops_updating_at_a_sample_is_an_error_there(tmp_path):
    run, _ = loop(tmp_path / "run", optimizer=lambda parameters: StopsUpdating(parameters, working=20))
    assert findings(run) == [("step_changed_nothing", 20, "error")]  # sampled: judged by the sample itself


class ComputesButStopsUpdating(torch.optim.SGD):
    """SGD whose step, after `working` steps, evaluates the closure (Lightning's training step) and applies
    nothing: a wrapped or compiled step that lost its write-back."""

    def __init__(self, params, working):
        super().__init__(params, lr=0.1)
        self.working, self.calls = working, 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls <= self.working:
            return super().step(closure)
        with torch.enable_grad():
            return closure() if closure is not None else None


@pytest.mark.parametrize("working", [None, 15])
def test_lightning_a_step_that_stops_updating_is_an_error_within_a_step(tmp_path, working):
    module = helpers.mlp_module()
    module.configure_optimizers = lambda: ComputesButStopsUpdating(module.parameters(), working or 10 ** 9)
    callback = TripwireCallback(CONFIG, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, module, max_epochs=2)
    run = tripwire.open_run(callback.run_url)
    if working is None:
        assert trainer.callback_metrics["val_loss"] < 0.8 and findings(run) == []  # it learns (from ln 10)
    else:  # sampled every 10: the first no-op step, 15, and the next, 16, are not
        assert findings(run) == [("step_changed_nothing", 16, "error")]


def lr_0_for_the_output_layer(parameters) -> list:
    """Param groups: the output Linear's weight and bias at learning rate 0 (its bias is the smallest parameter:
    a parameter at lr 0 must not be judged), the rest at the optimizer's."""
    return [{"params": parameters[:-2]}, {"params": parameters[-2:], "lr": 0.0}]


@pytest.mark.parametrize("optimizer", [
    lambda parameters: StopsUpdating(parameters),
    lambda parameters: torch.optim.AdamW(parameters, lr=1e-3, fused=True),  # writes without counting versions
    lambda parameters: torch.optim.SGD(lr_0_for_the_output_layer(list(parameters)), lr=0.05),
], ids=["subclass", "fused", "group_at_lr_0"])
def test_healthy_optimizers_change_what_they_step(tmp_path, optimizer):
    run, accuracy = loop(tmp_path / "run", optimizer=optimizer, steps=120)
    assert accuracy > 0.8 and findings(run) == []
    assert run.tensor("relations/step_changed_nothing").series("value")[1].tolist() == [0] * 14  # 0, 1, 2, 10, …


@pytest.mark.parametrize("overflowing", [(0, 10), (0, 1, 2, 3)], ids=["at_samples", "first_four"])
def test_steps_a_grad_scaler_skips_are_not_judged(tmp_path, overflowing):
    """Overflowing losses: GradScaler skips those optimizer steps, by design, and the next zero_grad() clears their
    gradients unapplied: at sampled steps, and at the first four (fp16 training whose scale starts too high)."""
    x, y = digits()
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    with TripwireProbe(model, optimizer, CONFIG, out_dir=tmp_path / "run") as probe:
        for step in range(30):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[32 * step:32 * step + 32]), y[32 * step:32 * step + 32])
            scaler.scale(loss * (float("inf") if step in overflowing else 1.0)).backward()
            scaler.step(optimizer)
            scaler.update()
            probe.step(loss)
    run = tripwire.open_run(probe.run_url)
    assert scaler.get_scale() == 2.0 ** (16 - len(overflowing))  # it skipped each of them
    assert findings(run) == []


def spread_out(logits, y, epsilon):
    """Cross-entropy with a small hinge that keeps outputs apart (pairwise distances below 1), the distances as the
    sqrt of the squared differences, which takes each sample's distance to itself: the gradient of sqrt at 0 is
    Inf, at every step, unless `epsilon` is added inside."""
    distances = ((logits[:, None] - logits[None]) ** 2).sum(-1).add(epsilon).sqrt()
    return F.cross_entropy(logits, y) + 1e-3 * F.relu(1 - distances).mean()


def test_a_grad_scaler_that_skips_every_step_is_an_error(tmp_path):
    """The spread-out loss without its epsilon: a GradScaler skips every step and halves its scale; the loss stays
    finite and the weights stay as they were. The fixed twin adds the epsilon."""
    x, y = digits()
    for epsilon, broken in ((0.0, True), (1e-6, False)):
        model = net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu")
        with TripwireProbe(model, optimizer, CONFIG, out_dir=tmp_path / str(epsilon)) as probe:
            for step in range(60):
                i = 32 * (step % 40)
                optimizer.zero_grad()
                loss = spread_out(model(x[i:i + 32]), y[i:i + 32], epsilon)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                probe.step(loss)
        run = tripwire.open_run(probe.run_url)
        if broken:
            assert scaler.get_scale() < 1e-9  # every step skipped
            assert findings(run) == [("skipped_steps", 29, "error")]  # told at the 30th skip in a row
            (verdict,) = [v for v in run.verdicts() if v.rule == "training_relations"]
            assert "last 30 steps" in verdict.message and "sqrt" in verdict.hint
        else:
            model.eval()
            assert float((model(x).argmax(1) == y).float().mean()) > 0.8  # it learns
            assert findings(run) == []


@pytest.mark.parametrize("epsilon", [0.0, 1e-6])
def test_lightning_a_grad_scaler_that_skips_every_step_is_an_error(tmp_path, epsilon):
    """The same under Lightning's mixed precision with a GradScaler (given explicitly: on the CPU, 16-mixed has
    none). Lightning counts a skipped step as a global step."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    module = helpers.mlp_module()
    module.training_step = lambda batch, batch_idx: spread_out(module(batch[0]), batch[1], epsilon)
    scaler = torch.amp.GradScaler("cpu")
    callback = TripwireCallback(CONFIG, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, module, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    run = tripwire.open_run(callback.run_url)
    if epsilon == 0:
        assert scaler.get_scale() < 1e-9 and findings(run) == [("skipped_steps", 29, "error")]
        (verdict,) = [v for v in run.verdicts() if v.rule == "training_relations"]
        assert "last 30 steps" in verdict.message
    else:
        assert trainer.callback_metrics["val_loss"] < 0.8 and findings(run) == []  # it learns (from ln 10)


def xgboost_run(out, same_data: bool):
    (x, y), (xv, yv) = helpers.digits()
    dtrain, dval = xgb.DMatrix(x, label=y), xgb.DMatrix(xv, label=yv)
    callback = XGBoostCallback(CONFIG, out_dir=out)
    xgb.train({"objective": "multi:softprob", "num_class": 10, "nthread": 1, "max_depth": 3}, dtrain, 12,
              evals=[(dtrain, "train"), (dtrain if same_data else dval, "validation")], callbacks=[callback],
              verbose_eval=False)
    return tripwire.open_run(callback.run_url)


@pytest.mark.parametrize("same_data", [True, False])
def test_the_training_set_as_xgboost_validation_set_is_a_warning(tmp_path, same_data):
    run = xgboost_run(tmp_path / "run", same_data)
    assert findings(run) == ([("same_eval_data", 1, "warning")] if same_data else [])
    # judged from the second round on (steps 1, 2, 10): one round of metrics equal may be chance
    assert run.tensor("relations/same_eval_data").series("value")[0].tolist() == [1, 2, 10]
    assert run.tensor("relations/same_eval_data").series("value")[1].tolist() == [int(same_data)] * 3


def test_training_in_eval_mode_is_a_warning(tmp_path):
    run, _ = loop(tmp_path / "run", mode=lambda model: model.eval())
    assert findings(run) == [("eval_mode", 0, "warning")]
    assert "model.train()" in run.verdicts()[0].hint


@pytest.mark.parametrize("in_eval_mode", [False, True])
def test_validation_in_train_mode_is_a_warning(tmp_path, in_eval_mode):
    """A validation loop without model.eval(): its dropout is on and its BatchNorm normalises with, and keeps
    running statistics of, the validation batches. Told at the first evaluation; silent with model.eval()."""
    x, y = digits()
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with TripwireProbe(model, optimizer, CONFIG, out_dir=tmp_path / "run") as probe:
        for epoch in range(2):
            model.train()
            for step in range(20):
                i = 32 * step
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
                loss.backward()
                optimizer.step()
                probe.step(loss)
            if in_eval_mode:
                model.eval()
            with torch.no_grad():
                val_loss = F.cross_entropy(model(x[-256:]), y[-256:])
            probe.log_eval({"val_loss": float(val_loss)})
    run = tripwire.open_run(probe.run_url)
    if in_eval_mode:
        assert findings(run) == []
    else:
        assert findings(run) == [("train_mode_eval", 20, "warning")]
        assert "2 dropout" in run.verdicts()[0].message and "model.eval()" in run.verdicts()[0].hint


class FunctionalDropout(nn.Module):
    """An MLP whose dropout is a function: F.dropout(h, 0.3) (on whatever the mode), with the module's mode, or an
    nn.Dropout module."""

    def __init__(self, dropout):
        super().__init__()
        torch.manual_seed(0)
        self.dropout = dropout
        self.fc1, self.fc2, self.module = nn.Linear(64, 64), nn.Linear(64, 10), nn.Dropout(0.3)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = {"always": lambda: F.dropout(h, 0.3), "with_mode": lambda: F.dropout(h, 0.3, training=self.training),
             "module": lambda: self.module(h)}[self.dropout]()
        return self.fc2(h)


class NetModule(pl.LightningModule):
    """Trains `net` (digits to 10 classes) with cross-entropy under SGD at 0.1, and logs val_acc."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("plugin", ["probe", "lightning"])
@pytest.mark.parametrize("dropout", ["always", "with_mode", "module"])
def test_a_dropout_function_left_on_in_evaluation_is_a_warning_at_the_first_evaluation(tmp_path, plugin, dropout):
    """F.dropout(h, p) takes training=True unless told: model.eval() does not turn it off, and the evaluation drops
    units at random (two passes over the same data differ). Told at the first evaluation, in the probe and in
    Lightning; with training=self.training, or an nn.Dropout module, silent."""
    if plugin == "probe":
        x, y = digits()
        model = FunctionalDropout(dropout)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with TripwireProbe(model, optimizer, CONFIG, out_dir=tmp_path / "run") as probe:
            for step in range(60):
                if step % 30 == 0:  # an evaluation before each stretch of training
                    model.eval()
                    with torch.no_grad():
                        probe.log_eval({"val_loss": float(F.cross_entropy(model(x[-256:]), y[-256:]))})
                    model.train()
                i = 32 * (step % 30)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
                loss.backward()
                optimizer.step()
                probe.step(loss)
        url, first_eval = probe.run_url, 0
        model.eval()
        with torch.no_grad():
            differ = not torch.equal(model(x[-256:]), model(x[-256:]))
    else:
        callback = TripwireCallback(CONFIG, out_dir=tmp_path / "run")
        trainer = helpers.fit(callback, NetModule(FunctionalDropout(dropout)), max_epochs=2)
        assert trainer.callback_metrics["val_acc"] > 0.8
        url, first_eval = callback.run_url, trainer.num_training_batches
        differ = dropout == "always"
    found = findings(tripwire.open_run(url))
    assert differ is (dropout == "always")
    assert found == ([("dropout_in_eval", first_eval, "warning")] if dropout == "always" else [])


def test_batch_norm_frozen_on_purpose_is_the_users_choice(tmp_path):
    def freeze_batch_norm(model):
        model.train()
        model[1].eval()

    run, _ = loop(tmp_path / "run", mode=freeze_batch_norm)
    assert findings(run) == []


class Manual(pl.LightningModule):
    """Manual optimisation, with or without zero_grad() (or with it between backward and step: `clear`
    "before_step"); with `gan`, two optimizers over two halves, the second's
    loss flowing back into the first half too (as a GAN's generator loss reaches the discriminator)."""

    def __init__(self, clear=True, gan=False, stepping=True):
        super().__init__()
        self.automatic_optimization = False
        self.clear, self.gan, self.stepping = clear, gan, stepping
        self.body, self.head = nn.Sequential(nn.Linear(64, 32), nn.ReLU()), nn.Linear(32, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizers = self.optimizers() if self.gan else [self.optimizers()]
        for optimizer in reversed(optimizers):  # the head's optimizer first, as a GAN's generator step
            loss = F.cross_entropy(self.head(self.body(x)), y)
            if self.clear is True:
                optimizer.zero_grad()
            self.manual_backward(loss)
            if self.clear == "before_step":
                optimizer.zero_grad()
            if self.stepping:
                optimizer.step()
        self.log("train_loss", loss)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.head(self.body(x)).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        if self.gan:
            return (torch.optim.SGD(self.body.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1))
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("clear, gan", [(False, False), (True, False), (True, True), ("before_step", False)])
def test_lightning_manual_optimisation(tmp_path, clear, gan):
    torch.manual_seed(0)
    callback = TripwireCallback(CONFIG, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, Manual(clear=clear, gan=gan), max_epochs=2)
    run = tripwire.open_run(callback.run_url)
    if clear is True:
        assert trainer.callback_metrics["val_acc"] > 0.8
        assert findings(run) == []
        assert sorted(run.tensor_names("relations")) == ["relations/no_gradient_path", "relations/no_gradients",
                                                         "relations/stale_gradients", "relations/step_changed_nothing"]
    elif clear == "before_step":
        assert findings(run) == [("no_gradients", 0, "error")]
    else:
        ((finding, step, severity),) = findings(run)
        assert (finding, severity) == ("stale_gradients", "error") and step <= 2


def test_lightning_manual_optimisation_that_never_steps(tmp_path):
    """Manual optimisation whose training_step forgot optimizer.step(): Lightning's step count stays at 0 (it counts
    optimizer steps), so every batch is step 0; the second batch in a row whose gradients were cleared unapplied
    tells it."""
    torch.manual_seed(0)
    callback = TripwireCallback(CONFIG, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, Manual(stepping=False), max_epochs=1)
    assert trainer.global_step == 0 and trainer.callback_metrics["val_acc"] < 0.2  # nothing trained
    assert findings(tripwire.open_run(callback.run_url)) == [("gradients_discarded", 0, "error")]


class ManualScheduled(Manual):
    """Manual optimisation with a StepLR from configure_optimizers, stepped as Lightning's docs write it (in
    on_train_epoch_end, which runs after the callbacks'; or in training_step at the epoch's last batch), or
    never."""

    def __init__(self, steps_it):
        super().__init__()
        self.steps_it = steps_it

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        if self.steps_it == "last_batch" and self.trainer.is_last_batch:
            self.lr_schedulers().step()

    def on_train_epoch_end(self):
        if self.steps_it == "epoch_end":
            self.lr_schedulers().step()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)]


@pytest.mark.parametrize("steps_it", ["epoch_end", "last_batch", None])
def test_lightning_a_schedule_manual_optimisation_never_steps_is_a_warning(tmp_path, steps_it, caplog):
    """Under manual optimisation Lightning steps no scheduler: one the module never steps leaves the learning rate
    where it started (so-vits-svc-fork's 'lr_decay not working' after its move to manual optimisation). Told once
    two epochs have ended (their epoch-end hooks too)."""
    torch.manual_seed(0)
    callback = TripwireCallback(CONFIG, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, ManualScheduled(steps_it), max_epochs=3)
    assert trainer.callback_metrics["val_acc"] > 0.8
    run = tripwire.open_run(callback.run_url)
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    if steps_it is None:
        assert lr == 0.1
        assert findings(run) == [("schedule_never_stepped", 2 * trainer.num_training_batches - 1, "warning")]
        assert "never stepped: StepLR (learning rate 0.1)" in caplog.text
    else:
        assert lr == pytest.approx(0.1 * 0.7 ** 3) and findings(run) == []


class Scheduled(NetModule):
    """An MLP on digits under AdamW and a schedule returned from configure_optimizers: a warmup over 200 optimizer
    steps (Transformers' get_linear_schedule_with_warmup's shape) or a StepLR halving every 2 epochs, returned at
    Lightning's default interval (the epoch) or with "interval": "step"."""

    def __init__(self, schedule, interval):
        torch.manual_seed(0)
        super().__init__(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
        self.schedule, self.interval = schedule, interval

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 200)) \
            if self.schedule == "warmup_in_steps" else torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.interval}}


@pytest.mark.parametrize("schedule, interval, wrong", [
    ("warmup_in_steps", "epoch", True), ("warmup_in_steps", "step", False),
    ("steplr_in_epochs", "step", True), ("steplr_in_epochs", "epoch", False)])
def test_lightning_a_schedule_stepped_at_an_interval_it_was_not_written_for_is_a_warning_at_step_0(
        tmp_path, schedule, interval, wrong, caplog):
    """A warmup counted in optimizer steps returned without "interval": "step" never leaves its warmup (a
    silent-bug hunt's Lightning port: val_acc 0.61 against 0.96); a StepLR counted in epochs stepped per batch
    takes the rate to 0 within the first epoch. Told before the first step, from a copy of the scheduler stepped
    over the planned training; the same schedules at their own interval are silent and learn."""
    callback = TripwireCallback(CONFIG, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, Scheduled(schedule, interval), max_epochs=4)
    assert (trainer.callback_metrics["val_acc"] > 0.9) is not wrong
    found = findings(tripwire.open_run(callback.run_url))
    assert found[:1] == ([("schedule_interval", 0, "warning")] if wrong else [])  # then the rate rounds away
    if wrong:
        assert {"warmup_in_steps": "LambdaLR (learning rate 1.5e-05): stepped per epoch, its rate never gets "
                                   "past 3% of its peak in the 4 epoch(s) planned",
                "steplr_in_epochs": "StepLR (learning rate 0.003): stepped per optimizer step, its rate is at "
                                    "most 0.0039 of its base rate from a tenth into the 172 steps"}[schedule] \
            in caplog.text


def test_a_schedule_is_stepped_ahead_on_a_copy_that_shares_what_it_holds_and_changes_nothing():
    """The copy stepped ahead copies the scheduler's own state, and its chained schedulers', never what it holds: a
    LambdaLR on a bound method of the LightningModule would otherwise copy the whole model. The scheduler and its
    optimizer are left as they were."""
    from tripwire.plugins.torch.schedules import shares

    class Uncopyable:
        def __deepcopy__(self, memo):
            raise AssertionError("a deep copy of what the schedule holds")

        def warmup(self, step):
            return min(1.0, (step + 1) / 10)

    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, Uncopyable().warmup)
    chained = torch.optim.lr_scheduler.SequentialLR(
        optimizer, [warmup, torch.optim.lr_scheduler.StepLR(optimizer, 5, 0.5)], milestones=[10])
    before = (chained.last_epoch, warmup.last_epoch, optimizer.param_groups[0]["lr"], optimizer.state_dict())
    ahead = shares(chained, 20)
    assert ahead[0] == pytest.approx(0.1) and max(ahead) == pytest.approx(1.0) and ahead[-1] == pytest.approx(0.25)
    assert (chained.last_epoch, warmup.last_epoch, optimizer.param_groups[0]["lr"]) == before[:3]
    assert optimizer.state_dict() == before[3]


class ManualSAM(Manual):
    """Manual optimisation with SAM through its own two calls (the common implementation, test_probe's): the base
    optimizer steps, while Lightning, which counts the steps of its wrapper, stays at step 0."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        sam = self.optimizers().optimizer
        loss = F.cross_entropy(self.head(self.body(x)), y)
        self.manual_backward(loss)
        sam.first_step()
        self.manual_backward(F.cross_entropy(self.head(self.body(x)), y))
        sam.second_step()
        self.log("train_loss", loss)

    def configure_optimizers(self):
        return SAM(self.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)


def test_lightning_manual_sam_steps_its_base_optimizer(tmp_path):
    """SAM clears its gradients after each of its steps and only its base optimizer's step runs: where 'an
    optimizer stepped' was read from Lightning's step count, that was gradients discarded, an error on a run that
    learns. The base optimizer's own step hook says it stepped."""
    torch.manual_seed(0)
    callback = TripwireCallback(CONFIG, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, ManualSAM(), max_epochs=2)
    assert trainer.global_step == 0 and trainer.callback_metrics["val_acc"] > 0.8
    assert findings(tripwire.open_run(callback.run_url)) == []


def test_a_parameter_no_optimizer_holds_is_not_this_rules(tmp_path):
    """Its gradient piles up (optimizer.zero_grad() clears only what the optimizer holds), but nothing applies it:
    untrained_parameters names that fault."""
    x, y = digits()
    model = net()
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.05)
    with TripwireProbe(model, optimizer, CONFIG, out_dir=tmp_path / "run") as probe:
        for step in range(20):
            optimizer.zero_grad()
            F.cross_entropy(model(x[32 * step:32 * step + 32]), y[32 * step:32 * step + 32]).backward()
            optimizer.step()
            probe.step()
    run = tripwire.open_run(probe.run_url)
    assert findings(run) == []
    assert run.tensor("relations/stale_gradients").series("value")[1].tolist() == [0, 0, 0]  # steps 1, 2, 10


def test_an_lbfgs_closure_computes_its_gradients_inside_the_step(tmp_path):
    """LBFGS as PyTorch's time-sequence example runs it: zero_grad, forward and backward in the closure, which the
    step calls after the probe's hook has run (step 0's gradients do not exist yet at that point), and which ends
    without an update once converged; a forward pass before the step (the batch's accuracy, in train mode) begins
    the step, so the hook sees a sampled one."""
    x, y = digits()
    model = net()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    with TripwireProbe(model, optimizer, CONFIG, out_dir=tmp_path / "run") as probe:
        for step in range(12):
            def closure():
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x[:256]), y[:256])
                loss.backward()
                return loss

            with torch.no_grad():
                model(x[:256])  # the batch's accuracy before the step, as a loop may log it
            probe.step(optimizer.step(closure))
    run = tripwire.open_run(probe.run_url)
    assert float(F.cross_entropy(model(x[:256]), y[:256])) < 0.5  # it learns
    assert findings(run) == []
    # not judged: the gradients before the step are the previous step's, and a converged LBFGS step changes nothing
    assert not {"relations/no_gradients", "relations/step_changed_nothing"} & set(run.tensor_names())


class BrokenGroups(torch.optim.SGD):
    """An optimizer whose param_groups cannot be read between steps (a wrapper that breaks them)."""

    @property
    def param_groups(self):
        if getattr(self, "broken", False):
            raise RuntimeError("param_groups unavailable")
        return self.__dict__["_groups"]

    @param_groups.setter
    def param_groups(self, groups):
        self.__dict__["_groups"] = groups


def test_a_failing_update_check_turns_itself_off_without_raising(caplog):
    optimizer = BrokenGroups(net().parameters(), lr=0.05)
    optimizer.broken = True
    watch = UpdateWatch()
    watch.before(optimizer)  # inside optimizer.step(): an exception here would end the training
    assert watch.after(optimizer, 0) is None and watch.told
    assert "it is off for the rest of this run" in caplog.text


def test_an_update_check_names_the_step_it_broke_at():
    """Told at the second step in a row that changed nothing, with that step's number (on an accelerator the
    answer is read a step or a few later: the number is the step it was about)."""
    x, y = digits()
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    watch, told = UpdateWatch(), []
    for step in range(5):
        optimizer.zero_grad()
        F.cross_entropy(model(x[:32]), y[:32]).backward()
        watch.before(optimizer)
        if step < 2:
            optimizer.step()
        told.append(watch.after(optimizer, step))
    assert told == [None, None, None, 3, None]


def through_data(optimizer) -> None:
    """An SGD step written through `.data`, as many optimizers of one's own are: torch does not count the write
    (the parameter's version stays), but the values change."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.data.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize("writes", ["step", "through .data", "fused Adam", "step, then through .data"])
@pytest.mark.parametrize("stops_at", [None, 8])
def test_an_update_check_trusts_a_version_only_where_it_moved_with_every_change(writes, stops_at):
    """After 4 steps that changed the witness and moved its version, an optimizer is judged by the version alone
    (no copy, no comparison); where a step changes it without moving the version (a write through `.data`, fused
    Adam on the CPU), from the start or once trusted, its steps are compared again: no false alarm. A step that
    stops writing is told at the second such step in a row, trusted or not."""
    x, y = digits()
    model = net()
    fused = writes == "fused Adam"
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True) if fused else \
        torch.optim.SGD(model.parameters(), lr=0.05)
    watch, told = UpdateWatch(), []
    for step in range(16):
        optimizer.zero_grad()
        F.cross_entropy(model(x[:32]), y[:32]).backward()
        watch.before(optimizer)
        if stops_at is not None and step >= stops_at:
            pass  # the update is no longer applied
        elif writes == "through .data" or (writes == "step, then through .data" and step >= 6):
            through_data(optimizer)
        else:
            optimizer.step()
        told.append(watch.after(optimizer, step))
    assert told == [None] * 16 if stops_at is None else [None] * 9 + [9] + [None] * 6


def test_an_empty_parameter_is_no_witness(caplog):
    """An empty parameter is the smallest of all: the witness it made had no largest value to read, and the check
    turned itself off with a warning on a healthy model. A step that changes nothing is still told."""
    x, y = digits()
    model = net()
    model.register_parameter("nothing", torch.nn.Parameter(torch.zeros(0)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    watch, told = UpdateWatch(), []
    for step in range(4):
        optimizer.zero_grad()
        (F.cross_entropy(model(x[:32]), y[:32]) + model.nothing.sum()).backward()
        watch.before(optimizer)
        if step < 2:
            optimizer.step()
        told.append(watch.after(optimizer, step))
    assert told == [None, None, None, 3] and "it is off" not in caplog.text


def test_a_batch_is_held_only_where_the_next_step_is_seen():
    """Three equal batches are a repeat told at the third; where the plugin says it will not see the next step
    (it sleeps until the next sample), the batch is let go at once and the next one is not compared with it."""
    batches = [(torch.ones(8, 4), torch.arange(8)) for _ in range(3)]  # equal, each in memory of its own
    watch = BatchWatch()
    assert [watch.see(step, batch) for step, batch in enumerate(batches)] == [False, False, True]
    watch = BatchWatch()
    assert [watch.see(step, batch, next_seen=step != 1) for step, batch in enumerate(batches)] == [False] * 3


class IgnoresItsIndex(torch.utils.data.Dataset):
    """A dataset whose __getitem__ forgets its index: every batch is the first sample, again and again."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[0], self.y[0]


@pytest.mark.parametrize("dataset, batch_size", [
    (torch.utils.data.TensorDataset, 32), (IgnoresItsIndex, 32), (torch.utils.data.TensorDataset, 4096),
], ids=["healthy", "index_ignored", "full_batch"])
def test_lightning_a_loader_that_repeats_one_batch_is_a_warning(tmp_path, dataset, batch_size):
    x, y = digits()
    train = torch.utils.data.DataLoader(dataset(x, y), batch_size=batch_size, shuffle=False)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=256)
    callback = TripwireCallback(CONFIG, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, helpers.mlp_module(), max_epochs=2 if batch_size == 32 else 60,
                          loaders=(train, val))
    run = tripwire.open_run(callback.run_url)
    if dataset is IgnoresItsIndex:  # batches 0, 1 and 2 are equal: the second repeat is told at step 2
        assert findings(run) == [("repeated_batch", 2, "warning")]
    else:  # a full-batch training sees its one batch at every step, by design
        assert trainer.callback_metrics["val_loss"] < 0.8 and findings(run) == []


def first_batch_loop(out, draw: str, steps: int = 120):
    """A plain loop on digits whose batch comes, at each step, from `draw`: "next_iter" (`next(iter(loader))`,
    shuffling off: the loader's first batch every time), "next_iter_shuffled" (a random batch each time),
    "epochs" (the loader iterated once per epoch, with a held-out batch drawn by `next(iter(val_loader))` at every
    step, as a loop that logs a validation loss per step does), "full_loader" (`next(iter(loader))` over a
    loader of one batch: full-batch training) or "full_tensor" (the whole set, a fresh copy at every step, after
    a held-out batch drawn by `next(iter(val_loader))` and run under torch.no_grad(), the model left in train
    mode). Returns (the run, the accuracy on the whole set)."""
    x, y = digits()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), shuffle=draw.endswith("shuffled"),
                                         batch_size=len(x) if draw == "full_loader" else 32)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[-256:], y[-256:]), batch_size=64)
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = iter(())
    with TripwireProbe(model, optimizer, CONFIG, out_dir=out) as probe:
        for step in range(steps):
            if draw == "epochs":
                batch = next(batches, None)
                if batch is None:
                    batches = iter(loader)
                    batch = next(batches)
            elif draw == "full_tensor":
                with torch.no_grad():
                    held_out = next(iter(val))
                    model(held_out[0])
                batch = x.clone(), y.clone()
            else:
                batch = next(iter(loader))
            optimizer.zero_grad()
            loss = F.cross_entropy(model(batch[0]), batch[1])
            loss.backward()
            optimizer.step()
            if draw == "epochs":
                with torch.no_grad():
                    model.eval()
                    held_out = next(iter(val))
                    probe.log_eval({"val_loss": float(F.cross_entropy(model(held_out[0]), held_out[1]))})
                    model.train()
            probe.step(loss)
    model.eval()
    return tripwire.open_run(probe.run_url), float((model(x).argmax(1) == y).float().mean())


@pytest.mark.parametrize("draw", ["next_iter", "next_iter_shuffled", "epochs", "full_loader", "full_tensor"])
def test_probe_a_loop_that_draws_the_first_batch_again_is_a_warning(tmp_path, draw):
    """`next(iter(loader))` in a plain loop, shuffling off: the model sees the loader's first batch alone, told at
    the third step in a row. A full-batch training (one batch by design, also where another loader's first batch
    is drawn alone at every step), a fresh random batch per step and a held-out batch drawn per step are silent,
    and DataLoader is left as it was once the probe stops looking."""
    iterate, draw_next = torch.utils.data.DataLoader.__iter__, torch.utils.data.dataloader._BaseDataLoaderIter.__next__
    run, accuracy = first_batch_loop(tmp_path / "run", draw)
    assert torch.utils.data.DataLoader.__iter__ is iterate
    assert torch.utils.data.dataloader._BaseDataLoaderIter.__next__ is draw_next
    if draw == "next_iter":
        assert findings(run) == [("repeated_batch", 2, "warning")]
        (verdict,) = [v for v in run.verdicts() if v.rule == "training_relations" and v.fired]
        assert "next(iter(loader))" in verdict.hint
        assert accuracy < 0.8  # 32 samples learnt by heart: the healthy loops reach 0.9
    else:
        assert findings(run) == [] and accuracy > 0.9


class BackboneAndHeads(nn.Module):
    """A backbone and a classifier head, and a second head beside it. `cut`: what reaches the head — the
    backbone's output as it is (None), detached ("detach"), or computed under torch.no_grad() ("no_grad"); with
    "online_probe" the second head learns from detached features while the loss reaches the backbone through the
    first; with "unused" the second head runs and its output is thrown away; "held" is Lightning's transfer-learning
    idiom, a feature extractor held in eval mode and run under no_grad: frozen on purpose."""

    def __init__(self, cut=None):
        super().__init__()
        torch.manual_seed(0)
        self.cut = cut
        self.backbone = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
        self.head = nn.Linear(32, 10)
        if cut in ("online_probe", "unused"):
            self.second = nn.Linear(32, 10)
        if cut == "held":  # pretrained (on the digits, with a head of its own), then held as it is
            x, y = digits()
            pretraining = nn.Sequential(self.backbone, nn.Linear(32, 10))
            optimizer = torch.optim.SGD(pretraining.parameters(), lr=0.1)
            for step in range(200):
                i = 32 * (step % 40)
                optimizer.zero_grad()
                F.cross_entropy(pretraining(x[i:i + 32]), y[i:i + 32]).backward()
                optimizer.step()
            self.backbone.eval()

    def forward(self, x):
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.cut not in ("no_grad", "held")):
            features = self.backbone(x)
        logits = self.head(features.detach() if self.cut == "detach" else features)
        if self.cut == "online_probe":
            return logits + self.second(features.detach()) - self.second(features.detach()).detach()
        if self.cut == "unused":
            self.second(features)
        return logits


@pytest.mark.parametrize("cut", ["detach", "no_grad", None, "online_probe", "unused", "held"])
def test_layers_cut_off_from_the_loss_are_a_warning(tmp_path, cut, caplog):
    """A backbone whose output reaches the head detached never trains: told at step 1 (the first step with a
    step before it), the log naming its parameters. A cut whose upstream still gets a gradient (an online probe
    on detached features), a head whose output the loss does not use and a backbone held in eval mode are healthy."""
    x, y = digits()
    model = BackboneAndHeads(cut)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with TripwireProbe(model, optimizer, CONFIG, out_dir=tmp_path / "run") as probe:
        helpers.probe_steps(probe, model, optimizer, x, y, 60, F.cross_entropy)
    run = tripwire.open_run(probe.run_url)
    if cut in ("detach", "no_grad"):
        assert findings(run) == [("no_gradient_path", 1, "warning")]
        assert "backbone.0.weight, backbone.0.bias" in caplog.text and "Module `head` received" in caplog.text
    else:
        model.eval()
        assert float((model(x).argmax(1) == y).float().mean()) > 0.8  # it learns
        assert findings(run) == [] and "relations/no_gradient_path" in run.tensor_names("relations")


@pytest.mark.parametrize("cut", ["detach", None])
def test_lightning_layers_cut_off_from_the_loss_are_a_warning(tmp_path, cut):
    callback = TripwireCallback(CONFIG, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, helpers.classifier(BackboneAndHeads(cut)), max_epochs=3)
    found = findings(tripwire.open_run(callback.run_url))
    if cut:
        assert found == [("no_gradient_path", 1, "warning")]
    else:
        assert trainer.callback_metrics["val_loss"] < 0.5 and found == []


@pytest.mark.parametrize("cut", ["held", "held_after_evaluating", "detach"])
def test_a_feature_extractor_held_in_eval_mode_is_frozen_on_purpose(tmp_path, cut):
    """Lightning's docs (transfer learning): `self.feature_extractor.eval()`, its features computed under
    torch.no_grad(), the optimizer over every parameter. Under the default config it was told 'cut from the graph'
    (training_relations) and its kernels 'did not change' (unchanged_tensor): both warnings, on a healthy program;
    also where the program measured its accuracy (model.eval()) before fitting, so that the whole model trains in
    eval mode (Lightning keeps the modes it finds). The same backbone in train mode, detached by mistake, is still
    told by both."""
    callback = TripwireCallback(None, out_dir=tmp_path / "run")
    module = helpers.classifier(BackboneAndHeads("held" if cut.startswith("held") else cut), lr=0.1)
    if cut == "held_after_evaluating":
        module.eval()
    trainer = helpers.fit(callback, module, max_epochs=10)
    run = tripwire.open_run(callback.run_url)
    told = sorted({v.rule for v in run.verdicts() if v.counts})
    captured = set(run.tensor_names())
    if cut.startswith("held"):
        assert trainer.callback_metrics["val_loss"] < 0.5 and told == []
        assert "weights/net.head.weight" in captured and "weights/net.backbone.0.weight" not in captured
    else:
        assert told == ["training_relations", "unchanged_tensor"] and "weights/net.backbone.0.weight" in captured
