"""The probe for plain PyTorch training loops: `TripwireProbe(model, optimizer, config, out_dir)`.

A plain loop has no callbacks, so the probe finds the step's phases through
torch's own hooks and asks the user for one call per iteration:

    with TripwireProbe(model, optimizer, "rules.yaml", out_dir="runs/exp1") as probe:
        for x, y in data:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            probe.step(loss)
            if probe.should_stop:
                break

- a forward pre-hook on the model begins the step (`TorchCapture.begin`: on an
  unsampled step one cached comparison; on a sampled one activation hooks
  are registered for that step only, and the inputs are taken);
- an optimizer step pre-hook reads gradients and the parameters as they were
  before the update (`TorchCapture.before_optimizer_step`), only on sampled steps;
- `probe.step(loss)` ends the step: the sample goes to the `Recorder`, rules
  run, and the decision is applied — `stop` sets `probe.should_stop`,
  `checkpoint` writes the model and optimizer state next to the run, `raise`
  raises `tripwire.RuleFired`. On an unsampled step the loss is only judged
  for NaN/Inf (`LossWatch`), so that a NaN is acted on at the step it appears.

The step is the number of `probe.step()` calls before this one: the plain
loop's global step (optimizer steps). Forward passes in eval mode
(`model.eval()`) do not begin a step.

Under DDP (the model given is the DistributedDataParallel wrapper, in a process
group of several ranks) with `workers: all` in the config, every rank makes its
probe, and they take part in two collectives at the sampled steps: where `relations` are sampled, the check that
the replicas still hold the same parameters (`replicas.Replicas`); and the
decision, agreed as under Lightning (tripwire.core.actions.agree), so that a
stop or a raise on any rank ends every rank at the same step and no rank waits
for one that left. A decision taken between samples (a NaN loss) waits for the
next sampled step. With `workers: zero` (the default) the probe makes no
collective: a probe on rank 0 alone must never wait for ranks that have none.
"""

from __future__ import annotations

import io
import logging
from dataclasses import replace

import torch

from tripwire.core.actions import agree
from tripwire.core.config import load_config
from tripwire.core.errors import RuleFired
from tripwire.core.recorder import Recorder, make_run_url, prepare_storage
from tripwire.core.rules.base import FORWARDS
from tripwire.core.rules.relations import SKIPPED_STEPS

from .capture import TorchCapture, step_closure
from .evaldropout import DropoutInEval
from .firststep import LossSpy
from .gradnorm import SERIES as GRADIENT_NORM
from .gradnorm import GradientNorms
from .loaders import FirstBatchRepeats
from .losswatch import KEPT_LOSSES, LossWatch
from .objectives import ForwardCounts, Objectives
from .origin import find_origin, finite_on_host, loss_origin
from .reduce import Reductions
from .relations import (MODE_DEPENDENT, DiscardedGradients, UpdateWatch, eval_mode_modules, overflowed,
                        stepping, train_mode_modules)
from .replicas import Replicas
from .schedules import RateWatch
from .structure import called_modules, describe

log = logging.getLogger("tripwire")


