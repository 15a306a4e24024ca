"""first_evaluation: a model evaluated far worse than it starts training — a spectral_norm model evaluated before
any training forward (plain torch loop), validation data prepared apart from the training data (Keras) — each
with its healthy twin silent."""

import keras
import numpy as np
import pytest
import torch
from torch import nn

import helpers
import tripwire
from tripwire.plugins.keras import TripwireCallback as KerasCallback
from tripwire.plugins.torch import TripwireProbe

F = nn.functional
CONFIG = {"sampling": {"every": 10}, "rules": [{"rule": "first_evaluation"}]}


def spectral_norm_loop(out, evaluate_first: bool):
    """An MLP with spectral_norm on digits, Adam, validated after each of 3 epochs (and before training where
    asked). Returns (the run, the final validation accuracy)."""
    (x, y), (xv, yv) = helpers.digits()
    x, y, xv, yv = torch.tensor(x), torch.tensor(y), torch.tensor(xv), torch.tensor(yv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(64, 64)), nn.ReLU(),
                          nn.utils.spectral_norm(nn.Linear(64, 10)))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    def validate(probe):
        model.eval()
        with torch.no_grad():
            logits = model(xv)
            probe.log_eval({"val_loss": F.cross_entropy(logits, yv).item()})
        model.train()
        return float((logits.argmax(1) == yv).float().mean())

    with TripwireProbe(model, optimizer, CONFIG, out_dir=out) as probe:
        if evaluate_first:
            validate(probe)
        for epoch in range(3):
            for i in range(0, len(x) - 31, 32):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
                loss.backward()
                optimizer.step()
                probe.step(loss)
            accuracy = validate(probe)
    return tripwire.open_run(probe.run_url), accuracy


@pytest.mark.parametrize("evaluate_first", [True, False])
def test_spectral_norm_evaluated_before_training(tmp_path, evaluate_first):
    run, accuracy = spectral_norm_loop(tmp_path / "run", evaluate_first)
    assert accuracy > 0.8  # it learns either way (chance: 0.1; unit-norm layers stay below 0.9 here)
    if not evaluate_first:
        assert [v.rule for v in run.verdicts() if v.fired] == []
        return
    (verdict,) = [v for v in run.verdicts() if v.fired]
    assert (verdict.rule, verdict.severity, verdict.onset) == ("first_evaluation", "warning", 0)
    assert verdict.evidence["first_eval"] > 10 * verdict.evidence["baseline"]
    assert "ln 10" in verdict.message and "spectral_norm" in verdict.hint


@pytest.mark.parametrize("apart", [True, False])
def test_keras_validation_data_prepared_apart(tmp_path, apart):
    """Training on standardised digits, validating on the raw 0-255 pixel bytes (the scaler never applied)."""
    (x, y), (xv, yv) = helpers.digits()
    if apart:
        from sklearn.datasets import load_digits

        xv = load_digits().data[-len(xv):].astype(np.float32) * (255 / 16)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(0.05), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callback = KerasCallback(CONFIG, out_dir=tmp_path / "run")
    model.fit(x, y, validation_data=(xv, yv), epochs=2, batch_size=32, verbose=0, callbacks=[callback])
    run = tripwire.open_run(callback.run_url)
    if apart:
        # the end of epoch 1, confirmed by the second evaluation (still above the start's loss)
        assert [(v.rule, v.onset, v.step) for v in run.verdicts() if v.fired] == [("first_evaluation", 43, 86)]
    else:
        assert [v.rule for v in run.verdicts() if v.fired] == []


@pytest.mark.parametrize("second,fires", [(1.5, False), (17.9, True)], ids=["undone", "confirmed"])
def test_a_first_evaluation_after_training_that_the_next_undoes_is_no_alarm(second, fires):
    """Lightning's imagenet example (a ResNet with BatchNorm, SGD 0.1 with momentum 0.9, ported on digits): its
    first evaluation, after epoch 1, read 70.5 in eval mode (0.91 with the batch's statistics), the next 1.5: the
    running statistics lagged weights that moved fast, and caught up. Data prepared apart stays above the start."""
    from tripwire.core.history import History
    from tripwire.core.rules.evaluation import FirstEvaluation

    history, rule = History(64, 64), FirstEvaluation()
    for step, loss in ((0, 2.3), (10, 2.0), (20, 1.4)):
        history.add(0, "train", step, {"losses/train": {"value": loss}})
    history.add(0, "eval", 24, {"metrics/val_loss": {"value": 70.5}})
    assert rule.check(history.at(24, "eval", 0), 24) is None  # after training: the next evaluation decides
    history.add(0, "eval", 48, {"metrics/val_loss": {"value": second}})
    verdict = rule.check(history.at(48, "eval", 0), 48)
    assert (verdict is not None and verdict.onset == 24 and "70.5 at step 24" in verdict.message) if fires else \
        verdict is None


@pytest.mark.parametrize("keep,later,fires", [(0.9, (414.0, 4.9, 0.26), False), (0.9, (414.0, 60.0, 55.0), True),
                                              (1.0, (414.0, 4.9, 0.26), True)],
                         ids=["lag_undone", "apart", "statistics_never_move"])
def test_evaluations_while_batchnorm_statistics_settle_wait_for_them(keep, later, fires):
    """A torchvision-style ResNet-18 under Lightning, SGD 0.1 with momentum, 11 steps an epoch (digits): its
    evaluations read 58,576, 8,219, 414, 4.9, 0.26; with the running statistics re-estimated, 2.08 and 0.73 at
    the first two. Torch's momentum 0.1 leaves under 1 % of their start after 44 steps: the evaluations up to the
    one after step 44 decide. Still above the start there, the model is evaluated apart from how it trains; with
    statistics that never move (momentum 0), the second decides, as without them."""
    from tripwire.core.history import History
    from tripwire.core.model import ModelInfo
    from tripwire.core.rules.evaluation import FirstEvaluation

    history, rule = History(64, 64), FirstEvaluation()
    history.model = ModelInfo("ResNet", running_keep=keep)
    for step, loss in ((0, 2.4), (5, 2.2), (10, 2.0)):
        history.add(0, "train", step, {"losses/train": {"value": loss}})
    told = []
    for step, value in zip((11, 22, 33, 44, 55), (58576.0, 8219.0, *later)):
        history.add(0, "eval", step, {"metrics/val_loss": {"value": value}})
        verdict = rule.check(history.at(step, "eval", 0), step)
        told += [(verdict.step, verdict.onset)] if verdict is not None else []
    assert told == ([(55 if keep < 1 else 22, 11)] if fires else [])
