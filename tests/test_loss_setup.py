"""Checks before the model learns anything: the output layer, the loss and the labels, read from what the first
step ran (the plain-torch probe and Lightning here; Keras in keras_cases.py, on every backend). Each buggy program
has a fixed twin that must stay silent."""

import numpy as np
import pytest
import torch
from torch import nn

import helpers
import tripwire
from tripwire.plugins.lightning import TripwireCallback
from tripwire.plugins.torch import TripwireProbe

F = nn.functional


def digits_tensors(n=512):
    (x, y), _ = helpers.digits()
    return torch.tensor(x[:n]), torch.tensor(y[:n], dtype=torch.long)


# (id, the model's head after a Linear(64, 32) + ReLU body, the loss of (output, labels), the labels from the digit,
#  the finding on the buggy program or None on its fixed twin)
CASES = [
    ("softmax_into_cross_entropy", lambda: nn.Sequential(nn.Linear(32, 10), nn.Softmax(dim=1)),
     lambda out, y: F.cross_entropy(out, y), lambda y: y, "applied_twice"),
    ("logits_into_cross_entropy", lambda: nn.Linear(32, 10),
     lambda out, y: nn.CrossEntropyLoss()(out, y), lambda y: y, None),
    ("one_unit_softmax", lambda: nn.Sequential(nn.Linear(32, 1), nn.Softmax(dim=1)),
     lambda out, y: F.binary_cross_entropy(out.squeeze(1), y), lambda y: (y == 0).float(), "one_unit_softmax"),
    ("one_unit_sigmoid", lambda: nn.Sequential(nn.Linear(32, 1), nn.Sigmoid()),
     lambda out, y: nn.BCELoss()(out.squeeze(1), y), lambda y: (y == 0).float(), None),
    ("sigmoid_for_targets_in_the_tens", lambda: nn.Sequential(nn.Linear(32, 1), nn.Sigmoid()),
     lambda out, y: F.mse_loss(out.view(-1), y), lambda y: y.float() * 4 + 3, "unreachable_targets"),
    ("linear_for_targets_in_the_tens", lambda: nn.Linear(32, 1),
     lambda out, y: F.mse_loss(out.view(-1), y), lambda y: y.float() * 4 + 3, None),
    ("relu_for_negative_targets", lambda: nn.Sequential(nn.Linear(32, 1), nn.ReLU()),
     lambda out, y: F.l1_loss(out[:, 0], y), lambda y: y.float() - 4.5, "unreachable_targets"),
    ("nll_on_logits", lambda: nn.Linear(32, 10),
     lambda out, y: F.nll_loss(out, y), lambda y: y, "not_log_probabilities"),
    ("nll_on_log_softmax", lambda: nn.Sequential(nn.Linear(32, 10), nn.LogSoftmax(dim=1)),
     lambda out, y: F.nll_loss(out, y), lambda y: y, None),
    ("softmax_under_mse_for_classes", lambda: nn.Sequential(nn.Linear(32, 10), nn.Softmax(dim=-1)),
     lambda out, y: F.mse_loss(out, F.one_hot(y, 10).float()), lambda y: y, "classes_by_regression"),
    ("class_ids_as_one_number", lambda: nn.Linear(32, 1),
     lambda out, y: F.mse_loss(out.view(-1), y), lambda y: y.float(), "classes_by_regression"),
    ("ratings_1_to_5_as_one_number", lambda: nn.Linear(32, 1),
     lambda out, y: F.mse_loss(out.view(-1), y), lambda y: (y % 5 + 1).float(), None),
    ("yes_no_by_absolute_error", lambda: nn.Sequential(nn.Linear(32, 1), nn.Sigmoid()),
     lambda out, y: F.l1_loss(out.view(-1), y), lambda y: (y % 2).float(), "classes_by_regression"),
    ("yes_no_by_squared_error", lambda: nn.Sequential(nn.Linear(32, 1), nn.Sigmoid()),
     lambda out, y: F.mse_loss(out.view(-1), y), lambda y: (y % 2).float(), None),
    ("log_softmax_across_the_batch", lambda: nn.Linear(32, 10),
     lambda out, y: F.nll_loss(F.log_softmax(out, dim=0), y), lambda y: y, "softmax_axis"),
    ("log_softmax_over_the_classes", lambda: nn.Linear(32, 10),
     lambda out, y: F.nll_loss(F.log_softmax(out, dim=1), y), lambda y: y, None),
    ("targets_broadcast_against_one_output", lambda: nn.Linear(32, 1),
     lambda out, y: F.mse_loss(out, y), lambda y: (y % 5 + 1).float(), "broadcast"),
    ("targets_of_the_output_s_shape", lambda: nn.Linear(32, 1),
     lambda out, y: F.mse_loss(out, y.unsqueeze(1)), lambda y: (y % 5 + 1).float(), None),
]


