"""Where a NaN began: the module (or the loss) whose output first went non-finite, found by replaying the step's
forward before the update, in the plain-loop probe and Lightning; and the replay changes nothing of the training."""

import pytest
import torch

import helpers
import tripwire
from tripwire.plugins.torch import TripwireProbe


class Square(torch.nn.Module):
    """x * x: overflows float32 once its input passes ~1.8e19 (an energy or polynomial feature)."""

    def forward(self, x):
        return x * x


def squared_features(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), Square(),
                               torch.nn.Linear(32, 10))


def batches():
    (x, y), _ = helpers.digits()
    return [(torch.tensor(x[i:i + 32]), torch.tensor(y[i:i + 32], dtype=torch.long))
            for i in range(0, len(x) - 31, 32)]


def hand_written_nll(logits, y):
    """-log(softmax) computed in two steps: a saturated softmax gives log(0) = -inf."""
    return -torch.log(torch.softmax(logits, dim=1)[torch.arange(len(y)), y]).mean()


def probe_fit(out, *, scale_input_at=None, scale_logits_at=None, steps=40, device="cpu", in_parts=False):
    """A plain loop over digits; `scale_input_at`: the step whose batch is multiplied by 1e20 (unscaled data:
    the squared features overflow), `scale_logits_at`: the step whose logits are multiplied by 1e4 in a
    hand-written loss; `in_parts`: the probe is given an nn.ModuleDict of the features and the last layer, which
    the loop calls one after the other. Returns the probe and the losses."""
    net = squared_features().to(device)
    model = torch.nn.ModuleDict({"features": net[:-1], "head": net[-1]}) if in_parts else net
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    data, losses = batches(), []
    with TripwireProbe(model, optimizer, out_dir=out) as probe:  # the default config
        for step in range(steps):
            x, y = (t.to(device) for t in data[step % len(data)])
            if step == scale_input_at:
                x = x * 1e20
            optimizer.zero_grad()
            logits = model["head"](model["features"](x)) if in_parts else net(x)
            loss = hand_written_nll(logits * (1e4 if step == scale_logits_at else 1.0), y)
            loss.backward()
            optimizer.step()
            probe.step(loss)
            losses.append(float(loss))
            if probe.should_stop:
                break
    return probe, losses


def nan_verdict(probe):
    (verdict,) = [v for v in probe.verdicts if v.rule == "exploding_tensor"]
    return verdict


def test_probe_names_the_module_that_overflowed_at_the_step_it_did(tmp_path):
    probe, _ = probe_fit(tmp_path / "run", scale_input_at=13)
    verdict = nan_verdict(probe)
    assert verdict.step == 13
    assert "It began in `3`: its output holds" in verdict.message
    assert "from a finite input that had grown to" in verdict.message and "learning rate" in verdict.hint
    run = tripwire.open_run(probe.run_url)
    assert run.tensor("origin/3").reduction(13, "nonfinite_count") > 0
    assert run.tensor("origin/3").reduction(13, "input_max_abs") > 1e19  # finite, and large enough to overflow
    assert [n for n in run.tensor_names() if n.startswith("origin/")] == ["origin/3"]


@pytest.mark.parametrize("scale_input_at", [13, None], ids=["overflow", "healthy"])
def test_a_model_in_parts_the_loop_calls_one_by_one_is_seen_from_their_forwards(tmp_path, scale_input_at):
    """An nn.ModuleDict has no forward (a GAN's generator and discriminator, an encoder and a head the loop calls in
    turn): the probe watches the forwards of the parts it holds. The step begins at the first, so its inputs and
    every part's activations are captured (a GAN's generator was never seen: the step began at the optimizer's
    step), and a NaN is traced to the part's module it began in."""
    probe, losses = probe_fit(tmp_path / "run", scale_input_at=scale_input_at, steps=80, in_parts=True)
    run = tripwire.open_run(probe.run_url)
    assert {"inputs/x", "activations/features.1"} <= set(run.tensor_names())  # the ReLU
    if scale_input_at is None:
        assert not [v for v in probe.verdicts if v.fired and v.severity in ("error", "warning")]
        assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:10]) / 10  # it learns
    else:
        assert nan_verdict(probe).step == 13 and "It began in `features.3`" in nan_verdict(probe).message
        assert [n for n in run.tensor_names() if n.startswith("origin/")] == ["origin/features.3"]


