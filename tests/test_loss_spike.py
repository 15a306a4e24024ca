"""loss_spike and gradient_spike: the training loss, and the gradient norm, of every step against its own recent
level, with patience — in the plain-loop probe, Lightning (every step's loss, read at the next sample; every step's
gradient norm) and Keras (the loss, told from the running mean it logs), silent on healthy training and on a loss
that only drifts."""

import numpy as np
import torch

import helpers
import tripwire
from tripwire.core.rules.spikes import LossSpike
from tripwire.plugins.torch import TripwireProbe

CONFIG = {"rules": [{"rule": "loss_spike"}]}


def probe_fit(out, corrupt=range(0), config=CONFIG):
    """The digits MLP in a plain loop, 400 steps; at the steps in `corrupt` the labels are shifted by 3 (a bad
    shard of data)."""
    torch.manual_seed(0)
    (x, y), _ = helpers.digits()
    x, y = torch.tensor(x), torch.tensor(y)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    with TripwireProbe(net, optimizer, config, out_dir=out) as probe:
        for step in range(400):
            i = 32 * (step % 40)
            xb, yb = x[i:i + 32], y[i:i + 32]
            if step in corrupt:
                yb = (yb + 3) % 10
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            optimizer.step()
            probe.step(loss)
            losses.append(float(loss))
    return probe, losses


def spikes(verdicts, rule="loss_spike") -> list:
    return [(v.step, v.onset, v.severity) for v in verdicts if v.rule == rule and v.fired]


def test_a_bad_shard_of_data_is_a_spike_named_at_the_step_it_began(tmp_path):
    probe, _ = probe_fit(tmp_path / "run", corrupt=range(250, 262))
    assert spikes(probe.verdicts) == [(259, 250, "warning")]  # patience 10: 250-259
    (verdict,) = [v for v in probe.verdicts if v.rule == "loss_spike"]
    assert "jumped at step 250" in verdict.message and "before step 250" in verdict.message
    # every step's loss is stored (read at the samples), the spike's step with its facts
    run = tripwire.open_run(probe.run_url)
    assert run.tensor("losses/train").series("value")[0].tolist() == list(range(400))
    assert run.tensor("spikes/loss_spike").reduction(259, "began") == 250


def test_healthy_training_has_no_spike(tmp_path):
    probe, losses = probe_fit(tmp_path / "run")
    assert np.mean(losses[-40:]) < 0.3 * np.mean(losses[:10])  # it learns
    assert spikes(probe.verdicts) == [] and "spikes/loss_spike" not in tripwire.open_run(probe.run_url).tensor_names()


BOTH = {"rules": [{"rule": "loss_spike"}, {"rule": "gradient_spike"}]}


def test_a_bad_shard_of_data_is_a_gradient_spike_too_each_rule_reading_its_own_series(tmp_path):
    """The shifted labels' gradients are larger as their losses are: both rules tell the spike at its step, each
    from its own series (every step's total gradient norm, `metrics/grad_norm`), each in its own words."""
    probe, _ = probe_fit(tmp_path / "run", corrupt=range(250, 262), config=BOTH)
    assert spikes(probe.verdicts) == spikes(probe.verdicts, "gradient_spike") == [(259, 250, "warning")]
    (verdict,) = [v for v in probe.verdicts if v.rule == "gradient_spike"]
    run = tripwire.open_run(probe.run_url)
    steps, norms = run.tensor("metrics/grad_norm").series("value")
    assert steps.tolist() == list(range(400))
    assert np.median(norms[250:260]) > 2 * np.median(norms[200:250])
    # its own facts, not loss_spike's of the same step: the norm of step 259, not the loss
    assert verdict.message.startswith(f"the gradient norm jumped at step 250 and stays up: {norms[259]:.4g} at step 259")
    (loss_verdict,) = [v for v in probe.verdicts if v.rule == "loss_spike"]
    assert f"{run.tensor('losses/train').reduction(259):.4g} at step 259" in loss_verdict.message


def test_healthy_training_has_no_gradient_spike_and_no_norm_is_computed_unless_a_rule_reads_it(tmp_path):
    probe, losses = probe_fit(tmp_path / "run", config=BOTH)
    assert np.mean(losses[-40:]) < 0.3 * np.mean(losses[:10])  # it learns
    assert spikes(probe.verdicts) == spikes(probe.verdicts, "gradient_spike") == []
    # the norms are the metric the rule reads, handed over every step: the loop passing no metric of its own, the
    # rule had its data, and the end of the run does not say it never had
    assert [v.message for v in probe.verdicts if v.status == "no_data"] == []
    probe, _ = probe_fit(tmp_path / "without", corrupt=range(250, 262))  # loss_spike alone
    assert "metrics/grad_norm" not in tripwire.open_run(probe.run_url).tensor_names()