@pytest.mark.parametrize("name,head,loss_of,labels_of,finding", CASES, ids=[c[0] for c in CASES])
def test_the_probe_judges_the_output_loss_and_labels_of_the_first_step(tmp_path, name, head, loss_of, labels_of,
                                                                        finding):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), head())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = digits_tensors()
    with TripwireProbe(model, optimizer, {"rules": ["loss_setup"]}, out_dir=tmp_path / "run") as probe:
        for step in range(8):
            batch = slice(64 * step, 64 * step + 64)
            optimizer.zero_grad()
            loss = loss_of(model(x[batch]), labels_of(y[batch]))
            loss.backward()
            optimizer.step()
            probe.step(loss)
    fired = [v for v in tripwire.open_run(probe.run_url).verdicts() if v.fired]
    assert [v.finding for v in fired] == ([finding] if finding else []), [v.message for v in fired]
    if finding:
        assert fired[0].step == 0 and \
            fired[0].severity == ("error" if finding in ("one_unit_softmax", "broadcast") else "warning")


@pytest.mark.parametrize("fixed", [False, True], ids=["broadcast", "fixed"])
def test_targets_that_broadcast_against_the_predictions_are_an_error_at_the_first_step(tmp_path, fixed):
    """mse_loss of predictions (N, 1) against targets (N,) compares every prediction with every target (N x N):
    the model learns the targets' mean, its loss falls a little, and nothing else shows it (torch only warns). Told
    under the default config at step 0; the fixed twin is silent and learns."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x = torch.tensor((x - x.mean(0)) / x.std(0), dtype=torch.float32)
    y = torch.tensor((y - y.mean()) / y.std(), dtype=torch.float32)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with TripwireProbe(model, optimizer, out_dir=tmp_path / "run") as probe:
        for step in range(200):
            batch = slice(step * 32 % 416, step * 32 % 416 + 32)
            optimizer.zero_grad()
            loss = F.mse_loss(model(x[batch]), y[batch].unsqueeze(1) if fixed else y[batch])
            loss.backward()
            optimizer.step()
            probe.step(loss)
    with torch.no_grad():
        error = F.mse_loss(model(x).squeeze(1), y).item()  # of standardised targets: 1 is the mean's
    fired = [v for v in tripwire.open_run(probe.run_url).verdicts() if v.counts]
    if fixed:
        assert error < 0.5 and fired == []
    else:
        assert error > 0.85
        (verdict,) = fired
        assert (verdict.rule, verdict.finding, verdict.severity, verdict.step) == \
            ("loss_setup", "broadcast", "error", 0)
        assert "(32, 1)" in verdict.message and "(32,)" in verdict.message and "(32, 32)" in verdict.message


def test_lightning_looks_at_the_first_training_step_once_and_gives_it_back(tmp_path):
    """The first sampled training_step runs under the look; the module's own method is put back after it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10), nn.Softmax(dim=1))
    module = helpers.classifier(net)
    callback = TripwireCallback({"rules": ["loss_setup"], "sampling": {"every": 10}}, out_dir=tmp_path / "run")
    helpers.fit(callback, module, max_epochs=1)
    run = tripwire.open_run(callback.run_url)
    (verdict,) = [v for v in run.verdicts() if v.fired]
    assert verdict.finding == "applied_twice" and verdict.step == 0 and "cross_entropy" in verdict.message
    (use,) = run.first_step.losses
    assert (use.loss, use.output, use.units, use.labels.max) == ("cross_entropy", "softmax", 10, 9.0)
    assert "training_step" not in module.__dict__


