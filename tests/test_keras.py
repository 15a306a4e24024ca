"""The Keras plugin: every case of keras_cases.py on TensorFlow here, and on torch and JAX in subprocesses;
what only TensorFlow can show; a Keras run and a Lightning run of the same model read the same."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import helpers
import tripwire
from keras_cases import *  # noqa: F401,F403 - collected here, on the TensorFlow backend (conftest.py)
from keras_models import fired, fit, mlp
from tripwire.plugins.keras import TripwireCallback
from tripwire.plugins.keras.capture import StepCapture, keras_function_of

HERE = Path(__file__).parent
SINGLE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_every_case_on_another_backend(backend):
    pytest.importorskip(backend)
    env = {**os.environ, "KERAS_BACKEND": backend, "XLA_FLAGS": SINGLE_THREAD_XLA}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "keras_cases.py")],
                            env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_where_a_nan_began_is_found_in_an_eager_step_too(tmp_path):
    """`run_eagerly`: the loss is read on the host before the update, and the layer found the same way."""
    from keras_cases import squared_features

    (x, y), _ = helpers.digits()
    x = x[:14 * 32].copy()
    x[13 * 32:] *= 1e20
    cb = TripwireCallback(out_dir=tmp_path / "run")
    squared_features("sparse_categorical_crossentropy", run_eagerly=True).fit(
        x, y[:14 * 32], batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    (verdict,) = [v for v in cb.verdicts if v.rule == "exploding_tensor"]
    assert verdict.step == 13 and "It began in `square`: its output holds" in verdict.message


@pytest.mark.parametrize("distribution", ["mirrored", "data_parallel"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_distributed_fit_is_captured_and_a_nan_told(tmp_path, distribution, replicas):
    """Two CPU devices (a process of its own): TensorFlow's MirroredStrategy, whose optimizer step count is a
    MirroredVariable (int() of it crashed the fit at its start), and Keras' DataParallel on JAX, whose
    make_train_function reads each variable's sharding from a value Keras empties during an epoch (a capture
    function made there crashed). The model learns, the sampled steps are captured, and a NaN is told at its
    step, with where it began (not on two TensorFlow replicas: origin.py)."""
    pytest.importorskip("jax" if distribution == "data_parallel" else "tensorflow")
    script = HERE / "scripts" / "train_keras_distributed.py"
    outputs = {}
    for case, extra in (("healthy", []), ("nan", ["--nan-at", "13"])):
        result = subprocess.run([sys.executable, str(script), str(tmp_path / case), distribution, str(replicas),
                                 *extra], cwd=HERE.parent, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        outputs[case] = result.stdout
    before, after = map(float, re.search(r"learned (\S+) (\S+)", outputs["healthy"]).groups())
    assert after < before / 3
    run = tripwire.open_run(str(tmp_path / "healthy"))
    assert run.steps() == list(range(0, 56, 5)) and run.tensor_names("gradients")
    verdict = re.search(r"verdict (\d+) (.*)", outputs["nan"])
    assert verdict and verdict.group(1) == "13"
    assert ("It began in `square`" in verdict.group(2)) == (distribution == "data_parallel" or replicas == 1)


def test_a_fit_on_sparse_inputs_trains_with_the_nan_guard_in_its_step(tmp_path):
    """The guard that finds where a NaN began copies the batch in the step: a SparseTensor cannot be handed to a
    host callback, and the first version of the guard broke the trace of such a fit. Sparse inputs are left to
    the NaN check alone; the fit trains as without tripwire."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = (rng.random((512, 30)) < 0.2).astype("float32")
    y = (x[:, :3].sum(axis=1) > 0).astype("int32")
    losses = {}
    for name, callbacks in (("plain", []), ("tripwire", [TripwireCallback(out_dir=tmp_path / "run")])):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((30,), sparse=True)
        model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(16, activation="relu")(inputs)))
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        data = tf.data.Dataset.from_tensor_slices((tf.sparse.from_dense(x), y)).batch(32)
        losses[name] = model.fit(data, epochs=3, verbose=0, callbacks=callbacks).history["loss"]
    assert losses["tripwire"] == losses["plain"] and losses["plain"][-1] < losses["plain"][0]


def test_keras_and_lightning_runs_read_the_same(tmp_path):
    from tripwire.plugins.lightning import TripwireCallback as LightningCallback

    config = {"sampling": {"every": 2},
              "collections": {c: {} for c in ("weights", "biases", "gradients", "updates", "activations", "losses",
                                              "metrics", "optimizer")},
              "rules": ["exploding_tensor", {"rule": "loss_not_decreasing", "params": {"min_steps": 20}}, "overfit"]}
    lightning = LightningCallback(config, out_dir=tmp_path / "lightning")
    helpers.fit(lightning, helpers.mlp_module(lr=0.0), max_epochs=1)
    keras_cb = TripwireCallback(config, out_dir=tmp_path / "keras")
    fit(keras_cb, mlp(lr=0.0), epochs=1)
    a, b = tripwire.open_run(lightning.run_url), tripwire.open_run(keras_cb.run_url)

    assert a.collections() == b.collections() and a.modes() == b.modes() == ["eval", "train"]
    assert a.steps() == b.steps() == list(range(0, 43, 2)) and a.steps(mode="eval") == b.steps(mode="eval") == [43]
    # every step holds the loss: Lightning's returned loss, Keras' told from the running mean it logs (metrics/loss)
    assert a.tensor("losses/train").steps() == b.tensor("losses/train").steps() == list(range(43))
    assert b.tensor("metrics/loss").steps() == list(range(43))
    for collection in a.collections():
        reductions = {frozenset(run.tensor(n).reductions(mode=m)) for run in (a, b) for m in run.modes()
                      for n in run.tensor_names(collection, mode=m)}
        assert len(reductions) == 1, (collection, reductions)  # every tensor of the collection, in both runs
    for collection, count in (("weights", 2), ("biases", 2), ("gradients", 4), ("updates", 4)):
        assert len(a.tensor_names(collection)) == len(b.tensor_names(collection)) == count
    assert [n.split("/", 1)[1] for n in a.tensor_names("optimizer")] == \
        [n.split("/", 1)[1] for n in b.tensor_names("optimizer")] == ["lr", "momentum", "weight_decay"]
    assert a.tensor_names("losses") == b.tensor_names("losses") == ["losses/train"]
    assert a.tensor_names("metrics") == ["metrics/val_loss"] and b.tensor_names("metrics") == ["metrics/loss",
                                                                                            "metrics/val_loss"]

    verdicts = [{v.rule: v for v in run.verdicts()} for run in (a, b)]
    assert verdicts[0].keys() == verdicts[1].keys() >= {"loss_not_decreasing"}
    for rule in verdicts[0]:
        x, y = verdicts[0][rule].to_dict(), verdicts[1][rule].to_dict()
        assert x.keys() == y.keys() and all(x[k] == y[k] for k in ("rule", "mode", "worker", "status", "source", "hint"))

    checks = [subprocess.run([sys.executable, "-m", "tripwire", "check", cb.run_url], capture_output=True, text=True,
                             timeout=120) for cb in (lightning, keras_cb)]
    assert [c.returncode for c in checks] == [1, 1]
    shape = [re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", re.sub(r"(net\.\d\.\w+|sequential/\S+)", "T", c.stdout))
             for c in checks]
    first = [{line.split("]")[0]: line for line in reversed(text.splitlines()) if line.startswith("[")} for text in shape]
    assert first[0] == first[1]  # each rule's first verdict: the same words, tensors and numbers aside


