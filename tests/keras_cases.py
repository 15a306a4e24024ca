"""The Keras plugin on real Keras training, on whichever backend KERAS_BACKEND names.

test_keras.py runs these in-process on TensorFlow and in subprocesses on torch
and JAX (`KERAS_BACKEND=torch python -m pytest tests/keras_cases.py`).
"""

import keras
import numpy as np
import pytest

import helpers
import tripwire
from keras_models import first_nonfinite_step, fired, fit, mlp
from tripwire.plugins.keras import TripwireCallback, wrap_optimizer
from tripwire.plugins.keras import capture as capture_module


def test_nan_stops_training_at_the_step_it_appears(tmp_path):
    """Sampled every 3 steps: the loss, on the host between samples, is judged at every step."""
    config = {"sampling": {"every": 3}, "rules": [{"rule": "exploding_tensor", "actions": ["log", "stop"]}],
              "collections": {"weights": {}, "gradients": {}}}
    cb = TripwireCallback(config, out_dir=tmp_path / "nan")
    model = fit(cb, mlp(lr=50.0), epochs=3)
    verdict = fired(cb.run_url)["exploding_tensor"]
    run = tripwire.open_run(cb.run_url)
    assert verdict.step == first_nonfinite_step(run)
    assert int(model.optimizer.iterations) == verdict.step + 1
    assert run.steps()[-1] == verdict.step and run.info["status"] == "stopped"
    assert cb.verdicts and cb.verdicts[0].step == verdict.step
    assert verdict.hint and "learning rate" in verdict.hint


def test_nan_between_samples_stops_training_at_the_step_it_appears(tmp_path):
    """Keras hands its loss over on the host at every step: an infinite loss (here from a batch of infinite
    targets) is acted on at that step under the default config, which samples every 100 steps."""
    (xt, yt), _ = helpers.digits()
    targets = yt.astype("float32")
    targets[37 * 32:38 * 32] = np.inf  # the 38th batch: step 37
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    cb = TripwireCallback(None, out_dir=tmp_path / "run")
    model.fit(xt, targets, batch_size=32, epochs=3, shuffle=False, verbose=0, callbacks=[cb])
    run = tripwire.open_run(cb.run_url)
    nan = next(v for v in run.verdicts() if v.rule == "exploding_tensor")
    assert (nan.step, run.info["status"], int(model.optimizer.iterations)) == (37, "stopped", 38)
    assert run.tensor("losses/train").reduction(37) == np.inf


class Square(keras.layers.Layer):
    """x * x: overflows float32 once its input passes ~1.8e19 (an energy or polynomial feature)."""

    def call(self, x):
        return x * x


