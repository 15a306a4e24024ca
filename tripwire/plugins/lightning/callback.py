"""The Lightning callback: an adapter from Lightning's hooks onto tripwire.core.

Lightning comes as two distributions with distinct `Callback` classes,
`lightning` (`lightning.pytorch`) and `pytorch-lightning`. TripwireCallback
derives from every one installed, so each Trainer gets a callback of its own
kind.

Per training step: `on_train_batch_start` asks the plan whether the step is
sampled (one comparison when it is not); on sampled steps activation hooks
are registered for that step only, gradients and pre-update parameters are
reduced in `on_before_optimizer_step`, and `on_train_batch_end` records the
sample, runs the rules and applies the decision: every rank takes part in
the decision, so a stop (or a raise) on any rank stops (raises on) all at the
same step. A step is what the optimizers did: with gradient accumulation its
micro-batches are one step, recorded after the one that ends in
`optimizer.step()`, with the mean of their losses as Lightning logs it (not
divided by the number of micro-batches).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import tempfile
from dataclasses import replace

from tripwire.core.actions import agree
from tripwire.core.config import load_config
from tripwire.core.errors import RuleFired, install
from tripwire.core.recorder import Recorder, make_run_url, prepare_storage
from tripwire.core.rules.relations import SKIPPED_STEPS
from tripwire.plugins.torch.capture import TorchCapture, step_closure
from tripwire.plugins.torch.evaldropout import DropoutInEval
from tripwire.plugins.torch.firststep import look_once
from tripwire.plugins.torch.gradnorm import SERIES as GRADIENT_NORM
from tripwire.plugins.torch.gradnorm import GradientNorms
from tripwire.plugins.torch.losswatch import KEPT_LOSSES, LossWatch
from tripwire.plugins.torch.origin import find_origin, finite_on_host
from tripwire.plugins.torch.reduce import Reductions
from tripwire.plugins.torch.relations import BatchWatch, DiscardedGradients, UpdateWatch, overflowed
from tripwire.plugins.torch.replicas import Replicas
from tripwire.plugins.torch.schedules import wrong_interval
from tripwire.plugins.torch.structure import describe

from .loggers import sinks_of

log = logging.getLogger("tripwire")
PREDICTION_KEYS = ("predictions", "preds", "logits", "y_hat")
# Hooks that matter only on a sampled step: switched off (None) on the others, see TripwireCallback.
SAMPLED_STEP_HOOKS = ("on_before_optimizer_step", "on_train_batch_end")


def _callback_bases() -> tuple:
    bases = []
    for module in ("lightning.pytorch", "pytorch_lightning"):
        if importlib.util.find_spec(module.split(".")[0]) is not None:
            bases.append(importlib.import_module(module).Callback)
    if not bases:
        raise ImportError(f"tripwire.plugins.lightning needs Lightning: {install('lightning')} "
                          "(or install pytorch-lightning).")
    return tuple(bases)


class TripwireCallback(*_callback_bases()):
    """Capture, rules and actions for a Lightning Trainer.

    config: a path to a YAML rule file, a dict, a tripwire.Config, or None for the packaged default.
    out_dir: the run's URL (any fsspec URL); overrides `output` in the config. Without either, the run goes where
        Lightning puts its own output: `<logger's log_dir>/tripwire` (lightning_logs/version_N/tripwire), or
        `<default_root_dir>/tripwire` without a logger. Where a run is there already, a new training gets a run of
        its own beside it (out_dir-1, -2, …; `run_url` and the log say which).
    storage_options: passed to fsspec (e.g. S3 credentials); merged over the config's.
    append: add to the run at out_dir instead (a training resumed from a Lightning checkpoint always appends to
        the run it came from; so does fitting again with the same Trainer and callback).
    """

    # Lightning calls a callback's hook only where it is callable (`_call_callback_hooks`), and each call costs
    # a profiler context and a string format, at every step, for every callback (about 2.5 us). So the
    # per-batch hooks tripwire has no use for are None, and those that matter only on a sampled step
    # (SAMPLED_STEP_HOOKS) are None on the other steps (`_listen`). Between samples on_train_batch_start is
    # None too: a post-step hook on each optimizer, a plain call inside `optimizer.step()`, switches it back
    # on before the next sampled step (`_watch`). An unsampled step costs Lightning no hook call at all, where
    # an empty Callback costs it six.
    on_before_backward = on_after_backward = on_before_zero_grad = None
    on_validation_batch_start = on_validation_batch_end = on_test_batch_start = on_test_batch_end = None
    on_predict_batch_start = on_predict_batch_end = None

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
        self._resume_url: str | None = None
        self._sampled = False
        self._norms: GradientNorms | None = None  # every step's gradient norm, where a rule reads it
        self._manual_losses = False  # manual optimisation: each manual_backward's loss is taken (losses captured)
        self._listen(False)
        self._watching: list = []  # handles of the optimizers' post-step hooks, while they wake this callback
        self._wake_at: int | None = None  # the next sampled step, while on_train_batch_start is off
        self._eval_keys: set = set()
        self._losses: list = []  # the losses of a sampled step's micro-batches so far
        # manual optimisation: the losses of a sampled step's manual_backward calls (None: the step spans batches)
        self._backward_losses: list | None = []
        self._batch_step = 0  # the global step when the current batch began
        self._alive = None  # Recorder.alive where a rule judges the time since the last step
        self._loss_watch = LossWatch()  # judges the loss of the steps between samples for NaN/Inf, and keeps it
        self._seek_origin = False  # where a NaN began is looked for (the config captures losses; until a NaN)
        self._origin = None  # (step, {origin/<module>: facts}) found before that step's update
        self._nonfinite = None  # (step, loss) of a NaN/Inf loss between samples, to record at the batch's end
        self._updates: UpdateWatch | None = None  # between samples, a step that stopped updating (relations)
        self._broken = None  # (step, relation) it told, to record at the batch's end
        self._discards: DiscardedGradients | None = None  # manual optimisation's first batches (relations)
        self._batches: BatchWatch | None = None  # whether the batch changes from step to step (relations)
        # manual optimisation leaves the schedulers to the module: (scheduler, its step count at the start, the epoch
        # by whose start it must have stepped)
        self._schedules: list = []
        self._eval_looked = False  # the first validation batch of the training was watched (DropoutInEval)
        self._eval_look = None  # its look, while it runs
        self._stepped_at = -1  # the global step of the last optimizer step that ran (a GradScaler skips some)
        self._scaled = False  # a GradScaler may skip a step: its optimizers' hooks do not run, and cannot wake this
        self._looked = False  # the first sampled step's training_step ran under a LossSpy
        self._first_facts = None  # what it saw, recorded at the batch's end
        self._state = "finished"
        self._verdicts: list = []
        self._replicas: Replicas | None = None  # under DDP: the ranks whose parameters are compared

    @property
    def verdicts(self) -> list:
        """Verdicts found so far in this process (in-process or picked up from the side process)."""
        return list(self._verdicts)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module):
        if self._recorder is not None:
            return
        # a resumed training (checkpoint, or a fit that goes on with this Trainer) appends to its run
        goes_on = self.run_url if self.run_url is not None and trainer.global_step > 0 else None
        append = self.append or bool(self._resume_url or goes_on)
        url = self._resume_url or goes_on or make_run_url(self.config, self._location(trainer))
        url = trainer.strategy.broadcast(url, src=0)
        rank, world = trainer.global_rank, trainer.world_size
        self._state = "finished"
        if rank == 0:  # worker 0 makes the run (beside the URL where a run is there): every rank writes there
            url = self._start(trainer, pl_module, url, append)
        self.run_url = trainer.strategy.broadcast(url, src=0)
        if rank != 0 and self.config.workers == "all":
            self._start(trainer, pl_module, self.run_url, True)
        self._watch(trainer)
        if "relations" in self._plan:  # the strategy wraps the module in DistributedDataParallel by now
            self._replicas = Replicas.of(trainer.strategy.model, trainer.strategy.root_device)
            if pl_module.automatic_optimization:
                self._judge_intervals(trainer)

    def _judge_intervals(self, trainer) -> None:
        """The schedulers Lightning steps at an interval their schedule was not written for (schedules.py), judged
        once, before the first step, over the training planned (its optimizer steps; its epochs, as many as those
        steps take)."""
        steps, per_epoch = trainer.estimated_stepping_batches, trainer.num_training_batches
        if not isinstance(steps, int) or not isinstance(per_epoch, int) or per_epoch <= 0:
            return  # an iterable dataset of unknown length with no max_steps
        epochs = -(-steps * trainer.accumulate_grad_batches // per_epoch)
        wrong = [(c.scheduler, what) for c in trainer.lr_scheduler_configs
                 if (what := wrong_interval(c.scheduler, c.interval == "epoch", epochs // c.frequency,
                                            steps // c.frequency))]
        if wrong and self._recorder is not None:
            log.warning("tripwire: %s", "; ".join(f"{_scheduler_named(s)}: {what}" for s, what in wrong))
            self._tell(trainer, "schedule_interval", len(wrong), trainer.global_step)

    def _tell(self, trainer, relation: str, count: int, step: int) -> None:
        """A relation this rank saw broken outside the sampled steps: recorded (and logged) where this rank records,
        and acted on at once in one process only. Under DDP the ranks that do not record never see it, and a
        decision only some ranks reach would wait in the collectives of the others (_decide agrees)."""
        if self._recorder is None:
            return
        decision = self._recorder.check_relation(step, relation, count)
        if trainer.world_size == 1:
            self._decide(trainer, decision, step)

    def _location(self, trainer):
        """out_dir, else the config's `output` where the user's config sets it (None), else where Lightning puts
        its own output, as its ModelCheckpoint does: the logger's folder (lightning_logs/version_N), or
        default_root_dir without a logger."""
        if self.out_dir is not None or self.config.output_set:
            return self.out_dir
        return os.path.join(trainer.log_dir or trainer.default_root_dir, "tripwire")

    def _start(self, trainer, pl_module, url: str, append: bool) -> str:
        import torch

        structure = describe(pl_module, trainer.optimizers)
        self._recorder = Recorder(self.config, run_url=url, framework="lightning",
                                  framework_version=_lightning_version(trainer), worker=trainer.global_rank,
                                  world_size=trainer.world_size, storage_options=self.storage_options,
                                  info={"torch_version": torch.__version__}, model=structure, append=append)
        self._recorder.start()
        if trainer.global_rank == 0:  # Lightning's loggers write on rank 0
            self._recorder.add_sinks(sinks_of(trainer.loggers))
        self._verdicts = self._recorder.verdicts
        self._eval_looked = False
        self._capture = TorchCapture(pl_module, self._recorder.plan, structure, self._recorder.tensor_budget,
                                     ranks_together=self.config.workers == "all" and trainer.world_size > 1)
        self._plan = self._recorder.plan
        self._alive = self._recorder.alive if self._recorder.clock else None
        # a step's closure returns the step's loss where a step is one batch: with gradient accumulation it is the
        # last micro-batch's alone (the sampled steps record the mean of them all), with manual optimisation
        # whatever the user's closure returns
        self._seek_origin = "losses" in self._plan
        self._updates = UpdateWatch() if "relations" in self._plan else None
        # manual optimisation: the user clears and steps, and may clear gradients no optimizer applied
        self._discards = DiscardedGradients([getattr(o, "optimizer", o) for o in trainer.optimizers]) \
            if "relations" in self._plan and not pl_module.automatic_optimization else None
        self._schedules = [(c.scheduler, c.scheduler.last_epoch,
                            trainer.current_epoch + 2 * (c.frequency if c.interval == "epoch" else 1))
                           for c in trainer.lr_scheduler_configs if isinstance(getattr(c.scheduler, "last_epoch", None),
                                                                               int)] \
            if "relations" in self._plan and not pl_module.automatic_optimization else []
        # one process: a rank that acted on its own batches alone would leave the others out of the decision
        self._batches = BatchWatch() if "relations" in self._plan and trainer.world_size == 1 and \
            trainer.num_training_batches > 1 else None
        self._loss_watch.keep = "losses" in self._plan and pl_module.automatic_optimization and \
            trainer.accumulate_grad_batches == 1
        # no closure hands over the loss: each manual_backward's, at every step
        self._manual_losses = "losses" in self._plan and not pl_module.automatic_optimization
        self._norms = GradientNorms() if GRADIENT_NORM in self._recorder.streamed else None
        self._listen(self._sampled)
        return self._recorder.run_url

    def on_exception(self, trainer, pl_module, exception):
        # Lightning runs no teardown hooks after an exception: close the run here
        self._close("stopped" if isinstance(exception, RuleFired) else "failed")

    def teardown(self, trainer, pl_module, stage):
        self._close(self._state)

    def _close(self, state: str) -> None:
        for handle in self._watching:
            handle.remove()
        self._watching, self._wake_at, self._alive = [], None, None
        if self._eval_look is not None:  # a validation that raised
            self._eval_look.leave()
            self._eval_look = None
        self.__dict__.pop("on_train_batch_start", None)
        self.__dict__.pop("on_before_backward", None)
        if self._discards is not None:
            self._discards.remove()
            self._discards = None
        if self._capture is not None:
            self._capture.close()
        self._loss_watch.close(self._recorder)
        if self._norms is not None:
            self._norms.store(self._recorder)
        if self._recorder is not None:
            try:
                self._recorder.finish(state)
            finally:
                self._recorder, self._capture, self._batches = None, None, None

    def state_dict(self):
        return {"run_url": self.run_url}

    def load_state_dict(self, state_dict):
        self._resume_url = state_dict.get("run_url")

    # -- epochs ---------------------------------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer, pl_module):
        self._judge_schedules(trainer)

    def on_train_end(self, trainer, pl_module):
        self._judge_schedules(trainer)

    def _judge_schedules(self, trainer) -> None:
        """Manual optimisation: once the epochs in which a scheduler must have stepped have ended (their epoch-end
        hooks too, where a module steps it; Lightning calls the callbacks' before the module's), the schedulers
        whose step count never moved, told once. Twice the declared interval: a module may step every other one."""
        due = [(scheduler, start) for scheduler, start, by in self._schedules if trainer.current_epoch >= by]
        if not due or self._recorder is None:
            return
        self._schedules = [entry for entry in self._schedules if trainer.current_epoch < entry[2]]
        never = [scheduler for scheduler, start in due if scheduler.last_epoch == start]
        if never:
            step = max(trainer.global_step - 1, 0)
            log.warning("tripwire: after %d epoch(s) of manual optimisation, never stepped: %s", trainer.current_epoch,
                        ", ".join(map(_scheduler_named, never)))
            self._tell(trainer, "schedule_never_stepped", len(never), step)

    # -- training steps -------------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = self._batch_step = trainer.global_step
        if self._discards is not None:
            self._discards.begin()
        if self._alive is not None and not self._watching:  # else the optimizers' post-step hook reports steps
            self._alive()
        if self._capture is None:
            sampled = bool(self._plan.at("train", step))
        elif self._capture.active and self._capture.step == step:  # a later micro-batch of the same step
            sampled = True
            self._capture.new_forward()
            self._take_batch(batch)
        else:
            self._losses, self._backward_losses = [], []
            sampled = self._capture.begin("train", step)
            if sampled:
                if step > 0:  # a new step follows an optimizer step: its gradients must start cleared
                    self._capture.watch_gradients(trainer.optimizers)
                self._take_batch(batch)
                if not self._looked:
                    self._look_at_first_step(pl_module, step)
        if sampled != self._sampled:
            self._sampled = sampled
            self._listen(sampled)
        sleeps = not sampled and self._watching and not self._scaled  # till the next sampled step
        if self._batches is not None and self._batches.see(
                step, batch, sampled, next_seen=not sleeps or self._plan.next_sampled("train", step + 1) == step + 1):
            self._decide(trainer, self._recorder.check_relation(step, "repeated_batch", BatchWatch.IN_A_ROW + 1),
                         step)
        if self._scaled and step - 1 - self._stepped_at == SKIPPED_STEPS and overflowed(trainer.optimizers):
            self._tell(trainer, "skipped_steps", SKIPPED_STEPS, step - 1)  # told at the step it is broken
        if sleeps:  # until the optimizers' hook wakes this
            self._wake_at = self._plan.next_sampled("train", step + 1)
            self.__dict__["on_train_batch_start"] = None

    def _look_at_first_step(self, pl_module, step: int) -> None:
        """Run this step's training_step under a LossSpy, once: what it does with its loss goes to the run."""
        self._looked = True

        def seen(facts) -> None:  # recorded at the batch's end: its backward passes find functional ReLUs' layers
            self._first_facts = facts

        look_once(pl_module, "training_step", step, seen, pl_module.trainer.optimizers)

    def _listen(self, sampled: bool) -> None:
        """Switch the hooks of a sampled step on (the class's methods) or off (None, which Lightning skips); the
        gradients' hook stays on where every step's gradient norm is read, the backward's under manual
        optimisation where losses are captured."""
        for name in SAMPLED_STEP_HOOKS:
            if sampled or (name == "on_before_optimizer_step" and self._norms is not None):
                self.__dict__.pop(name, None)
            else:
                self.__dict__[name] = None
        backward = self._manual_losses or sampled and self._capture is not None and "activations" in self._plan
        self.__dict__["on_before_backward"] = self._before_backward if backward else None

    def _watch(self, trainer) -> None:
        """Hook each optimizer's step, so that on_train_batch_start can be off between samples. Lightning's
        global step is the count of optimizer steps; after a step N, the next batch is step N + 1. Where an
        optimizer takes no such hook (not a torch.optim.Optimizer), or a GradScaler may skip its step (and the
        hook with it: Lightning counts the step all the same), on_train_batch_start stays on."""
        optimizers = [getattr(o, "optimizer", o) for o in trainer.optimizers]
        self._scaled = getattr(trainer.precision_plugin, "scaler", None) is not None
        if self._watching or not optimizers or \
                not all(callable(getattr(o, "register_step_post_hook", None)) for o in optimizers):
            return

        def after_optimizer_step(optimizer, args, kwargs):
            self._stepped_at = trainer.global_step
            if self._alive is not None:
                self._alive()
            if self._wake_at is not None and trainer.global_step + 1 >= self._wake_at:
                self._wake_at = None
                self.__dict__.pop("on_train_batch_start", None)
            if len(self._loss_watch.kept) >= KEPT_LOSSES:
                self._loss_watch.store(self._recorder)
            broke_at = self._updates.after(optimizer, trainer.global_step) \
                if self._updates is not None and not self._sampled else None
            if broke_at is not None:
                self._broken = (broke_at, "step_changed_nothing")  # recorded when this batch ends
                self.__dict__.pop("on_train_batch_end", None)

        def before_optimizer_step(optimizer, args, kwargs):
            """Wrap the closure Lightning hands the optimizer (the training step), to judge the loss it returns
            before the optimizer applies the step (`_judge_loss`). One process only: acting on one rank's loss
            would leave the others out of the collective decision, and a replay would wait in DDP's all-reduce."""
            if self._capture is not None:
                self._capture.stepped(optimizer)  # the step runs: a GradScaler did not skip it
            closure = step_closure(args, kwargs)
            if trainer.world_size > 1:
                return None
            watched = self._updates is not None and not self._sampled
            if not callable(closure):  # manual optimisation: the gradients are there already
                if watched:
                    self._updates.before(optimizer)
                return None
            if self._sampled and not self._seek_origin:
                return None
            step, sampled, first = trainer.global_step, self._sampled, [True]

            def kept():
                loss = closure()
                if first[0]:  # an optimizer that calls its closure again (LBFGS) searches: its first loss counts
                    first[0] = False
                    try:
                        self._judge_loss(trainer.lightning_module, closure, step, loss, sampled)
                        if watched:
                            self._updates.before(optimizer)
                    except Exception as exc:  # noqa: BLE001 - a look at the loss must never stop the training
                        log.warning("tripwire: could not judge step %s's loss: %s: %s", step, type(exc).__name__,
                                    exc)
                return loss

            return (args, {**kwargs, "closure": kept}) if "closure" in kwargs else \
                ((args[0], kept, *args[2:]), kwargs)

        self._watching = [o.register_step_post_hook(after_optimizer_step) for o in optimizers]
        self._watching += [o.register_step_pre_hook(before_optimizer_step) for o in optimizers]
        if self._capture is not None:
            self._capture.watching_steps = True

    def _judge_loss(self, pl_module, closure, step: int, loss, sampled: bool) -> None:
        """A step's loss, before the optimizer applies the step: between samples judged for NaN/Inf (LossWatch:
        at once on the CPU, a later step on an accelerator) and kept; a non-finite one is recorded when the batch
        ends. Where it is known non-finite at once, the step's forward runs again from the state it ran in, to
        find the module where the NaN began (tripwire.plugins.torch.origin); a sampled step records its loss
        itself, and is only looked at for that."""
        if not sampled:
            found = self._loss_watch.see(step, loss)
            if found is not None:
                self._nonfinite = found
                self.__dict__.pop("on_train_batch_end", None)
            nonfinite = found is not None and found[0] == step
        else:
            nonfinite = finite_on_host(loss) is False
        if nonfinite and self._seek_origin:
            self._seek_origin = False
            self._origin = (step, find_origin(pl_module, closure, computes_loss=True))

    def _origin_at(self, step: int) -> dict:
        """{`origin/<module>`: facts} found for this step's NaN, once; {} where none was."""
        if self._origin is None or self._origin[0] != step:
            return {}
        (_, found), self._origin = self._origin, None
        return found

    def _before_backward(self, trainer, pl_module, loss) -> None:
        """A sampled step's loss before its backward pass: the ReLUs the module applied as functions, in the graph
        behind it (TorchCapture.take_functional); and under manual optimisation each backward's loss."""
        if self._sampled and self._capture is not None:
            self._capture.take_functional(loss)
        if self._manual_losses:
            self._on_manual_backward(trainer, loss)

    def _on_manual_backward(self, trainer, loss) -> None:
        """Manual optimisation's: the loss of each `manual_backward` (no closure hands it over,
        and a training_step need return nothing). Between samples it is judged for NaN/Inf, at this step, as
        automatic optimisation's closure loss is (one process only, as there); a sampled step keeps it, for
        the step's loss where its training_step returns none. Under a GradScaler the loss comes scaled: judged,
        not kept."""
        step = trainer.global_step
        if self._sampled:
            if not self._scaled and hasattr(loss, "detach") and self._backward_losses is not None:
                self._backward_losses.append(loss.detach())
        elif trainer.world_size == 1:
            found = self._loss_watch.see(step, loss)
            if found is not None and self._nonfinite is None:  # the step's first; told at the batch's end
                self._nonfinite = found
                self.__dict__.pop("on_train_batch_end", None)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        """The gradients, after the loss scale is removed and before clipping."""
        if self._norms is not None:
            self._norms.see(trainer.global_step, optimizer, self._recorder)
        if self._capture is not None and self._sampled:
            self._capture.backward = not getattr(trainer.fit_loop, "_skip_backward", False)  # SWA's BatchNorm pass
            self._capture.before_optimizer_step(optimizer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._discards is not None:  # the first batches of manual optimisation, until an optimizer steps
            discarded = self._discards.end()
            if self._discards.done:
                self._discards = None
            if discarded:  # Lightning's step stays where no optimizer steps
                self._tell(trainer, "gradients_discarded", discarded, self._batch_step)
        if self._broken is not None:  # woken between samples by a step that changed nothing
            (step, relation), self._broken = self._broken, None
            self._listen(self._sampled)
            self._decide(trainer, self._recorder.check_relation(step, relation, 1) if self._recorder else None,
                         step)
        if self._nonfinite is not None:  # woken between samples by a NaN loss
            (step, loss), self._nonfinite = self._nonfinite, None
            self._listen(self._sampled)
            self._decide(trainer, self._recorder.check_loss(step, loss, self._origin_at(step)) if self._recorder
                         else None, step)
        if not self._sampled:
            return
        if self._first_facts is not None and self._recorder is not None:
            facts, self._first_facts = self._first_facts, None
            self._recorder.first_step(replace(facts, producers=self._capture.producers))
        stepped = trainer.global_step != self._batch_step  # else accumulating: a later micro-batch ends the step
        decision = None
        if self._capture is not None:
            capture, step = self._capture, self._capture.step
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if loss is not None:
                # automatic optimisation divides each micro-batch's loss by their number; undone here
                scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
                self._losses.append(loss.detach() * scale if hasattr(loss, "detach") else loss)
            elif stepped and self._backward_losses:  # manual optimisation's batch that returns no loss and steps:
                self._losses += self._backward_losses  # the mean of its backward passes' losses
            # one that spans several batches (accumulation) scales its losses as it likes (loss / N, as
            # Lightning's docs do): no step's loss is told from them, lest it be N times too small
            self._backward_losses = [] if stepped else None
            if isinstance(outputs, dict) and capture.wants("predictions"):
                for key in PREDICTION_KEYS:
                    if key in outputs:
                        capture.take("predictions", "", outputs[key])
                        break
        if not stepped:
            return
        differ = None
        if self._replicas is not None and any(c.name == "relations" for c in self._plan.at("train", self._batch_step)):
            differ = self._replicas.differ(trainer.optimizers)  # every rank, recording or not, at the same steps
        if self._capture is not None:
            self._loss_watch.store(self._recorder)  # the steps' losses since the last sample, before this step's
            if self._norms is not None:
                self._norms.store(self._recorder)
            scalars = {f"metrics/{k}": v for k, v in trainer.callback_metrics.items()
                       if k not in self._eval_keys} if capture.wants("metrics") else {}
            if differ is not None:
                scalars["relations/replicas_differ"] = differ
            if self._watching and step > self._stepped_at and capture.wants("relations"):  # a GradScaler skipped
                scalars["relations/skipped_steps"] = step - self._stepped_at if overflowed(trainer.optimizers) else 0
            losses, self._losses = self._losses, []
            loss = sum(losses) / len(losses) if losses else None
            values, tensors = capture.end(loss, trainer.optimizers if capture.wants("optimizer") else (), scalars)
            decision = self._recorder.record(step, "train", {**values, **self._origin_at(step)}, tensors, loss=loss)
        self._decide(trainer, decision, trainer.global_step - 1)

    def save_tensor(self, name: str, tensor) -> None:
        """Capture a tensor of your own as `custom/<name>` at this step, if the `custom` collection is sampled."""
        if self._sampled and self._capture is not None:
            self._capture.take("custom", name, tensor)

    # -- evaluation -----------------------------------------------------------------------------------------------
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self._alive is not None:  # an evaluation makes progress too: a long one is no stalled training
            self._alive()
        if not self._eval_looked and self._recorder is not None and not trainer.sanity_checking:
            self._eval_looked = True  # the first validation batch of the training: its dropout functions watched
            self._eval_look = DropoutInEval().__enter__() if "relations" in self._plan else None

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if self._eval_look is not None:
            look, self._eval_look = self._eval_look, None
            calls = look.leave()
            if calls:
                self._tell(trainer, "dropout_in_eval", calls, trainer.global_step)

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking or not self._plan.at("eval", trainer.global_step):
            return
        decision = None
        if self._recorder is not None:
            metrics = self._recorder.plan.collections.get("metrics")
            reductions = Reductions()
            for key, value in trainer.callback_metrics.items():
                self._eval_keys.add(key)
                if metrics is not None and metrics.selects(key):
                    reductions.add_scalar(f"metrics/{key}", value)
            values = reductions.to_host()
            if values:
                decision = self._recorder.record(trainer.global_step, "eval", values)
        self._decide(trainer, decision, trainer.global_step)

    # -- decisions ------------------------------------------------------------------------------------------------
    def _take_batch(self, batch) -> None:
        if isinstance(batch, (tuple, list)) and len(batch) >= 2:
            inputs, labels = batch[0], batch[1]
        elif isinstance(batch, dict):
            inputs = next((batch[k] for k in ("inputs", "input", "x") if k in batch), None)
            labels = next((batch[k] for k in ("labels", "label", "y", "target") if k in batch), None)
        else:
            inputs, labels = batch, None
        if inputs is not None:
            self._capture.take_inputs(inputs)
        if labels is not None:
            self._capture.take("labels", "", labels)

    def _decide(self, trainer, decision, step: int) -> None:
        """Agree across ranks (every rank calls this at the same sampled steps; tripwire.core.actions.agree) and
        act: a stop on any rank stops all; a checkpoint asked on any rank is written once (Lightning's
        save_checkpoint is itself collective); a `raise` on any rank raises RuleFired on every rank at the same
        step (`.rank` says which rank fired)."""
        if self._recorder is not None:
            decision = (decision.merge(self._recorder.poll()) if decision else self._recorder.poll())
        stop = bool(decision and decision.stop)
        checkpoint = bool(decision and decision.checkpoint)
        raise_for = decision.raise_for if decision is not None else None
        fired_rank = None
        if trainer.world_size > 1:
            import torch

            def reduce_max(flags):
                flags = torch.tensor(flags, device=trainer.strategy.root_device)
                return trainer.strategy.reduce(flags, reduce_op="max").tolist()

            stop, checkpoint, raise_for, fired_rank = agree(decision, trainer.global_rank, reduce_max,
                                                            lambda obj, src: trainer.strategy.broadcast(obj, src=src))
        if checkpoint:
            self._checkpoint(trainer, step)
        if stop or raise_for is not None:
            trainer.should_stop = True
            self._state = "stopped"
        if raise_for is not None:
            raise RuleFired(raise_for, rank=fired_rank)

    def _checkpoint(self, trainer, step: int) -> None:
        """Lightning's own checkpoint (a fit resumes from it with ckpt_path), made on a local disk by
        `trainer.save_checkpoint` (every rank takes part; rank 0 writes), then written into the run at
        `checkpoints/step<N>.ckpt` by the writer thread: storage that is slow or hangs holds no step up."""
        with tempfile.TemporaryDirectory(prefix="tripwire-") as folder:
            path = os.path.join(folder, "step.ckpt")
            try:
                trainer.save_checkpoint(path, weights_only=False)
                if self._recorder is not None and os.path.exists(path):
                    with open(path, "rb") as f:
                        self._recorder.save_checkpoint(f"checkpoints/step{step}.ckpt", f.read())
            except Exception as exc:  # noqa: BLE001 - a failed checkpoint must not take training down
                log.warning("tripwire: could not make the checkpoint of step %s: %s: %s", step, type(exc).__name__,
                            exc)


def _scheduler_named(scheduler) -> str:
    """A scheduler's class and the learning rate of its optimizer's first group, where it holds one as a number."""
    groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", None) or [{}]
    rate = groups[0].get("lr")
    return type(scheduler).__name__ + (f" (learning rate {rate:g})" if isinstance(rate, (int, float)) else "")


def _lightning_version(trainer) -> str:
    module = type(trainer).__module__.split(".")[0]
    return f"{module} {getattr(importlib.import_module(module), '__version__', '?')}"
