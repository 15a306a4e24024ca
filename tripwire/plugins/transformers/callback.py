"""The Hugging Face Transformers callback: an adapter from `transformers.Trainer`'s events onto tripwire.core.

A step is an optimizer step, numbered by the Trainer's global step as it is when the step begins (the optimizer
steps done before it); with gradient accumulation its micro-batches are one step. `on_step_begin` asks the plan
whether the step is sampled (one cached comparison when it is not); on a sampled step activation hooks are
registered for that step only, `on_pre_optimizer_step` reads the gradients (after clipping) and the parameters
before the update, and `on_step_end` records the sample, runs the rules and applies the decision.

The loss is the model's own (`outputs.loss`), read by a forward hook on the model, because the Trainer hands
callbacks no loss, and its logs hide a NaN (`logging_nan_inf_filter`, on by default, logs the mean of the other
steps instead). On a sampled step it is the step's loss as the model computed it, never divided by the
accumulation steps: the mean of its micro-batches' losses, or their sum where each is a share of the step's (the
Trainer passed the model `num_items_in_batch`, and the model's loss, seen at the first sampled step, sums over its
items: Transformers' own loss functions divide that sum by the step's count; a loss that takes the mean, like
BERT's sequence classifier's, ignores the count). On the other steps (and the sampled steps that do not sample the
loss) the hook only judges it for NaN/Inf (LossWatch), so that a NaN stops training at the step it appears; in one
process only, as under DDP a stop must be agreed by every rank, which they do at the sampled steps. Where the
Trainer computes the loss itself (label smoothing, a `compute_loss_func`, its own `compute_loss`), the loss and the
labels are read from its `compute_loss` instead (tripwire.plugins.transformers.trainer_loss), the same way.
"""

from __future__ import annotations

import logging
import numbers
import os
from collections.abc import Mapping
from dataclasses import replace

import torch
import transformers
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from tripwire.core.actions import agree
from tripwire.core.config import load_config
from tripwire.core.errors import RuleFired
from tripwire.core.recorder import Recorder, make_run_url, prepare_storage
from tripwire.core.sinks import WriterSink, siblings
from tripwire.plugins.torch.capture import TorchCapture, optimizer_state
from tripwire.plugins.torch.firststep import look_once
from tripwire.plugins.torch.losswatch import KEPT_LOSSES, LossWatch
from tripwire.plugins.torch.origin import find_origin
from tripwire.plugins.torch.relations import BatchWatch, UpdateWatch
from tripwire.plugins.torch.reduce import Reductions
from tripwire.plugins.torch.structure import describe
from tripwire.plugins.transformers.trainer_loss import calling_trainer, computes_own_loss, wrap_compute_loss

log = logging.getLogger("tripwire")
# The logs of the Trainer that are no step's: an evaluation's (recorded by on_evaluate) and the summary at the end.
NOT_A_STEP = ("eval_", "train_runtime")