def squared_features(loss, norm=True, run_eagerly=False):
    """Dense, dropout, a squaring layer and (norm) BatchNorm on digits' 64 features: what a replay could change.
    No ReLU: TensorFlow's fused Dense and ReLU turn a NaN input into 0 (the loss stays finite while the weights
    go NaN)."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    h = keras.layers.Dropout(0.2, name="drop")(keras.layers.Dense(32, name="first")(inputs))
    h = Square(name="square")(keras.layers.Dense(32, name="second")(h))
    h = keras.layers.BatchNormalization(name="norm")(h) if norm else h
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax", name="out")(h))
    model.compile(keras.optimizers.SGD(0.05), loss, run_eagerly=run_eagerly)
    return model


def hand_written_nll(y, p):
    """-log(p[y]) without clipping: a saturated softmax gives log(0) = inf."""
    y = keras.ops.cast(keras.ops.reshape(y, (-1, 1)), "int32")
    return -keras.ops.log(keras.ops.take_along_axis(p, y, axis=1))


@pytest.mark.parametrize("fault", ["overflow", "nan_input", "loss"])
def test_the_layer_where_a_nan_began_is_named_and_the_replay_changes_nothing(tmp_path, fault):
    """At step 13 a batch scaled by 1e20 (the squared features overflow), a NaN in one input, or a batch scaled by
    1e3 under a hand-written loss without BatchNorm (the softmax saturates: log(0)). The default config, which
    samples every 100 steps: the NaN is caught, and where it began found from the state before the update of the
    step it appears in."""
    (x, y), _ = helpers.digits()
    x, y = x[:14 * 32].copy(), y[:14 * 32]
    if fault == "nan_input":
        x[13 * 32 + 3, 5] = np.nan
    else:
        x[13 * 32:] *= 1e20 if fault == "overflow" else 1e3
    loss = hand_written_nll if fault == "loss" else "sparse_categorical_crossentropy"
    ends = {}
    for name, callbacks in (("plain", []), ("tripwire", [TripwireCallback(out_dir=tmp_path / "run")])):
        model = squared_features(loss, norm=fault != "loss")
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        ends[name] = [np.array(v) for v in model.variables]
    (verdict,) = [v for v in callbacks[0].verdicts if v.rule == "exploding_tensor"]
    assert verdict.step == 13
    if fault == "overflow":
        assert "It began in `square`: its output holds" in verdict.message
        assert "from a finite input that had grown to" in verdict.message and "learning rate" in verdict.hint
    elif fault == "nan_input":
        assert "The input of `first` (Dense) already held 1 NaN/Inf value(s)" in verdict.message
    else:
        assert "It began in the loss: the model's output was finite" in verdict.message
    # the same weights, BatchNorm statistics and seed states as without tripwire (stopped after the same step)
    for plain, traced in zip(ends["plain"], ends["tripwire"]):
        np.testing.assert_array_equal(traced, plain)


def test_a_nan_at_a_step_sampled_for_other_collections_is_told_as_the_loss(tmp_path):
    """Step 5 is sampled by the default config for the first steps' rules, not for the loss: the NaN loss Keras
    logs joins that sample, and the verdict names the loss (it named the origin's fact alone on torch)."""
    (x, y), _ = helpers.digits()
    x = x[:8 * 32].copy()
    x[5 * 32 + 3, 5] = np.nan
    cb = TripwireCallback(out_dir=tmp_path / "run")
    squared_features("sparse_categorical_crossentropy").fit(x, y[:8 * 32], batch_size=32, epochs=1, shuffle=False,
                                                            verbose=0, callbacks=[cb])
    (verdict,) = [v for v in cb.verdicts if v.rule == "exploding_tensor"]
    assert verdict.step == 5 and verdict.message.startswith("losses/train is not finite")


def test_a_learning_rate_far_too_low_is_named_once_the_first_steps_are_in(tmp_path):
    cb = TripwireCallback(None, out_dir=tmp_path / "run")
    fit(cb, mlp(lr=1e-7, optimizer="adam"), epochs=1)
    lr = fired(cb.run_url)["learning_rate"]
    assert (lr.step, lr.finding) == (4, "low") and "learning rate 1e-07 with Adam: below the lowest" in lr.message


def test_a_learning_rate_far_too_high_is_named_at_the_first_step(tmp_path):
    cb = TripwireCallback(None, out_dir=tmp_path / "run")
    fit(cb, mlp(lr=1.0, optimizer="adam"), epochs=1)
    lr = fired(cb.run_url)["learning_rate"]
    assert lr.step == 0 and "learning rate 1 with Adam: 100x the highest" in lr.message


# (id, output activation, units, loss, labels of the digit, the finding on the buggy program or None on its twin)
SETUPS = [
    ("softmax_from_logits", "softmax", 10, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
     lambda y: y, "applied_twice"),
    ("softmax_from_probabilities", "softmax", 10, "sparse_categorical_crossentropy", lambda y: y, None),
    ("logits_read_as_probabilities", None, 10, "sparse_categorical_crossentropy", lambda y: y, "not_probabilities"),
    ("labels_divided_by_255", None, 10, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
     lambda y: y / 255.0, "not_class_ids"),
    ("one_hot_into_a_one_hot_loss", "softmax", 10, "categorical_crossentropy", lambda y: np.eye(10)[y], None),
    ("sigmoid_for_classes", "sigmoid", 10, "categorical_crossentropy", lambda y: np.eye(10)[y],
     "sigmoid_for_classes"),
    ("one_label_per_row_under_a_binary_loss", "sigmoid", 10, "binary_crossentropy", lambda y: np.eye(10)[y],
     "one_label_per_row"),
    ("labels_true_together", "sigmoid", 10, "binary_crossentropy", lambda y: np.eye(10)[y] + np.eye(10)[(y + 1) % 10],
     None),
    ("one_unit_softmax", "softmax", 1, "binary_crossentropy", lambda y: (y == 0).astype("float32"),
     "one_unit_softmax"),
    ("one_unit_sigmoid", "sigmoid", 1, "binary_crossentropy", lambda y: (y == 0).astype("float32"), None),
    ("sigmoid_for_targets_in_the_tens", "sigmoid", 1, "mse", lambda y: y * 4.0 + 3, "unreachable_targets"),
    ("yes_no_by_absolute_error", "sigmoid", 1, "mean_absolute_error", lambda y: (y % 2).astype("float32"),
     "classes_by_regression"),
    ("yes_no_by_squared_error", "sigmoid", 1, "mean_squared_error", lambda y: (y % 2).astype("float32"), None),
]


@pytest.mark.parametrize("name,activation,units,loss,labels_of,finding", SETUPS, ids=[s[0] for s in SETUPS])
def test_the_output_the_loss_and_the_labels_are_judged_at_the_first_step(tmp_path, name, activation, units, loss,
                                                                         labels_of, finding):
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(units, activation=activation)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
    (xt, yt), _ = helpers.digits(n_train=256)
    cb = TripwireCallback({"rules": ["loss_setup"]}, out_dir=tmp_path / "run")
    model.fit(xt, labels_of(yt), batch_size=64, epochs=1, verbose=0, callbacks=[cb])
    fired = [v for v in tripwire.open_run(cb.run_url).verdicts() if v.fired]
    assert [v.finding for v in fired] == ([finding] if finding else []), [v.message for v in fired]


def test_healthy_run_fires_nothing_with_the_default_config(tmp_path):
    cb = TripwireCallback(None, out_dir=tmp_path / "healthy")
    model = fit(cb, epochs=3)
    run = tripwire.open_run(cb.run_url)
    assert int(model.optimizer.iterations) == 3 * 43 and not [v for v in run.verdicts() if v.counts]
    # every 100 steps; poor_weight_initialization adds the weights' spread in the first 10 steps
    assert run.info["status"] == "finished" and run.steps() == [*range(10), 100]
    assert run.info["framework"] == "keras" and run.info["keras_backend"] == keras.backend.backend()
    kernel = model.layers[0].kernel.path
    assert run.tensor(f"weights/{kernel}").steps() == [*range(10), 100]
    assert run.tensor(f"gradients/{kernel}").steps() == [0, 100]
    structure = run.model.parameters[kernel]  # the model as Keras built it, recorded when training began
    assert (structure.layer_type, structure.role, structure.fan_in, structure.trainable) == ("dense", "kernel", 64, True)
    assert {"losses/train", f"gradients/{kernel}", f"activations/{model.layers[0].path}"} <= set(run.tensor_names())
    assert run.tensor_names(collection="activations") == [f"activations/{model.layers[0].path}"]  # Dense/relu only


@pytest.mark.parametrize("faulty", [True, False], ids=["deep_sigmoid", "relu"])
def test_vanishing_gradient(tmp_path, faulty):
    model = mlp(hidden=(32,) * 10, activation="sigmoid") if faulty else mlp()
    cb = TripwireCallback({"rules": ["vanishing_gradient"], "sampling": {"every": 10}}, out_dir=tmp_path / "run")
    fit(cb, model, epochs=1)
    assert ("vanishing_gradient" in fired(cb.run_url)) == faulty


@pytest.mark.parametrize("faulty", [True, False], ids=["negative_bias", "healthy"])
def test_dead_relu(tmp_path, faulty):
    model = mlp(hidden=(32, 32), first_bias=-20.0 if faulty else None)
    cb = TripwireCallback({"rules": ["dead_relu"], "sampling": {"every": 10}}, out_dir=tmp_path / "run")
    fit(cb, model, epochs=1)
    verdicts = fired(cb.run_url)
    assert ("dead_relu" in verdicts) == faulty
    if faulty:  # every unit dead at three samples in a row (steps 0, 10, 20): an error
        verdict = verdicts["dead_relu"]
        assert verdict.step == 20 and verdict.severity == "error" and f"activations/{model.layers[0].path}" in \
            verdict.message


@pytest.mark.parametrize("first_bias", [None, -20.0], ids=["healthy", "first_call_dead"])
def test_each_call_of_a_shared_layer_is_captured_under_its_own_name(tmp_path, first_bias):
    """A layer called twice in a forward pass (one ReLU after two Dense layers) is captured at each call,
    `shared` and `shared#2`, on every backend (traced once or run eagerly); the second call's output alone was
    captured before. The structure cannot say which Dense each call takes, so a verdict names none."""
    (x, y), _ = helpers.digits()
    keras.utils.set_random_seed(0)
    inputs, relu = keras.Input((64,)), keras.layers.ReLU(name="shared")
    bias = keras.initializers.Constant(first_bias) if first_bias is not None else "zeros"
    hidden = relu(keras.layers.Dense(32, bias_initializer=bias)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(10)(relu(keras.layers.Dense(32)(hidden))))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=["accuracy"])
    cb = TripwireCallback({"sampling": {"every": 10}, "collections": {"activations": {"include": ["shared"]}},
                           "rules": ["dead_relu"]}, out_dir=tmp_path / "run")
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[cb]).history
    run = tripwire.open_run(cb.run_url)
    assert run.tensor_names("activations") == ["activations/shared", "activations/shared#2"]
    dead = run.tensor("activations/shared").reduction(0, "dead_fraction")
    if first_bias is None:
        assert history["accuracy"][-1] > 0.9, history["accuracy"]
        assert dead < 0.7 and not [v for v in run.verdicts() if v.fired]
    else:
        assert dead == 1.0
        verdict = next(v for v in run.verdicts() if v.fired and v.finding == "activations/shared")
        assert verdict.severity == "error" and "the output of" not in verdict.message