def test_the_loss_keras_logs_is_stored_at_every_step_and_the_rules_read_the_sampled_steps(tmp_path):
    """Keras hands its logged loss (the epoch's running mean) over at every step: with config=None (every 100
    steps) a run of 430 steps stores 430 points of it as metrics/loss, and each step's own loss told from it as
    losses/train; the rules read the sampled steps."""
    cb = TripwireCallback(None, out_dir=tmp_path / "run")
    history = fit(cb, epochs=10).history.history
    run = tripwire.open_run(cb.run_url)
    steps, values = run.tensor("metrics/loss").series()
    assert steps.tolist() == list(range(430))
    assert np.isclose(values[42], history["loss"][0], rtol=1e-5)  # an epoch's last step: the epoch's loss
    own = run.tensor("losses/train").series()[1]
    assert np.isclose(own[43:86].mean(), history["loss"][1], rtol=1e-3)  # an epoch's steps: the epoch's mean
    assert run.tensor("losses/train").steps() == list(range(430)) and run.steps() == [*range(10), 100, 200, 300,
                                                                                       400]


def test_steps_per_execution_samples_the_calls_that_hold_a_scheduled_step(tmp_path):
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=4)
    cb = TripwireCallback({"collections": {"gradients": {}, "losses": {}}, "sampling": {"every": 10}},
                          out_dir=tmp_path / "run")
    fit(cb, model, epochs=1, validation=False)
    run = tripwire.open_run(cb.run_url)
    # calls run steps 0-3, 4-7, …; each call holding 0, 10, 20, 30 or 40 is sampled, at its last step
    assert run.steps() == [3, 11, 23, 31, 42]
    assert run.tensor(f"gradients/{model.layers[0].kernel.path}").steps() == [3, 11, 23, 31, 42]


def test_first_evaluation_says_why_a_call_of_several_steps_leaves_it_without_data(tmp_path):
    """The first loss recorded is the first call's (steps 0-3, at step 3): no untrained model's loss to hold the
    first evaluation to. The reason given names steps_per_execution, not only a resumed run."""
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), steps_per_execution=4)
    cb = TripwireCallback({"collections": {"losses": {}}, "rules": ["first_evaluation"]}, out_dir=tmp_path / "run")
    fit(cb, model, epochs=1)
    (verdict,) = [v for v in tripwire.open_run(cb.run_url).verdicts() if v.rule == "first_evaluation"]
    assert verdict.status == "no_data" and "step 3's" in verdict.message and "steps_per_execution" in verdict.message


def test_a_model_compiled_with_xla_is_captured(tmp_path):
    # XLA cannot compile the dataset's get_next: the capture function must keep it outside the compiled step
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True)
    cb = TripwireCallback({"collections": {"gradients": {}, "losses": {}}, "sampling": {"every": 10}},
                          out_dir=tmp_path / "run")
    fit(cb, model, epochs=1, validation=False)
    run = tripwire.open_run(cb.run_url)
    gradient = run.tensor(f"gradients/{model.layers[0].kernel.path}")
    assert gradient.steps() == run.steps() == [0, 10, 20, 30, 40]
    l2 = gradient.series("l2")[1]
    assert np.all(np.isfinite(l2) & (l2 > 0))


def test_unsampled_steps_run_one_step_function_from_a_fit_with_tripwire_until_compile(tmp_path):
    """The one-step function stands in for Keras' own, traced in its place: it stays the model's train function
    after the fit (a later fit trains what it traced, as with Keras' own: test_a_layer_s_trainable_changed…), and
    hands what is no dataset iterator to Keras' (train_on_batch passes a generator); compile() ends it."""
    from tripwire.plugins.keras.tf_step import UnsampledSteps

    model = mlp()
    model.make_train_function()
    seen = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(type(self.model.train_function))

    cb = TripwireCallback({"collections": {"gradients": {}}, "sampling": {"every": 10}}, out_dir=tmp_path / "run")
    fit(cb, model, epochs=1, validation=False, callbacks=[Spy()])
    assert seen.count(UnsampledSteps) == 43 - 5
    stays = model.train_function
    assert isinstance(stays, UnsampledSteps) and stays.keras_function is keras_function_of(model)
    (x, y), _ = helpers.digits()
    assert np.isfinite(model.train_on_batch(x[:32], y[:32]))
    model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)  # without tripwire: the same function, as traced
    assert model.train_function is stays and stays.function.experimental_get_tracing_count() == 1
    capture = cb._capture
    functions = [capture._unsampled.function, *capture._functions.values()]
    fit(cb, model, epochs=1, validation=False)  # fitting again reuses the functions and their traces
    assert cb._capture is capture and len(functions) == 2
    assert [f.experimental_get_tracing_count() for f in functions] == [1, 1]
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fit(cb, model, epochs=1, validation=False)  # a new optimizer: Keras made a new function, and so does tripwire
    assert cb._capture is not capture and keras_function_of(model) is not stays.keras_function
    assert model.train_function is cb._capture._unsampled