def test_probe_names_the_loss_where_the_model_output_was_finite(tmp_path):
    probe, _ = probe_fit(tmp_path / "run", scale_logits_at=13)
    verdict = nan_verdict(probe)
    assert verdict.step == 13 and "It began in the loss: the model's output was finite" in verdict.message
    assert "fused loss on logits" in verdict.hint
    assert tripwire.open_run(probe.run_url).tensor("origin/loss").reduction(13, "nonfinite_count") == 1


def test_the_fixed_program_learns_and_records_no_origin(tmp_path):
    probe, losses = probe_fit(tmp_path / "run", steps=80)
    assert not [v for v in probe.verdicts if v.fired and v.severity in ("error", "warning")]
    assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:10]) / 10  # it learns
    assert not [n for n in tripwire.open_run(probe.run_url).tensor_names() if n.startswith("origin/")]


def lightning_module(nan_step, where):
    """BatchNorm, dropout and a torchmetrics accuracy updated and logged in training_step: what a replay could
    change. `where`: 'loss' (the logits scaled by 1e4 at nan_step in a hand-written loss) or 'input' (NaN in
    the batch at nan_step)."""
    import lightning.pytorch as pl
    import torchmetrics

    torch.manual_seed(0)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                           torch.nn.Dropout(0.2), torch.nn.Linear(32, 10))
            self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=10)

        def training_step(self, batch, batch_idx):
            x, y = batch
            if where == "input" and self.global_step == nan_step:
                x = x.clone()
                x[0, 5] = float("nan")
            logits = self.net(x)
            self.accuracy(logits, y)
            self.log("train_acc", self.accuracy, on_epoch=True)
            scale = 1e4 if where == "loss" and self.global_step == nan_step else 1.0
            return hand_written_nll(logits * scale, y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Module()


@pytest.mark.parametrize("where", ["loss", "input"])
def test_lightning_names_where_the_nan_began_and_the_replay_changes_nothing(tmp_path, where):
    from tripwire.plugins.lightning import TripwireCallback

    ends = {}
    for name, callback in [("plain", None), ("tripwire", TripwireCallback(out_dir=tmp_path / "run"))]:
        module = lightning_module(nan_step=12, where=where)
        helpers.fit(callback, module, max_epochs=1, max_steps=13)
        ends[name] = (module.net[1].running_mean.clone(), module.net[1].running_var.clone(),
                      int(module.net[1].num_batches_tracked), module.accuracy.tp.clone(), torch.get_rng_state())
    verdict = nan_verdict(callback)
    assert verdict.step == 12
    if where == "loss":
        assert "It began in the loss: the model's output was finite" in verdict.message
    else:
        assert "The input of `net.0` (Linear) already held 1 NaN/Inf value(s)" in verdict.message
    # the replay put back BatchNorm's statistics, the metric's state and the random number generator
    for plain, traced in zip(ends["plain"], ends["tripwire"]):
        torch.testing.assert_close(torch.as_tensor(traced), torch.as_tensor(plain), rtol=0, atol=0, equal_nan=True)


def test_lightning_healthy_run_records_no_origin(tmp_path):
    from tripwire.plugins.lightning import TripwireCallback

    callback = TripwireCallback(out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, lightning_module(nan_step=None, where="loss"), max_epochs=3)
    assert trainer.callback_metrics["train_acc_epoch"] > 0.8  # it learns
    assert not [v for v in callback.verdicts if v.fired and v.severity in ("error", "warning")]
    assert not [n for n in tripwire.open_run(callback.run_url).tensor_names() if n.startswith("origin/")]


class Log(torch.nn.Module):
    def forward(self, x):
        return torch.log(x)


def test_probe_names_a_log_of_zero_with_the_change_to_make(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), Log(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = batches()[0]
    with TripwireProbe(net, optimizer, out_dir=tmp_path / "run") as probe:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        probe.step(loss)
    verdict = nan_verdict(probe)
    assert verdict.step == 0 and "It began in `2`: its output holds" in verdict.message
    assert "from a finite input (largest |input|" in verdict.message and "log or sqrt" in verdict.hint