@pytest.mark.parametrize("faulty", [True, False], ids=["six_of_eight_dead", "healthy"])
def test_dead_relu_counts_the_channels_of_a_channels_first_convolution(tmp_path, faulty):
    """A Conv2D with data_format="channels_first": its units are the channels at axis 1, not the last axis (the
    image's width, every column of which has live channels). Six of its eight channels held dead by their biases
    are 75 % of its units."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).reshape(-1, 1, 8, 8).astype("float32")
    keras.utils.set_random_seed(0)
    conv = keras.layers.Conv2D(8, 3, activation="relu", data_format="channels_first", padding="same")
    model = keras.Sequential([keras.Input((1, 8, 8)), conv, keras.layers.Flatten(), keras.layers.Dense(10)])
    if faulty:
        kernel, bias = conv.get_weights()
        bias[:6] = -100.0
        conv.set_weights([kernel, bias])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    cb = TripwireCallback({"rules": ["dead_relu"], "sampling": {"every": 10}}, out_dir=tmp_path / "run")
    history = model.fit(x, y, batch_size=32, epochs=1 if faulty else 3, verbose=0, callbacks=[cb])
    run = tripwire.open_run(cb.run_url)
    (name,) = run.tensor_names("activations")
    shares = run.tensor(name).tail("dead_fraction", 3)[1]
    if faulty:
        assert shares == [0.75] * 3 and fired(cb.run_url)["dead_relu"].step == 20
    else:
        assert max(shares) < 0.5 and fired(cb.run_url) == {} and history.history["accuracy"][-1] > 0.8


@pytest.mark.parametrize("faulty", [True, False], ids=["lr0", "healthy"])
def test_loss_not_decreasing(tmp_path, faulty):
    # 43 steps: judged from step 20 on (min_steps), where the default waits 300 steps for a slow start
    cb = TripwireCallback({"rules": [{"rule": "loss_not_decreasing", "params": {"min_steps": 20}}],
                           "sampling": {"every": 2}}, out_dir=tmp_path / "run")
    fit(cb, mlp(lr=0.0) if faulty else mlp(lr=0.003, optimizer="adam"), epochs=1)
    verdicts = fired(cb.run_url)
    assert ("loss_not_decreasing" in verdicts) == faulty
    if faulty:  # from the first step with three windows of 5 samples: nothing learns, an error
        assert verdicts["loss_not_decreasing"].step >= 28 and verdicts["loss_not_decreasing"].severity == "error"
    losses = tripwire.open_run(cb.run_url).tensor("losses/train").series()[1]
    assert len(set(losses.tolist())) == len(losses)  # the step's loss, not Keras' running mean


@pytest.mark.parametrize("faulty", [True, False], ids=["tiny_train_set", "healthy"])
def test_overfit(tmp_path, faulty):
    # overfit is a warning: `stop` acts on errors unless told to act on warnings too
    cb = TripwireCallback({"rules": [{"rule": "overfit", "actions": ["log", {"stop": "warning"}]}],
                           "sampling": {"every": 1}}, out_dir=tmp_path / "run")
    if faulty:  # 20 training samples: the validation loss climbs 40% above its best
        model = fit(cb, mlp(hidden=(256,), optimizer="adam", lr=0.01), epochs=60, n_train=20, batch_size=8)
    else:
        model = fit(cb, epochs=1)
    verdicts = fired(cb.run_url)
    assert ("overfit" in verdicts) == faulty
    run = tripwire.open_run(cb.run_url)
    if faulty:  # stopped at the end of the epoch whose validation fired it
        step = verdicts["overfit"].step
        assert verdicts["overfit"].mode == "eval" and step % 3 == 0 and int(model.optimizer.iterations) == step
        assert run.steps(mode="eval")[-1] == step and run.info["status"] == "stopped"
    else:  # it was evaluated: the validation loss is there
        assert run.steps(mode="eval") == [43] and run.tensor("metrics/val_loss").steps(mode="eval") == [43]


def test_rule_without_its_data_says_no_data(tmp_path):
    cb = TripwireCallback({"rules": ["overfit"]}, out_dir=tmp_path / "run")
    fit(cb, epochs=1, validation=False)
    (verdict,) = tripwire.open_run(cb.run_url).verdicts()
    assert verdict.status == "no_data" and verdict.rule == "overfit" and "metrics" in verdict.message


def test_only_sampled_steps_run_a_capture_function(tmp_path, monkeypatch):
    emitted = []
    emit = capture_module.StepCapture.emit
    monkeypatch.setattr(capture_module.StepCapture, "emit",
                        lambda self, collection, *a, **k: emitted.append(collection) or emit(self, collection, *a, **k))
    seen = {}

    class Spy(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):  # after tripwire's: Keras' function or tripwire's tf_step
            self.unsampled = self.model.train_function

        def on_train_batch_begin(self, batch, logs=None):
            seen[batch] = self.model.train_function is self.unsampled

    config = {"collections": {"gradients": {"every": 4}, "losses": {"every": 4}}}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    model = fit(cb, epochs=1, callbacks=[Spy()])
    assert [b for b, own in seen.items() if not own] == list(range(0, 43, 4))  # the capture function: sampled only
    gradients = emitted.count("gradients")
    if keras.backend.backend() == "torch":  # eager: the reduction branch runs once per sampled step and parameter
        assert gradients == 11 * 4
    else:  # compiled: the hooks run while the capture function is traced, never on unsampled steps
        assert 4 <= gradients <= 2 * 4
    assert tripwire.open_run(cb.run_url).tensor(f"gradients/{model.layers[0].kernel.path}").steps() == \
        list(range(0, 43, 4))


def test_a_step_that_samples_only_the_loss_takes_the_loss_of_that_step(tmp_path):
    """On TensorFlow the function of the unsampled steps keeps the loss (no capture function runs for it): the same
    values as a capture function takes, step by step."""
    swapped = {}

    class Spy(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.unsampled = self.model.train_function

        def on_train_batch_begin(self, batch, logs=None):
            swapped[batch] = self.model.train_function is not self.unsampled

    runs = {}
    for name, collections in (("loss only", {"losses": {"every": 4}}),
                              ("with gradients", {"losses": {"every": 4}, "gradients": {"every": 4}})):
        swapped.clear()
        cb = TripwireCallback({"collections": collections}, out_dir=tmp_path / name.replace(" ", "_"))
        fit(cb, epochs=1, validation=False, callbacks=[Spy()])
        runs[name] = tripwire.open_run(cb.run_url).tensor("losses/train").series()
        if name == "loss only" and keras.backend.backend() == "tensorflow":
            assert not any(swapped.values())  # the unsampled steps' function ran every step, the sampled ones too
    (steps, losses), (steps_g, losses_g) = runs["loss only"], runs["with gradients"]
    assert steps.tolist() == steps_g.tolist() == list(range(43))  # between samples: told from the running mean
    sampled = steps % 4 == 0
    np.testing.assert_allclose(losses[sampled], losses_g[sampled], rtol=1e-6)
    assert len(set(losses[sampled].tolist())) == sampled.sum()  # a value per step, not one kept from an earlier step


def test_full_tensors_are_the_parameters_before_the_update(tmp_path):
    config = {"collections": {"weights": {"save": "tensors"}, "updates": {"save": "tensors"}}, "sampling": {"every": 5}}
    model = mlp()
    kernel = model.layers[0].kernel
    initial = keras.ops.convert_to_numpy(kernel).copy()
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    fit(cb, model, epochs=1, validation=False, steps_per_epoch=1)
    run = tripwire.open_run(cb.run_url)
    after = keras.ops.convert_to_numpy(kernel)
    np.testing.assert_array_equal(run.tensor(f"weights/{kernel.path}").value(0), initial)
    np.testing.assert_allclose(run.tensor(f"updates/{kernel.path}").value(0), after - initial, atol=1e-6)
    assert run.tensor(f"weights/{kernel.path}").reduction(0, "max") == pytest.approx(float(initial.max()))


def test_checkpoint_action_writes_a_keras_file(tmp_path):
    config = {"sampling": {"every": 2}, "rules": [{"rule": "exploding_tensor", "actions": ["checkpoint", "stop"]}]}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    model = fit(cb, mlp(lr=50.0), epochs=2)
    step = fired(cb.run_url)["exploding_tensor"].step
    restored = keras.saving.load_model(tmp_path / "run" / "checkpoints" / f"step{step}.keras")
    assert int(restored.optimizer.iterations) == step + 1
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(restored.layers[0].kernel),
                                  keras.ops.convert_to_numpy(model.layers[0].kernel))


def test_raise_action_closes_the_run_and_raises(tmp_path):
    config = {"sampling": {"every": 2}, "rules": [{"rule": "exploding_tensor", "actions": ["raise"]}]}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    model = mlp(lr=50.0)
    with pytest.raises(tripwire.RuleFired):
        fit(cb, model, epochs=2)
    run = tripwire.open_run(cb.run_url)
    assert run.info["status"] == "stopped" and run.verdicts()[0].rule == "exploding_tensor"
    assert not isinstance(getattr(model.train_function, "__self__", None), capture_module.StepCapture)


def test_training_with_tripwire_ends_with_the_same_weights_as_without(tmp_path):
    # every hook and function swap of the plugin in play: capture functions on sampled steps, loss-only steps,
    # and (TensorFlow) the one-step function of the unsampled steps
    config = {"collections": {c: {} for c in ("weights", "gradients", "updates", "activations", "inputs", "losses")},
              "sampling": {"every": 3}}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    with_tripwire = fit(cb, epochs=2).get_weights()
    without = fit(None, epochs=2).get_weights()
    assert len(tripwire.open_run(cb.run_url).steps()) == 29
    for a, b in zip(with_tripwire, without):
        np.testing.assert_array_equal(a, b)


def test_fitting_again_appends_to_the_same_run(tmp_path):
    cb = TripwireCallback({"collections": {"losses": {}}, "sampling": {"every": 10}}, out_dir=tmp_path / "run")
    model = fit(cb, epochs=1, validation=False)
    fit(cb, model, epochs=1, validation=False)
    run = tripwire.open_run(cb.run_url)
    assert run.steps() == list(range(0, 86, 10)) and run.info["status"] == "finished"


def test_evaluate_after_fit_appends_its_metrics_to_the_run(tmp_path):
    cb = TripwireCallback({"collections": {"metrics": {}}, "sampling": {"every": 10}}, out_dir=tmp_path / "run")
    model = fit(cb, epochs=1)
    _, (xv, yv) = helpers.digits()
    loss = model.evaluate(xv, yv, batch_size=256, verbose=0, callbacks=[cb])
    run = tripwire.open_run(cb.run_url)
    assert run.steps(mode="eval") == [43] and run.info["status"] == "finished"
    assert run.tensor("metrics/loss").reduction(43, mode="eval") == pytest.approx(loss, rel=1e-5)
    # the same weights and data as the validation that ended fit
    assert run.tensor("metrics/val_loss").reduction(43, mode="eval") == pytest.approx(loss, rel=1e-4)


def test_predict_records_its_outputs_in_mode_predict(tmp_path):
    config = {"collections": {"losses": {}, "predictions": {"reductions": ["mean", "l2", "max"]}},
              "sampling": {"every": 10}, "rules": ["exploding_tensor"]}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    model = fit(cb, epochs=1, validation=False)
    _, (xv, _) = helpers.digits()
    outputs = model.predict(xv, batch_size=100, verbose=0, callbacks=[cb])  # 450 rows: 5 batches, the last short
    run = tripwire.open_run(cb.run_url)
    assert run.modes() == ["predict", "train"] and run.steps(mode="predict") == [43]
    assert run.info["status"] == "finished" and not run.verdicts()
    predictions = run.tensor("predictions")
    assert predictions.reduction(43, "mean", mode="predict") == pytest.approx(float(np.mean(outputs)), rel=1e-5)
    assert predictions.reduction(43, "l2", mode="predict") == pytest.approx(float(np.linalg.norm(outputs)), rel=1e-5)
    assert predictions.reduction(43, "max", mode="predict") == pytest.approx(float(np.max(outputs)))


def test_nan_predictions_fire_exploding_tensor_in_mode_predict(tmp_path):
    config = {"collections": {"predictions": {"save": "tensors"}},
              "rules": [{"rule": "exploding_tensor", "actions": ["log", "stop"]}]}
    model = mlp()
    kernel = model.layers[-1].kernel
    kernel.assign(np.where(np.arange(kernel.shape[1]) == 3, np.nan, keras.ops.convert_to_numpy(kernel)))
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    _, (xv, _) = helpers.digits()
    outputs = model.predict(xv, batch_size=128, verbose=0, callbacks=[cb])
    verdict = fired(cb.run_url)["exploding_tensor"]
    assert (verdict.mode, verdict.step) == ("predict", 0) and "predictions" in verdict.message
    run = tripwire.open_run(cb.run_url)
    assert run.info["status"] == "finished"  # nothing to stop: the predictions are all made
    saved = run.tensor("predictions").value(0, mode="predict")
    assert saved.shape == (450, 10) and np.isnan(saved[:, 3]).all() and np.array_equal(saved, outputs, equal_nan=True)


def test_predict_without_predictions_in_the_config_writes_nothing(tmp_path):
    cb = TripwireCallback(None, out_dir=tmp_path / "run")
    _, (xv, _) = helpers.digits()
    mlp().predict(xv, verbose=0, callbacks=[cb])
    assert cb.run_url is None and not (tmp_path / "run").exists()


def test_a_learning_rate_schedule_is_read_at_the_step(tmp_path):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(schedule, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = TripwireCallback({"collections": {"optimizer": {}}, "sampling": {"every": 10}}, out_dir=tmp_path / "run")
    fit(cb, model, epochs=1, validation=False)
    run = tripwire.open_run(cb.run_url)
    steps, lrs = run.tensor("optimizer/lr").series()
    np.testing.assert_allclose(lrs, 0.1 * 0.5 ** (steps / 10), rtol=1e-5)
    assert run.tensor("optimizer/momentum").series()[1].tolist() == [0.9] * 5


def test_device_reductions_follow_the_core_definitions():
    from tripwire.core.reductions import REDUCTIONS, applicable, reduce
    from tripwire.plugins.keras.reduce import reduce_ops

    rng = np.random.default_rng(0)
    cases = [rng.normal(size=(16, 8)).astype("float32"), np.maximum(rng.normal(size=(4, 3, 5)), 0).astype("float32"),
             np.array([1.0, -2.0, 0.0, np.nan, np.inf], dtype="float32"), rng.normal(size=7),
             np.maximum(rng.normal(size=(16, 3, 3, 8)) - 2.5, 0).astype("float32")]  # NHWC: some channels dead
    saturated = np.tanh(rng.normal(scale=8, size=(200, 6))).astype("float32")
    nchw = np.maximum(rng.normal(size=(16, 8, 3, 3)) - 2.5, 0).astype("float32")  # channels first
    for x, kind, channels in [*((x, "", -1) for x in cases), (saturated, "Dense/tanh", -1),
                              (cases[0], "Embedding", -1), (nchw, "", 1)]:
        names = REDUCTIONS if np.isfinite(x).all() else [r for r in REDUCTIONS if r not in ("p5", "p95")]
        names = applicable(names, x.shape, kind)  # what a plugin asks for: the reductions that apply
        got = keras.ops.convert_to_numpy(reduce_ops(x, names, kind, channels)).astype(float)
        want = np.array([reduce(x, names, kind, channels)[r] for r in names])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=f"{kind}: {names}")
    diverged = rng.normal(scale=1e19, size=(64, 64)).astype("float32")  # finite; its float32 squares overflow
    l2 = float(keras.ops.convert_to_numpy(reduce_ops(diverged, ["l2"]))[0])
    assert l2 == pytest.approx(float(np.linalg.norm(diverged.astype(np.float64))), rel=1e-5)


def test_training_on_an_accelerator_reduces_in_the_step(tmp_path, monkeypatch):
    def run_with(on_device, folder):
        monkeypatch.setattr(capture_module, "on_accelerator", lambda model: on_device)
        cb = TripwireCallback({"collections": {"gradients": {}, "activations": {}, "weights": {"save": "tensors"}},
                               "sampling": {"every": 10}}, out_dir=tmp_path / folder)
        fit(cb, epochs=1, validation=False)
        return tripwire.open_run(cb.run_url)

    host, device = run_with(False, "host"), run_with(True, "device")
    assert host.tensor_names() == device.tensor_names()
    for name in host.tensor_names():
        for reduction in host.tensor(name).reductions():
            np.testing.assert_allclose(device.tensor(name).series(reduction)[1], host.tensor(name).series(reduction)[1],
                                       rtol=1e-4, atol=1e-6)
    kernel = next(n for n in host.tensor_names("weights"))
    np.testing.assert_allclose(device.tensor(kernel).value(10), host.tensor(kernel).value(10), rtol=1e-6)


def test_wrap_optimizer_is_idempotent_and_inert():
    optimizer = keras.optimizers.SGD(0.1)
    assert wrap_optimizer(optimizer) is optimizer
    hooks = dict(vars(optimizer))
    wrap_optimizer(optimizer)
    assert vars(optimizer)["apply"] is hooks["apply"] and vars(optimizer)["scale_loss"] is hooks["scale_loss"]
    assert float(optimizer.scale_loss(keras.ops.ones(()))) == 1.0


def test_the_run_knows_the_model_normalisation_shifts_are_biases_and_frozen_layers_are_seen(tmp_path):
    """BatchNormalization's beta (zeros at first) is a normalisation shift filed under biases/, gamma a scale; a
    frozen layer is in the structure (a frozen first layer is fine-tuning: no verdict); the default config stays
    quiet on the model and lets it train."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, use_bias=False),
                              keras.layers.BatchNormalization(), keras.layers.ReLU(),
                              keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.layers[0].trainable = False
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    config = tripwire.load_config(None).to_dict()  # the default rules, sampled every 10 steps
    config.update(sampling={"every": 10}, collections={"weights": {}, "biases": {}, "losses": {}, "metrics": {}})
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    fit(cb, model, epochs=2)
    run = tripwire.open_run(cb.run_url)
    bn = model.layers[1]
    gamma, beta = run.model.parameters[bn.gamma.path], run.model.parameters[bn.beta.path]
    assert (gamma.role, beta.role, gamma.layer_type) == ("norm_scale", "norm_shift", "norm")
    assert f"biases/{bn.beta.path}" in run.tensor_names() and f"weights/{bn.gamma.path}" in run.tensor_names()
    first = run.model.parameters[model.layers[0].kernel.path]
    assert first.followed_by == "norm" and first.trainable is False
    assert not any(bn.moving_mean.path == p for p in run.model.parameters)  # state, not a parameter
    assert [v for v in run.verdicts() if v.counts] == [] and run.info["status"] == "finished"