def fine_tune(change: str, callbacks_of) -> tuple[float, float]:
    """keras.io's transfer-learning recipe on digits: fit with the base frozen (or trainable), flip the base's
    `trainable` (`change`: "unfreeze" or "freeze"), fit again, compiled again or not ("…_recompiled"); the
    largest change of the base's and the head's kernels over the second fit. callbacks_of(phase) lists each fit's."""
    (x, y), _ = helpers.digits()
    keras.utils.set_random_seed(0)
    base = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu")], name="base")
    head = keras.layers.Dense(10, name="head")
    model = keras.Sequential([base, head])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    base.trainable = change.startswith("freeze")
    model.compile(keras.optimizers.Adam(1e-3), loss)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=callbacks_of(1))
    base.trainable = not base.trainable
    if change.endswith("recompiled"):
        model.compile(keras.optimizers.Adam(1e-3), loss)
    before = [keras.ops.convert_to_numpy(layer.kernel).copy() for layer in (base.layers[0], head)]
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=callbacks_of(2))
    return tuple(float(np.abs(keras.ops.convert_to_numpy(layer.kernel) - b).max())
                 for layer, b in zip((base.layers[0], head), before))


@pytest.mark.parametrize("change", ["unfreeze", "freeze", "unfreeze_recompiled"])
@pytest.mark.parametrize("first_fit", ["keras", "tripwire"])
def test_a_layer_s_trainable_changed_without_compile_trains_as_keras_does_and_is_an_error(tmp_path, change,
                                                                                            first_fit):
    """Keras' TensorFlow train function, once traced, trains the variables it was traced with until compile():
    a base unfrozen for fine-tuning without compile() is not trained, one frozen is still trained (Keras warns).
    A function tripwire traced afresh trained the others or failed ("Unknown variable"), whether tripwire watched
    the first fit or only the second: the fit must train what it trains without tripwire, and say why."""
    alone = fine_tune(change, lambda phase: [])
    config = {"sampling": {"every": 5}, "collections": {"losses": {}, "weights": {}, "gradients": {}},
              "rules": ["training_relations"]}
    callbacks = {phase: TripwireCallback(config, out_dir=tmp_path / f"fit{phase}") for phase in (1, 2)}
    watched = fine_tune(change, lambda phase: [callbacks[phase]] if phase == 2 or first_fit == "tripwire" else [])
    assert watched == pytest.approx(alone, rel=1e-5)
    assert (alone[0] > 0) == (change == "freeze") or change.endswith("recompiled") and alone[0] > 0
    run = tripwire.open_run(callbacks[2].run_url)
    found = [(v.finding, v.step, v.severity) for v in run.verdicts() if v.fired]
    relation = {"unfreeze": "trainable_after_compile", "freeze": "frozen_after_compile"}.get(change)
    assert found == ([(relation, run.steps()[0], "error")] if relation else [])  # at the second fit's first step


