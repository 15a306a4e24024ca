"""ReLUs applied as functions (pytorch/examples' mnist: `F.relu(self.fc1(x))`), which no module hook sees: found in
the autograd graph of the first sampled step, captured as `activations/<layer>:relu` in the plain-loop probe and
Lightning, judged by dead_relu; no ReLU on anything but a layer's output, none twice, and no saved tensor read
(activation checkpointing recomputes nothing more)."""

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import helpers
import tripwire
from tripwire.plugins.lightning import TripwireCallback
from tripwire.plugins.torch import TripwireProbe

F = nn.functional
CONFIG = {"rules": ["dead_relu"], "sampling": {"every": 10},
          "collections": {"activations": {"include": ["relu"], "reductions": ["min"]}}}


class MnistNet(nn.Module):
    """pytorch/examples' mnist Net, sized for 8x8 digits: convolutions and a dense layer, each through F.relu."""

    def __init__(self, dead: bool = False):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(256, 64), nn.Linear(64, 10)
        if dead:  # every unit of fc1 below zero for every input: its ReLU passes nothing
            nn.init.constant_(self.fc1.bias, -20.0)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.dropout(torch.flatten(x, 1), 0.25, self.training)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def images():
    (x, y), (xv, yv) = helpers.digits()
    return (torch.tensor(x).view(-1, 1, 8, 8), torch.tensor(y, dtype=torch.long),
            torch.tensor(xv).view(-1, 1, 8, 8), torch.tensor(yv, dtype=torch.long))


def accuracy(net, x, y) -> float:
    net.eval()
    with torch.no_grad():
        return float((net(x).argmax(1) == y).float().mean())


def probe_fit(out, net, steps=200, config=CONFIG):
    torch.manual_seed(0)
    x, y, xv, yv = images()
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    with TripwireProbe(net, optimizer, config, out_dir=out) as probe:
        helpers.probe_steps(probe, net, optimizer, x, y, steps, F.nll_loss)
    return tripwire.open_run(probe.run_url), accuracy(net, xv, yv)


def dead_relu_verdicts(run) -> list:
    return [v for v in run.verdicts() if v.rule == "dead_relu" and v.fired]


@pytest.mark.parametrize("dead", [False, True], ids=["healthy", "negative_bias"])
def test_probe_judges_relus_applied_as_functions(tmp_path, dead):
    torch.manual_seed(0)
    run, learned = probe_fit(tmp_path / "run", MnistNet(dead))
    names = ["activations/conv1:relu", "activations/conv2:relu", "activations/fc1:relu"]
    assert sorted(run.tensor_names("activations")) == names
    assert run.tensor("activations/conv2:relu").steps() == list(range(0, 200, 10))
    assert run.tensor("activations/fc1:relu").reduction(0, "min") == 0  # the ReLU's output, not the layer's
    if dead:
        (verdict,) = dead_relu_verdicts(run)
        assert (verdict.step, verdict.severity) == (20, "error") and "fc1:relu (the output of Linear fc1)" in \
            verdict.message and "Every bias of Linear fc1 is negative (at most -20" in verdict.hint
    else:
        assert learned > 0.85 and dead_relu_verdicts(run) == []


class MnistModule(pl.LightningModule):
    def __init__(self, dead: bool = False):
        super().__init__()
        self.net = MnistNet(dead)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.nll_loss(self.net(x.view(-1, 1, 8, 8)), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x.view(-1, 1, 8, 8)).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


@pytest.mark.parametrize("dead", [False, True], ids=["healthy", "negative_bias"])
def test_lightning_judges_relus_applied_as_functions(tmp_path, dead):
    torch.manual_seed(0)
    callback = TripwireCallback(CONFIG, out_dir=tmp_path / "run")
    trainer = helpers.fit(callback, MnistModule(dead), max_epochs=2)
    run = tripwire.open_run(callback.run_url)
    assert sorted(run.tensor_names("activations")) == ["activations/net.conv1:relu", "activations/net.conv2:relu",
                                                         "activations/net.fc1:relu"]
    if dead:
        (verdict,) = dead_relu_verdicts(run)
        assert verdict.severity == "error" and "net.fc1:relu (the output of Linear net.fc1)" in verdict.message
    else:
        assert trainer.callback_metrics["val_acc"] > 0.85 and dead_relu_verdicts(run) == []


class Mixed(nn.Module):
    """A ReLU module, a functional ReLU on a residual sum, one in place on a layer's output, and a hinge margin in
    the model's own output: only the module's and the in-place one are a layer's ReLU, each captured once; the
    dense layer in the middle runs under activation checkpointing."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2, self.fc3 = nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 10)
        self.recomputed = 0

    def middle(self, h):
        self.recomputed += 1
        return self.fc2(h)

    def forward(self, x):
        h = self.act(self.fc1(x.flatten(1)))
        h = F.relu(h + checkpoint(self.middle, h, use_reentrant=False))  # a sum: no layer's units
        logits = F.relu(self.fc3(h), inplace=True)
        return F.log_softmax(logits - F.relu(1 - logits).mean(), dim=1)


def test_only_relus_on_a_layers_output_are_taken_once_and_no_saved_tensor_is_read(tmp_path):
    torch.manual_seed(0)
    net = Mixed()
    run, _ = probe_fit(tmp_path / "run", net, steps=30)
    assert sorted(run.tensor_names("activations")) == ["activations/act", "activations/fc3:relu"]
    assert net.recomputed == 2 * 30 + 1  # each step's forward and backward's recomputation, the accuracy's: no more