def test_a_gradient_norm_that_climbs_as_the_model_leaves_its_plateau_is_no_spike(tmp_path):
    """pytorch/tutorials' nn_tutorial CNN (three stride-2 convolutions to 10 channels, ReLU, average pooling; SGD
    0.1, momentum 0.9): the loss sits at ln 10 for about four epochs, then falls while the gradient norm climbs
    tenfold in 40 steps and stays there. The level was the window's median, and the values above it that came back
    were kept out of it: it stayed at the plateau's 0.13 and the climb was told four times as spikes to roll back
    from."""
    torch.manual_seed(0)
    (x, y), _ = helpers.digits(n_train=1400, pixels=True)
    x = torch.nn.functional.pad(torch.tensor(x / 255).reshape(-1, 8, 8).repeat_interleave(3, 1)
                                .repeat_interleave(3, 2), (2, 2, 2, 2)).reshape(-1, 1, 28, 28)
    y = torch.tensor(y)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 10, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    losses = []
    with TripwireProbe(net, optimizer, BOTH, out_dir=tmp_path / "run") as probe:
        for epoch in range(15):
            for i in torch.randperm(len(y)).split(64):
                loss = torch.nn.functional.cross_entropy(net(x[i]), y[i])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                probe.step(loss)
                losses.append(float(loss))
    norms = tripwire.open_run(probe.run_url).tensor("metrics/grad_norm").series("value")[1]
    assert np.mean(losses[:40]) > 2.2 and np.mean(losses[-40:]) < 0.6  # a plateau, then it learns
    assert np.median(norms[150:250]) > 4 * np.median(norms[:80])  # and its gradient norm climbed to stay
    assert spikes(probe.verdicts) == spikes(probe.verdicts, "gradient_spike") == []