class Interrupt(keras.callbacks.Callback):
    """Listed after tripwire's callback: raises at the start of a batch, as a KeyboardInterrupt would."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 5:
            raise KeyboardInterrupt


def test_a_fit_cut_short_in_a_sampled_step_leaves_keras_function_to_the_next_fit(tmp_path):
    config = {"collections": {"gradients": {}}, "sampling": {"every": 5}}
    cb = TripwireCallback(config, out_dir=tmp_path / "a")
    model = fit(cb, epochs=1, validation=False)
    keras_own = keras_function_of(model)
    with pytest.raises(KeyboardInterrupt):  # on_train_end never comes: the capture function is still in place
        fit(cb, model, epochs=1, validation=False, callbacks=[Interrupt()])
    other, base = TripwireCallback(config, out_dir=tmp_path / "b"), int(model.optimizer.iterations)
    fit(other, model, epochs=1, validation=False)  # another callback: finds Keras' function under tripwire's
    assert keras_function_of(model) is keras_own
    assert tripwire.open_run(other.run_url).tensor(f"gradients/{model.layers[0].kernel.path}").steps() == \
        [s for s in range(base, base + 43) if s % 5 == 0]
    with pytest.raises(KeyboardInterrupt):
        fit(cb, model, epochs=1, validation=False, callbacks=[Interrupt()])
    # compiled again (the same optimizer, hooked already): Keras makes a new function at the next fit
    model.compile(optimizer=model.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fit(cb, model, epochs=1, validation=False)  # the same callback: it must not put back the function of before
    assert keras_function_of(model) is not keras_own and model.train_function is cb._capture._unsampled


class StepsRun(keras.callbacks.Callback):
    """Listed before tripwire's callback: the steps Keras ran, and which of them ran tripwire's capture function."""

    def __init__(self):
        super().__init__()
        self.steps, self.captured = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(int(self.model.optimizer.iterations) - 1)
        self.captured.append(isinstance(getattr(self.model.train_function, "__self__", None), StepCapture))


def test_a_dataset_of_unknown_length_runs_out_inside_a_sampled_step(tmp_path):
    # the filter hides the length: each epoch ends with a call that finds no data and never reaches
    # on_train_batch_end; after epoch 0 it is a sampled step's call, running the capture function
    import tensorflow as tf

    (x, y), _ = helpers.digits()
    data = tf.data.Dataset.from_tensor_slices((x[:1000], y[:1000])).filter(lambda *_: True).batch(100)
    model, probe = mlp(), StepsRun()
    cb = TripwireCallback({"collections": {"gradients": {}, "losses": {}}, "sampling": {"every": 2}},
                          out_dir=tmp_path / "run")
    with pytest.warns(UserWarning, match="ran out of data"):  # Keras' word for a dataset of unknown length
        model.fit(data, epochs=3, shuffle=False, verbose=0, callbacks=[probe, cb])
    assert len(probe.steps) == 30
    sampled = [s for s in probe.steps if s % 2 == 0]
    run = tripwire.open_run(cb.run_url)
    assert run.steps() == run.tensor(f"gradients/{model.layers[0].kernel.path}").steps() == sampled
    assert probe.captured == [s % 2 == 0 for s in probe.steps]  # the next epoch is back on the unsampled steps' function


def test_batches_with_a_none_part_are_captured(tmp_path):
    # a generator's None (here: no sample weights) reaches the compiled step as an empty tf Optional
    (x, y), _ = helpers.digits()

    def batches():
        while True:
            for i in range(0, 1000, 100):
                yield x[i:i + 100], y[i:i + 100], None

    model = mlp()
    cb = TripwireCallback({"collections": {"gradients": {}, "losses": {}}, "sampling": {"every": 2}},
                          out_dir=tmp_path / "run")
    model.fit(batches(), steps_per_epoch=5, epochs=2, shuffle=False, verbose=0, callbacks=[cb])
    run = tripwire.open_run(cb.run_url)
    assert run.steps() == run.tensor(f"gradients/{model.layers[0].kernel.path}").steps() == [0, 2, 4, 6, 8]


class OwnTrainFunction(keras.Sequential):
    """A model that makes its train function itself: one that counts its calls."""

    calls = 0

    def make_train_function(self, force=False):
        super().make_train_function(force)
        function = self.train_function

        def counted(iterator):
            self.calls += 1
            return function(iterator)

        self.train_function = counted
        return counted


def test_a_model_that_makes_its_own_train_function_is_captured_through_it(tmp_path):
    keras.utils.set_random_seed(0)
    model = OwnTrainFunction([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = TripwireCallback({"collections": {"gradients": {}}, "sampling": {"every": 10}}, out_dir=tmp_path / "run")
    fit(cb, model, epochs=1, validation=False)
    assert model.calls == 43  # every step, the sampled ones too, ran a function the model made
    assert tripwire.open_run(cb.run_url).tensor(f"gradients/{model.layers[0].kernel.path}").steps() == [0, 10, 20, 30, 40]


class ManualStep(keras.Sequential):
    """A train step that applies gradients itself, past model.optimizer."""

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        for variable, grad in zip(self.trainable_variables, tape.gradient(loss, self.trainable_variables)):
            variable.assign_sub(0.1 * grad)
        self.optimizer.iterations.assign_add(1)
        return {"loss": loss}


class TwoOptimizers(keras.Model):
    """A train step that applies two optimizers of its own, a GAN's way: `compile()` without one leaves
    `model.optimizer` Keras' default RMSprop, which never steps."""

    def __init__(self):
        super().__init__()
        self.body = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu")], name="body")
        self.head = keras.Sequential([keras.Input((32,)), keras.layers.Dense(10)], name="head")

    def call(self, x, training=False):
        return self.head(self.body(x))

    def compile(self, body_optimizer, head_optimizer):
        super().compile()
        self.body_optimizer, self.head_optimizer = body_optimizer, head_optimizer

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            loss = keras.losses.sparse_categorical_crossentropy(y, self(x, training=True), from_logits=True)
            loss = keras.ops.mean(loss)
        for optimizer, part in ((self.body_optimizer, self.body), (self.head_optimizer, self.head)):
            optimizer.apply_gradients(zip(tape.gradient(loss, part.trainable_weights), part.trainable_weights))
        return {"xent": loss}  # "loss" is the loss tracker's, which compile() without a loss never updates


def test_optimizers_of_a_custom_train_step_passed_through_wrap_optimizer_are_captured(tmp_path, caplog):
    """As the README says: wrap the optimizers your train_step applies. Only model.optimizer's hooks were turned
    on in a capture, so nothing of these was captured, and the callback advised wrap_optimizer again."""
    from tripwire.plugins.keras import wrap_optimizer

    keras.utils.set_random_seed(0)
    model = TwoOptimizers()
    model.compile(wrap_optimizer(keras.optimizers.SGD(0.1)), wrap_optimizer(keras.optimizers.SGD(0.1)))
    cb = TripwireCallback({"collections": {"gradients": {}, "weights": {}}, "sampling": {"every": 10},
                           "rules": ["vanishing_gradient"]}, out_dir=tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="tripwire"):
        fit(cb, model, epochs=2, validation=False)
    (x, y), _ = helpers.digits()
    assert np.mean(np.argmax(model.predict(x, verbose=0), axis=1) == y) > 0.9
    assert not any("wrap_optimizer" in r.getMessage() for r in caplog.records)
    run = tripwire.open_run(cb.run_url)
    kernels = [n for n in run.tensor_names("gradients") if n.endswith("kernel")]
    assert len(kernels) == 2 and {"body", "head"} == {n.split("/")[1] for n in kernels}
    assert run.tensor(kernels[0]).steps() == list(range(0, 86, 10))
    assert not fired(cb.run_url)


class SineFit(keras.Model):
    """A physics-informed network's way: the train step draws its own points on [-3, 3] and fits sin there; the
    fit's data is a placeholder of zeros (the same bytes at every step)."""

    def __init__(self):
        super().__init__()
        self.net = keras.Sequential([keras.Input((1,)), keras.layers.Dense(32, activation="tanh"),
                                     keras.layers.Dense(1)])

    def call(self, x, training=False):
        return self.net(x)

    def train_step(self, data):
        import tensorflow as tf

        points = tf.random.uniform((64, 1), -3.0, 3.0)
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(points, training=True) - keras.ops.sin(points)))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_weights), self.trainable_weights))
        return {"loss": loss}


def test_a_placeholder_batch_of_a_train_step_that_makes_its_own_data_is_no_repeat(tmp_path):
    keras.utils.set_random_seed(0)
    model = SineFit()
    model.compile(keras.optimizers.Adam(0.01))
    cb = TripwireCallback({"rules": [{"rule": "training_relations"}]}, out_dir=tmp_path / "run")
    model.fit(np.zeros((64 * 32, 1), "float32"), np.zeros((64 * 32, 1), "float32"), batch_size=64, epochs=5,
              verbose=0, callbacks=[cb])
    points = np.linspace(-3, 3, 200, dtype="float32")[:, None]
    assert np.mean((model.predict(points, verbose=0) - np.sin(points)) ** 2) < 0.05  # it learns sin
    assert not [v for v in cb.verdicts if v.fired]


