"""The Keras 3 callback: an adapter from Keras' hooks onto tripwire.core (TensorFlow, torch and JAX backends).

The step is the training batches seen, counted from `model.optimizer.iterations` when fit begins (a Python
counter: an unsampled batch costs one addition and one cached comparison, `plan.at`). On a sampled batch
`on_train_batch_begin` hands the step to `StepCapture`, which runs the step through a capture function if it
needs tensors from inside it (capture.py); `on_train_batch_end` adds the
metrics Keras logged, records the sample, runs the rules and acts:
`stop` sets `model.stop_training`, `checkpoint` writes a `.keras` file
through fsspec, `raise` closes the run and raises. Each epoch's validation
metrics (`val_*`) are recorded in mode eval at the step after the epoch's last;
`model.predict` records its outputs as `predictions` in mode predict.

Under JAX, reading `self.model` in a callback copies the training state back
into the model; batch hooks therefore use the reference taken when training
began, and only the checkpoint action asks for that copy.
"""

from __future__ import annotations

import logging
import os
import tempfile

import keras
import numpy as np

from tripwire.core.config import load_config
from tripwire.core.firststep import swapped_columns
from tripwire.core.naming import COLLECTIONS
from tripwire.core.recorder import Recorder, make_run_url, prepare_storage
from tripwire.core.rules.relations import SKIPPED_STEPS
from tripwire.core.reductions import reduce as reduce_numpy
from tripwire.core.sinks import EventFileSink, siblings

from .batches import InputRepeats, repeats_by_design
from .fitargs import classes_only_in, fit_locals, zero_weighted
from .capture import StepCapture, on_accelerator
from .firststep import first_step
from .hooks import hook_model
from .steploss import StepLosses, nonfinite_logged_loss
from .structure import describe
from .tf_step import trained_apart

log = logging.getLogger("tripwire")
# What a Keras fit shows: not a booster's trees, nor the torch loop's relations (Keras computes gradients afresh
# each step and keeps the model's mode itself: a missing zero_grad or an eval-mode step cannot happen); those a fit
# can break are provided where the fit can tell them.
PROVIDES = set(COLLECTIONS) - {"trees", "feature_importance", "relations"}