class TripwireProbe:
    """Capture, rules and actions for a plain PyTorch loop. Call `step(loss)` after `optimizer.step()`.

    model: the torch.nn.Module being trained (its `named_parameters()` paths name the tensors).
    optimizer: a torch.optim.Optimizer, or a list of them. One that hands its steps to an optimizer it holds (SAM's
        first_step/second_step step its base_optimizer; a Lookahead steps the one it wraps) is watched through it.
    config: a path to a YAML rule file, a dict, a tripwire.Config, or None for the packaged default.
    out_dir: the run's URL (any fsspec URL); overrides `output` in the config. Where a run is there already, this
        training gets a run of its own beside it (out_dir-1, -2, …; `run_url` and the log say which).
    storage_options: passed to fsspec (e.g. S3 credentials); merged over the config's.
    append: add to the run at out_dir instead (a loop resumed from its own checkpoint).
    """

    def __init__(self, model: torch.nn.Module, optimizer, config=None, out_dir=None,
                 storage_options: dict | None = None, *, append: bool = False):
        self.model = model
        self.optimizers = [stepping(o) for o in (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])]
        self.config = load_config(config)
        _warn_ranks_apart(self.config.workers)
        prepare_storage(self.config, out_dir, storage_options)
        self.global_step = 0
        self.should_stop = False
        structure = describe(model, self.optimizers)
        self._recorder = Recorder(self.config, run_url=make_run_url(self.config, out_dir), framework="torch",
                                  framework_version=f"torch {torch.__version__}", storage_options=storage_options,
                                  info={"torch_version": torch.__version__}, model=structure, append=append)
        self._recorder.start()
        self._recorder.exit_state = "finished"  # a probe never closed: its loop ran to the end of the script
        self.run_url = self._recorder.run_url
        self._capture = TorchCapture(model, self._recorder.plan, structure, self._recorder.tensor_budget,
                                     ranks_together=self.config.workers == "all" and _several_processes())
        # the loss of every step between samples: judged for NaN/Inf at once, kept, and stored at the next sample
        self._losses = LossWatch(keep="losses" in self._recorder.plan.collections)
        self._norms = GradientNorms() if GRADIENT_NORM in self._recorder.streamed else None  # where a rule reads it
        self._spy: LossSpy | None = None  # looks at the first sampled step's forward pass and loss
        self._objectives: Objectives | None = None  # counts the objectives that step trains in turn
        self._first = None  # what the look saw (a FirstStep), recorded with the objectives when the step ends
        # the training forwards of each of the first steps: a loss over a number of them that changes from step to
        # step (an RL episode) measures that number as much as the fit (recorded where relations are captured)
        self._forwards = ForwardCounts() if "relations" in self._recorder.plan.collections else None
        self._begun = False  # a forward pass (or step()) began the current step
        self._stepping = False  # an optimizer stepped during the current step
        self._skipped = 0  # training steps in a row in which no optimizer stepped (accumulation, a GradScaler's skip)
        self._stepped_now: set = set()  # the ids of the optimizers that stepped in this step, and in the last that
        self._stepped_last: set = set()  # any did: where none is in both, another objective is trained (spikes)
        self._shapes = InputShapes()  # inputs of a shape not seen before begin a stage of their own (spikes)
        self._in_step = None  # the optimizer whose step is running (a closure's forward may begin the step in it)
        self._after_optimizer = False  # the previous step ended with an optimizer's step
        # training in eval mode matters where a module computes differently in it; said once is enough
        self._eval_mode_said = not any(isinstance(m, MODE_DEPENDENT) for m in model.modules())
        self._train_mode_eval_said = self._eval_mode_said  # and an evaluation in train mode, likewise
        # the first evaluation forward, watched for dropout functions left on (DropoutInEval), where relations count
        self._eval_look: tuple | None = None  # (the module whose forward it is, the look) while that forward runs
        self._eval_looked = "relations" not in self._recorder.plan.collections
        self._sampled = False
        # where a NaN begins, while none has been seen: the step's last training call of each module the loop calls
        # (the model, or each of the parts it holds), in the order of those calls: {module: (args, kwargs, output)},
        # references; the last call's output is judged before the optimizer's update (`_look_for_origin`)
        self._last_calls: dict = {}
        self._output_finite = None  # what that judged, until another call
        self._origin = None  # (step, {origin/<path>: facts}) found before the update of that step
        # one process only: a replayed forward of a DDP model would wait in collectives the other ranks never join
        self._seek_origin = "losses" in self._recorder.plan.collections and not _several_processes()
        # between samples, a step that stopped updating, told within a step (UpdateWatch), acted on at step()
        self._updates = UpdateWatch() if "relations" in self._recorder.plan.collections else None
        self._told = None  # the decision on such a step, until step() acts on it
        # over the first steps, until an optimizer steps: gradients cleared that no optimizer applied
        self._discards = DiscardedGradients(self.optimizers) \
            if "relations" in self._recorder.plan.collections and self.optimizers else None
        # a learning rate that fell to near 0 early and stays there (a scheduler stepped per batch, not per epoch)
        self._rates = RateWatch(self.optimizers) if "relations" in self._recorder.plan.collections else None
        # over the first steps, a loader that hands out its first batch again and again (next(iter(loader)))
        self._repeats = FirstBatchRepeats() if "relations" in self._recorder.plan.collections else None
        self._hooks = [hook for called in called_modules(model)
                       for hook in (called.register_forward_pre_hook(self._on_forward),
                                    called.register_forward_hook(self._after_forward, with_kwargs=True))]
        self._hooks += [o.register_step_pre_hook(self._on_optimizer_step) for o in self.optimizers]
        self._hooks += [o.register_step_post_hook(self._after_optimizer_step) for o in self.optimizers]
        self._capture.watching_steps = bool(self.optimizers)  # a step no optimizer took changed no parameter
        # None outside DDP, or unless every rank has a probe (workers: all): no collective at all
        self._replicas = Replicas.of(model) if self.config.workers == "all" else None
        self._held = None  # under DDP, the decision of the steps since the last sample, acted on at the next
        self._arm_look()

    @property
    def verdicts(self) -> list:
        """Verdicts found so far in this process (in-process or picked up from the side process)."""
        return list(self._recorder.verdicts)

    # -- the loop's calls -------------------------------------------------------------------------------------------
    def step(self, loss=None, *, labels=None, predictions=None, metrics: dict | None = None) -> None:
        """End the training step: record what was sampled, run the rules, act. Cheap on unsampled steps."""
        self._end_step(loss, labels, predictions, metrics)
        if self._after_optimizer:  # the next step's gradients are watched from here, wherever it is found to begin
            self._capture.watch_gradients(self.optimizers, self.global_step)
        self._arm_look()

    def _end_step(self, loss, labels, predictions, metrics) -> None:
        if not self._begun:
            self._begin()
        self._begun = False
        if self._recorder.clock:
            self._recorder.alive()
        self._end_look()
        self._record_first_step()
        step = self.global_step
        self.global_step += 1
        trained, self._after_optimizer, self._stepping = self._stepping, self._stepping, False
        stepped, self._stepped_now = self._stepped_now, set()
        if stepped:  # none of the optimizers that stepped before: another objective from here
            if self._stepped_last and not stepped & self._stepped_last:
                self._recorder.new_objective(step)
            self._stepped_last = stepped
        forwards = self._count_forwards()
        discarded = self._discarded()
        repeats = self._repeated_batches(step)
        collapsed = self._rates.see(step) if self._rates is not None else None
        if collapsed:
            log.warning("tripwire: %s", collapsed)
        self._skipped = 0 if trained or not self.optimizers else self._skipped + 1
        if not self._sampled:  # a NaN loss, and training in eval mode, at the step it appears, sampled or not
            found = self._losses.see(step, loss)
            origin = self._origin_of(step, found is not None)
            decision = self._recorder.check_loss(*found, origin=origin) if found is not None else None
            decision, self._told = _merged(decision, self._told), None
            if len(self._losses.kept) >= KEPT_LOSSES:
                self._losses.store(self._recorder)
            if trained and not self.model.training and not self._eval_mode_said:
                decision = self._eval_mode(step, decision)
            if forwards is not None:
                decision = _merged(decision, self._recorder.fact(step, FORWARDS, forwards))
            # relations broken at this step, told at once
            skipped = self._skipped == SKIPPED_STEPS and overflowed(self.optimizers) and self._skipped
            for relation, count in (("skipped_steps", skipped), ("gradients_discarded", discarded),
                                    ("repeated_batch", repeats), ("rate_collapsed", 1 if collapsed else 0)):
                if count:
                    decision = _merged(decision, self._recorder.check_relation(step, relation, count))
            if decision is not None:
                self._act(decision.merge(self._recorder.poll()))
            return
        self._sampled = False
        if labels is not None:
            self._capture.take("labels", "", labels)
        if predictions is not None:
            self._capture.take("predictions", "", predictions)
        scalars = {f"metrics/{k}": v for k, v in (metrics or {}).items()}
        if trained:
            scalars["relations/eval_mode"] = eval_mode_modules(self.model)
            self._eval_mode_said |= scalars["relations/eval_mode"] > 0
        elif self._skipped:
            scalars["relations/skipped_steps"] = self._skipped if overflowed(self.optimizers) else 0
        if discarded:
            scalars["relations/gradients_discarded"] = discarded
        if repeats:
            scalars["relations/repeated_batch"] = repeats
        if collapsed:
            scalars["relations/rate_collapsed"] = 1
        if self._replicas is not None and self._capture.wants("relations"):  # every rank, at the same steps
            differ = self._replicas.differ(self.optimizers)
            if differ is not None:
                scalars["relations/replicas_differ"] = differ
        self._losses.store(self._recorder)  # the steps' losses since the last sample, before this step's
        if self._norms is not None:
            self._norms.store(self._recorder)
        values, tensors = self._capture.end(loss, self.optimizers, scalars)
        if forwards is not None:
            values[FORWARDS] = forwards
        origin = self._origin_of(step, _nonfinite(loss))
        decision = self._recorder.record(step, "train", {**values, **origin}, tensors, loss=_mean(loss))
        self._act(decision.merge(self._recorder.poll()), sampled=True)

    def _discarded(self) -> int | None:
        """The end of a step for DiscardedGradients: the parameters whose gradients were cleared unapplied, where
        this step tells it; then, and once an optimizer stepped or its steps are over, it is off."""
        if self._discards is None:
            return None
        found = self._discards.end()
        if self._discards.done:
            self._discards = None
        return found

    def _repeated_batches(self, step: int) -> int | None:
        """The end of a step for FirstBatchRepeats: the steps trained on one repeated first batch, where this step
        tells it; then, and once its first steps are over, it is off."""
        if self._repeats is None:
            return None
        found = self._repeats.end_step(step)
        if self._repeats.done:
            self._repeats = None
        return found

    def _count_forwards(self) -> dict | None:
        """The end of a step for ForwardCounts: its fact where this is the step it is known at; then it is off."""
        if self._forwards is None:
            return None
        fact = self._forwards.end_step()
        if self._forwards.done:
            self._forwards = None
        return fact

    def log_eval(self, metrics: dict) -> None:
        """Record evaluation metrics (e.g. {"val_loss": 0.3}) as `metrics/<name>` in mode eval at this step."""
        step = self.global_step
        # forwards in train mode since the last step(), and no optimizer step: an evaluation, not a training step
        if self._begun and not self._stepping and not self._train_mode_eval_said:
            self._train_mode_eval_said = True
            said = self._recorder.check_relation(step, "train_mode_eval", train_mode_modules(self.model))
            if said is not None:
                self._act(said)
        plan = self._recorder.plan.collections.get("metrics")
        if not self._recorder.plan.at("eval", step) or plan is None:
            return
        reductions = Reductions()
        for key, value in metrics.items():
            if plan.selects(key):
                reductions.add_scalar(f"metrics/{key}", value)
        values = reductions.to_host()
        if values:
            self._act(self._recorder.record(step, "eval", values))

    def save_tensor(self, name: str, tensor) -> None:
        """Capture a tensor of your own as `custom/<name>` at this step, if the `custom` collection is sampled."""
        if self._sampled:
            self._capture.take("custom", name, tensor)

    def close(self, state: str | None = None) -> None:
        """Remove the hooks, write what is left and close the run (`finished`, or `stopped` after a stop)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._discards is not None:
            self._discards.remove()
        if self._repeats is not None:
            self._repeats.close()
        self._end_look()
        self._end_eval_look()
        self._record_first_step()
        self._capture.close()
        self._losses.close(self._recorder)
        if self._norms is not None:
            self._norms.store(self._recorder)
        self._recorder.finish(state or ("stopped" if self.should_stop else "finished"))

    def __enter__(self) -> "TripwireProbe":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.close("stopped" if isinstance(exc, RuleFired) else "failed")

    # -- hooks ------------------------------------------------------------------------------------------------------
    def _on_forward(self, module, args) -> None:
        if not module.training:
            if not self._eval_looked:
                self._eval_looked = True
                self._eval_look = (module, DropoutInEval().__enter__())
            self._disarm_look()
            if self._recorder.clock:  # an evaluation makes progress too: a long one is no stalled training
                self._recorder.alive()
            return
        if self._forwards is not None and self._in_step is None and torch.is_grad_enabled():
            self._forwards.this_step += 1
        if self._repeats is not None and args:
            self._repeats.see_inputs(self.global_step, args[0])
        if self._begun:
            return
        if self._shapes.new_stage(args[0] if args else None):
            self._recorder.new_objective(self.global_step)
        self._begin()
        if self._sampled and args:
            self._capture.take_inputs(args[0])

    def _after_forward(self, module, args, kwargs, output) -> None:
        if self._eval_look is not None and self._eval_look[0] is module:
            self._end_eval_look()
        if module.training:
            if self._sampled:  # before the backward pass, while its graph is whole
                self._capture.take_functional(output)
            self._capture.new_forward()
        if self._seek_origin and module.training:
            self._last_calls.pop(module, None)
            self._last_calls[module] = (args, kwargs, output)
            self._output_finite = None

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        closure = step_closure(args, kwargs) is not None
        if not self._begun and not closure:  # no forward of the model began this step (a loop that calls its
            self._begin()  # layers' forward itself, as forward-forward training does): here, before the update
        self._stepping, self._in_step = True, optimizer
        self._stepped_now.add(id(optimizer))
        self._end_look()
        if self._objectives is not None:
            self._objectives.before(optimizer)
        self._capture.stepped(optimizer)
        if self._sampled:  # a closure (LBFGS) computes the step's gradients inside the step, after this hook
            self._capture.before_optimizer_step(optimizer, gradients_later=closure)
        if self._last_calls and self._output_finite is None and not closure:
            self._look_for_origin()
        if self._norms is not None and not closure:  # a GradScaler's step calls this after removing its scale
            self._norms.see(self.global_step, optimizer, self._recorder)
        if self._updates is not None and not self._sampled and not closure:
            self._updates.before(optimizer)

    def _look_for_origin(self) -> None:
        """Before the update: whether the step's model output is finite (read at once on the CPU, about the cost of
        a loss read; not judged on an accelerator, where reading would wait for it). Where it is not, the forward
        runs again, from the state it ran in, to find the module where the NaN began (tripwire...origin): the call of
        the first part whose output holds it, where the loop calls the model's parts one by one."""
        calls = list(self._last_calls.items())
        try:
            finite = finite_on_host(calls[-1][1][2])
        except Exception as exc:  # noqa: BLE001 - an output tripwire cannot read must not stop training
            log.debug("tripwire: the model's output could not be read for NaN (%s: %s)", type(exc).__name__, exc)
            finite = None
        self._output_finite = finite
        if finite is None:  # on an accelerator, or nothing to judge: not sought again
            self._seek_origin = False
        elif finite is False:
            self._seek_origin = False
            module, (args, kwargs, _) = next(call for call in calls if finite_on_host(call[1][2]) is False)
            self._origin = (self.global_step, find_origin(self.model, lambda: module(*args, **kwargs)))

    def _origin_of(self, step: int, nonfinite_loss: bool) -> dict:
        """Where this step's NaN began: the module the replay found before the update, or, for a non-finite loss,
        the loss itself where the model's output was seen finite. {} otherwise. Lets go of the step's calls."""
        calls, self._last_calls = self._last_calls, {}
        finite, self._output_finite = self._output_finite, None
        if self._origin is not None:
            (at, found), self._origin = self._origin, None
            return found if at == step else {}
        if not nonfinite_loss or not calls or finite is not True:
            return {}
        self._seek_origin = False
        return loss_origin(list(calls.values())[-1][2])

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._in_step = None
        if self._objectives is not None:
            self._objectives.after(optimizer)
        broke_at = self._updates.after(optimizer, self.global_step) \
            if self._updates is not None and not self._sampled else None
        if broke_at is not None:
            self._told = _merged(self._told, self._recorder.check_relation(broke_at, "step_changed_nothing", 1))

    def _begin(self) -> None:
        self._begun = True
        if self._discards is not None:
            self._discards.begin()
        self._sampled = self._capture.begin("train", self.global_step)
        if self._sampled and self._in_step is not None:  # begun by a closure inside an optimizer's step (LBFGS):
            self._capture.stepped(self._in_step)  # the parameters are as before it; its gradients come later
            self._capture.before_optimizer_step(self._in_step, gradients_later=True)
        if self._sampled and self._after_optimizer:
            self._capture.watch_gradients(self.optimizers)
        if self._sampled and (self._spy is None or not self._spy.looking):  # the first sampled step: what the
            if self._spy is None:  # loop does with its loss
                self._spy = LossSpy(self.model).__enter__()
            self._spy.look()
            self._objectives = Objectives(self.optimizers)

    def _arm_look(self) -> None:
        """Before the first sampled step (at the end of the step before it, or here at the start): follow which
        tensors are computed from a parameter from here, so a target computed before the model's forward (a DQN's,
        by its target network) is known for the model's own."""
        if self._spy is None and self._capture.plan.at("train", self.global_step):
            self._spy = LossSpy(self.model, looking=False).__enter__()

    def _disarm_look(self) -> None:
        """An evaluation before the first sampled step: the look waits for the training forward (no evaluation pays
        for it)."""
        if self._spy is not None and not self._spy.looking:
            self._spy.finish(self.global_step)
            self._spy = None

    def _end_look(self) -> None:
        """Stop looking at the loss (at the step's first optimizer step, or its end)."""
        if self._spy is not None and not self._spy.looking:  # armed for a step that never began (closed before it)
            self._disarm_look()
        elif self._spy is not None and not self._spy.done:
            self._first = self._spy.finish(self.global_step)

    def _record_first_step(self) -> None:
        """At the end of the first sampled step: what the look saw, and how many objectives the step trained."""
        if self._first is not None:
            self._recorder.first_step(replace(self._first, objectives=self._objectives.count,
                                              producers=self._capture.producers))
            self._first, self._objectives = None, None

    def _end_eval_look(self) -> None:
        """The first evaluation forward ended (or training did, inside it): its dropout functions left on, told."""
        if self._eval_look is None:
            return
        (_, look), self._eval_look = self._eval_look, None
        calls = look.leave()
        said = self._recorder.check_relation(self.global_step, "dropout_in_eval", calls) if calls else None
        if said is not None:
            self._act(said)

    def _eval_mode(self, step: int, decision):
        """An optimizer stepped with the model in eval mode, at an unsampled step: said once, at that step."""
        modules = eval_mode_modules(self.model)
        if not modules:
            return decision
        self._eval_mode_said = True
        return _merged(decision, self._recorder.check_relation(step, "eval_mode", modules))

    def _act(self, decision, sampled: bool = False) -> None:
        """Checkpoint, stop, raise. Under DDP a decision is held until a sampled step (`sampled`), where every
        rank agrees on it: a stop or a raise on any rank stops (raises on) all; a checkpoint, of this rank's own
        state, is written by the ranks that asked for it."""
        rank = None
        if self._replicas is not None:
            self._held = _merged(self._held, decision)
            if not sampled:
                return
            decision, self._held = self._held, None
            try:
                decision.stop, _, decision.raise_for, rank = agree(decision, self._replicas.rank,
                                                                   self._replicas.reduce_max, self._replicas.broadcast)
            except Exception as exc:  # noqa: BLE001 - a failed collective must not take training down
                log.warning("tripwire: the ranks could not agree on step %s's decision (%s: %s); this rank acts on "
                            "its own", self.global_step - 1, type(exc).__name__, exc)
        if decision.checkpoint:
            self._checkpoint(decision.checkpoint[0])
        if decision.stop or decision.raise_for is not None:
            self.should_stop = True
        if decision.raise_for is not None:
            raise RuleFired(decision.raise_for, rank=rank)

    def _checkpoint(self, verdict) -> None:
        """Model and optimizer state, with torch.save, into the run (`checkpoints/<rule>-step<N>-worker<W>.pt`)."""
        safe = "".join(c if c.isalnum() or c in "_.-" else "_" for c in verdict.rule)
        state = {"step": verdict.step, "model": self.model.state_dict(),
                 "optimizers": [o.state_dict() for o in self.optimizers]}
        try:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            self._recorder.save_checkpoint(f"checkpoints/{safe}-step{verdict.step}-worker{verdict.worker}.pt",
                                           buffer.getbuffer())
        except Exception as exc:  # noqa: BLE001 - a failed checkpoint must not take training down
            log.warning("tripwire: could not make the checkpoint of step %s: %s: %s", verdict.step,
                        type(exc).__name__, exc)