class OwnLosses(TwoOptimizers):
    """TwoOptimizers whose train step logs its loss under a name of its own, as a GAN's logs `d_loss` and `g_loss`:
    Keras logs no `loss`."""

    def train_step(self, data):
        return {"head_loss": super().train_step(data)["xent"]}


@pytest.mark.parametrize("lr", [50.0, 0.1])
def test_a_nan_in_the_losses_a_custom_train_step_logs_is_told_at_its_step(tmp_path, lr):
    """Only `loss` was judged between samples: a NaN here was not told at all (the weights these optimizers train
    are not captured without wrap_optimizer)."""
    keras.utils.set_random_seed(0)
    model = OwnLosses()
    model.compile(keras.optimizers.SGD(lr), keras.optimizers.SGD(lr))
    nan_at = []  # the steps whose logged loss is not finite

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if not np.isfinite(logs["head_loss"]):
                nan_at.append(batch)

    cb = TripwireCallback({"rules": [{"rule": "exploding_tensor", "actions": ["log", "stop"]}],
                           "sampling": {"every": 10}}, out_dir=tmp_path / "run")
    (x, y), _ = helpers.digits()
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[Watch(), cb])
    if lr == 0.1:
        assert np.mean(np.argmax(model.predict(x, verbose=0), axis=1) == y) > 0.9  # it learns
        assert not fired(cb.run_url) and not nan_at
        return
    assert nan_at[0] % 10 != 0 and fired(cb.run_url)["exploding_tensor"].step == nan_at[0]  # unsampled
    assert nan_at == [nan_at[0]] and tripwire.open_run(cb.run_url).info["status"] == "stopped"


def test_gradients_that_bypass_the_optimizer_are_reported_missing(tmp_path, caplog):
    keras.utils.set_random_seed(0)
    model = ManualStep([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = TripwireCallback({"rules": ["vanishing_gradient"], "collections": {"losses": {}}, "sampling": {"every": 10}},
                          out_dir=tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="tripwire"):
        fit(cb, model, epochs=1, validation=False)
    assert sum("wrap_optimizer" in r.getMessage() for r in caplog.records) == 1
    assert sum("scale_loss" in r.getMessage() for r in caplog.records) == 1  # the loss falls back to Keras' logs
    (verdict,) = tripwire.open_run(cb.run_url).verdicts()
    assert verdict.rule == "vanishing_gradient" and verdict.status == "no_data" and "gradients" in verdict.message
    assert not fired(cb.run_url)
    assert np.isfinite(tripwire.open_run(cb.run_url).tensor("losses/train").series()[1]).all()


def test_a_train_step_without_scale_loss_still_gives_every_sampled_loss(tmp_path, caplog):
    """The unsampled steps' function keeps no loss there: the first loss-only step finds out and falls back on the
    logs, each step's own loss told from the running mean they hold."""
    keras.utils.set_random_seed(0)
    model = ManualStep([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = TripwireCallback({"collections": {"losses": {}}, "sampling": {"every": 10}}, out_dir=tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="tripwire"):
        fit(cb, model, epochs=1, validation=False)
    assert sum("scale_loss" in r.getMessage() for r in caplog.records) == 1
    steps, losses = tripwire.open_run(cb.run_url).tensor("losses/train").series()
    assert steps.tolist() == list(range(43)) and np.isfinite(losses).all()


class OwnOptimizer(keras.Sequential):
    """An autoencoder whose train step applies an optimizer of its own, as a GAN's does: model.optimizer never
    steps, and the data holds no labels."""

    def train_step(self, x):
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self(x, training=True) - x) ** 2)
        self.own.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        return {"loss": loss}


def test_a_train_step_with_an_optimizer_of_its_own_counts_its_steps_across_epochs(tmp_path, caplog):
    keras.utils.set_random_seed(0)
    model = OwnOptimizer([keras.Input((64,)), keras.layers.Dense(8), keras.layers.Dense(64)])
    model.own = keras.optimizers.SGD(0.05)
    model.compile()
    cb = TripwireCallback({"collections": {"losses": {}, "labels": {}}, "sampling": {"every": 10}},
                          out_dir=tmp_path / "run")
    (xt, _), _ = helpers.digits()
    error = lambda: float(keras.ops.mean((model(xt) - xt) ** 2))  # noqa: E731
    before = error()
    with caplog.at_level(logging.WARNING, logger="tripwire"):
        model.fit(xt, epochs=3, batch_size=32, verbose=0, callbacks=[cb])
    run = tripwire.open_run(cb.run_url)
    assert error() < 0.8 * before  # it learns
    # 43 steps an epoch: each epoch's steps are its own, not the first epoch's again
    assert int(model.optimizer.iterations) == 0 and run.steps() == list(range(0, 129, 10))
    assert run.tensor("losses/train").steps() == list(range(129))
    assert not [r for r in caplog.records if "labels" in r.getMessage()]  # no labels: nothing to say


def test_steps_a_loss_scale_optimizer_skips_are_steps_all_the_same(tmp_path):
    """mixed_float16 wraps the optimizer in a LossScaleOptimizer, which skips a step whose scaled gradients
    overflow and does not count it (optimizer.iterations). Here its initial scale overflows a loss x1000 for the
    first steps: each epoch's steps are still its own, not the last epoch's again, and validation is recorded at
    the step after each epoch's last."""
    model = mlp()
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-4), initial_scale=2.0 ** 127)
    model.compile(optimizer, lambda y, logits: 1e3 * keras.losses.sparse_categorical_crossentropy(
        y, logits, from_logits=True))
    cb = TripwireCallback({"collections": {"losses": {}, "metrics": {}}, "sampling": {"every": 10}},
                          out_dir=tmp_path / "run")
    fit(cb, model, epochs=3)
    run = tripwire.open_run(cb.run_url)
    assert int(optimizer.iterations) == 129 - 10  # the first 10 steps were skipped, and not counted
    assert run.tensor("losses/train").steps() == list(range(129)) and run.steps("train") == list(range(0, 129, 10))
    assert run.tensor("metrics/val_loss").steps(mode="eval") == [43, 86, 129]
    fit(cb, model, epochs=1)  # a next fit goes on where this one ended
    assert tripwire.open_run(cb.run_url).tensor("losses/train").steps() == list(range(172))


