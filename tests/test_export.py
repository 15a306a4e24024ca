"""TensorBoard export: event files read back with TensorBoard's own EventAccumulator, after the fact and live."""

import subprocess
import sys

import numpy as np
import pytest

import helpers
import tripwire
from tripwire.core.export import export_tensorboard
from tripwire.core.recorder import Recorder

pytest.importorskip("tensorboard")


def accumulator(logdir):
    """TensorBoard's reader over one sub-logdir. (Not with its TensorFlow stub, `tensorboard.compat.notf`: once
    chosen it stays for the whole process, and a Keras TensorBoard callback in a later test then cannot write.)"""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def assert_scalars_match(acc, run, mode):
    """Every series of the run in this mode is a scalar tag with the same steps and (float32) values."""
    expected = set()
    for name in run.tensor_names(mode=mode):
        tensor = run.tensor(name)
        for reduction in tensor.reductions(mode=mode):
            tag = name if reduction == "value" else f"{name}/{reduction}"
            expected.add(tag)
            steps, values = tensor.series(reduction, mode=mode)
            events = acc.Scalars(tag)
            assert [e.step for e in events] == steps.tolist(), tag
            np.testing.assert_array_equal(np.array([e.value for e in events], dtype=np.float32),
                                          values.astype(np.float32), err_msg=tag)
    assert set(acc.Tags()["scalars"]) == expected


def faulty_run(folder):
    """A run of 10 steps (NaN loss at step 7, stopped there), with full weights and an eval metric."""
    config = {"collections": {"weights": {"save": "tensors"}, "losses": {}, "metrics": {}},
              "sampling": {"every": 1}, "writer": {"flush_every_s": 0.05},
              "rules": [{"rule": "exploding_tensor", "actions": ["stop"]}]}
    rec = Recorder(config, run_url=str(folder), framework="test")
    rec.start()
    rng = np.random.default_rng(0)
    for step in range(10):
        w = rng.normal(size=(4, 3)).astype(np.float32)
        loss = float("nan") if step == 7 else 1 / (step + 1)
        if step % 3 == 2:
            rec.record(step, "eval", {"metrics/val_loss": {"value": 2 / (step + 1)}})
        values = {"losses/train": {"value": loss},
                  "weights/w": {"mean": float(w.mean()), "l2": float(np.linalg.norm(w))}}
        if rec.record(step, "train", values, {"weights/w": w}).stop:
            break
    rec.finish("stopped")
    return tripwire.open_run(folder)


# Where `tensorboard` is installed it writes; tensorboardX (what the `tensorboard` extra installs) writes otherwise.
# Each is asked for by name here, and TensorBoard's own reader reads both.
@pytest.mark.parametrize("backend", ["tensorboard", "tensorboardX"])
def test_export_reads_back_with_event_accumulator(tmp_path, backend):
    pytest.importorskip(backend)
    run = faulty_run(tmp_path / "run")
    counts = export_tensorboard(run, str(tmp_path / "tb"), backend=backend)
    assert counts == {"scalars": 26, "histograms": 8, "verdicts": 1}  # 8 train steps x 3, 2 eval steps
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["eval", "train"]

    train, evaluation = accumulator(tmp_path / "tb" / "train"), accumulator(tmp_path / "tb" / "eval")
    assert_scalars_match(train, run, "train")
    assert_scalars_match(evaluation, run, "eval")
    assert np.isnan(train.Scalars("losses/train")[-1].value)
    histograms = train.Histograms("weights/w")
    assert [h.step for h in histograms] == list(range(8))
    for h in histograms:
        w = run.tensor("weights/w").value(h.step)
        value = h.histogram_value
        assert value.num == w.size and value.min == pytest.approx(w.min()) and value.max == pytest.approx(w.max())
        assert value.sum == pytest.approx(float(w.sum(dtype=np.float64)), abs=1e-6) and sum(value.bucket) == w.size
    (text,) = train.Tensors("verdicts/exploding_tensor")
    assert text.step == 7 and b"**exploding_tensor** error at step 7" in text.tensor_proto.string_val[0]
    assert b"hint" in text.tensor_proto.string_val[0]


def test_export_command_without_tensorboard_writes_with_tensorboardx(tmp_path):
    """`tripwire export tensorboard` in a process where the `tensorboard` package cannot be imported (as after
    `pip install 'tripwire-training[tensorboard]'`, which installs tensorboardX alone) writes what TensorBoard reads."""
    pytest.importorskip("tensorboardX")
    run = faulty_run(tmp_path / "run")
    code = ("import sys; sys.modules['tensorboard'] = None; from tripwire.core.cli import main; "
            f"sys.exit(main(['export', 'tensorboard', {str(tmp_path / 'run')!r}, {str(tmp_path / 'tb')!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "wrote 26 scalars, 8 histograms and 1 verdicts" in out.stdout
    assert_scalars_match(accumulator(tmp_path / "tb" / "train"), run, "train")
    assert_scalars_match(accumulator(tmp_path / "tb" / "eval"), run, "eval")


def test_tensorboard_config_writes_live_during_lightning_training(tmp_path):
    from tripwire.plugins.lightning import TripwireCallback

    config = {"collections": {"losses": {}, "metrics": {}, "weights": {"include": ["net.0"], "save": "tensors"}},
              "sampling": {"every": 1}, "tensorboard": {"dir": str(tmp_path / "tb" / "{run_id}")},
              "rules": [{"rule": "exploding_tensor", "actions": ["stop"]}]}
    cb = TripwireCallback(config, out_dir=tmp_path / "runs" / "faulty")
    helpers.fit(cb, helpers.mlp_module(lr=50.0), max_epochs=1, val_check_interval=4, limit_val_batches=1)
    run = tripwire.open_run(cb.run_url)
    verdict = next(v for v in run.verdicts() if v.fired)
    assert verdict.rule == "exploding_tensor" and run.steps(mode="eval")

    logdir = tmp_path / "tb" / "faulty"  # {run_id} is the run folder's name
    train, evaluation = accumulator(logdir / "train"), accumulator(logdir / "eval")
    assert_scalars_match(train, run, "train")
    assert_scalars_match(evaluation, run, "eval")
    assert "metrics/val_loss" in evaluation.Tags()["scalars"]
    assert [h.step for h in train.Histograms("weights/net.0.weight")] == run.steps()
    (text,) = (train if verdict.mode == "train" else evaluation).Tensors("verdicts/exploding_tensor")
    assert text.step == verdict.step and verdict.message.encode() in text.tensor_proto.string_val[0]
