"""The XGBoost callback: an adapter from `xgboost.callback.TrainingCallback` onto tripwire.core.

One step is one boosting round, in mode `train`. At every round the callback
records the round's eval log (it is on the host: it costs nothing); on a
sampled round also the newest trees' statistics, feature importance, and
labels and predictions on the eval data it was given; the
Recorder runs the rules; `stop` returns True from `after_iteration`. The
eval log is also read as XGBoost's EarlyStopping reads it (`eval_losses`):
the training set's loss as `losses/train` and the validation set's as
`metrics/val_loss` in mode eval, the names the loss rules read by default, so
`overfit` and `loss_not_decreasing` need no parameters on a booster either.

Distributed training (`xgboost.dask`, or any XGBoost collective) pickles the
callback to every worker, so it keeps only its settings and opens its Recorder
in `before_training`, on the worker. Rank 0 names the run and broadcasts the
URL; only rank 0 records unless the config says `workers: all`. Every worker
runs the callback at the same rounds, and at each sampled round they agree on
stop and checkpoint with one allreduce (MAX) over XGBoost's own collective, so
a stop decided on any rank ends boosting on all of them at the same round,
whether the verdict came from that rank's rules or from `tripwire watch`.
"""

from __future__ import annotations

import logging

import numpy as np
import xgboost as xgb
from xgboost import collective

from tripwire.core.config import load_config
from tripwire.core.firststep import COLUMN_ROWS, caller_locals, swapped_columns
from tripwire.core.naming import VALUE
from tripwire.core.recorder import Recorder, make_run_url, prepare_storage
from tripwire.core.reductions import reduce

from .booster import (IMPORTANCE_TYPES, TREE_BOOSTERS, booster_config, booster_kind, eval_losses, feature_names,
                      first_step, hyperparameters, importance, repeated_eval_sets, tree_stats)

log = logging.getLogger("tripwire")
CHECKPOINT_FORMATS = ("ubj", "json")
# what a booster shows; of the relations of a training, the one an eval log can break
PROVIDES = {"losses", "metrics", "feature_importance", "trees", "labels", "predictions", "relations"}