def spread_out(epsilon):
    """Cross-entropy with a small hinge that keeps logits apart (pairwise distances below 1), the distances as the
    sqrt of the squared differences, which takes each sample's distance to itself: the gradient of sqrt at 0 is
    NaN, at every step, unless `epsilon` is added inside."""
    def loss(y, logits):
        distances = keras.ops.sqrt(keras.ops.sum((logits[:, None] - logits[None]) ** 2, -1) + epsilon)
        return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True) + \
            1e-3 * keras.ops.mean(keras.ops.relu(1 - distances))
    return loss


@pytest.mark.parametrize("epsilon", [0.0, 1e-6])
def test_a_loss_scale_optimizer_that_skips_every_step_is_an_error(tmp_path, epsilon):
    model = mlp()
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer, spread_out(epsilon))
    cb = TripwireCallback({"sampling": {"every": 10}, "rules": [{"rule": "training_relations"}]},
                          out_dir=tmp_path / "run")
    fit(cb, model, epochs=2)
    run = tripwire.open_run(cb.run_url)
    found = [(v.finding, v.step, v.severity) for v in run.verdicts() if v.fired]
    if epsilon == 0:
        assert int(optimizer.iterations) == 0 and found == [("skipped_steps", 29, "error")]  # the 30th skip
        assert "last 30 steps" in run.verdicts()[0].message
    else:
        (xt, yt), _ = helpers.digits()
        assert float(np.mean(np.argmax(model.predict(xt, verbose=0), 1) == yt)) > 0.8  # it learns
        assert int(optimizer.iterations) == 86 and found == []


TRAINING_IMPORTS = """
import sys, tempfile
import numpy as np, keras
from tripwire.plugins.keras import TripwireCallback
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
model.compile(optimizer="sgd", loss="mse")
callback = TripwireCallback(None, out_dir=tempfile.mkdtemp())
before = set(sys.modules)
model.fit(np.zeros((64, 8), "float32"), np.zeros((64, 4), "float32"), epochs=1, verbose=0, callbacks=[callback])
print(sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("tripwire", "fsspec", "numpy", "yaml")))
"""


def test_predictions_past_the_writer_limit_are_left_out_with_a_warning(tmp_path, caplog):
    """The outputs of a predict call wait for its end in memory: no more of them than the writer's queue holds."""
    config = {"collections": {"predictions": {"save": "tensors"}}, "writer": {"max_queue_mb": 20_000 / 2**20}}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    _, (xv, _) = helpers.digits()
    with caplog.at_level(logging.WARNING, logger="tripwire"):
        outputs = mlp().predict(xv, batch_size=100, verbose=0, callbacks=[cb])  # 4,000 bytes a batch
    assert sum("max_queue_mb" in r.getMessage() for r in caplog.records) == 1
    saved = tripwire.open_run(cb.run_url).tensor("predictions").value(0, mode="predict")
    np.testing.assert_array_equal(saved, outputs[:200])


class PredictEachEpoch(keras.callbacks.Callback):
    def __init__(self, tripwire_callback, x):
        super().__init__()
        self.tripwire_callback, self.x = tripwire_callback, x

    def on_epoch_end(self, epoch, logs=None):
        self.model.predict(self.x, verbose=0, callbacks=[self.tripwire_callback])


def test_predict_during_fit_records_into_the_open_run(tmp_path):
    config = {"collections": {"losses": {}, "predictions": {}}, "sampling": {"every": 10}}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    _, (xv, _) = helpers.digits()
    fit(cb, epochs=2, validation=False, callbacks=[PredictEachEpoch(cb, xv[:64])])
    run = tripwire.open_run(cb.run_url)
    assert run.steps(mode="predict") == [43, 86] and run.steps() == list(range(0, 86, 10))
    assert run.info["status"] == "finished"


class TwoOutputs(keras.Model):
    def __init__(self):
        super().__init__()
        self.first, self.second = keras.layers.Dense(3), keras.layers.Dense(2)

    def call(self, x):
        return self.first(x), self.second(x)


def test_predict_of_a_model_with_several_outputs_records_the_first(tmp_path):
    cb = TripwireCallback({"collections": {"predictions": {"save": "tensors"}}}, out_dir=tmp_path / "run")
    keras.utils.set_random_seed(0)
    first, _ = TwoOutputs().predict(np.ones((40, 5), np.float32), batch_size=16, verbose=0, callbacks=[cb])
    saved = tripwire.open_run(cb.run_url).tensor("predictions").value(0, mode="predict")
    np.testing.assert_array_equal(saved, first)