def test_a_healthy_model_under_the_default_config_records_its_first_step_and_fires_nothing(tmp_path):
    callback = TripwireCallback(None, out_dir=tmp_path / "run")
    helpers.fit(callback, helpers.mlp_module(), max_epochs=1)
    run = tripwire.open_run(callback.run_url)
    assert [v for v in run.verdicts() if v.fired] == []
    (use,) = run.first_step.losses
    assert (use.loss, use.reads, use.output, use.labels.integer) == ("cross_entropy", "logits", "linear", True)
    assert np.isclose(use.labels.min, 0) and use.labels.distinct > 5


@pytest.mark.parametrize("shuffled", [False, True], ids=["sorted_by_class", "shuffled"])
def test_a_first_batch_of_one_class_says_the_data_is_not_shuffled(tmp_path, shuffled):
    x, y = digits_tensors(1024)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0)) if shuffled else torch.argsort(y)
    x, y = x[order], y[order]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with TripwireProbe(model, optimizer, {"rules": ["loss_setup"]}, out_dir=tmp_path / "run") as probe:
        for step in range(4):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[64 * step:64 * step + 64]), y[64 * step:64 * step + 64])
            loss.backward()
            optimizer.step()
            probe.step(loss)
    fired = [v.finding for v in tripwire.open_run(probe.run_url).verdicts() if v.fired]
    assert fired == ([] if shuffled else ["one_class_batch"])


def test_a_loss_per_time_step_whose_first_sees_one_token_is_no_unshuffled_batch(tmp_path):
    """A decoder trained with a loss per time step and teacher forcing (PyTorch's seq2seq tutorial), its parts in
    an nn.ModuleDict the loop calls one by one: every target sequence begins with the same token, so the first
    call's 32 labels are one class; the step's other calls see many, and the batch is shuffled."""
    torch.manual_seed(0)
    vocab, length = 12, 6
    targets = torch.cat([torch.ones(256, 1, dtype=torch.long), torch.randint(2, vocab, (256, length - 1))], 1)
    model = nn.ModuleDict({"embed": nn.Embedding(vocab, 16), "gru": nn.GRU(16, 32, batch_first=True),
                           "out": nn.Linear(32, vocab)})
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with TripwireProbe(model, optimizer, {"rules": ["loss_setup"]}, out_dir=tmp_path / "run") as probe:
        for step in range(4):
            batch, tokens, hidden, loss = targets[32 * step:32 * step + 32], torch.zeros(32, 1).long(), None, 0
            optimizer.zero_grad()
            for t in range(length):
                states, hidden = model["gru"](model["embed"](tokens), hidden)
                loss = loss + F.cross_entropy(model["out"](states[:, -1]), batch[:, t])
                tokens = batch[:, t:t + 1]  # teacher forcing
            (loss / length).backward()
            optimizer.step()
            probe.step(loss / length)
    run = tripwire.open_run(probe.run_url)
    uses = run.first_step.losses
    assert len(uses) == length and uses[0].labels.distinct == 1 and uses[1].labels.distinct > 1
    assert [v.finding for v in run.verdicts() if v.fired] == []


def test_a_warning_a_loss_raises_under_the_first_step_look_is_the_user_s_line(tmp_path):
    """F.mse_loss warns of a target shaped apart from its input, naming its caller's line: under the look the caller
    was tripwire's own code, and the user was sent to it."""
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(32, 4), torch.randn(32)
    with pytest.warns(UserWarning, match="target size") as raised:
        with TripwireProbe(net, optimizer, {"rules": ["loss_setup"]}, out_dir=tmp_path / "run") as probe:
            for _ in range(3):
                optimizer.zero_grad()
                loss = F.mse_loss(net(x), y)  # the line the warning names
                loss.backward()
                optimizer.step()
                probe.step(loss)
    sizes = [w for w in raised if "target size" in str(w.message)]
    assert sizes and {w.filename for w in sizes} == {__file__}, [(w.filename, w.lineno) for w in sizes]