def test_input_features_names_a_feature_on_another_scale_from_the_first_batch_alone(tmp_path):
    """The first batch is kept whole for input_features (on every backend, from the compiled step too); the
    later sampled batches as reductions only."""
    (xt, yt), _ = helpers.digits()
    xt = xt.copy()
    xt[:, 5] *= 10_000.0
    config = {"sampling": {"every": 10}, "rules": [{"rule": "input_features"}], "collections": {"inputs": {}}}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    model = mlp(lr=0.01)
    model.fit(xt, yt, batch_size=32, epochs=1, verbose=0, callbacks=[cb])
    run = tripwire.open_run(cb.run_url)
    (verdict,) = [v for v in run.verdicts() if v.finding == "inputs/x:scales"]
    assert verdict.step == 0 and verdict.evidence["largest"] == 5
    inputs = run.tensor("inputs/x")
    assert inputs.steps(tensors=True) == [0] and inputs.steps()[:3] == [0, 10, 20]


@pytest.mark.parametrize("ids", [False, True], ids=["pixels", "ids"])
def test_integer_inputs_are_measurements_unless_a_layer_reads_them_as_ids(tmp_path, ids):
    """uint8 pixels (the digits as 0..255) fed straight to Dense layers, which cast them: input_not_normalized
    judges them as any raw pixels. The same integers read by an Embedding are ids: not captured."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x * 255 / 16).astype("uint8")
    keras.utils.set_random_seed(0)
    reader = [keras.layers.Embedding(256, 4), keras.layers.Flatten()] if ids else []
    model = keras.Sequential([keras.Input((64,), dtype="uint8"), *reader, keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    config = {"sampling": {"every": 10}, "rules": [{"rule": "input_not_normalized"}]}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[cb])
    run = tripwire.open_run(cb.run_url)
    if ids:
        assert "inputs/x" not in run.tensor_names() and not any(v.fired for v in run.verdicts())
    else:
        (verdict,) = [v for v in run.verdicts() if v.fired]  # info: a risk, until training suffers from it
        assert verdict.rule == "input_not_normalized" and verdict.severity == "info"
        assert verdict.step == 2 and "values from 0 to 255" in verdict.message  # the first 3 batches


@pytest.mark.parametrize("given_as", ["dict", "list"])
def test_each_input_of_a_model_of_several_is_captured_by_its_name(tmp_path, given_as):
    """keras.io's structured-data recipes feed a dict of inputs, one per feature, by name (raw measurements in the
    thousands beside scaled ones): each is captured and judged on its own, `inputs/<key>` (`inputs/x.<i>` for a
    list); none was before."""
    (xt, yt), _ = helpers.digits()
    raw, scaled = xt[:, :8] + 50.0, xt[:, 8:]  # measurements around 50
    keras.utils.set_random_seed(0)
    inputs = {"raw": keras.Input((8,), name="raw"), "scaled": keras.Input((56,), name="scaled")}
    hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Concatenate()([inputs["raw"], inputs["scaled"]]))
    model = keras.Model(inputs if given_as == "dict" else [inputs["raw"], inputs["scaled"]],
                        keras.layers.Dense(10)(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=["accuracy"])
    cb = TripwireCallback({"sampling": {"every": 10}, "rules": ["input_not_normalized"]}, out_dir=tmp_path / "run")
    x = {"raw": raw, "scaled": scaled} if given_as == "dict" else [raw, scaled]
    history = model.fit(x, yt, batch_size=32, epochs=3, verbose=0, callbacks=[cb]).history
    assert history["accuracy"][-1] > 0.8, history["accuracy"]
    run = tripwire.open_run(cb.run_url)
    names = {"dict": ("inputs/raw", "inputs/scaled"), "list": ("inputs/x.0", "inputs/x.1")}[given_as]
    assert set(names) <= set(run.tensor_names("inputs"))
    (verdict,) = [v for v in run.verdicts() if v.fired]
    assert verdict.rule == "input_not_normalized" and verdict.finding == names[0] and verdict.step == 2


@pytest.mark.parametrize("given_as", ["dict", "list"])
def test_each_target_of_a_model_of_several_outputs_is_captured_by_its_name(tmp_path, given_as, caplog):
    """A model of two outputs (a digit's class, its ink) trained on a dict of targets by output name, or a list:
    each target is captured as `labels/<key>` (`labels/y.<i>` for a list); a dict was 'not captured' before."""
    (xt, yt), _ = helpers.digits()
    ink = xt.mean(axis=1, keepdims=True)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    model = keras.Model(inputs, {"digit": keras.layers.Dense(10, activation="softmax", name="digit")(hidden),
                                 "ink": keras.layers.Dense(1, name="ink")(hidden)})
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss={"digit": "sparse_categorical_crossentropy",
                                                               "ink": "mse"}, metrics={"digit": ["accuracy"]})
    cb = TripwireCallback({"sampling": {"every": 10}, "collections": {"labels": {"save": "tensors"}}, "rules": []},
                          out_dir=tmp_path / "run")
    y = {"digit": yt, "ink": ink} if given_as == "dict" else [yt, ink]
    history = model.fit(xt, y, batch_size=32, epochs=3, shuffle=False, verbose=0, callbacks=[cb]).history
    assert history["digit_accuracy"][-1] > 0.8, history
    run = tripwire.open_run(cb.run_url)
    digit, ink_name = {"dict": ("labels/digit", "labels/ink"), "list": ("labels/y.0", "labels/y.1")}[given_as]
    assert set(run.tensor_names("labels")) == {digit, ink_name}
    np.testing.assert_array_equal(run.tensor(digit).value(0).ravel(), yt[:32])
    np.testing.assert_allclose(run.tensor(ink_name).value(0).ravel(), ink[:32, 0], rtol=1e-6)
    assert not [r for r in caplog.records if "is not captured" in r.getMessage()]


def test_a_nested_model_s_layers_are_read_in_their_order(tmp_path):
    """keras.io's supervised contrastive example nests its encoder, an adapted Normalization first, in the
    classifier. Keras' recursive walk of the layers visits a nested model's layers last-first: the Normalization was
    not seen as the first layer (raw inputs were called not normalised), and the nested model's last Dense came
    first in the model's order (the first and last layers of exploding_gradient's ratio)."""
    (xt, yt), _ = helpers.digits()
    x = (xt - xt.min()) * 40.0  # 0..~255, the digits as raw pixels
    keras.utils.set_random_seed(0)
    normalization = keras.layers.Normalization()
    normalization.adapt(x)
    encoder = keras.Sequential([keras.Input((64,)), normalization, keras.layers.Dense(32, activation="relu",
                                                                                      name="hidden"),
                                keras.layers.Dense(16, name="embedding")], name="encoder")
    model = keras.Sequential([keras.Input((64,)), encoder, keras.layers.Dense(10, name="head")], name="classifier")
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = TripwireCallback({"rules": ["input_not_normalized"]}, out_dir=tmp_path / "run")
    model.fit(x, yt, batch_size=32, epochs=1, verbose=0, callbacks=[cb])
    run = tripwire.open_run(cb.run_url)
    assert run.model.inputs_scaled == "Normalization"
    kernels = [p.layer.split("/")[-1] for p in run.model.parameters.values() if p.role == "kernel"]
    assert kernels == ["hidden", "embedding", "head"]
    assert [v for v in run.verdicts() if v.fired] == []


@pytest.mark.parametrize("first", ["rescaling", "normalization", "dense_then_batchnorm", "none"])
def test_a_model_that_scales_its_own_inputs_is_not_told_to_normalise_them(tmp_path, first):
    """keras.io's way: raw 0..255 pixels into the model, augmentation, then Rescaling(1/255) (or an adapted
    Normalization layer) as the first layer that computes: the raw scale is what the model expects. A first Dense
    normalised next (BatchNormalization) takes the scale out as well."""
    (xt, yt), _ = helpers.digits()
    x = (xt - xt.min()) * 40.0  # 0..~255, the digits as raw pixels
    keras.utils.set_random_seed(0)
    scale = {"rescaling": [keras.layers.Rescaling(1 / 255.0)], "normalization": [keras.layers.Normalization()],
             "dense_then_batchnorm": [keras.layers.Dense(64), keras.layers.BatchNormalization()], "none": []}[first]
    if first == "normalization":
        scale[0].adapt(x)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Reshape((8, 8, 1)), keras.layers.RandomFlip(),
                              keras.layers.Flatten(), *scale, keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = TripwireCallback({"rules": ["input_not_normalized"]}, out_dir=tmp_path / "run")
    model.fit(x, yt, batch_size=32, epochs=1, verbose=0, callbacks=[cb])
    run = tripwire.open_run(cb.run_url)
    assert run.model.inputs_scaled == {"rescaling": "Rescaling", "normalization": "Normalization"}.get(first, "")
    told = [v for v in run.verdicts() if v.rule == "input_not_normalized" and v.fired]
    assert bool(told) == (first == "none")


def test_a_loss_that_stays_at_what_predicting_the_mean_scores_is_named_stuck(tmp_path):
    """Targets drawn apart from the inputs (DeepLocalize 39217567: labels that are a shuffle of another column),
    learned by mean squared error: the loss sits at the targets' variance, what predicting their mean scores,
    while the steps hardly move the weights. loss_not_decreasing says the model learned nothing from the inputs."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(2048, 8)).astype("float32"), rng.integers(0, 2, (2048, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    config = {"sampling": {"every": 5}, "rules": [{"rule": "loss_not_decreasing", "params": {"min_steps": 50}}]}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[cb])
    verdict = fired(cb.run_url)["loss_not_decreasing"]
    assert verdict.finding == "stuck" and "about what predicting the targets' mean scores" in verdict.message