def _merged(decision, said):
    """Two decisions as one, either of which may be None."""
    if decision is None or said is None:
        return said if decision is None else decision
    return decision.merge(said)


def _several_processes() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class InputShapes:
    """The shape of the model's first input per sample (the batch dimension aside), step by step, while few are
    seen: a shape not seen before begins a stage of training of its own (progressive resizing trains on small
    images, then on large ones), whose loss starts over from about the untrained level, on purpose, with no fault of
    the training. Inputs that come in many shapes (sequences of every length, multi-scale training) tell no stage:
    they are no longer followed once more than MOST shapes were seen."""

    MOST = 4

    def __init__(self):
        self._seen: set | None = set()
        self._last = None

    def new_stage(self, inputs) -> bool:
        """Whether these inputs, a step's first, begin a stage (a shape not seen before, after the first)."""
        if self._seen is None or not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
            return False
        shape = tuple(inputs.shape[1:])
        if shape == self._last:
            return False
        new = self._last is not None and shape not in self._seen
        self._last = shape
        self._seen.add(shape)
        if len(self._seen) > self.MOST:
            self._seen = None
        return new


def _warn_ranks_apart(workers: str) -> None:
    """A probe on a rank other than 0 under `workers: zero` means a probe on several ranks that do not agree:
    each decides alone, and a rank that stops (a NaN loss on its own batch) leaves the others waiting in DDP's
    next collective. Said on that rank, at once; a probe on rank 0 alone (what `workers: zero` is for) is not
    told anything."""
    if workers == "all" or not _several_processes() or torch.distributed.get_rank() == 0:
        return
    log.warning("tripwire: a probe on rank %d of %d with `workers: zero` in the config: each rank records and "
                "decides alone, and a rank that stops training leaves the others waiting in the next collective. "
                "With a probe on every rank, set `workers: all`: the ranks then agree on every stop (and record a "
                "run each); or make the probe on rank 0 only.", torch.distributed.get_rank(),
                torch.distributed.get_world_size())


def _nonfinite(loss) -> bool:
    """Whether a loss holds NaN/Inf (read on the host: called once a step's output is known finite, on the CPU)."""
    try:
        return not bool(torch.isfinite(torch.as_tensor(loss)).all())
    except (TypeError, ValueError, RuntimeError):
        return False


def _mean(loss):
    """The loss, detached, as one number where it is several (per sample), for the recorder's NaN check (which
    reads it as a float: detached, torch says nothing about its graph); None where no number can be read."""
    if not isinstance(loss, torch.Tensor):
        return loss
    try:
        return loss.detach().float().mean() if loss.numel() > 1 else loss.detach()
    except (RuntimeError, NotImplementedError):  # a loss of a kind no mean is taken of (nested, sparse)
        return None