def test_fit_imports_nothing_of_tripwire_or_its_storage(tmp_path):
    """Importing fsspec the first time costs tens of milliseconds (compiling it, without bytecode caches): the
    callback prepares the run's filesystem when it is made, so that fit does not pay for it."""
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "KERAS_HOME": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run([sys.executable, "-c", TRAINING_IMPORTS], env=env, cwd=HERE.parent, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_save_tensor_of_any_kind_inside_the_step_never_reaches_training(tmp_path, caplog):
    """TensorFlow's sparse and ragged tensors and strings are skipped, said once each; complex (as its magnitude),
    bfloat16, float8, numpy arrays and numbers are stored; the losses of every step are kept."""
    import tensorflow as tf

    cb = TripwireCallback({"collections": {"losses": {}, "custom": {"save": "tensors"}}, "sampling": {"every": 1},
                           "rules": []}, out_dir=tmp_path / "run")

    class Saver(keras.layers.Layer):
        def call(self, x):
            d = tf.constant([[0.0, 3.0], [4.0, 0.0]])
            for name, value in {"sparse": tf.sparse.from_dense(d), "ragged": tf.ragged.constant([[1.0, 2.0], [3.0]]),
                                "string": tf.constant(["a", "b"]), "complex": tf.complex(d, d),
                                "bf16": tf.cast(d, tf.bfloat16), "f8": keras.ops.cast(d, "float8_e4m3fn"),
                                "numpy": np.ones(3), "number": 1.5}.items():
                cb.save_tensor(name, value)
            return x

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), Saver(), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(np.random.rand(64, 8).astype("float32"), np.random.randint(0, 2, 64), batch_size=16, epochs=2,
              verbose=0, callbacks=[cb])
    run = tripwire.open_run(cb.run_url)
    assert run.steps() == list(range(8)) and len(run.tensor("losses/train").steps()) == 8
    assert run.tensor("custom/complex").value(3).ravel() == pytest.approx([0, 3 * 2 ** 0.5, 4 * 2 ** 0.5, 0])
    assert run.tensor("custom/bf16").value(3).tolist() == [[0.0, 3.0], [4.0, 0.0]]
    assert {"custom/f8", "custom/numpy", "custom/number"} <= set(run.tensor_names())
    said = [r.getMessage() for r in caplog.records if "is not captured" in r.getMessage()]
    assert sorted(m.split()[1] for m in said) == ["custom/ragged", "custom/sparse", "custom/string"]


def test_a_validation_loss_still_falling_towards_chance_is_not_labels_at_chance(tmp_path):
    """Raw breast-cancer features (up to 4,000) into a sigmoid classifier: the validation loss starts near 100 and
    falls for every epoch, above ln 2 throughout twelve epochs, while the accuracy climbs. It is learning, slowly:
    overfit's "never below chance" (labels that do not match their inputs) waits until it stops coming down. On
    TensorFlow only: on torch and JAX the same seed starts this model saturated, its loss flat."""
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((30,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    cb = TripwireCallback({"rules": ["overfit"]}, out_dir=tmp_path / "run")
    history = model.fit(x.astype("float32"), y.astype("float32"), batch_size=32, epochs=12, validation_split=0.2,
                        verbose=0, callbacks=[cb])
    val = history.history["val_loss"]
    assert val[-1] < val[0] / 10 and min(val) > np.log(2)  # falling, and above chance all along
    assert [v for v in tripwire.open_run(cb.run_url).verdicts() if v.fired] == []


def test_a_validation_at_chance_while_batchnorm_statistics_hold_their_start_is_not_labels_at_chance(tmp_path):
    """keras.io's time-series classifier (three Conv1D-BatchNorm-ReLU blocks, global pooling, softmax; Adam) on 1,200
    synthetic series (class 1 carries a short burst of a higher tone): 38 steps per epoch. Its training loss falls
    from the first epoch, while the validation loss stays at ln 2 for the first epochs: an evaluation normalises
    with BatchNorm's running statistics, which at Keras' momentum 0.99 still hold their initial values after 200
    steps (without waiting for them: a verdict at step 304). Once they are the data's, validation follows.
    Overfit's "never below chance" waits for them."""
    rng = np.random.RandomState(1)
    t = np.arange(176)
    y = rng.randint(0, 2, 1500)
    x = np.sin(2 * np.pi * rng.uniform(0.02, 0.08, (1500, 1)) * t + rng.uniform(0, 6.28, (1500, 1))) \
        + 0.8 * rng.randn(1500, 176)
    centre = rng.randint(20, 136, 1500)[:, None]
    x += y[:, None] * 1.2 * np.exp(-0.5 * ((t - centre) / 8.0) ** 2) * np.sin(2 * np.pi * 0.3 * t)
    x = ((x - x.mean(1, keepdims=True)) / x.std(1, keepdims=True)).astype("float32")[..., None]
    keras.utils.set_random_seed(1)
    inputs = keras.Input((176, 1))
    h = inputs
    for _ in range(3):
        h = keras.layers.ReLU()(keras.layers.BatchNormalization()(keras.layers.Conv1D(64, 3, padding="same")(h)))
    outputs = keras.layers.Dense(2, activation="softmax")(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["sparse_categorical_accuracy"])
    cb = TripwireCallback({"rules": ["overfit"]}, out_dir=tmp_path / "run")
    history = model.fit(x, y, batch_size=32, epochs=16, validation_split=0.2, verbose=0, callbacks=[cb]).history
    assert min(history["val_loss"][:8]) > 0.95 * np.log(2) and history["loss"][7] < 0.9 * history["loss"][0]
    # it learns what holds for other data (0.50 at the end against ln 2 = 0.69; accuracy 0.78)
    assert min(history["val_loss"]) < 0.85 * np.log(2) and max(history["val_sparse_categorical_accuracy"]) > 0.7
    run = tripwire.open_run(cb.run_url)
    assert run.model.running_keep == pytest.approx(0.99)
    assert [v for v in run.verdicts() if v.fired] == []


def test_a_validation_loss_read_while_batchnorm_statistics_hold_their_start_is_no_best_to_rise_from(tmp_path):
    """A small CNN (two Conv-BatchNorm-ReLU blocks, global pooling, softmax; Adam 1e-3) on 16x16 digits from a
    repeating tf.data pipeline, 40 steps an epoch: validation reads Keras' running statistics (momentum 0.99),
    which hold their start for hundreds of steps; the loss it gave at step 120, 2.27, was the best that the
    model, learning, 'rose from' while they settled: overfit (default config) warned."""
    import tensorflow as tf
    from scipy.ndimage import zoom
    from sklearn.datasets import load_digits

    keras.utils.set_random_seed(0)
    digits = load_digits()
    x = np.stack([zoom(image / 16.0, 2, order=1) for image in digits.images]).clip(0, 1)[..., None]
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order].astype("float32"), digits.target[order]
    model = keras.Sequential([
        keras.Input((16, 16, 1)), keras.layers.Conv2D(16, 3, padding="same"), keras.layers.BatchNormalization(),
        keras.layers.ReLU(), keras.layers.MaxPooling2D(), keras.layers.Conv2D(32, 3, padding="same"),
        keras.layers.BatchNormalization(), keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dropout(0.2), keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    train = tf.data.Dataset.from_tensor_slices((x[:1400], y[:1400])).shuffle(1400, seed=0).repeat().batch(32)
    cb = TripwireCallback(None, out_dir=tmp_path / "run")
    history = model.fit(train, steps_per_epoch=40, epochs=20, validation_data=(x[1400:], y[1400:]), verbose=0,
                        callbacks=[cb]).history
    # it learns: held-out accuracy at 0.11 (one class) for six epochs, then up to 0.85 as the statistics settle
    assert history["loss"][-1] < 0.5 * history["loss"][0] and max(history["val_accuracy"][12:]) > 0.7
    assert [v.message for v in tripwire.open_run(cb.run_url).verdicts() if v.counts] == []


def test_a_loss_that_falls_slowly_under_noisy_batches_has_gone_down(tmp_path):
    """keras.io's endpoint-layer recipe: a logistic regression on 764 features, soft targets, each sample weighted
    at random in [0, 1) (Adam 1e-3): the batch loss swings by 11 % from batch to batch while it falls 4 % an
    epoch. The medians of its first and newest five samples stood 5 % apart at step 310: "never went down", an
    error, on a model that learns; and at step 210 two windows 25 % apart were "levelled off". The line through
    every sample the rule saw falls, surer at every sample; the newest samples' line shows no levelling."""
    rng = np.random.RandomState(2)
    w = 3 * rng.randn(764) / np.sqrt(764 / 12.0)
    x = rng.random_sample((4000, 764)).astype("float32")
    targets = (1 / (1 + np.exp(-((x - 0.5) @ w))))[:, None].astype("float32")
    weights = rng.random_sample(4000).astype("float32")
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((764,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(1e-3), loss=keras.losses.BinaryCrossentropy(from_logits=True))
    cb = TripwireCallback({"sampling": {"every": 10}, "rules": ["loss_not_decreasing"]}, out_dir=tmp_path / "run")
    history = model.fit(x, targets, sample_weight=weights, epochs=4, verbose=0, callbacks=[cb]).history
    assert history["loss"][-1] < 0.9 * history["loss"][0]  # it learns (the best it can reach: about 0.17)
    assert [v for v in tripwire.open_run(cb.run_url).verdicts() if v.fired] == []


def test_a_loss_at_its_floor_is_told_levelled_off_and_one_still_falling_is_not(tmp_path):
    """A logistic regression on five features whose labels carry noise (Adam 0.05, batches of 256): its loss falls
    from 0.59 to the floor the noise leaves, 0.27, in five epochs and stays: loss_not_decreasing says, at info,
    that it levelled off. The standardised breast-cancer features into a small sigmoid classifier (Adam 1e-2)
    fall from 0.42 to 0.05 in five epochs and then by 30 % every five: not levelled off."""
    from sklearn.datasets import load_breast_cancer

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 5)).astype("float32")
    y = ((x @ np.array([1.0, -1.0, 0.5, 0.0, 2.0]) + rng.normal(size=4096)) > 0).astype("float32")
    cancer_x, cancer_y = load_breast_cancer(return_X_y=True)
    cancer_x = ((cancer_x - cancer_x.mean(0)) / cancer_x.std(0)).astype("float32")
    told = []
    trainings = (((), 0.05, (x, y), 256, 20), ((16,), 1e-2, (cancer_x, cancer_y), 32, 15))
    for hidden, rate, (x, y), batch, epochs in trainings:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input(x.shape[1:]), *[keras.layers.Dense(n, activation="relu") for n in hidden],
                                  keras.layers.Dense(1, activation="sigmoid")])
        model.compile(keras.optimizers.Adam(rate), loss="binary_crossentropy")
        cb = TripwireCallback({"sampling": {"every": 10}, "rules": ["loss_not_decreasing"]},
                              out_dir=tmp_path / f"run{len(told)}")
        loss = model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, callbacks=[cb]).history["loss"]
        assert loss[-1] < loss[0] / 2
        told.append([(v.finding, v.severity) for v in tripwire.open_run(cb.run_url).verdicts() if v.fired])
    assert told == [[("plateau", "info")], []]