def test_a_loss_that_sums_its_samples_says_how_many_at_the_first_step(tmp_path):
    """An autoencoder of the digits' pixels under BinaryCrossentropy(reduction="sum"): the loss adds up one term per
    sample of the batch (each the mean over the pixels, as Keras computes a sample's loss), and its gradients
    are that many times the mean's; exploding_gradient judges them against that scale, and the run learns."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(64, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.BinaryCrossentropy(reduction="sum"))
    (xt, _), _ = helpers.digits(n_train=1024, pixels=True)
    pixels = xt / 255.0
    cb = TripwireCallback(None, out_dir=tmp_path / "run")
    history = model.fit(pixels, pixels, batch_size=128, epochs=30, verbose=0, callbacks=[cb])
    mean_image = np.clip(pixels.mean(0), 1e-4, 1 - 1e-4)
    baseline = -np.mean(pixels * np.log(mean_image) + (1 - pixels) * np.log(1 - mean_image))  # per pixel
    assert history.history["loss"][-1] / 128 < 0.9 * baseline, (history.history["loss"][-1] / 128, baseline)
    run = tripwire.open_run(cb.run_url)
    (use,) = run.first_step.losses
    assert (use.loss, use.settings["reduction"], use.terms) == ("binary_cross_entropy", "sum", 128)
    assert [v.rule for v in run.verdicts() if v.counts] == []


class Batches(keras.utils.PyDataset):
    """Digits in batches of 32; `ignores_index`: __getitem__ forgets its index and hands out the first batch at
    every step; `batches`: how many an epoch holds (1: the whole set at once, a full-batch training)."""

    def __init__(self, x, y, ignores_index=False, batches=None):
        super().__init__()
        self.x, self.y, self.ignores_index = x, y, ignores_index
        self.size = 32 if batches is None else -(-len(x) // batches)

    def __len__(self):
        return -(-len(self.x) // self.size)

    def __getitem__(self, index):
        start = 0 if self.ignores_index else index * self.size
        return self.x[start:start + self.size], self.y[start:start + self.size]


@pytest.mark.parametrize("data", ["healthy", "index_ignored", "full_batch", "full_batch_dataset",
                                  "full_batch_repeated_then_batched", "alike_samples"])
def test_a_dataset_that_hands_out_one_batch_again_is_a_warning(tmp_path, data):
    """A PyDataset whose __getitem__ ignores its index trains on one batch: the inputs of steps 0, 1 and 2 are
    the same bytes, told at step 2. Batches that change, a full-batch training (one batch per epoch, the same at
    every step by design; or a tf.data dataset of the whole set as one element, repeated, four steps an epoch, or
    the set's samples repeated and batched by their number) and
    data whose first batches hold one sample over and over (a flat stretch at the start of a series: each batch is
    its samples alike, so equal batches say nothing of the loader) are silent and learn."""
    (xt, yt), (xv, yv) = helpers.digits()
    if data == "alike_samples":
        xt, yt = np.concatenate([np.repeat(xt[:1], 96, axis=0), xt]), np.concatenate([np.repeat(yt[:1], 96), yt])
    model = mlp(optimizer="adam", lr=0.01)
    cb = TripwireCallback({"rules": [{"rule": "training_relations"}]}, out_dir=tmp_path / "run")
    if data.startswith("full_batch_"):
        import tensorflow as tf

        dataset = tf.data.Dataset.from_tensors((xt, yt)).repeat() if data == "full_batch_dataset" else \
            tf.data.Dataset.from_tensor_slices((xt, yt)).repeat().batch(len(xt))
        model.fit(dataset, steps_per_epoch=4, epochs=25, shuffle=False, verbose=0, callbacks=[cb])
    else:
        batches = Batches(xt, yt, ignores_index=data == "index_ignored", batches=1 if data == "full_batch" else None)
        model.fit(batches, epochs=100 if data == "full_batch" else 5, shuffle=False, verbose=0, callbacks=[cb])
    found = [(v.finding, v.step, v.severity) for v in tripwire.open_run(cb.run_url).verdicts()
             if v.rule == "training_relations" and v.fired]
    accuracy = float(np.mean(np.argmax(model.predict(xv, verbose=0), axis=1) == yv))
    if data == "index_ignored":
        assert found == [("repeated_batch", 2, "warning")] and accuracy < 0.8
    else:
        assert found == [] and accuracy > 0.9


@pytest.mark.parametrize("weights", ["integer_division", "floats"])
def test_class_weights_that_leave_classes_out_are_told_at_the_first_step(tmp_path, weights):
    """Class weights computed as sklearn's "balanced" formula with `//`: every class with more samples than the
    mean gets weight 0 and is never learned (0 % recall on it), told at step 0 by the default config. The same
    formula in floats is silent, and the model learns every class."""
    (xt, yt), (xv, yv) = helpers.digits()
    counts = np.bincount(yt, minlength=10)
    divide = (lambda a, b: a // b) if weights == "integer_division" else (lambda a, b: a / b)
    class_weight = {c: divide(len(yt), 10 * int(counts[c])) for c in range(10)}
    model = mlp(optimizer="adam", lr=0.01)
    cb = TripwireCallback(None, out_dir=tmp_path / "run")
    model.fit(xt, yt, batch_size=32, epochs=5, class_weight=class_weight, verbose=0, callbacks=[cb])
    predicted = np.argmax(model.predict(xv, verbose=0), axis=1)
    recalls = [float(np.mean(predicted[yv == c] == c)) for c in range(10)]
    found = [(v.rule, v.finding, v.step) for v in tripwire.open_run(cb.run_url).verdicts() if v.counts]
    if weights == "integer_division":
        zero = [c for c in range(10) if class_weight[c] == 0]
        assert len(zero) >= 2 and min(recalls[c] for c in zero) < 0.5
        assert found[0] == ("loss_setup", "classes_weighted_out", 0), found
        assert ", ".join(map(str, zero)) in tripwire.open_run(cb.run_url).verdicts()[0].message
    else:
        assert found == [] and min(recalls) > 0.7


@pytest.mark.parametrize("data", ["ordered_by_class", "shuffled", "one_rare_class"])
def test_a_validation_split_of_classes_training_never_holds_is_told_at_the_first_step(tmp_path, data):
    """validation_split takes the last 20 % of the arrays before Keras shuffles: on digits ordered by class, the
    validation holds only the last classes, which training never sees (0 % validation accuracy), told at step 0
    by the default config. The same arrays shuffled first are silent, and the model learns; so is a split whose
    validation alone holds one sample of a rare class (under 5 % of its labels: no bug of the split)."""
    (xt, yt), _ = helpers.digits()
    if data == "one_rare_class":  # the only 9 left is the last sample, which falls into the validation
        keep = np.flatnonzero(yt != 9)
        xt, yt = np.concatenate([xt[keep], xt[yt == 9][:1]]), np.concatenate([yt[keep], [9]])
    order = np.argsort(yt, kind="stable") if data == "ordered_by_class" else \
        np.random.default_rng(0).permutation(len(yt)) if data == "shuffled" else np.arange(len(yt))
    model = mlp(optimizer="adam", lr=0.01)
    cb = TripwireCallback(None, out_dir=tmp_path / "run")
    history = model.fit(xt[order], yt[order], batch_size=32, epochs=5, validation_split=0.2, verbose=0,
                        callbacks=[cb])
    found = [(v.rule, v.finding, v.step) for v in tripwire.open_run(cb.run_url).verdicts() if v.counts]
    if data == "ordered_by_class":
        assert history.history["val_loss"][-1] > 3.0
        assert found[0] == ("loss_setup", "validation_classes_untrained", 0), found
    else:
        assert found == [] and history.history["val_loss"][-1] < 0.35


@pytest.mark.parametrize("order", ["permuted", "same"])
def test_validation_data_whose_columns_come_in_another_order_is_told_at_the_first_step(tmp_path, order):
    """Raw measurements (breast cancer), normalised by the model's first layer: validation_data whose columns
    were taken in another order scores the model on features it was not trained on, told at step 0 under the
    default config; the columns in order are silent, and the model is right on the validation set."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    x, y = load_breast_cancer(return_X_y=True)
    x_train, x_valid, y_train, y_valid = train_test_split(x.astype("float32"), y.astype("float32"), test_size=0.3,
                                                          random_state=0, stratify=y)
    fed = x_valid[:, np.random.default_rng(0).permutation(x.shape[1])] if order == "permuted" else x_valid
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    normalise = keras.layers.Normalization()
    normalise.adapt(x_train)
    model = keras.Sequential([keras.Input((30,)), normalise, keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy", metrics=["accuracy"])
    cb = TripwireCallback(None, out_dir=tmp_path / "run")
    history = model.fit(x_train, y_train, batch_size=32, epochs=10, validation_data=(fed, y_valid), verbose=0,
                        callbacks=[cb])
    found = [(v.rule, v.finding, v.step) for v in tripwire.open_run(cb.run_url).verdicts() if v.counts]
    if order == "permuted":
        assert history.history["val_accuracy"][-1] < 0.8
        assert found[0] == ("loss_setup", "columns_swapped", 0), found
    else:
        assert found == [] and history.history["val_accuracy"][-1] > 0.9