class TripwireCallback(TrainerCallback, ExportableState):
    """Capture, rules and actions for a `transformers.Trainer`: `Trainer(..., callbacks=[TripwireCallback()])`.

    config: a path to a YAML rule file, a dict, a tripwire.Config, or None for the packaged default.
    out_dir: the run's URL (any fsspec URL). Without it the run goes to the config's `output` where your config
        sets one, else to `<TrainingArguments.output_dir>/tripwire`, beside the Trainer's checkpoints. Where a run
        is there already, a new training gets a run of its own beside it (-1, -2, …; `run_url` says which).
    storage_options: passed to fsspec (e.g. S3 credentials); merged over the config's.
    append: add to the run at out_dir instead. A training resumed with `trainer.train(resume_from_checkpoint=…)`
        always appends to the run it came from: the run's URL travels in the Trainer's checkpoint.

    Names are the model's `named_parameters()` paths (`weights/bert.encoder.layer.0.attention.self.query.weight`).
    The Trainer's logs (`loss`, `grad_norm`, `learning_rate`, …) are recorded as `metrics/<key>` in mode train at
    the step that just ended, whenever the Trainer logs (`logging_steps`); an evaluation's metrics in mode eval at
    the global step it ran at, with Keras' names for them: Transformers' `eval_` prefix becomes `val_`
    (`eval_loss` is `metrics/val_loss`), so `overfit` and `oscillating_loss` read them with their defaults.
    Actions: `stop` sets `control.should_training_stop`, so the Trainer ends as it would at its last step;
    `checkpoint` sets `control.should_save`: the Trainer's own resumable checkpoint, `output_dir/checkpoint-<N>`,
    N the global step after the step that fired; `raise` closes the run and raises `tripwire.RuleFired` out of
    `train()`. Under DDP every rank stops (saves, raises) at the same step.
    """

    def __init__(self, config=None, out_dir=None, storage_options: dict | None = None, *, append: bool = False):
        self.config = load_config(config)
        self.out_dir = out_dir
        self.storage_options = storage_options
        self.append = append
        self.run_url: str | None = None
        prepare_storage(self.config, out_dir, storage_options)
        self._plan = self.config.plan()
        self._recorder: Recorder | None = None
        self._capture: TorchCapture | None = None
        self._training = False  # between on_train_begin and on_train_end: the Trainer's events are training's
        self._rank, self._world, self._device = 0, 1, None
        self._model = None
        self._hook = None  # the model's forward hook, while training
        self._loss_owner = None  # the Trainer, where it computes the loss itself: its compute_loss is read instead
        self._unwrap = None  # undoes the wrapping of that compute_loss
        self._step = 0  # the global step when the current step began
        self._sampled = False
        self._losses: list = []  # the losses of a sampled step's micro-batches so far
        self._rates: dict = {}  # optimizer/<name> as the sampled step's optimizer step found them
        self._shares = False  # they are shares of the step's loss (the model was given num_items_in_batch)
        self._sums = False  # the model's loss sums over its items (seen at the first sampled step)
        self._share_scale = 1  # shares of a loss averaged over every rank's tokens: the Trainer's own factor
        self._loss_watch = LossWatch()  # judges the loss of the steps between samples for NaN/Inf, and keeps it
        self._watch_loss = False
        self._nonfinite = None  # (step, loss) of a NaN/Inf loss between samples, to record when the step ends
        self._origin = {}  # {origin/<module>: facts} of that loss, found by replaying its forward
        self._replaying = False  # the forward hook sees the replay's forward pass: not a step's
        self._updates: UpdateWatch | None = None  # between samples, a step that stopped updating (relations)
        self._batches: BatchWatch | None = None  # whether the batch changes from step to step (relations)
        self._broken: list = []  # (relation, count, step) they told this step, recorded when it ends
        self._looked = False  # the first sampled step's forward pass ran under a LossSpy
        self._said_no_loss = False
        self._alive = None  # Recorder.alive where a rule judges the time since the last step
        self._state = "finished"
        self._verdicts: list = []

    @property
    def verdicts(self) -> list:
        """Verdicts found so far in this process (in-process or picked up from the side process)."""
        return list(self._verdicts)

    def state(self) -> dict:
        """What the Trainer's checkpoint keeps of this callback (TrainerState.stateful_callbacks): the run's URL, read
        back when training resumes. The config is there so that `restore_callback_states_from_checkpoint=True`,
        which makes a new callback from it, gets the same rules (without storage_options: they may hold
        credentials)."""
        return {"args": {"config": self.config.to_dict()}, "attributes": {"run_url": self.run_url}}

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._close("failed")  # a train() that raised left its run open
        self._rank, self._world, self._device = int(args.process_index), max(int(args.world_size), 1), args.device
        resumed = self._stored_url(state) if state.global_step > 0 else None
        url = self._broadcast(resumed or make_run_url(self.config, self._location(args)))
        self._state, self._training, self._looked = "finished", True, False
        if self._rank == 0:  # worker 0 makes the run (beside the URL where a run is there): every rank writes there
            url = self._start(model, optimizer, url, self.append or resumed is not None)
        self.run_url = self._broadcast(url)
        if self._rank != 0 and self.config.workers == "all":
            self._start(model, optimizer, self.run_url, True)
        if self._recorder is not None:
            self._model = model
            self._watch_loss = self._world == 1
            # every step's loss, kept and stored at the next sample (loss_spike), where a step is one forward pass
            self._loss_watch.keep = self._watch_loss and "losses" in self._plan and \
                args.gradient_accumulation_steps == 1
            self._updates = UpdateWatch() if self._world == 1 and "relations" in self._plan else None
            self._batches = BatchWatch() if self._world == 1 and "relations" in self._plan and \
                _batches_per_epoch(kwargs.get("train_dataloader")) > 1 else None
            self._share_scale = self._world if getattr(args, "average_tokens_across_devices", False) else 1
            self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)
            trainer = calling_trainer()
            if trainer is not None and computes_own_loss(trainer):
                self._loss_owner, self._share_scale = trainer, 1  # its shares are scaled to the rank's already
                self._unwrap = wrap_compute_loss(trainer, self._on_trainer_loss)

    def _location(self, args):
        """out_dir, else the config's `output` where the user's config sets it (None), else beside the checkpoints."""
        if self.out_dir is not None or self.config.output_set or not args.output_dir:
            return self.out_dir
        return os.path.join(args.output_dir, "tripwire")

    def _stored_url(self, state) -> str | None:
        stored = (state.stateful_callbacks or {}).get(type(self).__name__)
        for entry in stored if isinstance(stored, list) else [stored]:
            url = entry.get("attributes", {}).get("run_url") if isinstance(entry, dict) else None
            if url:
                return url
        return None

    def _start(self, model, optimizer, url: str, append: bool) -> str:
        structure = describe(model, [optimizer] if optimizer is not None else None)
        self._recorder = Recorder(self.config, run_url=url, framework="transformers",
                                  framework_version=f"transformers {transformers.__version__}", worker=self._rank,
                                  world_size=self._world, storage_options=self.storage_options,
                                  info={"torch_version": torch.__version__}, model=structure, append=append)
        self._recorder.start()
        if self._rank == 0:  # the Trainer's report_to integrations write on the main process; MLflow's active run
            self._recorder.add_sinks(WriterSink(c.tb_writer, "TensorBoardCallback") for c in siblings(self)
                                     if getattr(c, "tb_writer", None) is not None)
        self._verdicts = self._recorder.verdicts
        self._capture = TorchCapture(model, self._recorder.plan, structure, self._recorder.tensor_budget)
        self._capture.watching_steps = True  # on_step_end says whether the optimizer stepped
        self._plan = self._recorder.plan
        self._alive = self._recorder.alive if self._recorder.clock else None
        return self._recorder.run_url

    def on_train_end(self, args, state, control, **kwargs):
        self._close(self._state)

    def _close(self, state: str) -> None:
        self._training, self._sampled, self._nonfinite, self._alive = False, False, None, None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._unwrap is not None:
            self._unwrap()
            self._unwrap, self._loss_owner = None, None
        if self._capture is not None:
            self._capture.close()
        self._loss_watch.close(self._recorder)
        if self._recorder is not None:
            try:
                self._recorder.finish(state)
            finally:
                self._recorder, self._capture, self._model = None, None, None

    # -- training steps -------------------------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        step = self._step = state.global_step
        if self._alive is not None:
            self._alive()
        if self._capture is None:
            self._sampled = self._training and bool(self._plan.at("train", step))
            return
        self._sampled = self._capture.begin("train", step)
        if self._sampled:
            self._losses, self._shares = [], False
            if step > 0:  # a step after an optimizer step: its gradients start cleared (the Trainer's zero_grad)
                self._capture.watch_gradients([kwargs.get("optimizer")] if kwargs.get("optimizer") else [])
            if not self._looked:
                self._look_at_first_step(self._model, step)

    def _on_forward(self, module, args, kwargs, output) -> None:
        """Every training forward pass of the model: its loss, kept where the step samples the loss, else judged
        for NaN/Inf; labels and inputs on a sampled step. Evaluation's forward passes (eval mode) are no step's."""
        if not module.training or self._replaying:
            return
        if self._capture is not None:
            if self._sampled:  # before the backward pass, while its graph is whole
                self._capture.take_functional(output)
            self._capture.new_forward()
        if self._loss_owner is None:
            loss = output.get("loss") if isinstance(output, Mapping) else None
            self._see_loss(loss, self._sums and kwargs.get("num_items_in_batch") is not None, kwargs.get("labels"),
                           lambda: module(*args, **kwargs))
        if self._batches is not None and self._batches.see(self._step, (args, kwargs), self._sampled):
            self._broken.append(("repeated_batch", BatchWatch.IN_A_ROW + 1, self._step))
        if self._sampled:
            self._capture.take_inputs(kwargs.get(getattr(module, "main_input_name", "input_ids")))

    def _on_trainer_loss(self, loss, labels, share: bool, replay) -> None:
        """Each training call of the Trainer's compute_loss, where it computes the loss itself (trainer_loss)."""
        if self._training and not self._replaying:
            self._see_loss(loss, share, labels, replay)

    def _see_loss(self, loss, share: bool, labels, forward) -> None:
        """A micro-batch's loss and labels: kept where the step samples them, else the loss judged for NaN/Inf.
        share: the loss is a share of the step's; forward: computes it again (to find where a NaN began)."""
        if self._sampled and self._capture.wants("losses"):
            if isinstance(loss, torch.Tensor):
                self._losses.append(loss.detach())
                self._shares = share
        elif self._watch_loss and loss is not None and self._nonfinite is None:
            self._nonfinite = self._loss_watch.see(self._step, loss)
            if self._nonfinite is not None and self._nonfinite[0] == self._step:  # known before the update
                self._origin = self._replay(forward)
        if self._sampled:
            self._capture.take("labels", "", labels)

    def _replay(self, forward) -> dict:
        """Where this step's NaN began: its forward pass again, from the state it ran in (origin.find_origin)."""
        self._replaying = True
        try:
            return find_origin(self._model, forward, computes_loss=True)
        finally:
            self._replaying = False

    def _look_at_first_step(self, model, step: int) -> None:
        """Run this step's forward pass, where a Transformers model computes its loss (or the Trainer's compute_loss,
        where the Trainer computes it), under a LossSpy, once: what it does with its loss goes to the run, and says
        whether the model's loss sums over its items."""
        self._looked = True

        def seen(facts) -> None:
            self._sums = any(use.settings.get("reduction") == "sum" for use in facts.losses)
            if self._recorder is not None:
                self._recorder.first_step(replace(facts, producers=self._capture.producers))

        if self._loss_owner is not None:
            look_once(self._loss_owner, "compute_loss", step, seen)
        else:
            look_once(model, "forward", step, seen)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        """Gradients after clipping, and the learning rate of this step: the scheduler steps before on_step_end."""
        if self._updates is not None and not self._sampled:
            self._updates.before(optimizer)
        if self._sampled and self._capture is not None:
            self._capture.before_optimizer_step(optimizer)
            if self._capture.wants("optimizer"):
                self._rates = {f"optimizer/{k}": v for k, v in optimizer_state([optimizer]).items()}

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        """After the update: whether a step between samples changed what it applied a gradient to (a step AMP's
        scaler skipped changed nothing, by design: not judged)."""
        if self._updates is not None and not self._sampled and not getattr(optimizer, "step_was_skipped", False):
            broke_at = self._updates.after(optimizer, self._step)
            if broke_at is not None:
                self._broken.append(("step_changed_nothing", 1, broke_at))

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        for relation, count, step in self._broken:  # between samples, one process: no other rank to agree with
            self._decide(args, state, control, self._recorder.check_relation(step, relation, count)
                         if self._recorder else None)
        self._broken = []
        if self._nonfinite is not None:
            (step, loss), self._nonfinite = self._nonfinite, None
            origin, self._origin = self._origin, {}
            self._decide(args, state, control, self._recorder.check_loss(step, loss, origin) if self._recorder
                         else None)
        if not self._sampled:
            if len(self._loss_watch.kept) >= KEPT_LOSSES:
                self._loss_watch.store(self._recorder)
            return
        self._sampled = False
        decision = None
        if self._capture is not None:
            self._loss_watch.store(self._recorder)  # the steps' losses since the last sample, before this step's
            capture = self._capture
            if not getattr(optimizer, "step_was_skipped", False):  # AMP's scaler skips steps with inf gradients
                capture.stepped()
            rates, self._rates = self._rates, {}
            values, tensors = capture.end(self._step_loss(), (), rates)
            decision = self._recorder.record(self._step, "train", values, tensors)
        self._decide(args, state, control, decision)

    def _step_loss(self):
        losses, self._losses = self._losses, []
        if not losses:
            if self._capture.wants("losses") and not self._said_no_loss:
                self._said_no_loss = True
                log.warning("tripwire: no training loss was seen at step %s (neither in the model's output nor "
                            "from the Trainer's compute_loss): losses/train is not recorded, and a NaN loss is not "
                            "caught.", self._step)
            return None
        total = sum(loss.float().mean() for loss in losses)
        return total * self._share_scale if self._shares else total / len(losses)

    def save_tensor(self, name: str, tensor) -> None:
        """Capture a tensor of your own as `custom/<name>` at this step, if the `custom` collection is sampled."""
        if self._sampled and self._capture is not None:
            self._capture.take("custom", name, tensor)

    # -- logs and evaluation --------------------------------------------------------------------------------------
    def on_log(self, args, state, control, logs=None, **kwargs):
        """The Trainer's logs of the steps, as `metrics/<key>` at the step that just ended, whenever it logs."""
        if not self._training or not logs or any(key.startswith(NOT_A_STEP) for key in logs):
            return
        decision = self._record_metrics(max(state.global_step - 1, 0), "train", logs)
        self._decide(args, state, control, decision)

    def on_prediction_step(self, args, state, control, **kwargs):
        if self._alive is not None:  # an evaluation makes progress too: a long one is no stalled training
            self._alive()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        """An evaluation during training, in mode eval at the global step it ran at; `eval_x` as `metrics/val_x`."""
        if not self._training or not self._plan.at("eval", state.global_step):
            return
        named = {("val_" + key[5:] if key.startswith("eval_") else key): value
                 for key, value in (metrics or {}).items()}
        self._decide(args, state, control, self._record_metrics(state.global_step, "eval", named))

    def _record_metrics(self, step: int, mode: str, metrics: dict):
        plan = self._recorder.plan.collections.get("metrics") if self._recorder is not None else None
        if plan is None:
            return None
        reductions = Reductions()
        for key, value in metrics.items():
            if isinstance(value, numbers.Real) and plan.selects(key):
                reductions.add_scalar(f"metrics/{key}", value)
        values = reductions.to_host()
        return self._recorder.record(step, mode, values) if values else None

    # -- decisions ------------------------------------------------------------------------------------------------
    def _decide(self, args, state, control, decision) -> None:
        """Agree across ranks (every rank calls this at the same events; tripwire.core.actions.agree) and act on
        the Trainer's control."""
        if self._recorder is not None:
            decision = decision.merge(self._recorder.poll()) if decision else self._recorder.poll()
        stop = bool(decision and decision.stop)
        checkpoint = bool(decision and decision.checkpoint)
        raise_for = decision.raise_for if decision is not None else None
        fired_rank = None
        if self._world > 1:
            stop, checkpoint, raise_for, fired_rank = agree(decision, self._rank, self._reduce_max, self._broadcast)
        if checkpoint:
            control.should_save = True
            log.warning("tripwire: the Trainer saves a checkpoint now, in %s", os.path.join(
                args.output_dir or ".", f"checkpoint-{state.global_step}"))
        if stop or raise_for is not None:
            control.should_training_stop = True
            self._state = "stopped"
        if raise_for is not None:
            self._close("stopped")
            raise RuleFired(raise_for, rank=fired_rank)

    def _broadcast(self, value, src: int = 0):
        if self._world <= 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]

    def _reduce_max(self, flags: list) -> list:
        values = torch.tensor(flags, device=self._device)
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
        return values.tolist()


def _batches_per_epoch(loader) -> int:
    """How many batches the Trainer's training loader holds (0 where it cannot say: an iterable dataset)."""
    try:
        return len(loader)
    except TypeError:
        return 0
