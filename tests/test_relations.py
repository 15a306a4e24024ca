"""training_relations: bugs that show no bad number, caught at the step they first show — a missing zero_grad()
(at step 1) and training in eval mode — in the plain-torch probe and in Lightning's manual optimisation; each
buggy loop has a healthy twin that must stay silent (accumulation, zero_grad between forward and backward, a GAN's
two optimizers, BatchNorm frozen in eval mode on purpose)."""

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import helpers
import tripwire
from tripwire.plugins.lightning import TripwireCallback
from tripwire.plugins.torch import TripwireProbe

F = nn.functional
CONFIG = {"sampling": {"every": 10}, "rules": [{"rule": "training_relations"}]}


def digits():
    (x, y), _ = helpers.digits()
    return torch.tensor(x), torch.tensor(y, dtype=torch.long)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 10))


def loop(out, clear="before_forward", accumulate=1, mode=None, steps=40):
    """A plain loop on digits; `clear`: where zero_grad() is called (None: nowhere); `mode(model)` sets the mode
    before training. Returns (the run, the final training accuracy)."""
    x, y = digits()
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
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
            if (step + 1) % accumulate == 0:
                optimizer.step()
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


@pytest.mark.parametrize("clear, accumulate", [("before_forward", 1), ("before_backward", 1), ("before_forward", 4)])
def test_healthy_loops_break_no_relation(tmp_path, clear, accumulate):
    run, accuracy = loop(tmp_path / "run", clear=clear, accumulate=accumulate, steps=80)
    assert accuracy > 0.8  # they learn
    assert findings(run) == []
    # the mode is judged at the steps an optimizer took: with accumulation, not at the first micro-batch sampled
    judged = {"relations/stale_gradients"} | ({"relations/eval_mode"} if accumulate == 1 else set())
    assert set(run.tensor_names("relations")) == judged


def test_training_in_eval_mode_is_a_warning(tmp_path):
    run, _ = loop(tmp_path / "run", mode=lambda model: model.eval())
    assert findings(run) == [("eval_mode", 0, "warning")]
    assert "model.train()" in run.verdicts()[0].hint


def test_batch_norm_frozen_on_purpose_is_the_users_choice(tmp_path):
    def freeze_batch_norm(model):
        model.train()
        model[1].eval()

    run, _ = loop(tmp_path / "run", mode=freeze_batch_norm)
    assert findings(run) == []


class Manual(pl.LightningModule):
    """Manual optimisation, with or without zero_grad(); with `gan`, two optimizers over two halves, the second's
    loss flowing back into the first half too (as a GAN's generator loss reaches the discriminator)."""

    def __init__(self, clear=True, gan=False):
        super().__init__()
        self.automatic_optimization = False
        self.clear, self.gan = clear, gan
        self.body, self.head = nn.Sequential(nn.Linear(64, 32), nn.ReLU()), nn.Linear(32, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizers = self.optimizers() if self.gan else [self.optimizers()]
        for optimizer in reversed(optimizers):  # the head's optimizer first, as a GAN's generator step
            loss = F.cross_entropy(self.head(self.body(x)), y)
            if self.clear:
                optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        self.log("train_loss", loss)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.head(self.body(x)).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        if self.gan:
            return (torch.optim.SGD(self.body.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1))
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("clear, gan", [(False, False), (True, False), (True, True)])
def test_lightning_manual_optimisation(tmp_path, clear, gan):
    torch.manual_seed(0)
    callback = TripwireCallback(CONFIG, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, Manual(clear=clear, gan=gan), max_epochs=2)
    run = tripwire.open_run(callback.run_url)
    if clear:
        assert trainer.callback_metrics["val_acc"] > 0.8
        assert findings(run) == [] and run.tensor_names("relations") == ["relations/stale_gradients"]
    else:
        ((finding, step, severity),) = findings(run)
        assert (finding, severity) == ("stale_gradients", "error") and step <= 2


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