class TripwireCallback(keras.callbacks.Callback):
    """Capture, rules and actions for `model.fit`.

    config: a path to a YAML rule file, a dict, a tripwire.Config, or None for the packaged default.
    out_dir: the run's URL (any fsspec URL); overrides `output` in the config. Where a run is there already, a
        new training gets a run of its own beside it (out_dir-1, -2, …; `run_url` and the log say which).
        Fitting (or evaluating) the trained model again with the same callback appends to its run, as the
        global step goes on.
    storage_options: passed to fsspec (e.g. S3 credentials); merged over the config's.
    append: add to the run at out_dir instead.
    """

    def __init__(self, config=None, out_dir=None, storage_options: dict | None = None, *, append: bool = False):
        super().__init__()
        self.config = load_config(config)
        self.out_dir = out_dir
        self.storage_options = storage_options
        self.append = append
        self.run_url: str | None = None
        prepare_storage(self.config, out_dir, storage_options)
        self._plan = self.config.plan()
        self._recorder: Recorder | None = None
        self._capture: StepCapture | None = None  # kept across fits: its traced functions serve them all
        self._fit_model = None
        self._base = 0  # the global step of the epoch's first batch
        self._begun = 0  # steps begun in the epoch so far
        self._epoch_steps = None  # steps per epoch, where Keras knows them
        # under a LossScaleOptimizer, which does not count the steps it skips: (its step count, the step it was
        # last seen to change at)
        self._counted: tuple | None = None
        self._next = 0  # the step after the last one of this callback's run: where a next fit on it goes on
        self._span = 1
        self._sampled: tuple = ()
        self._state = "finished"
        self._verdicts: list = []
        self._told_apart: set = set()  # the variables trained apart from their flag already told (Keras warns once)
        self._predicted: Predicted | None = None
        self._alive = None  # Recorder.alive where a rule judges the time since the last step
        self._given: dict = {}  # of the fit that began last: fitargs' facts, for the first step's record
        self._looked = False  # the run holds what the first sampled step trained with
        self._log_loss = False  # the config captures the loss Keras logs (`metrics/loss`) at every step
        self._step_losses: StepLosses | None = None  # each step's own loss, stored where the config keeps losses
        self._guard = None  # where the loss of a step is not finite, finds the layer where that began (origin.py)
        self._repeats: InputRepeats | None = None  # whether the batch changes, over the fit's first steps

    @property
    def verdicts(self) -> list:
        """Verdicts found so far in this process (in-process or picked up from the side process)."""
        return list(self._verdicts)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        model = self.model
        if self._capture is not None:  # a fit that raised left the capture in place: Keras has no hook for that
            self._capture.close()
        structure = describe(model)
        apart = trained_apart(model)
        self._given, by_design = _given_to_fit()
        # one batch per call, more than one per epoch, inputs read on the host: else a repeat is not told
        repeats = int(getattr(model, "steps_per_execution", 1) or 1) == 1 and (self.params.get("steps") or 0) > 1 \
            and not on_accelerator(model) and not by_design
        self._open(model, structure, relations=any(apart) or repeats)
        self._recorder.add_sinks(EventFileSink(os.path.join(tb.log_dir, "train")) for tb in siblings(self)
                                 if isinstance(tb, keras.callbacks.TensorBoard))
        self._guard = hook_model(model, remake=not any(apart))
        self._sampled = ()
        if self._capture is None or not self._capture.serves(model):
            self._capture = StepCapture(model, self._plan, structure)
            self._capture.budget_of = self._recorder.tensor_budget
        self._capture.start(retraces=not any(apart))
        self._span = int(getattr(model, "steps_per_execution", 1) or 1)
        self._base, self._begun = max(_steps_taken(model), self._next), 0
        self._epoch_steps = self.params.get("steps")  # fit's: a predict inside the fit sets params of its own
        self._counted = (_steps_taken(model), self._base - 1) if _skips_steps(model) else None
        self._step_losses = StepLosses(self._span) if "losses" in self._plan.collections else None
        self._repeats = InputRepeats() if repeats and "relations" in self._plan.collections else None
        self._tell_trained_apart(*apart)

    def _tell_trained_apart(self, made: list, frozen: list) -> None:
        """Variables whose layer's `trainable` changed after Keras' train function was traced, which this fit
        leaves untrained or trains all the same (tf_step.trained_apart): their layers named in the log, the
        relations told at the fit's first step, once (a loop of one-epoch fits would tell them at every fit)."""
        for relation, variables, *what in (("trainable_after_compile", made, "made trainable", "not trained"),
                                           ("frozen_after_compile", frozen, "frozen", "still trained")):
            variables = [v for v in variables if id(v) not in self._told_apart]
            self._told_apart.update(id(v) for v in variables)
            if variables:
                log.warning("tripwire: layers %s after the model's train function was made, so %s by this fit "
                            "(call compile() again): %s", *what,
                            ", ".join(sorted({v.path.rpartition("/")[0] for v in variables})))
                self._decide(self._recorder.check_relation(self._base, relation, len(variables)), self._base)

    def on_train_end(self, logs=None):
        self._next = self._epoch_end()
        self._close(self._state)

    def _open(self, model, structure=None, relations: bool = False) -> None:
        """Start the run, or append to it when this callback already wrote one (fitting or evaluating again).
        relations: the fit can tell a relation (besides skipped steps)."""
        if self._recorder is None:
            # the model this callback trained goes on (it took steps): append to its run
            goes_on = self.run_url is not None and (_steps_taken(model) > 0 or model is self._fit_model)
            self._next = self._next if goes_on else 0
            self._recorder = Recorder(self.config, run_url=self.run_url if goes_on else make_run_url(
                                          self.config, self.out_dir), framework="keras",
                                      framework_version=f"keras {keras.__version__}",
                                      storage_options=self.storage_options,
                                      info={"keras_backend": keras.backend.backend()},
                                      provides=PROVIDES | {"relations"} if _skips_steps(model) or relations
                                      else PROVIDES,
                                      model=structure if structure is not None else _built(model),
                                      append=self.append or goes_on)
            self._recorder.start()
            self.run_url = self._recorder.run_url
            self._looked = False
            self._verdicts = self._recorder.verdicts
        self._plan = self._recorder.plan
        metrics = self._plan.collections.get("metrics")
        self._log_loss = metrics is not None and metrics.selects("loss")
        self._alive = self._recorder.alive if self._recorder.clock else None
        self._fit_model, self._state = model, "finished"
        if self._capture is not None:
            self._capture.budget_of = self._recorder.tensor_budget

    def on_epoch_begin(self, epoch, logs=None):
        """The epoch's first step: the step after the last epoch's. Not the optimizer's step count, which a
        LossScaleOptimizer (mixed_float16) does not advance at the steps it skips, and a train_step that applies
        its own optimizers (a GAN's) does not advance at all: each epoch's steps would be the last epoch's again."""
        self._base, self._begun = self._epoch_end(), 0

    def _epoch_end(self) -> int:
        """The step after the epoch's last begun (Keras counts a short last call of several steps as a full one)."""
        return self._base + min(self._begun, self._epoch_steps or self._begun)

    # -- training steps -------------------------------------------------------------------------------------------
    def on_train_batch_begin(self, batch, logs=None):
        if self._alive is not None:
            self._alive()
        step = self._base + batch
        self._begun = batch + self._span  # the epoch's steps begun so far (a short last call counted as a full one)
        collections = self._plan.at("train", step)
        if self._span > 1:  # one call runs several steps: sample it if any of them is scheduled
            for later in range(step + 1, step + self._span):
                collections = collections or self._plan.at("train", later)
        if collections:
            self._sampled = collections
            self._capture.begin(collections)

    def on_train_batch_end(self, batch, logs=None):
        if not self._sampled:  # Keras hands the loss over on the host anyway: a NaN is acted on at its step
            if logs and self._recorder is not None:
                self._keep_loss(self._base + batch, batch, logs, taken=False)
                decision = self._recorder.check_loss(self._base + batch, nonfinite_logged_loss(logs), self._origin())
                if decision is not None:
                    self._decide(decision, self._base + batch)
            if self._counted is not None and self._base + batch == self._counted[1] + SKIPPED_STEPS and \
                    self._recorder is not None:  # 30 steps since the optimizer was last seen to step: has it since?
                skipped = self._skipped(self._base + batch)
                if skipped >= SKIPPED_STEPS:
                    self._decide(self._recorder.check_relation(self._base + batch, "skipped_steps", skipped),
                                 self._base + batch)
            return
        plans = {c.name: c for c in self._sampled}
        self._sampled = ()
        if self._span > 1 and self._epoch_steps:  # Keras counts a short last call as a full one
            batch = min(batch, self._epoch_steps - 1)
        step = self._base + batch  # with steps_per_execution > 1: the call's last step, whose tensors were taken
        values, tensors = self._capture.end()
        # the step's own loss is in the sample where the train step handed it over, or where `losses` is sampled
        own = self._keep_loss(step, batch, logs, taken="losses/train" in values or "losses" in plans)
        if not self._looked:  # the first sampled step: the loss, the output layer and the labels it trains with
            self._looked = True
            self._recorder.first_step(first_step(self._fit_model, step, tensors.get("labels"), **self._given))
        for key, value in (logs or {}).items():
            if key == "loss" and "losses" in plans and "losses/train" not in values and np.ndim(value) == 0:
                why = "the train step did not hand its loss to model.optimizer.scale_loss()" if \
                    self._capture.retraces else "this fit runs the train function traced before `trainable` changed"
                self._capture.warn_once("loss", f"tripwire: {why}, so losses/train is told from the loss Keras logs, "
                                        "the mean over the epoch so far.")
                values["losses/train"] = {"value": own if own is not None else float(value)}
            elif key != "loss" and "metrics" in plans and plans["metrics"].selects(key) and np.ndim(value) == 0:
                values[f"metrics/{key}"] = {"value": float(value)}
        if self._counted is not None and "relations" in plans:
            values["relations/skipped_steps"] = {"value": float(self._skipped(step))}
        repeated = self._repeats.see(step, self._capture.fingerprints) if self._repeats is not None else None
        if repeated is not None and "relations" in plans:
            values["relations/repeated_batch"] = {"value": float(repeated)}
        # a NaN in the loss Keras logs joins a sample that does not hold the loss (one sampled for other collections)
        self._decide(self._recorder.record(step, "train", {**values, **self._origin()}, tensors,
                                           loss=nonfinite_logged_loss(logs)), step)

    def _origin(self) -> dict:
        """{`origin/<layer>`: facts} of the step just run, where its loss was not finite (once); else {}."""
        return self._guard.origin() if self._guard is not None and self._guard.kept is not None else {}

    def _skipped(self, step: int) -> int:
        """The steps in a row up to this one that a LossScaleOptimizer skipped (its gradients not finite), where
        its step count has not moved since the step that saw it move (read at sampled steps, and 30 steps after
        it was last seen to move: a step between two readings that ran is taken to be the last of them, so the
        count is never too high)."""
        iterations = _steps_taken(self._fit_model)
        if iterations != self._counted[0]:
            self._counted = (iterations, step)
        return step - self._counted[1]

    def _keep_loss(self, step: int, batch: int, logs, taken: bool) -> float | None:
        """The loss Keras logs (the mean over the epoch so far, on the host at every step) as `metrics/loss`, at
        every step: a curve of the whole run for free. Returns the step's own loss told from it (StepLosses)
        where the config keeps losses, stored as `losses/train` unless the sample holds it (`taken`), so that
        loss_spike judges every step. Stored, not judged (Recorder.scalars): the loss rules read the sampled
        steps. One queued sample."""
        loss = (logs or {}).get("loss")
        if loss is None or np.ndim(loss) != 0:
            return None
        own = self._step_losses.see(batch, loss) if self._step_losses is not None else None
        values = {"metrics/loss": {"value": float(loss)}} if self._log_loss else {}
        if own is not None and not taken:
            values["losses/train"] = {"value": own}
        if values:
            self._recorder.scalars(step, "train", values)
        return own

    def save_tensor(self, name: str, tensor) -> None:
        """Capture a tensor of your own as `custom/<name>` at sampled steps, if the `custom` collection is on.

        Call it from your model's `call` or `train_step`; on compiled backends it takes part only in the
        capture function, so it costs nothing on unsampled steps."""
        if self._capture is not None:
            self._capture.emit("custom", name, tensor)

    # -- evaluation -----------------------------------------------------------------------------------------------
    def on_test_batch_begin(self, batch, logs=None):
        if self._alive is not None:  # an evaluation makes progress too: a long one is no stalled training
            self._alive()

    def on_epoch_end(self, epoch, logs=None):
        """Validation inside fit: its metrics under Keras' own `val_` names, in mode eval.

        A dataset of unknown length ends its epoch with a call that finds no data and gets no
        `on_train_batch_end`: if that call was sampled, its capture is dropped here (there is no step to record)
        and the function of the unsampled steps put back."""
        if self._sampled:
            self._sampled = ()
            self._capture.end()
        self._record_eval({k: v for k, v in (logs or {}).items() if k.startswith("val_")}, self._epoch_end())

    def on_test_end(self, logs=None):
        """`model.evaluate(..., callbacks=[cb])` outside fit: its metrics under the names evaluate returns, in
        mode eval at the model's current step, appended to this callback's run. (Inside fit, validation is
        recorded by `on_epoch_end`.)"""
        if self._recorder is not None:
            return
        model = self.model
        step = max(_steps_taken(model), self._next)
        if not self._plan.at("eval", step):
            return
        self._open(model)
        try:
            self._record_eval(logs or {}, step)
        finally:
            self._close(self._state)

    def _record_eval(self, logs: dict, step: int) -> None:
        metrics = self._plan.collections.get("metrics")
        values = {f"metrics/{k}": {"value": float(v)} for k, v in logs.items()
                  if np.ndim(v) == 0 and metrics is not None and metrics.selects(k)}
        if values and self._plan.at("eval", step):
            self._decide(self._recorder.record(step, "eval", values), step)

    # -- prediction -----------------------------------------------------------------------------------------------
    def on_predict_begin(self, logs=None):
        """`model.predict(..., callbacks=[cb])`, if the config has `predictions`: the outputs of the whole call,
        recorded once it ends, in mode predict at the model's step, in this callback's run."""
        step = max(_steps_taken(self.model), self._next)
        plan = next((c for c in self._plan.at("predict", step) if c.name == "predictions"), None)
        limit = int(self.config.writer.max_queue_mb * (1 << 19))  # half the writer's queue: the sample fits in it
        self._predicted = Predicted(step, plan, limit) if plan is not None and plan.selects("", "") else None

    def on_predict_batch_end(self, batch, logs=None):
        if self._predicted is not None:
            self._predicted.add((logs or {}).get("outputs"))

    def on_predict_end(self, logs=None):
        predicted, self._predicted = self._predicted, None
        if predicted is None or not predicted.batches:
            return
        values, tensors = predicted.sample()
        inside_fit = self._recorder is not None  # predict called from a callback during fit: the run stays open
        if not inside_fit:
            self._open(self.model)
        try:
            self._decide(self._recorder.record(predicted.step, "predict", values, tensors), predicted.step)
        finally:
            if not inside_fit:
                self._close(self._state)

    # -- decisions ------------------------------------------------------------------------------------------------
    def _decide(self, decision, step: int) -> None:
        decision = decision.merge(self._recorder.poll()) if decision else self._recorder.poll()
        if decision.checkpoint:
            self._checkpoint(step)
        if decision.stop or decision.raise_for:
            self._fit_model.stop_training = True
            self._state = "stopped"
        if decision.raise_for is not None:
            self._close("stopped")  # no Keras hook runs after an exception: close the run before raising
            decision.raise_if_asked()

    def _checkpoint(self, step: int) -> None:
        """The model as a `.keras` file, into the run at `checkpoints/step<N>.keras` (by the writer thread)."""
        model = self._fit_model
        try:
            if hasattr(model, "jax_state_sync"):
                model.jax_state_sync()  # JAX keeps the training state outside the model during an epoch
            with tempfile.TemporaryDirectory(prefix="tripwire-") as folder:
                path = os.path.join(folder, "model.keras")
                model.save(path)
                with open(path, "rb") as f:
                    self._recorder.save_checkpoint(f"checkpoints/step{step}.keras", f.read())
        except Exception as exc:  # noqa: BLE001 - a failed checkpoint must not take training down
            log.warning("tripwire: could not make the checkpoint of step %s: %s: %s", step, type(exc).__name__, exc)

    def _close(self, state: str) -> None:
        if self._capture is not None:
            self._capture.close()
        if self._recorder is not None:
            try:
                self._recorder.finish(state)
            finally:
                self._recorder, self._alive = None, None