class Tagger(nn.Module):
    """A convolutional tagger: token ids (B, T) to class scores per position, (B, C, T)."""

    def __init__(self, tokens=20, classes=5):
        super().__init__()
        self.embed, self.conv = nn.Embedding(tokens, 16), nn.Conv1d(16, classes, 3, padding=1)

    def forward(self, ids):
        return self.conv(self.embed(ids).transpose(1, 2))


@pytest.mark.parametrize("rows", ["viewed", "permuted", "as_it_is"])
def test_class_scores_viewed_as_rows_from_an_axis_not_last_are_a_warning_at_the_first_step(tmp_path, rows):
    """Scores (B, C, T) viewed as (-1, C) without moving the classes last (Karpathy's 'view vs transpose'): each
    row mixes one class's scores at several positions, and the loss stays at ln C. A silent-bug hunt's tagger sat at
    ln 5 for 600 steps with nothing fired. Told at step 0; permuted first, or handed to cross_entropy as (N, C, T),
    it is silent and learns."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 20, (1024, 40), generator=generator)
    tags = ids % 5  # each token's class: learnable from the token alone
    torch.manual_seed(0)
    model = Tagger()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with TripwireProbe(model, optimizer, {"rules": ["loss_setup"]}, out_dir=tmp_path / "run") as probe:
        for step in range(60):
            batch = slice(32 * step % 1024, 32 * step % 1024 + 32)
            scores, y = model(ids[batch]), tags[batch]
            optimizer.zero_grad()
            loss = {"viewed": lambda: F.cross_entropy(scores.reshape(-1, 5), y.reshape(-1)),
                    "permuted": lambda: F.cross_entropy(scores.permute(0, 2, 1).reshape(-1, 5), y.reshape(-1)),
                    "as_it_is": lambda: F.cross_entropy(scores, y)}[rows]()
            loss.backward()
            optimizer.step()
            probe.step(loss)
    with torch.no_grad():
        accuracy = float((model(ids).argmax(1) == tags).float().mean())
    fired = [(v.finding, v.step, v.severity) for v in tripwire.open_run(probe.run_url).verdicts() if v.fired]
    if rows == "viewed":
        assert accuracy < 0.4 and fired == [("classes_reshaped", 0, "warning")]
    else:
        assert accuracy > 0.95 and fired == []


@pytest.mark.parametrize("weights", ["integer_division", "floats"])
def test_class_weights_of_zero_are_told_at_the_first_step(tmp_path, weights):
    """CrossEntropyLoss(weight=...) from sklearn's "balanced" formula computed with `//`: every class with more
    samples than the mean weighs 0 and is never learned; told at step 0 under the default config. The float
    weights are silent, and every class is learned."""
    (x, y), (xv, yv) = helpers.digits()
    x, y = torch.tensor(x), torch.tensor(y, dtype=torch.long)
    counts = torch.bincount(y, minlength=10)
    weight = len(y) // (10 * counts) if weights == "integer_division" else len(y) / (10 * counts)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    criterion = nn.CrossEntropyLoss(weight=weight.float())
    with TripwireProbe(model, optimizer, None, out_dir=tmp_path / "run") as probe:
        for epoch in range(5):
            for start in range(0, len(y), 32):
                optimizer.zero_grad()
                loss = criterion(model(x[start:start + 32]), y[start:start + 32])
                loss.backward()
                optimizer.step()
                probe.step(loss)
    with torch.no_grad():
        predicted = model(torch.tensor(xv)).argmax(1).numpy()
    recalls = [float(np.mean(predicted[yv == c] == c)) for c in range(10)]
    found = [(v.rule, v.finding, v.step) for v in tripwire.open_run(probe.run_url).verdicts() if v.counts]
    if weights == "integer_division":
        zero = torch.nonzero(weight == 0).flatten().tolist()
        assert len(zero) >= 2 and min(recalls[c] for c in zero) < 0.5
        assert found[0] == ("loss_setup", "classes_weighted_out", 0), found
    else:
        assert found == [] and min(recalls) > 0.7