class TripwireCallback(xgb.callback.TrainingCallback):
    """Capture, rules and actions for `xgb.train`, `xgboost.dask.train` and the sklearn estimators.

    config: a path to a YAML rule file, a dict, a tripwire.Config, or None for the packaged default.
    out_dir: the run's URL (any fsspec URL); overrides `output` in the config. Given, the URL is fixed now
        (`run_url` is known before training, also on a Dask client); otherwise each training gets a fresh run.
        Where a run is there already, a new training gets a run of its own beside it (out_dir-1, -2, …): the
        log and, in the training process, `run_url` say which.
    storage_options: passed to fsspec (e.g. S3 credentials); merged over the config's.
    append: add each training to the run at out_dir instead.
    eval_data: (X, y) or a DMatrix whose labels and predictions feed the `labels` and `predictions`
        collections (rules class_imbalance, confusion). Use (X, y) with Dask: a DMatrix does not pickle.
    checkpoint_format: "ubj" or "json", the format of the booster the `checkpoint` action writes.
    """

    def __init__(self, config=None, out_dir=None, storage_options: dict | None = None, *, eval_data=None,
                 checkpoint_format: str = "ubj", append: bool = False):
        super().__init__()
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format must be one of {', '.join(CHECKPOINT_FORMATS)}; "
                             f"got {checkpoint_format!r}.")
        self.config = load_config(config)
        self.out_dir, self.storage_options = out_dir, storage_options
        self.eval_data, self.checkpoint_format, self.append = eval_data, checkpoint_format, append
        self.run_url: str | None = make_run_url(self.config, out_dir) if out_dir is not None else None
        prepare_storage(self.config, out_dir, storage_options)
        self._open_state()

    def _open_state(self) -> None:
        """What exists only while training runs in this process; never pickled."""
        self._plan = None
        self._recorder: Recorder | None = None
        self._rank, self._world = 0, 1
        self._trees = False
        self._state = "finished"
        self._verdicts: list = []
        self._unreadable: set = set()  # what a round of this training could not be read for: not tried again
        self._evals_unseen = False  # the training has not yet shown whether it logs an eval set (told once if not)

    def __getstate__(self):
        return {k: self.__dict__[k] for k in ("config", "out_dir", "storage_options", "eval_data",
                                              "checkpoint_format", "append", "run_url")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open_state()

    @property
    def verdicts(self) -> list:
        """Verdicts found so far in this process (on Dask, in the workers: read them with open_run)."""
        return list(self._verdicts)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def before_training(self, model):
        if not isinstance(model, xgb.Booster):
            raise TypeError("tripwire's TripwireCallback works with xgb.train, xgboost.dask and the sklearn "
                            "estimators; xgb.cv is not supported.")
        if self._recorder is not None:  # the last training raised before after_training
            self._finish("failed")
        self._rank, self._world = collective.get_rank(), collective.get_world_size()
        url = make_run_url(self.config, self.out_dir)
        url = collective.broadcast(url, 0) if self._world > 1 else url
        self._plan = self.config.plan()
        config = booster_config(model)
        self._trees = booster_kind(config) in TREE_BOOSTERS
        self._state, self._unreadable = "finished", set()
        self._rounds_before = model.num_boosted_rounds()
        self._offset: int | None = None  # rounds before this training's first, once it ran (_round)
        self._column_swaps = _column_swaps()  # recorded with the first round
        if self._rank == 0:  # worker 0 makes the run (beside the URL where a run is there): every rank writes there
            url = self._start(model, config, url, self.append)
        self.run_url = collective.broadcast(url, 0) if self._world > 1 else url
        if self._rank != 0 and self.config.workers == "all":
            self._start(model, config, self.run_url, True)
        wanted = set(self.config.collections).union(*(spec.create().needs() for spec in self.config.rules))
        self._evals_unseen = bool({"losses", "metrics"} & wanted)
        if self._recorder is not None and self.eval_data is None and {"labels", "predictions"} & wanted:
            log.warning("tripwire: the config captures labels and predictions, but the callback has no eval_data: "
                        "pass TripwireCallback(..., eval_data=(X, y)).")
        return model

    def _start(self, model, config: dict, url: str, append: bool) -> str:
        self._recorder = Recorder(self.config, run_url=url, framework="xgboost",
                                  framework_version=_framework_version(), worker=self._rank, world_size=self._world,
                                  storage_options=self.storage_options,
                                  info={"hyperparameters": hyperparameters(config),
                                        "num_features": model.num_features()},
                                  provides=PROVIDES, append=append)
        self._recorder.start()
        self._verdicts = self._recorder.verdicts
        return self._recorder.run_url

    def _round(self, model, epoch: int) -> int:
        """The booster's own round of this iteration: XGBoost counts `epoch` from 0 again for a booster trained
        further (xgb_model=), whose rounds go on from those it held, so that a run appended to never repeats a step
        and the rules see that they did not see training begin; a booster refreshing its trees in place
        (process_type=update) adds none, and its round is the one it refreshes. Known at the first iteration, where
        the setup the booster starts with is recorded (loss_setup's first step)."""
        if self._offset is None:
            adds = model.num_boosted_rounds() > self._rounds_before
            self._offset = self._rounds_before if adds else 0
            if self._recorder is not None:
                self._recorder.first_step(first_step(booster_config(model), self._offset, self._eval_labels(),
                                                     self._column_swaps))
        return self._offset + epoch

    def _eval_labels(self):
        """The labels of the eval data, where the callback was given any."""
        if self.eval_data is None:
            return None
        return _host(self.eval_data.get_label() if isinstance(self.eval_data, xgb.DMatrix) else self.eval_data[1])

    def after_training(self, model):
        self._finish(self._state)
        return model

    def _finish(self, state: str) -> None:
        if self._recorder is not None:
            try:
                self._recorder.finish(state)
            finally:
                self._recorder = None

    # -- rounds ---------------------------------------------------------------------------------------------------
    def after_iteration(self, model, epoch: int, evals_log) -> bool:
        epoch = self._round(model, epoch)
        if self._recorder is not None and self._recorder.clock:
            self._recorder.alive()
        collections, evaluated = self._plan.at("train", epoch), self._plan.at("eval", epoch)
        train_loss, val_loss = eval_losses(evals_log)
        if self._evals_unseen:
            self._evals_unseen = False
            if not evals_log and self._rank == 0:
                log.warning("tripwire: this training has no eval set, so XGBoost logs no loss and the rules on it "
                            "(loss_not_decreasing, overfit, exploding_tensor on the loss, …) have nothing to judge: "
                            "pass evals=[(dtrain, 'train'), (dvalid, 'valid')] to xgb.train, or "
                            "eval_set=[(X_train, y_train), (X_valid, y_valid)] to fit.")
            elif train_loss is None and val_loss is None and self._rank == 0:
                logged = sorted({metric for metrics in evals_log.values() for metric in metrics})
                log.warning("tripwire: the eval sets log %s, which go up as the model learns, and no loss or error "
                            "rate, so the rules on the loss (loss_not_decreasing, overfit, …) have nothing to judge: "
                            "add a loss to eval_metric where the objective has one (logloss, mlogloss, rmse, …); a "
                            "ranking objective has none.", ", ".join(logged))
        # the eval log is on the host at every round, whatever the schedule: every round of it is recorded
        logged = self._eval_log(evals_log, train_loss)
        if not (collections or evaluated or logged):
            return False
        decision = None
        if self._recorder is not None:
            values, tensors = self._sample(model, epoch, {c.name: c for c in collections}, evals_log) \
                if collections else ({}, {})
            if values or tensors or logged:
                decision = self._recorder.record(epoch, "train", {**logged, **values}, tensors)
            metrics = next((c for c in evaluated if c.name == "metrics"), None)
            if val_loss is not None and metrics is not None and metrics.selects("val_loss"):
                evaluation = self._recorder.record(epoch, "eval", {"metrics/val_loss": {VALUE: val_loss}})
                decision = evaluation if decision is None else decision.merge(evaluation)
        return self._decide(model, decision, epoch)

    def _eval_log(self, evals_log, train_loss: float | None) -> dict:
        """The round's eval log as scalars: every metric of every eval set (`metrics/<set>/<metric>`) and the
        training loss (`losses/train`), where the config captures them. XGBoost hands the whole log to every
        call, so storing each round costs nothing and the rules that read it (overfit, loss_not_decreasing) see
        every round; a NaN loss is judged at its round. Every worker sees the same log, so all of them record
        (and decide) at the same rounds."""
        values = {}
        metrics = self._plan.collections.get("metrics")
        if metrics is not None:
            for data, logged in evals_log.items():
                for metric, history in logged.items():
                    if metrics.selects(f"{data}/{metric}"):
                        values[f"metrics/{data}/{metric}"] = {VALUE: float(history[-1])}
        if train_loss is not None and "losses" in self._plan:
            values["losses/train"] = {VALUE: train_loss}
        return values

    def _sample(self, model, epoch: int, active: dict, evals_log) -> tuple[dict, dict]:
        """What a sampled round holds besides the eval log: the round's trees, feature importance, labels and
        predictions, and whether two eval sets are the same data."""
        values, tensors = {}, {}

        def scalar(collection: str, path: str, value: float) -> None:
            plan = active.get(collection)
            if plan is not None and plan.selects(path):
                values[f"{collection}/{path}"] = {VALUE: float(value)}

        repeated = repeated_eval_sets(evals_log) if "relations" in active else None
        if repeated is not None:
            scalar("relations", "same_eval_data", repeated)
        # the round's own trees: a training continued from a model (xgb_model=) counts its rounds from 0 again
        rounds = model.num_boosted_rounds()
        if self._trees and "trees" in active:
            for key, value in (self._read("trees", epoch, lambda: tree_stats(model, rounds - 1)) or {}).items():
                scalar("trees", key, value)
        if self._trees and "feature_importance" in active:
            plan, names = active["feature_importance"], feature_names(model)
            kinds = [k for k in IMPORTANCE_TYPES if any(plan.selects(f"{k}/{f}") for f in names)]
            scored = self._read("feature importance", epoch, lambda: importance(model, kinds)) or {}
            for kind, scores in scored.items():
                for feature, value in scores.items():
                    scalar("feature_importance", f"{kind}/{feature}", value)
        if self.eval_data is not None and ("labels" in active or "predictions" in active):
            read = self._read("predictions", epoch, lambda: self._labels_and_predictions(model, rounds))
            for name, array in zip(("labels", "predictions"), read or ()):
                plan = active.get(name)
                if plan is not None:
                    if plan.reductions:
                        values[name] = reduce(array, plan.reductions)
                    if plan.save_tensors:
                        tensors[name] = array
        return values, tensors

    def _read(self, what: str, epoch: int, reader):
        """reader()'s answer; None where it raises, said once, and not tried again in this training: a booster that
        cannot be read so (a refresh of existing trees, process_type=update, refuses a slice of them) must not
        stop the training."""
        if what in self._unreadable:
            return None
        try:
            return reader()
        except Exception as exc:  # noqa: BLE001 - a round tripwire cannot read must not stop training
            self._unreadable.add(what)
            said = (str(exc).strip().splitlines() or [""])[0][:200]
            log.warning("tripwire: could not read the %s of round %d (%s: %s); they are not captured for the rest "
                        "of this training.", what, epoch, type(exc).__name__, said)
            return None

    def _labels_and_predictions(self, model, rounds: int) -> tuple[np.ndarray, np.ndarray]:
        """Labels (class ids as int64 where they are whole numbers) and the model's predictions after its first
        `rounds` rounds (all of them by now)."""
        if isinstance(self.eval_data, xgb.DMatrix):
            labels = self.eval_data.get_label()
            scores = model.predict(self.eval_data, iteration_range=(0, rounds))
        else:
            x, labels = self.eval_data
            scores = model.inplace_predict(x, iteration_range=(0, rounds))
        labels, scores = _host(labels), _host(scores).astype(np.float32)
        if np.all(labels == np.round(labels)):
            labels = labels.astype(np.int64)
        return labels, scores

    # -- decisions ------------------------------------------------------------------------------------------------
    def _decide(self, model, decision, epoch: int) -> bool:
        """Agree across workers (every worker calls this at the same sampled rounds) and act."""
        stop = bool(decision and (decision.stop or decision.raise_for))
        checkpoint = bool(decision and decision.checkpoint)
        if self._world > 1:
            flags = collective.allreduce(np.array([stop, checkpoint], dtype=np.int32), collective.Op.MAX)
            stop, checkpoint = bool(flags[0]), bool(flags[1])
        if checkpoint and self._rank == 0:  # the model is the same on every worker
            self._recorder.save_checkpoint(f"checkpoints/step{epoch}.{self.checkpoint_format}",
                                           model.save_raw(raw_format=self.checkpoint_format))
        if stop:
            self._state = "stopped"
        if decision is not None and decision.raise_for is not None:
            self._finish("stopped")
            decision.raise_if_asked()
        return stop


def _column_swaps() -> tuple | None:
    """The columns of the first eval set that are the training set's in another order (numpy data has no feature
    names for XGBoost to check), read from the call that trains: an sklearn estimator's fit (its arrays `X` and
    `eval_set`, as given), else xgb.train (`dtrain` and `evals`, read back); None where there are none or the data
    cannot be read (a large QuantileDMatrix, data on a GPU)."""
    try:
        fit = caller_locals("fit", "eval_set")
        if fit:
            pairs = [(fit.get("X"), data[0]) for data in fit.get("eval_set") or () if data[0] is not fit.get("X")]
        else:
            given = caller_locals("train", "dtrain")
            train = given.get("dtrain")
            pairs = [(_rows(train), _rows(matrix)) for matrix, _ in given.get("evals") or () if matrix is not train]
        for training, validation in pairs:
            swaps = swapped_columns(training, validation)
            if swaps:
                return swaps
    except Exception as exc:  # noqa: BLE001 - data that cannot be read is not judged; it must never stop training
        log.debug("tripwire: the eval sets' columns could not be read: %s: %s", type(exc).__name__, exc)
    return None


def _rows(matrix) -> np.ndarray | None:
    """The first COLUMN_ROWS rows of a DMatrix, dense, NaN where a value is missing; None where it cannot say (a
    QuantileDMatrix, which cannot be sliced, is read whole only where it is small)."""
    try:
        if isinstance(matrix, xgb.QuantileDMatrix):
            data = matrix.get_data() if matrix.num_row() <= 10 * COLUMN_ROWS else None
        else:
            data = matrix.slice(np.arange(min(matrix.num_row(), COLUMN_ROWS))).get_data()
    except Exception:  # noqa: BLE001 - a matrix that does not give its data back is not judged
        return None
    if data is None:
        return None
    data = data[:COLUMN_ROWS].tocoo()
    dense = np.full(data.shape, np.nan)
    dense[data.row, data.col] = data.data
    return dense


def _host(array) -> np.ndarray:
    """A numpy array of labels or predictions (cupy arrays are copied from the GPU)."""
    if hasattr(array, "__cuda_array_interface__"):
        array = array.get()
    return np.asarray(array)


def _framework_version() -> str:
    """The installed distribution: `xgboost` or `xgboost-cpu`, with its version."""
    from importlib import metadata

    for distribution in ("xgboost", "xgboost-cpu"):
        try:
            return f"{distribution} {metadata.version(distribution)}"
        except metadata.PackageNotFoundError:
            continue
    return f"xgboost {xgb.__version__}"