def _given_to_fit() -> tuple[dict, bool]:
    """What the fit that calls its callbacks was given (fitargs), as the first step records it, and whether its data
    hands out one batch by design (batches.repeats_by_design). Data that cannot be read is not judged: ({}, True),
    said in the debug log; it must never stop the fit."""
    try:
        given = fit_locals()
        return ({"zero_weight": zero_weighted(given.get("class_weight")),
                 "validation_only": classes_only_in(given.get("val_y"), given.get("y")),
                 "column_swaps": swapped_columns(given.get("x"), given.get("val_x"))},
                repeats_by_design(getattr(given.get("epoch_iterator"), "data_adapter", None)))
    except Exception as exc:  # noqa: BLE001
        log.debug("tripwire: what fit was given could not be read: %s: %s", type(exc).__name__, exc)
        return {}, True


def _skips_steps(model) -> bool:
    """Whether the model's optimizer skips the steps whose gradients are not finite, without counting them
    (a LossScaleOptimizer, as mixed_float16 wraps every optimizer in), and its count can be read during fit (not
    under JAX, which holds the optimizer's state outside the model until the epoch ends)."""
    return isinstance(getattr(model, "optimizer", None), keras.optimizers.LossScaleOptimizer) and \
        keras.backend.backend() != "jax"