def test_a_long_validation_is_no_stalled_training(tmp_path):
    """The validation pass takes 4.5 s (450 samples in batches of 32, another callback waiting 0.3 s after each),
    over a 2 s threshold: evaluation batches are progress. One epoch: Keras itself may pause for 2 s before an
    epoch's first batch (its data iterator), which is no progress either, and not what this test is about."""
    import time

    class SlowValidation(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            time.sleep(0.3)

    config = {"rules": [{"rule": "stalled_training", "params": {"threshold_s": 2.0}}], "collections": {"losses": {}},
              "writer": {"flush_every_s": 0.2}}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    fit(cb, epochs=1, validation_batch_size=32, callbacks=[SlowValidation()])
    assert [v.rule for v in tripwire.open_run(cb.run_url).verdicts() if v.fired] == []


def test_what_fit_was_given_that_cannot_be_read_never_stops_the_fit(tmp_path, monkeypatch):
    """Reading fit's data as it begins (class weights, validation classes and columns, the data's pipeline) runs
    inside Keras' fit: a failure there is left out of the judgement, and the fit trains as without tripwire."""
    from tripwire.plugins.keras import callback as callback_module

    def unreadable(*args):
        raise ValueError("an array tripwire cannot read")

    monkeypatch.setattr(callback_module, "zero_weighted", unreadable)
    cb = TripwireCallback(None, out_dir=tmp_path / "run")
    model = fit(cb, mlp(optimizer="adam", lr=0.01), epochs=3, class_weight={c: 1.0 for c in range(10)})
    _, (xv, yv) = helpers.digits()
    assert float(np.mean(np.argmax(model.predict(xv, verbose=0), axis=1) == yv)) > 0.9
    assert [v for v in cb.verdicts if v.counts] == []
