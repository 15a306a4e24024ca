"""Family 6: overhead of the Keras (TensorFlow backend) and XGBoost callbacks with the default config.

Written against the public contract, `TripwireCallback(config=None, out_dir=...)`
in `model.fit(callbacks=…)` / `xgb.train(callbacks=…)`. Each configuration
trains in a fresh process, with one thread; the figure is the wall time of
`fit` / `train` relative to the same call without the callback.
"""

from __future__ import annotations

import shutil
import tempfile

from .common import BenchError, Clock, Row, child, interleaved, median, overhead_row

XGB_ROUNDS = 300


def available(framework: str) -> dict:
    """Whether tripwire.plugins.<framework> offers TripwireCallback here; the import error if not."""
    import importlib

    try:
        importlib.import_module(f"tripwire.plugins.{framework}").TripwireCallback  # noqa: B018
    except Exception as exc:  # noqa: BLE001 - any failure means the plugin cannot be measured
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {}


def keras_fit(with_callback: bool, steps: int, out_dir: str, epochs: int = 1, one_step: bool = False) -> dict:
    """`steps` distinct batches, seen `epochs` times. `one_step` (without the callback): every step runs the
    one-step function a fit with tripwire runs its unsampled steps through, not Keras' own (tf_step.py)."""
    import os

    os.environ["KERAS_BACKEND"] = "tensorflow"
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    from .model import BATCH, WIDTHS

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((steps * BATCH, WIDTHS[0]), dtype=np.float32)
    y = rng.integers(0, WIDTHS[-1], steps * BATCH)
    model = keras.Sequential([keras.Input((WIDTHS[0],)), keras.layers.Dense(WIDTHS[1], activation="relu"),
                              keras.layers.Dense(WIDTHS[2], activation="relu"), keras.layers.Dense(WIDTHS[3])])
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = []
    if with_callback:
        from tripwire.plugins.keras import TripwireCallback

        callbacks.append(TripwireCallback(None, out_dir=out_dir))
    elif one_step:
        from tripwire.plugins.keras.tf_step import UnsampledSteps

        model.make_train_function()
        model.train_function = UnsampledSteps(model, model.train_function)
    with Clock() as clock:
        model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    return clock.to_dict()


def xgboost_train(with_callback: bool, rounds: int, out_dir: str) -> dict:
    import numpy as np
    import xgboost as xgb

    rng = np.random.default_rng(0)
    x = rng.standard_normal((20_000, 32), dtype=np.float32)
    y = (x[:, :4].sum(axis=1) + rng.standard_normal(20_000) > 0).astype(np.float32)
    train, valid = xgb.DMatrix(x[:16_000], y[:16_000]), xgb.DMatrix(x[16_000:], y[16_000:])
    params = {"objective": "binary:logistic", "max_depth": 6, "eta": 0.1, "nthread": 1, "tree_method": "hist",
              "eval_metric": "logloss"}
    callbacks = []
    if with_callback:
        from tripwire.plugins.xgboost import TripwireCallback

        callbacks.append(TripwireCallback(None, out_dir=out_dir))
    with Clock() as clock:
        xgb.train(params, train, rounds, evals=[(train, "train"), (valid, "valid")], verbose_eval=False,
                  callbacks=callbacks)
    return clock.to_dict()


KERAS_TARGET = "<= 1.05"
ONE_STEP_ROW = "default rules.yaml, to Keras on tripwire's one-step function"


def _family(framework: str, function: str, size: dict, label: str, repeats: int, work: str, row: str = "",
            target: str = "", baselines: dict | None = None) -> list[Row]:
    """Rows `no callback: <label>` (seconds) and `default rules.yaml<row>` (the ratio); for each of `baselines`
    ({row name: the function's arguments}), the ratio to that other run without the callback, measured in
    the same rounds."""
    name = f"default rules.yaml{row}"
    missing = child("frameworks", "available", framework=framework).get("error")
    if missing:
        return [Row(framework, name, None, "x", note=f"n/a (plugin missing): {missing}")]

    def case(with_callback, **extra):
        def call():
            out_dir = tempfile.mkdtemp(dir=work)
            try:
                return child("frameworks", function, with_callback=with_callback, out_dir=out_dir, **size, **extra)
            finally:
                shutil.rmtree(out_dir, ignore_errors=True)
        return call

    baselines = baselines or {}
    cases = {"without": case(False), "with": case(True), **{b: case(False, **a) for b, a in baselines.items()}}
    try:
        results = interleaved(cases, repeats)
    except BenchError as exc:
        return [Row(framework, name, None, "x", note=f"n/a: {exc}")]
    base = [r["seconds"] for r in results["without"]]
    return [Row(framework, f"no callback: {label}", median(base), "s", samples=base),
            overhead_row(framework, name, results["with"], results["without"], target),
            *(overhead_row(framework, b, results["with"], results[b]) for b in baselines)]


def run_keras(repeats: int, work: str, steps: int | None = None, **_) -> list[Row]:
    """The documented 2,000 steps, and the same batches for 10 epochs: what tripwire costs Keras once per fit
    (tracing its capture functions) shrinks with the length of training, what it costs per step does not.

    A fit with tripwire runs its unsampled steps through a leaner function than Keras' own (tf_step.py): the
    ratio to plain Keras is what a user sees, the ratio to Keras on that same function is tripwire's own work."""
    steps = 2000 if steps is None else steps
    return [*_family("keras", "keras_fit", {"steps": steps}, f"fit, {steps} steps", repeats, work,
                     target=KERAS_TARGET, baselines={ONE_STEP_ROW: {"one_step": True}}),
            *_family("keras", "keras_fit", {"steps": steps, "epochs": 10}, f"fit, 10 epochs of {steps} steps",
                     repeats, work, row=", 10 epochs")]


def run_xgboost(repeats: int, work: str, steps: int | None = None, **_) -> list[Row]:
    rounds = XGB_ROUNDS if steps is None else max(10, steps // 10)
    return _family("xgboost", "xgboost_train", {"rounds": rounds}, f"train, {rounds} rounds", repeats, work)
