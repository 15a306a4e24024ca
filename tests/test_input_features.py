"""input_features: a table whose features lie on scales far apart (one raw column in the thousands beside
standardised ones), judged once on the first batch, in the plain-torch probe and in Lightning (Keras: in
keras_cases.py, on every backend). The same data standardised stays silent; only the first batch is kept whole."""

import pytest
import torch

import helpers
import tripwire
from tripwire.plugins.lightning import TripwireCallback
from tripwire.plugins.torch import TripwireProbe

CONFIG = {"sampling": {"every": 10}, "rules": [{"rule": "input_features"}], "collections": {"inputs": {}}}


def table(raw_column: bool):
    """Digits, standardised; with `raw_column`, feature 5 multiplied by 10,000 (a measurement left in its unit)."""
    (x, y), _ = helpers.digits()
    x = x.copy()
    if raw_column:
        x[:, 5] *= 10_000.0
    return torch.tensor(x), torch.tensor(y, dtype=torch.long)


def train_with_probe(out, x, y, steps=30, first=()):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*first, torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    with TripwireProbe(net, optimizer, CONFIG, out_dir=out) as probe:
        for step in range(steps):
            i = 32 * (step % 40)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x[i:i + 32]), y[i:i + 32]).backward()
            optimizer.step()
            probe.step()
    return tripwire.open_run(probe.run_url)


@pytest.mark.parametrize("raw_column", [True, False])
def test_the_probe_names_the_feature_on_another_scale(tmp_path, raw_column):
    run = train_with_probe(tmp_path / "run", *table(raw_column))
    scales = [v for v in run.verdicts() if v.rule == "input_features" and v.finding.endswith(":scales")]
    if not raw_column:
        assert scales == []
        return
    (verdict,) = scales
    assert verdict.severity == "warning" and verdict.step == 0 and verdict.evidence["largest"] == 5
    assert "feature 5" in verdict.message and "standardise" in verdict.hint
    # the first batch is kept whole for this rule, the other sampled batches as reductions only
    inputs = run.tensor("inputs/x")
    assert inputs.steps(tensors=True) == [0] and inputs.steps() == [0, 10, 20]


def test_constant_features_are_info(tmp_path):
    x, y = table(raw_column=False)
    x[:, 7] = 3.0
    run = train_with_probe(tmp_path / "run", x, y)
    (verdict,) = [v for v in run.verdicts() if v.rule == "input_features"]
    assert verdict.severity == "info" and verdict.finding == "inputs/x:constant"
    assert 7 in verdict.evidence["features"]


def test_lightning_names_the_feature_on_another_scale(tmp_path):
    x, y = table(raw_column=True)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    callback = TripwireCallback(CONFIG, out_dir=tmp_path / "run")
    helpers.fit(callback, helpers.mlp_module(lr=0.01), max_epochs=1, loaders=(loader, loader))
    (verdict,) = [v for v in tripwire.open_run(callback.run_url).verdicts() if v.finding == "inputs/x:scales"]
    assert verdict.rule == "input_features" and verdict.evidence["largest"] == 5
    assert verdict.evidence["ratio"] > 1000


def test_a_model_whose_first_layer_normalises_each_feature_is_not_judged(tmp_path):
    """A BatchNorm as the first layer standardises each feature itself: the raw column is the model's business."""
    x, y = table(raw_column=True)
    run = train_with_probe(tmp_path / "run", x, y, first=(torch.nn.BatchNorm1d(64),))
    assert run.model.inputs_scaled == "BatchNorm1d"
    (verdict,) = run.verdicts()
    assert verdict.status == "no_data" and "(BatchNorm1d) rescales or normalises the inputs" in verdict.message