def shifted_module(steps):
    """The digits MLP as a LightningModule whose labels are shifted by 3 at `steps`."""
    import lightning.pytorch as pl

    class Shifted(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.global_step in steps:
                y = (y + 3) % 10
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Shifted()


def test_lightning_reads_every_step_s_loss_at_the_next_sample(tmp_path):
    from tripwire.plugins.lightning import TripwireCallback

    callback = TripwireCallback(CONFIG, out_dir=tmp_path / "run")
    helpers.fit(callback, shifted_module(range(150, 160)), max_epochs=6)
    assert spikes(callback.verdicts) == [(159, 150, "warning")]


def test_lightning_reads_every_step_s_gradient_norm_and_a_healthy_run_has_no_spike(tmp_path):
    from tripwire.plugins.lightning import TripwireCallback

    callback = TripwireCallback(BOTH, out_dir=tmp_path / "spike")
    helpers.fit(callback, shifted_module(range(150, 160)), max_epochs=6)
    assert spikes(callback.verdicts, "gradient_spike") == [(159, 150, "warning")]
    assert tripwire.open_run(callback.run_url).tensor("metrics/grad_norm").series("value")[0].tolist() == \
        list(range(6 * 43))  # every step's, before clipping
    callback = TripwireCallback(BOTH, out_dir=tmp_path / "healthy")
    trainer = helpers.fit(callback, shifted_module(()), max_epochs=6)
    assert spikes(callback.verdicts) == spikes(callback.verdicts, "gradient_spike") == []


def stream_fires(losses, **params) -> list:
    watch = LossSpike(**params).stream()
    return [step for step, value in enumerate(losses) if watch.see(step, value)]


def test_a_loss_that_drifts_up_or_settles_at_zero_is_no_spike():
    noise = np.random.default_rng(0).normal(0, 0.05, 2000)
    assert stream_fires(np.linspace(0.7, 3.0, 2000) + noise) == []  # a GAN generator's loss as its critic wins
    assert stream_fires(np.r_[np.zeros(200), np.full(50, 1e-9)]) == []  # a problem fit exactly
    # fit exactly, one sample per step: a few samples' losses of 0.03 around 1e-7 are noise, not a state to undo
    fitted = np.abs(noise[:300]) * 1e-6
    fitted[250:256] = 0.03
    assert stream_fires(np.r_[0.5 + noise[:40], fitted]) == []
    assert stream_fires(np.r_[0.5 + noise[:40], 0.1 + noise[:200] / 10, np.full(12, 0.5)]) == [249]  # not yet fit
    assert stream_fires(np.r_[1.0 + noise[:200], 1.5 + noise[:20]]) == [209]  # a jump that stays
    assert stream_fires(np.r_[1.0 + noise[:200], [1.5] * 7, 1.0 + noise[:20]]) == []  # shorter than patience
    # a classifier near a perfect fit (2.3 to 0.002) that loses a few samples for a while: 0.12 gives back 5 % of
    # the ground it gained, nothing to roll back for (without `progress` a spike at 249); 1.0 gives back 43 %
    near_fit = 0.002 + np.abs(noise[:200]) / 100
    assert stream_fires(np.r_[2.3 + noise[:40], near_fit, np.full(15, 0.12)]) == []
    assert stream_fires(np.r_[2.3 + noise[:40], near_fit, np.full(15, 1.0)]) == [249]


def test_a_rule_whose_look_at_every_loss_fails_is_dropped_and_training_goes_on(tmp_path, caplog):
    config = {"rules": [{"rule": "custom_rules:FailingLossStream"}, {"rule": "loss_spike"}]}
    probe, losses = probe_fit(tmp_path / "run", corrupt=range(250, 262), config=config)
    assert len(losses) == 400 and "could not judge losses/train of step 4" in caplog.text
    assert spikes(probe.verdicts) == [(259, 250, "warning")]  # the other rule's stream goes on


def keras_fit(out, corrupt=range(0)):
    """The digits MLP in Keras, one epoch of 400 steps in order; the batches in `corrupt` have their labels
    shifted by 3. Returns the callback and each step's loss (from the epoch's running mean Keras logs)."""
    import keras

    from tripwire.plugins.keras import TripwireCallback

    keras.utils.set_random_seed(0)
    (x, y), _ = helpers.digits()
    x, y = np.resize(x, (400 * 32, 64)), np.resize(y, 400 * 32)
    for step in corrupt:
        y[32 * step:32 * step + 32] = (y[32 * step:32 * step + 32] + 3) % 10
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callback = TripwireCallback(CONFIG, out_dir=out)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    return callback


def test_keras_tells_each_step_s_loss_from_the_running_mean_it_logs(tmp_path):
    callback = keras_fit(tmp_path / "run", corrupt=range(250, 262))
    assert spikes(callback.verdicts) == [(259, 250, "warning")]
    steps, losses = tripwire.open_run(callback.run_url).tensor("losses/train").series("value")
    assert steps.tolist() == list(range(400))
    assert np.median(losses[250:262]) > 3 * np.median(losses[200:250])  # the steps' own, not the epoch's mean


def test_keras_healthy_training_has_no_spike(tmp_path):
    callback = keras_fit(tmp_path / "run")
    _, losses = tripwire.open_run(callback.run_url).tensor("losses/train").series("value")
    assert np.mean(losses[-40:]) < 0.3 * np.mean(losses[:10]) and spikes(callback.verdicts) == []  # it learns


def test_layers_trained_one_after_another_each_by_its_own_optimizer_are_no_gradient_spike(tmp_path):
    """As pytorch/examples' forward-forward trains: the first layer until it has converged, then the second, each
    with its own Adam. The second's gradients are far larger than the first's were at the end: the norm series is
    the first optimizer's alone, and stops with it."""
    torch.manual_seed(0)
    (x, y), _ = helpers.digits()
    x, y = torch.tensor(x), torch.tensor(y)
    first, second = torch.nn.Linear(64, 10), torch.nn.Linear(64, 10)
    model = torch.nn.ModuleList([first, second])
    optimizers = [torch.optim.Adam(first.parameters(), lr=1e-2), torch.optim.Adam(second.parameters(), lr=1e-3)]
    with TripwireProbe(model, optimizers, BOTH, out_dir=tmp_path / "run") as probe:
        for step in range(400):
            layer, optimizer = (first, optimizers[0]) if step < 200 else (second, optimizers[1])
            i = 32 * (step % 40)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(layer(x[i:i + 32]), y[i:i + 32])
            loss.backward()
            optimizer.step()
            probe.step(loss)
    norms = tripwire.open_run(probe.run_url).tensor("metrics/grad_norm").series("value")[0]
    assert list(norms) == list(range(200))
    assert spikes(probe.verdicts, "gradient_spike") == []


def test_a_stage_on_inputs_of_another_shape_starts_its_loss_over_without_a_spike(tmp_path):
    """Progressive resizing (fast.ai's idiom): a fully convolutional network trains on small images, then on large
    ones, each stage with a one-cycle schedule of its own. At the first large batch the loss goes back to about
    chance and falls again from there: loss_spike said 'jumped and stays up, roll back' under the default config
    (a port: 0.10 -> 2.11 at the switch, 96 % accurate at the end). Inputs of a shape the probe has not seen begin
    a stage that is judged afresh."""
    (xt, yt), (xv, yv) = helpers.digits()
    large = lambda x: torch.nn.functional.interpolate(torch.tensor(x).view(-1, 1, 8, 8), size=16)  # noqa: E731
    torch.manual_seed(0)
    block = lambda i, o, s: torch.nn.Sequential(torch.nn.Conv2d(i, o, 3, s, 1, bias=False),  # noqa: E731
                                                 torch.nn.BatchNorm2d(o), torch.nn.ReLU())
    model = torch.nn.Sequential(block(1, 32, 1), block(32, 64, 2), block(64, 64, 2), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    labels = torch.tensor(yt)
    with TripwireProbe(model, optimizer, None, out_dir=tmp_path / "run") as probe:
        for images in (torch.tensor(xt).view(-1, 1, 8, 8), large(xt)):
            batches = list(zip(images.split(64), labels.split(64)))
            schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=6 * len(batches))
            for _ in range(6):
                for x, y in batches:
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    schedule.step()
                    probe.step(loss)
    model.eval()
    with torch.no_grad():
        accuracy = float((model(large(xv)).argmax(1) == torch.tensor(yv)).float().mean())
    losses = tripwire.open_run(probe.run_url).tensor("losses/train").series()[1]
    switch = 6 * len(batches)
    assert losses[switch] > 5 * losses[switch - 1] and accuracy > 0.85, (losses[switch - 1:switch + 1], accuracy)
    assert [v.message for v in probe.verdicts if v.counts] == []