def _steps_taken(model) -> int:
    """The optimizer's step count (0 for a model not trained, or without an optimizer). Read as an array: under a
    distribution strategy it is a MirroredVariable, which int() refuses."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not hasattr(optimizer, "iterations"):
        return 0
    return int(keras.ops.convert_to_numpy(optimizer.iterations))


def _built(model):
    """The structure of a model that evaluate or predict opens a run for, where it has its variables."""
    return describe(model) if model.built else None


class Predicted:
    """The outputs of one `model.predict` call, kept until it ends (as predict keeps them itself), up to `limit`
    bytes (half of `writer.max_queue_mb`): past it the later batches are left out, with a warning, so that memory
    stays bounded and the sample fits in the writer's queue."""

    def __init__(self, step: int, plan, limit: int):
        self.step, self.plan, self.limit = step, plan, limit
        self.batches: list = []
        self.size = 0
        self.full = False  # a batch was left out: so are all later ones, and the warning is given

    def add(self, outputs) -> None:
        if isinstance(outputs, (tuple, list)):  # several outputs: the first, as in training
            outputs = outputs[0] if outputs else None
        if self.full:
            return
        if outputs is None:  # a dict of outputs: Keras spreads it over the logs under the outputs' names
            self.full = True
            log.warning("tripwire: model.predict returned no single output or list of outputs, so no "
                        "predictions were captured (a model with a dict of outputs is not supported).")
            return
        array = np.asarray(keras.ops.convert_to_numpy(outputs))
        if self.size + array.nbytes > self.limit:  # the first batches, without a gap
            self.full = True
            log.warning("tripwire: the predictions of this model.predict call pass half of writer.max_queue_mb; "
                        "only those of its first %d batches are captured.", len(self.batches))
            return
        self.batches.append(array)
        self.size += array.nbytes

    def sample(self) -> tuple[dict, dict]:
        """({"predictions": reductions}, {"predictions": array} if the config saves tensors)."""
        array = np.concatenate(self.batches) if len(self.batches) > 1 else self.batches[0]
        values = {"predictions": reduce_numpy(array, self.plan.reductions, "")}
        return values, ({"predictions": array} if self.plan.save_tensors else {})
