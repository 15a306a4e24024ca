"""Comparing runs step by step: `tripwire compare`, `tripwire.compare`, `assert_runs_equivalent`, the name map and
the `similar_across_runs` rule, on real Lightning training (and Keras against Lightning, through a name map)."""

import subprocess
import sys

import lightning.pytorch as pl
import numpy as np
import pytest
import yaml

import helpers
import tripwire
from tripwire.core.namemap import load_name_map
from tripwire.core.evaluate import check
from tripwire.core.recorder import Recorder
from tripwire.plugins.lightning import TripwireCallback
from tripwire.testing import assert_runs_equivalent

EVERY_STEP = {"sampling": {"every": 1}, "writer": {"flush_every_s": 0.01},  # several shards, then an index
              "collections": {"weights": {"save": "tensors"}, "biases": {"save": "tensors"}, "gradients": {},
                              "optimizer": {}, "losses": {}}}


class HalveLrAt(pl.Callback):
    """A learning rate schedule that changes at `step`: the lr is halved before that step's update."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] /= 2


def train(out, config=EVERY_STEP, callbacks=(), steps=12):
    cb = TripwireCallback(config, out_dir=out)
    helpers.fit(cb, helpers.mlp_module(hidden=(32, 32)), max_steps=steps, callbacks=list(callbacks))
    return cb


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {name: train(root / name, callbacks=callbacks).run_url
            for name, callbacks in [("a", ()), ("same", ()), ("lr5", (HalveLrAt(5),))]}


def cli(*args):
    return subprocess.run([sys.executable, "-m", "tripwire", "compare", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def test_two_runs_with_the_same_seed_are_equivalent(runs):
    done = cli(runs["a"], runs["same"])
    assert done.returncode == 0, done.stdout + done.stderr
    every = len(tripwire.open_run(runs["a"]).tensor_names())  # 6 parameters, their gradients, loss, optimizer
    assert "EQUIVALENT" in done.stdout and f"compared {every} tensors at 12 train steps" in done.stdout
    result = tripwire.compare(runs["a"], tripwire.open_run(runs["same"]))  # URLs and Run objects alike
    assert result.equivalent and not result.diverged and result.steps == {"train": 12} and result.tensors == every
    assert assert_runs_equivalent(runs["a"], runs["same"]).equivalent


def test_a_learning_rate_change_at_step_5_is_found_at_step_5_then_the_weights(runs):
    result = tripwire.compare(runs["a"], runs["lr5"])
    assert result.diverged and result.first_step == 5
    assert [d.name for d in result.diverging] == ["optimizer/lr"]
    lr = result.diverging[0]
    assert lr.max_abs == pytest.approx(0.05) and lr.max_rel == pytest.approx(0.5)
    then = result.differences[1:]
    assert {d.step for d in then} == {6}  # the parameters after the step-5 update, and all that follows from them
    assert [d.name for d in then][:2] == ["weights/net.0.weight", "biases/net.0.bias"]  # compute order
    names = [d.name for d in then]
    assert names.index("weights/net.4.weight") < names.index("losses/train") < names.index("gradients/net.0.weight")
    assert then[0].what == "values" and then[0].max_abs > 1e-5

    done = cli(runs["a"], runs["lr5"])
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "DIVERGED at step 5 (train)" in out and out.index("optimizer/lr") < out.index("weights/net.0.weight")
    with pytest.raises(AssertionError, match=r"(?s)not equivalent.*DIVERGED at step 5.*optimizer/lr"):
        assert_runs_equivalent(runs["a"], runs["lr5"])
    # before the change, the runs agree; comparing only weights finds the change one step later
    assert tripwire.compare(runs["a"], runs["lr5"], steps=range(5)).equivalent
    assert tripwire.compare(runs["a"], runs["lr5"], tensors="^weights/").first_step == 6


def test_cli_errors_exit_2(runs, tmp_path):
    missing = cli(runs["a"], tmp_path / "nothing")
    assert missing.returncode == 2 and "no tripwire run at" in missing.stderr
    bad_regex = cli(runs["a"], runs["same"], "--tensors", "(")
    assert bad_regex.returncode == 2 and "not a valid regular expression" in bad_regex.stderr
    none = cli(runs["a"], runs["same"], "--tensors", "^nothing")
    assert none.returncode == 2 and "NOTHING COMPARED" in none.stdout
    (tmp_path / "map.yaml").write_text("rename:\n  - form: x\n")
    bad_map = cli(runs["a"], runs["same"], "--map", tmp_path / "map.yaml")
    assert bad_map.returncode == 2 and "map.yaml:2: rename[0].form: unknown key" in bad_map.stderr


def record(url, rows, config=None):
    """A run written through the recorder: rows of (step, {name: {reduction: value}}, {name: array})."""
    rec = Recorder(config or {"collections": {"weights": {"save": "tensors"}, "losses": {}}}, run_url=str(url),
                   framework="test")
    rec.start()
    for step, values, tensors in rows:
        rec.record(step, "train", values, tensors)
    rec.finish()
    return str(url)


def test_tolerance_schedule_nan_and_full_values(tmp_path):
    def run(name, loss, w=lambda s: np.arange(6.0).reshape(2, 3)):
        return record(tmp_path / name, [(s, {"losses/train": {"value": loss(s)}}, {"weights/w": w(s)})
                                        for s in range(20)])

    a = run("a", lambda s: 1.0 + s)
    assert tripwire.compare(a, run("tiny", lambda s: 1.0 + s + 5e-6)).equivalent  # within atol 1e-5
    early = run("early", lambda s: 1.0 + s + (1e-4 if s == 3 else 0))
    assert tripwire.compare(a, early).first_step == 3 and tripwire.compare(a, early, atol=1e-3).equivalent
    late = run("late", lambda s: (1.0 + s) * (1.01 if s > 10 else 1))  # 1% relative after step 10: within rtol
    assert tripwire.compare(a, late).equivalent and tripwire.compare(a, late, rtol=0.001).first_step == 11
    assert tripwire.compare(a, late, switch_step=15).first_step == 11  # absolute until step 15
    nan = run("nan", lambda s: float("nan") if s >= 7 else 1.0 + s)
    assert tripwire.compare(nan, nan).equivalent  # a run compared with itself, NaN and all
    assert tripwire.compare(a, nan).first_step == 7 and tripwire.compare(a, nan).diverging[0].what == "value"
    # the full values decide where both saved them: a permutation keeps every reduction but not the values
    perm = run("perm", lambda s: 1.0 + s, w=lambda s: np.arange(6.0)[::-1].reshape(2, 3) if s == 4 else
               np.arange(6.0).reshape(2, 3))
    d = tripwire.compare(a, perm).diverging
    assert [(x.name, x.step, x.what, x.max_abs) for x in d] == [("weights/w", 4, "values", 5.0)]


def test_steps_where_only_some_reductions_were_captured_are_compared_on_those(tmp_path):
    def run(name, mean, l2_steps):
        return record(tmp_path / name, [(s, {"weights/v": {"mean": mean(s), **({"l2": 1.0} if s in l2_steps else {})}},
                                         {}) for s in range(20)], {"collections": {"weights": {}}})

    a = run("a", lambda s: 0.5, range(20))
    b = run("b", lambda s: 0.6 if s == 15 else 0.5, range(10))  # l2 only up to step 9
    d = tripwire.compare(a, b).diverging
    assert [(x.step, x.what) for x in d] == [(15, "reductions mean")]


def test_name_map_renames_and_transposes(tmp_path):
    kernel = np.arange(6.0, dtype=np.float32).reshape(2, 3)  # torch layout (out, in); Keras stores (in, out)
    stats = {"mean": 2.5, "l2": 7.4}

    def run(name, tensor_name, value=None):
        return record(tmp_path / name, [(s, {tensor_name: stats}, {} if value is None else {tensor_name: value})
                                        for s in range(3)])

    a, b = run("a", "weights/net.0.weight", kernel), run("b", "weights/dense/kernel", kernel.T)
    unmapped = tripwire.compare(a, b)
    assert not unmapped.tensors and unmapped.only_a == ["weights/net.0.weight"]
    assert unmapped.only_b == ["weights/dense/kernel"] and "NOTHING COMPARED" in unmapped.report()
    renamed = {"rename": [{"from": r"weights/dense/(kernel)", "to": "weights/net.0.weight"}]}
    shapes = tripwire.compare(a, b, name_map=renamed).diverging[0]
    assert shapes.name_b == "weights/dense/kernel" and "shapes differ" in shapes.note
    renamed["rename"][0]["transpose"] = True
    assert tripwire.compare(a, b, name_map=renamed).equivalent
    path = tmp_path / "map.yaml"
    path.write_text("rename:\n  - from: 'weights/(dense)/kernel'\n    to: 'weights/net.0.weight'\n"
                    "    transpose: [1, 0]\n")
    assert tripwire.compare(a, b, name_map=str(path)).equivalent
    # where only reductions are held, no transpose is needed: reductions do not change under one
    renamed["rename"][0]["transpose"] = False
    assert tripwire.compare(a, run("c", "weights/dense/kernel"), name_map=renamed).equivalent


@pytest.mark.parametrize("text, error", [
    ("rename:\n  - form: x\n", r"map.yaml:2: rename\[0\].form: unknown key 'form'.*Did you mean 'from'"),
    ("renames: []\n", r"map.yaml:1: renames: unknown key.*Did you mean 'rename'"),
    ("rename:\n  - to: x\n", r"map.yaml:2: rename\[0\]: each rename needs `from:`"),
    ("rename:\n  - from: '(a'\n", r"map.yaml:2: rename\[0\].from: '\(a' is not a valid regular expression"),
    ("rename:\n  - from: 'a(b)'\n    to: 'x\\2'\n", r"map.yaml:3: rename\[0\].to: .*refers to group 2"),
    ("rename:\n  - from: a\n    transpose: [0, 0]\n", r"map.yaml:3: rename\[0\].transpose: \[0, 0\] is not a perm"),
    ("rename:\n  - from: a\n    transpose: yes please\n", r"map.yaml:3: rename\[0\].transpose: expected true"),
    ("rename: [a: [\n", r"map.yaml:\d+: malformed YAML"),
])
def test_name_map_is_validated_with_file_and_line(tmp_path, text, error):
    path = tmp_path / "map.yaml"
    path.write_text(text)
    with pytest.raises(tripwire.ConfigError, match=error):
        load_name_map(str(path))


def test_name_map_reports_every_mistake_at_once(tmp_path):
    path = tmp_path / "map.yaml"
    path.write_text("rename:\n  - form: x\n  - from: '(a'\n  - from: a\n    transpose: [0, 0]\n")
    with pytest.raises(tripwire.ConfigError) as err:
        load_name_map(str(path))
    assert [(p.line, p.key) for p in err.value.problems] == [
        (2, "rename[0].form"), (3, "rename[1].from"), (5, "rename[2].transpose")]


def test_name_map_refuses_two_names_onto_one():
    name_map = load_name_map({"rename": [{"from": "w/.*", "to": "w"}]})
    assert name_map.rename("w/x")[0] == "w" and name_map.rename("v")[0] == "v"
    with pytest.raises(tripwire.ConfigError, match="renames both 'w/x' and 'w/y' of run B to 'w'"):
        name_map.rename_all(["w/x", "w/y"])


def test_similar_across_runs_fires_on_a_run_that_departs_from_its_reference(runs, tmp_path):
    config = {"sampling": {"every": 1}, "rules": [{"rule": "similar_across_runs", "params": {"reference": runs["a"]}}]}
    same = train(tmp_path / "same", config)
    assert not same.verdicts
    departs = train(tmp_path / "departs", config, callbacks=[HalveLrAt(5)])
    (verdict,) = departs.verdicts
    assert verdict.rule == "similar_across_runs" and verdict.step == 5 and verdict.fired
    assert verdict.message.startswith("optimizer/lr differs from the reference run") and "optimizer/" in verdict.hint
    # evaluated again over the stored run, it fires at the same step
    (offline,) = [v for v in check(tripwire.open_run(departs.run_url)) if v.fired]
    assert offline.step == 5 and list(offline.evidence["tensors"]) == ["optimizer/lr"]


# -- Keras (TensorFlow) against Lightning ------------------------------------------------------------------------------
# Keras layer -> the torch Linear holding its parameters, and the torch module whose output equals the layer's
# (a Keras Dense applies its activation itself; torch has a separate ReLU module).
LAYERS = [("hidden1", "net.0", "net.1"), ("hidden2", "net.2", "net.3"), ("out", "net.4", "net.4")]
KERAS_MAP = {"rename": [rename for keras, linear, output in LAYERS for rename in (
    {"from": rf"(weights|gradients)/(.*/)?{keras}/kernel", "to": rf"\1/{linear}.weight", "transpose": True},
    {"from": rf"(biases|gradients)/(.*/)?{keras}/bias", "to": rf"\1/{linear}.bias"},
    {"from": rf"activations/(.*/)?{keras}", "to": f"activations/{output}"})]}
CROSS = {"sampling": {"every": 1}, "collections": {"weights": {"save": "tensors"}, "biases": {"save": "tensors"},
                                                   "gradients": {}, "activations": {}, "losses": {}}}


def keras_run(out, first_activation="relu", steps=20):
    """A 3-layer MLP trained with plain SGD on the first `steps` batches of digits, in order; returns the run URL and
    the initial weights (Keras layout)."""
    import keras

    from tripwire.plugins.keras import TripwireCallback as KerasCallback

    (x, y), _ = helpers.digits()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, first_activation, name="hidden1"),
                              keras.layers.Dense(32, "relu", name="hidden2"), keras.layers.Dense(10, name="out")],
                             name="mlp")
    initial = [v.numpy().copy() for v in model.weights]
    model.compile(optimizer=keras.optimizers.SGD(0.1),  # the callback hooks its gradients by itself
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = KerasCallback(CROSS, out_dir=out)
    model.fit(x[:32 * steps], y[:32 * steps], batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    return cb.run_url, initial


def lightning_run(out, initial, steps=20):
    """The same MLP in Lightning, from the same initial weights (torch layout), on the same batches in order."""
    import torch

    def copy_initial(net):
        with torch.no_grad():
            for layer, (kernel, bias) in zip((net[0], net[2], net[4]), zip(initial[::2], initial[1::2])):
                layer.weight.copy_(torch.from_numpy(kernel.T))
                layer.bias.copy_(torch.from_numpy(bias))

    (x, y), _ = helpers.digits()
    batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.from_numpy(x[:32 * steps]), torch.from_numpy(y[:32 * steps]).long()), batch_size=32, shuffle=False)
    cb = TripwireCallback(CROSS, out_dir=out)
    helpers.fit(cb, helpers.mlp_module(hidden=(32, 32), init=copy_initial), max_steps=steps,
                loaders=(batches, batches), limit_val_batches=0)
    return cb.run_url


def test_keras_and_lightning_runs_of_one_model_are_equivalent_and_a_changed_activation_is_found(tmp_path):
    # Keras and TensorFlow are always installed for the tests (`make test`): a missing plugin fails, never skips
    import keras  # noqa: F401
    import tensorflow  # noqa: F401

    from tripwire.plugins.keras import TripwireCallback as KerasCallback  # noqa: F401
    keras_url, initial = keras_run(tmp_path / "keras")
    torch_url = lightning_run(tmp_path / "lightning", initial)
    path = tmp_path / "keras-to-torch.yaml"
    path.write_text(yaml.safe_dump(KERAS_MAP))
    done = cli(torch_url, keras_url, "--map", path)
    assert done.returncode == 0 and "EQUIVALENT" in done.stdout, done.stdout + done.stderr
    result = tripwire.compare(torch_url, keras_url, name_map=KERAS_MAP)
    assert result.equivalent, result.report()
    assert result.steps == {"train": 20} and result.tensors == 6 + 6 + 3 + 1  # parameters, gradients, outputs, loss
    assert result.only_a == ["activations/net.0", "activations/net.2"]  # torch's Linear outputs before the ReLU

    changed, _ = keras_run(tmp_path / "keras-tanh", first_activation="tanh")
    result = tripwire.compare(torch_url, changed, name_map=KERAS_MAP)
    assert result.first_step == 0, result.report()
    first = result.diverging[0]
    assert (first.name, first.name_b) == ("activations/net.1", "activations/mlp/hidden1"), result.report()
    assert not [d for d in result.diverging if d.name.startswith(("weights/", "biases/"))]  # same initial weights
