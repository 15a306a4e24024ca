"""What a torch model offers tripwire at a sampled step, shared by the Lightning callback and the plain-loop probe.

The caller marks the step's phases: `begin(mode, step)` before the forward
pass (activation hooks are registered here, and only here),
`before_optimizer_step(optimizer)` before each optimizer step (the gradients
of the parameters that optimizer holds, and those parameters as they were
before it updated them), `end(...)` after the step (updates, losses,
optimizer state), which returns the sample for the recorder. `updates/` are
what an optimizer's step did: a parameter no optimizer stepped has none
(not a zero). Frozen parameters are not captured: the model's structure
(`structure.describe`) records them. On an unsampled step `begin` returns
False after one cached comparison and nothing else runs.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist

from tripwire.core.model import ModelInfo, parameter_collection
from tripwire.core.naming import calls_left_out, next_call
from tripwire.core.reductions import combine_shards, shard_reductions
from tripwire.core.sampling import CapturePlan

from .functional import SUFFIX as FUNCTIONAL_RELU
from .functional import FunctionalReLUs
from .reduce import Reductions, Unsupported, host_array
from .relations import GradientPath, GradientsCleared, StepEffect, batch_tensors
from .structure import PASS_THROUGH, has_parameters, is_activation, named_modules, named_parameters

log = logging.getLogger("tripwire")

PARAM_COLLECTIONS = ("weights", "biases", "gradients", "updates")
# Layers whose output holds its features at axis 1 (N, C, ...), also in three dimensions (Conv1d's N, C, L)
CHANNELS_FIRST = (torch.nn.modules.conv._ConvNd, torch.nn.modules.batchnorm._BatchNorm,
                  torch.nn.modules.instancenorm._InstanceNorm, torch.nn.GroupNorm)


class TorchCapture:
    def __init__(self, module: torch.nn.Module, plan: CapturePlan, model: ModelInfo, budget=None,
                 ranks_together: bool = False):
        """budget: called as a sampled step begins, gives the TensorBudget its full tensors are copied within.
        ranks_together: every rank of the process group captures the same steps (`workers: all`), so that a
        tensor sharded across them (FSDP) is reduced as a whole, by a collective; else each reads its own shard."""
        self.module, self.plan, self.model, self.ranks_together = module, plan, model, ranks_together
        self._new_budget = budget
        self._budget = None
        self.active: dict = {}
        self.step, self.mode = None, None
        self._hooks: list = []
        self._reductions: Reductions | None = None
        self._tensors: dict = {}
        self._before: dict = {}
        self._taken: set = set()  # parameters whose weights (and gradients) this sample holds
        self._activation_hooks: list | None = None  # (module, hook) of the activations selected, made once
        self._functional: FunctionalReLUs | None = None  # ReLUs applied as functions, made at the first such sample
        self._calls: dict = {}  # path -> the calls of that module's hook in this forward pass (naming.next_call)
        # {activation: the layer whose output it took}, seen in the forward of the first training step sampled, where
        # it captured activations (FirstStep.producers, through `producers`)
        self._producers: dict = {}
        self._seen_call = False  # an activation's call was seen while producers were noted
        self._first_train = True  # no training step was sampled yet (or none where an activation's call was seen)
        # while producers are seen: id(output) -> (weak reference to it, the layer it is of, its version then)
        self._made: dict | None = None
        self._taking: dict = {}  # while producers are seen: id(activation module) -> the layer its call takes
        self._held: dict = {}  # id(optimizer) or None -> (requires_grad flags, [(path, parameter, its Parameter)])
        self._every_parameter = None  # the module's parameters, for a step no optimizer is known of
        self._layers: dict | None = None  # layer path -> module, to read the mode a layer is held in
        # id(layer with parameters) -> whether it was fed data at this sampled training step (an expert no token was
        # routed to runs on an empty batch), where gradients or updates are captured
        self._fed: dict = {}
        self._unread: set = set()  # names of tensors that could not be read (said once each)
        self.watching_steps = False  # the plugin tells each optimizer step that ran (`stepped`)
        self._stepped = False  # an optimizer step ran during the step being captured
        self._ran: set = set()  # id of each optimizer whose step ran (None: one the plugin cannot name)
        self._late: list = []  # (path, parameter, its Parameter) whose gradient the step computes itself (a closure)
        self._cleared: GradientsCleared | None = None  # this step's gradient hooks, where relations are sampled
        self._path: GradientPath | None = None  # this step's forward hooks for cuts in the graph, with them
        self._stepping: dict = {}  # id(optimizer) -> {id(parameter): parameter} it holds, for this step's hooks
        self._told_cut = False  # the parameters cut off from the loss were named in the log
        self._sharded: dict = {}  # name -> the reductions asked of a tensor sharded across the ranks (FSDP)
        self._effect = StepEffect()  # what this sample's optimizer steps had to apply and did (relations)
        # False where the framework itself runs the step being captured without a backward pass, by design
        # (Lightning's StochasticWeightAveraging ends with an epoch of forwards that recompute BatchNorm's statistics
        # for the averaged weights): whether it had gradients to apply, or reached every parameter, is not judged
        self.backward = True

    # -- phases ---------------------------------------------------------------------------------------------------
    def begin(self, mode: str, step: int) -> bool:
        collections = self.plan.at(mode, step)
        if not collections:
            self.active = {}
            return False
        self.active = {c.name: c for c in collections}
        self.mode, self.step, self._stepped, self._ran, self._late = mode, step, False, set(), []
        self.backward = True
        self._reductions, self._tensors, self._before, self._taken = Reductions(), {}, {}, set()
        self._effect = StepEffect()  # nothing left over from a sample that ended without end() (closed in a step)
        self._budget = self._new_budget() if self._new_budget is not None else None
        self._calls = {}
        activations = self.active.get("activations")
        if activations is not None and mode == "train":
            self._hook_activations(activations)
            if self._first_train:
                self._see_producers()
            self._functional = self._functional or FunctionalReLUs(self.module, self._take_relu)
            self._hooks += self._functional.watch()
        self._first_train = self._first_train and mode != "train"
        self._fed = {}
        if mode == "train" and ("gradients" in self.active or "updates" in self.active):
            self._hooks += [layer.register_forward_pre_hook(self._note_fed) for layer in self._layers_of().values()
                            if next(layer.parameters(recurse=False), None) is not None]
        if "predictions" in self.active and mode == "train":  # the model's own output, where forward() is used
            self._hooks.append(self.module.register_forward_hook(self._output_hook("predictions", "")))
        return True

    def watch_gradients(self, optimizers, step: int | None = None) -> None:
        """The step being captured follows an optimizer step: note whether the gradients of the parameters these
        optimizers step start from cleared ones (tripwire.plugins.torch.relations), where the `relations`
        collection is sampled. A parameter no optimizer holds is untrained_parameters' (its gradient, applied by
        nothing, may well pile up).
        step: the coming step, where the plugin watches from the end of the step before it, before that step has
        begun: the probe begins a step at the model's forward, or, in a loop that never calls the model itself
        (a GAN's two networks in one container), at its first optimizer step, after the backward passes that
        gradient hooks made then would miss. The forward hooks for cuts are made as the step begins."""
        sampled = "relations" in self.active and self.mode == "train" if step is None else \
            any(c.name == "relations" for c in self.plan.at("train", step))
        if sampled and self._cleared is None and optimizers:
            self._stepping = {id(_real(o)): {id(p): p for _, p, _ in self._parameters_of(o)} for o in optimizers}
            held = {key: p for params in self._stepping.values() for key, p in params.items()}
            self._cleared = GradientsCleared(held.values())
        if step is None and self._cleared is not None and self._path is None:
            self._path = GradientPath(self.module)

    def before_optimizer_step(self, optimizer=None, gradients_later: bool = False) -> None:
        """The parameters `optimizer` is about to update (every trainable one where it is None): their values
        and gradients now, and a copy for their update, once per sample; and, where relations are sampled, whether
        the step has gradients to apply and changes what it holds (tripwire.plugins.torch.relations).
        gradients_later: the step was handed a closure that computes its gradients."""
        if not self.active or self.mode != "train":
            return
        # a step that evaluates a closure itself (LBFGS) has no gradients of its own yet, and ends without an
        # update once converged: its relations are not judged
        if "relations" in self.active and optimizer is not None and not gradients_later and self.backward and \
                not isinstance(_real(optimizer), torch.optim.LBFGS):
            rates = {id(p): g.get("lr") for g in _real(optimizer).param_groups for p in g["params"]}
            self._effect.before(_real(optimizer), [param for _, param, _ in self._parameters_of(optimizer)], rates)
        if not any(c in self.active for c in PARAM_COLLECTIONS):
            return
        updates = self.active.get("updates")
        for path, param, info in self._parameters_of(optimizer):
            if path in self._taken or not gradients_later and self._held_in_eval(param, info):
                continue
            self._taken.add(path)
            self.take(parameter_collection(info.role, path), path, param, info.layer_class)
            if self._unfed(info):
                continue  # its gradient is 0 by construction, its update momentum's alone: nothing to judge
            if gradients_later:
                self._late.append((path, param, info))
            elif param.grad is not None:
                self.take("gradients", path, param.grad, info.layer_class)
            if updates is not None and (param.grad is not None or gradients_later) and updates.selects(path):
                self._before[path] = (param, param.detach().clone())  # no gradient: no step

    def stepped(self, optimizer=None) -> None:
        """An optimizer's step ran (called from a hook inside `optimizer.step()`, where the plugin has one; with
        that optimizer where it can tell)."""
        self._stepped = True
        self._ran.add(None if optimizer is None else id(_real(optimizer)))

    def end(self, loss=None, optimizers=(), extra_scalars: dict | None = None):
        """The step's sample as (values, tensors), or None if the step was not sampled. A training step in which no
        optimizer stepped (AMP's GradScaler skips the steps whose gradients overflowed, by design) changed no
        parameter: its weights, gradients and updates are left out, so that no rule judges a step that did not
        happen."""
        if not self.active:
            return None
        self._remove_hooks()
        if self._functional is not None:
            self._functional.release()
        if self._made is not None and not self._seen_call:  # the step's forward ran before its hooks (a probe
            self._first_train = True  # whose model is never called itself): noted at the next sampled step
        self._made, self._taking = None, {}
        ran = None if not self.watching_steps or None in self._ran else self._ran  # a skipped step changes nothing
        if self._path is not None:
            self._judge_gradient_path(ran)
        if self._cleared is not None:
            stale, self._cleared = self._cleared.stale(), None
            if stale is not None:
                self._scalar("relations/stale_gradients", stale)
        for relation, count in self._effect.read(ran).items():
            self._scalar(f"relations/{relation}", count)
        if self.watching_steps and not self._stepped and self.mode == "train":
            self._leave_out_parameters()
        for path, param, info in self._late:  # the gradient its step's closure computed
            if param.grad is not None:
                self.take("gradients", path, param.grad, info.layer_class)
        if self.mode == "train" and any(c in self.active for c in PARAM_COLLECTIONS):
            idle = self._held_idle(optimizers, ran)
            for path, param, info in self._parameters_of(None):  # parameters no optimizer stepped: as they are
                if path not in self._taken and path not in idle and not self._held_in_eval(param, info):
                    self.take(parameter_collection(info.role, path), path, param, info.layer_class)
                    if param.grad is not None and not self._unfed(info):  # one no optimizer applied (or ever)
                        self.take("gradients", path, param.grad, info.layer_class)
        for path, (param, before) in self._before.items():  # into the copy: an update costs no memory of its own
            self.take("updates", path, torch.sub(param.detach(), before, out=before))
        if "losses" in self.active and loss is not None:
            self._scalar("losses/train", loss)
        if "optimizer" in self.active:
            for name, value in optimizer_state(optimizers).items():
                if self.active["optimizer"].selects(name):
                    self._scalar(f"optimizer/{name}", value)
        for name, value in (extra_scalars or {}).items():
            collection, _, path = name.partition("/")
            plan = self.active.get(collection)
            if plan is not None and plan.selects(path):
                self._scalar(name, value)
        values, tensors = self._reductions.to_host(), self._tensors
        if self._sharded:
            values = self._combined(values)
        self.active, self._reductions, self._tensors, self._before, self._taken = {}, None, {}, {}, set()
        self._late = []
        return values, tensors

    def _judge_gradient_path(self, ran) -> None:
        """relations/no_gradient_path: the parameters that ran, that an optimizer stepped, and that got no gradient
        below a cut in the graph (tripwire.plugins.torch.relations.GradientPath); named in the log once. Where
        several optimizers hold parameters and which stepped is unknown (a GAN's generator rests while its
        critic trains), not judged."""
        path, self._path = self._path, None
        path.remove()
        if self._cleared is None or ran is None and len(self._stepping) > 1 or not self.backward:
            return
        stepped = {key: p for o, params in self._stepping.items() if ran is None or o in ran
                   for key, p in params.items()}
        if not stepped:
            return
        found = path.cut_off(stepped, self._cleared.received())
        self._scalar("relations/no_gradient_path", 0 if found is None else len(found[0]))
        if found is not None and not self._told_cut:
            self._told_cut = True
            cut, below = found
            log.warning("tripwire: at step %s, %d parameter(s) that ran in the forward and that an optimizer steps "
                        "got no gradient: %s%s. Module `%s` received its input cut from the graph (.detach(), or "
                        "computed under torch.no_grad()), so the loss cannot reach what ran before it.", self.step,
                        len(cut), ", ".join(cut[:5]), f" and {len(cut) - 5} more" if len(cut) > 5 else "",
                        below or "(the model)")

    def _combined(self, values: dict) -> dict:
        """Each sharded tensor's reductions over the whole tensor (FSDP's parameters, gradients and updates): the
        ranks' shard reductions gathered, a few numbers per tensor in one all_gather_object at the sampled steps,
        which every rank reaches together, and combined (tripwire.core.reductions.combine_shards). Where the
        gather fails, each rank keeps its shard's, said once."""
        sharded, self._sharded = self._sharded, {}
        mine = {name: values[name] for name in sharded if name in values}
        try:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        except Exception as exc:  # noqa: BLE001 - a failed gather must not take training down
            if "gather" not in self._unread:
                self._unread.add("gather")
                log.warning("tripwire: the reductions of sharded parameters are this rank's shard's: gathering the "
                            "other ranks' failed (%s: %s)", type(exc).__name__, exc)
            return values
        for name, names in sharded.items():
            shards = [ranks.get(name) for ranks in gathered]
            if name in mine and all(shard is not None for shard in shards):
                values[name] = combine_shards(shards, names)
        return values

    def _leave_out_parameters(self) -> None:
        if "skipped" not in self._unread:
            self._unread.add("skipped")
            log.info("tripwire: no optimizer stepped at step %s (gradient accumulation, or a GradScaler that found "
                     "inf/NaN gradients): its weights, gradients and updates are not recorded.", self.step)
        self.active = {n: c for n, c in self.active.items() if n not in PARAM_COLLECTIONS}
        self._reductions.forget(lambda name: name.split("/", 1)[0] in PARAM_COLLECTIONS)
        self._tensors = {n: t for n, t in self._tensors.items() if n.split("/", 1)[0] not in PARAM_COLLECTIONS}
        self._before, self._late = {}, []

    def close(self) -> None:
        self._remove_hooks()
        if self._functional is not None:  # closed inside a step: what it held goes too
            self._functional.release()
        if self._cleared is not None:  # closed inside a step: its gradient hooks go too
            self._cleared.remove()
            self._cleared = None
        if self._path is not None:
            self._path.remove()
            self._path = None
        self.active = {}

    # -- helpers --------------------------------------------------------------------------------------------------
    def wants(self, collection: str) -> bool:
        """Whether the step being captured samples this collection (so the caller gathers it only then)."""
        return collection in self.active

    def take_inputs(self, tensor) -> None:
        """The batch's inputs, where they are measurements: token ids and other integers are not."""
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            self.take("inputs", "x", tensor)

    def take(self, collection: str, path: str, tensor: torch.Tensor, kind: str = "", channels: int = -1) -> None:
        """Reduce (and copy, if asked) one tensor into the sample, if its collection is sampled and selects it;
        `channels`: the axis of its output features (an activation's)."""
        plan = self.active.get(collection)
        if plan is None or not plan.selects(path, kind) or not isinstance(tensor, torch.Tensor):
            return
        name = f"{collection}/{path}" if path else collection
        try:
            reductions = plan.reductions
            if self.ranks_together and _sharded(tensor):  # FSDP: this rank's shard, with the others' in end()
                self._sharded[name], reductions = plan.reductions, shard_reductions(plan.reductions)
            self._reductions.add(name, tensor, reductions, kind, channels)
            if plan.save_tensors and (self._budget is None or self._budget.take(name, _nbytes(tensor))):
                self._tensors[name] = host_array(tensor)
        except Exception as exc:  # noqa: BLE001 - a tensor tripwire cannot read must not stop training
            self._not_captured(name, tensor, exc)

    def _scalar(self, name: str, value) -> None:
        """One number of the step (the loss, a learning rate, a metric), whatever form it comes in."""
        try:
            self._reductions.add_scalar(name, value)
        except Exception as exc:  # noqa: BLE001 - a value tripwire cannot read must not stop training
            self._not_captured(name, value, exc)

    def _not_captured(self, name: str, value, exc: Exception) -> None:
        """Say once per name that a value is not captured, and why."""
        what = f"a {value.layout} tensor of {value.dtype}" if isinstance(value, torch.Tensor) else \
            f"a {type(value).__name__}"
        self._say_once(name, f"tripwire: {name} ({what}) is not captured: "
                             f"{exc if isinstance(exc, Unsupported) else f'{type(exc).__name__}: {exc}'}.")

    def _say_once(self, name: str, message: str) -> None:
        """Log a warning of what is not captured, once per name."""
        if name not in self._unread:
            self._unread.add(name)
            log.warning("%s", message)

    def _held_idle(self, optimizers, ran) -> set:
        """The paths of the parameters held only by optimizers that did not step at this step while another did
        (`ran`: the ids of those that stepped, where known): their step did not happen, as a skipped step's did not
        (a layer that a later phase trains, as forward-forward training trains one layer after another)."""
        if not ran:
            return set()
        held = {id(_real(o)): {path for path, _, _ in self._parameters_of(o)} for o in optimizers}
        stepping = set().union(*(paths for key, paths in held.items() if key in ran))
        return set().union(*(paths for key, paths in held.items() if key not in ran)) - stepping

    def _held_in_eval(self, param, info) -> bool:
        """Whether a parameter without a gradient belongs to a layer the program holds in eval mode: frozen on
        purpose (Lightning's transfer-learning idiom: `feature_extractor.eval()`, its features computed under
        torch.no_grad(), the optimizer over every parameter), not captured as one that trains, so that no rule
        reads its standing still as a fault."""
        if param.grad is not None:
            return False
        layer = self._layers_of().get(info.layer)
        return layer is not None and not layer.training

    def _note_fed(self, layer, args) -> None:
        """A layer's forward begins: fed unless every tensor it is handed is empty."""
        tensors = batch_tensors(args)
        self._fed[id(layer)] = self._fed.get(id(layer), False) or not tensors or any(t.numel() for t in tensors)

    def _unfed(self, info) -> bool:
        """Whether the parameter's layer ran at this step on empty batches only: a Mixture of Experts' expert no
        token was routed to (conditional computation, by design), whose zero gradient and still weights at this
        step say nothing of its training."""
        return self._fed.get(id(self._layers_of().get(info.layer)), True) is False

    def _layers_of(self) -> dict:
        """Layer path -> module, as the model's structure names layers; found once."""
        if self._layers is None:
            self._layers = dict(named_modules(self.module, remove_duplicate=False))
        return self._layers

    def _parameters_of(self, optimizer) -> list:
        """(path, parameter, its Parameter) for each trainable parameter of the model this optimizer holds (all
        of them for None), in the model's order. Found again only where which parameters the optimizer holds, or
        which of them require a gradient, changed since (Lightning's BackboneFinetuning unfreezes a backbone and
        hands it to the optimizer mid-fit): a walk of a large model costs more than a sample's reductions."""
        optimizer = _real(optimizer)
        key = None if optimizer is None else id(optimizer)
        if optimizer is None:
            if self._every_parameter is None:
                self._every_parameter = list(self.module.parameters())
            held = self._every_parameter
        else:
            held = [p for group in optimizer.param_groups for p in group["params"]]
        signature = tuple(p.requires_grad for p in held)
        if key not in self._held or self._held[key][0] != signature:
            ids = {id(p) for p in held}
            self._held[key] = (signature, [(path, param, self.model.parameters[path])
                                           for path, param in named_parameters(self.module)
                                           if param.requires_grad and path in self.model.parameters
                                           and id(param) in ids])
        return self._held[key][1]

    def _hook_activations(self, plan) -> None:
        """Forward hooks on the modules whose outputs the plan selects: leaves, or any module its patterns
        name. The modules are found once, the hooks made once; they are registered for this step only."""
        if self._activation_hooks is None:
            self._activation_hooks = []
            modules = dict(named_modules(self.module))
            for path, module in modules.items():
                kind = type(module).__name__
                leaf = next(module.children(), None) is None
                if path and (plan.include or leaf) and plan.selects(path, kind):
                    producer = modules.get(self.model.activations.get(path, path) if self.model else path)
                    self._activation_hooks.append((module, self._output_hook(
                        "activations", path, kind, isinstance(producer, CHANNELS_FIRST))))
        self._hooks += [module.register_forward_hook(hook) for module, hook in self._activation_hooks]

    @property
    def producers(self) -> dict | None:
        """{activation: the layer whose output it took}, as the first training step sampled with activations whose
        forward pass ran under the hooks saw it; None before such a step."""
        return self._producers if self._seen_call else None

    def take_functional(self, result) -> None:
        """At a sampled training step, before the backward pass: the ReLUs the model applied as functions in the
        forward pass behind `result` (its output, or the loss), as `activations/<layer>:relu`
        (tripwire.plugins.torch.functional)."""
        if self._functional is None or self.mode != "train" or "activations" not in self.active:
            return
        try:
            self._functional.walk(result)
        except Exception as exc:  # noqa: BLE001 - a graph tripwire cannot walk must not stop training
            self._say_once(FUNCTIONAL_RELU, f"tripwire: the ReLUs applied as functions could not be found in the "
                                            f"autograd graph ({type(exc).__name__}: {exc}); they are not captured.")

    def _take_relu(self, layer: str, module, output: torch.Tensor) -> None:
        """The ReLU of a layer's output, which a ReLU applied as a function takes."""
        path = next_call(self._calls, layer + FUNCTIONAL_RELU)
        if path is None:
            return
        if self._made is not None:  # the first training step sampled with activations: noted as they are taken
            self._seen_call, self._producers[path] = True, layer
        try:  # called from a forward hook: a tensor tripwire cannot take must not stop training
            with torch.no_grad():
                relu = output.detach().relu()
        except Exception as exc:  # noqa: BLE001
            self._not_captured(f"activations/{path}", output, exc)
            return
        channels = 1 if isinstance(module, CHANNELS_FIRST) or output.dim() >= 4 else -1
        self.take("activations", path, relu, "ReLU", channels)

    def new_forward(self) -> None:
        """Another forward pass of the step begins (a later micro-batch of gradient accumulation): its modules'
        calls are counted from the first again, so that each micro-batch names its activations alike."""
        self._calls = {}

    def _see_producers(self) -> None:
        """For this step's forward pass: hooks that note each output of a layer with parameters (passed on through
        dropout, pooling and reshaping modules), so that each activation's hook finds the layer whose output it
        takes. Made once, at the first training step sampled with activations: a model computes alike at every step,
        and no other step pays for it."""
        self._producers, self._made, self._taking = {}, {}, {}
        for path, module in named_modules(self.module):
            if isinstance(module, PASS_THROUGH):
                self._hooks.append(module.register_forward_hook(self._passed_on))
            elif path and has_parameters(module):
                self._hooks.append(module.register_forward_hook(functools.partial(self._made_by, path)))
        # read as the call begins: an in-place activation (ReLU(inplace=True)) changes its input as it runs
        self._hooks += [module.register_forward_pre_hook(self._takes) for module, _ in self._activation_hooks
                        if is_activation(module)]

    def _made_by(self, layer: str, module, inputs, output) -> None:
        self._note_made(output[0] if isinstance(output, (tuple, list)) and output else output, layer)

    def _passed_on(self, module, inputs, output) -> None:
        layer = self._layer_of(inputs)
        if layer is not None:
            self._note_made(output, layer)

    def _note_made(self, output, layer: str) -> None:
        """Note a layer's output, where it is a tensor that keeps a version counter (one made under
        torch.inference_mode, a frozen backbone's features, keeps none: it is left out)."""
        if isinstance(output, torch.Tensor) and not output.is_inference():
            self._made[id(output)] = (weakref.ref(output), layer, output._version)

    def _takes(self, module, inputs) -> None:
        self._taking[id(module)] = self._layer_of(inputs)

    def _layer_of(self, inputs) -> str | None:
        """The layer whose output a module's first input is, as that layer made it (not changed in place since, as
        torchvision's `out += identity` changes bn2's output), where the hooks of _see_producers saw it."""
        first = inputs[0] if isinstance(inputs, tuple) and inputs else None
        made = self._made.get(id(first)) if isinstance(first, torch.Tensor) else None
        return made[1] if made is not None and made[0]() is first and first._version == made[2] else None

    def _output_hook(self, collection: str, path: str, kind: str = "", channels_first: bool = False):
        """A module's output: the first of several, or the `logits` of a mapping (a Hugging Face ModelOutput,
        which also holds the loss). Its features are axis 1 where it comes from a convolution or a normalisation
        over channels (NCHW, as any tensor of 4 or more dimensions), else the last axis (a sequence's). A module
        called several times in a forward pass is captured at each call, under a name of its own (call_path)."""
        def hook(module, inputs, output):
            tensor = output[0] if isinstance(output, (tuple, list)) else \
                output.get("logits") if isinstance(output, Mapping) else output
            if isinstance(tensor, torch.Tensor) and self._reductions is not None:
                if collection == "activations":
                    path_now = next_call(self._calls, path)
                    if path_now is None:
                        self._say_once(path, calls_left_out(path))
                        return
                    if self._made is not None:
                        self._seen_call = True
                        if (layer := self._taking.pop(id(module), None)) is not None:
                            self._producers[path_now] = layer
                else:
                    path_now = path
                channels = 1 if channels_first or tensor.dim() >= 4 else -1
                self.take(collection, path_now, tensor, kind, channels)
        return hook

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def optimizer_state(optimizers) -> dict[str, float]:
    """Learning rate and momentum of each param group: `lr`, `lr.1` for the second group, `momentum`, `beta1`."""
    out = {}
    for o, optimizer in enumerate(optimizers or ()):
        optimizer = _real(optimizer)
        for g, group in enumerate(getattr(optimizer, "param_groups", ())):
            suffix = "" if (o, g) == (0, 0) else (f".{g}" if o == 0 else f".{o}.{g}")
            for key in ("lr", "momentum", "weight_decay"):
                if isinstance(group.get(key), (int, float, torch.Tensor)):
                    out[f"{key}{suffix}"] = group[key]
            betas = group.get("betas")
            if isinstance(betas, (tuple, list)) and betas:
                out[f"beta1{suffix}"] = betas[0]
    return out


def step_closure(args: tuple, kwargs: dict):
    """The closure an optimizer's step was called with (`step(closure)`, `step(closure=...)`), or None, from the
    arguments a step pre-hook receives: args[0] is the optimizer itself."""
    return kwargs.get("closure", args[1] if len(args) > 1 else None)


def _real(optimizer):
    """The torch optimizer itself: Lightning's LightningOptimizer wraps it."""
    return getattr(optimizer, "optimizer", optimizer)


def _sharded(tensor) -> bool:
    """Whether a tensor is a DTensor sharded along one dimension over every rank (FSDP's fully_shard): its shards,
    one per rank, make the whole. A replicated one holds the whole tensor already; one on a mesh of several
    dimensions (HSDP) repeats its shards, and is read as this rank's shard."""
    if type(tensor).__name__ != "DTensor" or not (dist.is_available() and dist.is_initialized()):
        return False
    placements = tensor.placements
    return len(placements) == 1 and placements[0].is_shard() and tensor.device_mesh.size() == dist.get_world_size()


def _nbytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor's host copy takes (as dense); 0 where a tensor cannot say (nested, meta)."""
    try:
        return tensor.numel() * tensor.element_size()
    except (RuntimeError, NotImplementedError):
        return 0
