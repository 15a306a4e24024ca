"""Facts about a torch training step that every healthy training obeys (tripwire.core.rules.relations judges them).

- Gradients are cleared between optimizer steps: each parameter's gradient, at some backward pass of a step that
  follows an optimizer step, finds the parameter's `.grad` None or zero (`zero_grad()` ran since that step). A
  missing `zero_grad()` adds every step's gradient to all the earlier ones: the training "works", the loss goes
  down a little, and the steps grow. Seen through a hook on each trainable parameter's gradient, at sampled steps
  only: the hook notes whether `.grad` was clear when the gradient arrived (a device flag, read when the step ends,
  with the rest of the sample). Several backward passes in a step (accumulation, a GAN's two losses) are fine as
  long as one of them started from a cleared gradient.
- The model trains in train mode: a step in which an optimizer stepped, taken with the model in eval mode, runs
  its dropout and batch normalisation as at inference (no dropout, running statistics) — the usual cause being a
  validation loop's `model.eval()` not followed by `model.train()`. Read from the model's flag, at no cost. And
  it is validated in eval mode: forwards in train mode before metrics are logged as an evaluation ran with
  dropout on and batch normalisation learning from the validation data (the probe: no `model.eval()`).
- An optimizer's step has gradients to apply: at its step, some parameter it holds has a gradient that is not None
  and not all zero. None anywhere means `zero_grad()` ran between `backward()` and `step()`, or no backward pass
  reached the parameters this optimizer holds.
- An optimizer's step changes the parameters it applies a gradient to: of its few smallest parameters with a
  non-zero gradient and a learning rate above 0, copied before the step, at least one differs after it. None
  changing is a step that does nothing (overridden, skipped by a wrapper, a compiled step that never writes back).
  Values are compared, not torch's version counters: a fused optimizer writes without counting.
The last two are read at sampled steps, in one copy with the rest of the sample.
- Optimizer steps run: a GradScaler skips a step whose gradients hold Inf/NaN (a few at the start of fp16
  training, by design); steps skipped one after another, the gradients non-finite still, have no scale left to
  lower: the model is no longer updated (`overflowed`, read where the plugin counts such steps).
- The loss reaches what trains: parameters that ran in the forward and that an optimizer steps get a gradient,
  unless the graph was cut above them on purpose and they get one by another path (GradientPath).
- The batch changes from step to step, where an epoch holds more than one (BatchWatch). Across ranks, DDP replicas that
hold the same parameters: tripwire.plugins.torch.replicas.
"""

from __future__ import annotations

import logging

import torch

from .lateread import LateRead
from .reduce import local_shard
from .structure import named_modules

log = logging.getLogger("tripwire")

# Modules whose computation differs between train and eval mode: eval mode during training changes what they do.
MODE_DEPENDENT = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._BatchNorm,
                  torch.nn.modules.instancenorm._InstanceNorm)


class GradientsCleared:
    """Hooks on the trainable parameters' gradients for one step: which parameters received a gradient, and
    whether any of its arrivals found the parameter's `.grad` cleared."""

    def __init__(self, parameters):
        self._clear: dict = {}  # id(parameter) -> [bool or device bool tensor] per arrival of its gradient
        self._handles = [p.register_hook(self._hook_for(p)) for p in parameters if p.requires_grad]

    def _hook_for(self, param):
        def noted(grad):
            old = local_shard(param.grad)
            if old is None:
                clear = True
            elif old.layout != torch.strided or old.is_meta:
                clear = None  # a sparse or meta gradient: not judged
            else:
                clear = ~old.detach().any()
            self._clear.setdefault(id(param), []).append(clear)
            return None  # the gradient itself is left as it is

        return noted

    def received(self) -> set:
        """The ids of the parameters a gradient arrived at this step."""
        return set(self._clear)

    def stale(self) -> int | None:
        """Parameters whose gradient never arrived at a cleared `.grad` this step; None where no gradient arrived
        (no backward pass ran: nothing to judge). The device flags are read in one copy. Removes the hooks."""
        self.remove()
        if not self._clear:
            return None
        judged = [arrivals for arrivals in self._clear.values() if all(a is not None for a in arrivals)]
        flags = [a for arrivals in judged for a in arrivals if isinstance(a, torch.Tensor)]
        read = iter(torch.stack([f.to(flags[0].device) for f in flags]).cpu().tolist() if flags else [])
        clear = [[a if isinstance(a, bool) else next(read) for a in arrivals] for arrivals in judged]
        return sum(not any(arrivals) for arrivals in clear)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class DiscardedGradients:
    """Over the first steps, until an optimizer steps: whether a backward pass's gradients are cleared before any
    optimizer applied them. A loop that calls zero_grad() and backward() but never optimizer.step() (forgotten,
    or under a condition that never holds, or stepping another optimizer than the one holding the model) trains
    nothing while every tensor looks healthy and the loss wanders at its first level; its first steps show it:
    the gradients of one step are gone when the next step's arrive. Gradient accumulation keeps them (the next
    arrive on top), and a GradScaler skips the steps whose gradients overflowed: neither is judged. Hooks on the
    parameters' gradients at each of the first STEPS steps, and on the optimizers' steps (the one that updates:
    SAM's base optimizer), none once an optimizer stepped."""

    STEPS = 4
    IN_A_ROW = 2  # steps whose gradients were found cleared, unapplied (one could be a batch skipped on purpose)

    def __init__(self, optimizers):
        self._optimizers = [stepping(o) for o in optimizers]
        self._parameters = [p for o in self._optimizers for group in o.param_groups for p in group["params"]
                            if p.requires_grad]
        self._stepped = False  # an optimizer stepped in the current step
        self._watch: GradientsCleared | None = None
        self._kept = False  # the last step's backward left gradients that no optimizer applied, and none overflowed
        self._in_a_row = 0
        self._steps = 0  # steps ended so far (Lightning's step count stays at 0 while no optimizer steps)
        self.done = not self._parameters  # nothing to watch: no hook is made
        self._steps_hooks = [] if self.done else [o.register_step_post_hook(self._note_step) for o in self._optimizers]

    def _note_step(self, optimizer, args, kwargs) -> None:
        self._stepped = True

    def begin(self) -> None:
        """A training step begins (before its backward passes)."""
        if not self.done and self._watch is None:
            self._watch = GradientsCleared(self._parameters)

    def end(self) -> int | None:
        """The step ended: the number of parameters whose gradients were cleared unapplied, at the IN_A_ROW-th such
        step in a row; None otherwise. Once done, its hooks are gone."""
        watch, self._watch = self._watch, None
        stepped, self._stepped = self._stepped, False
        if watch is None:
            return None
        received, accumulated = watch.received(), watch.stale()  # stale(): arrivals on a .grad not cleared
        self._steps += 1
        self.done = stepped or self._steps >= self.STEPS
        found = None
        if stepped or not received:
            self._kept, self._in_a_row = False, 0
        else:
            discarded = self._kept and accumulated == 0
            self._in_a_row = self._in_a_row + 1 if discarded else 0
            self._kept = not overflowed(self._optimizers)
            if self._in_a_row >= self.IN_A_ROW:
                self.done, found = True, len(received)
        if self.done:
            self.remove()
        return found

    def remove(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        for handle in self._steps_hooks:
            handle.remove()
        self._steps_hooks = []


def stepping(optimizer):
    """The optimizer whose steps update the parameters: where one holds another that shares its param_groups, it
    hands its steps to it (SAM's second_step calls its base_optimizer's step, and its own step() is never called),
    and that one's steps are watched."""
    for inner in vars(optimizer).values() if hasattr(optimizer, "__dict__") else ():
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer and \
                inner.param_groups is getattr(optimizer, "param_groups", None):
            return stepping(inner)
    return optimizer


class GradientPath:
    """Forward hooks on the model's modules for one sampled training step: whether parameters that ran in the
    forward and that an optimizer steps got no gradient because the graph was cut above them.

    A cut shows where a module with trainable parameters, while gradients are recorded, receives a float input that
    records none and holds the values of an earlier module's output (the same storage: `features.detach()`, or
    features computed under `torch.no_grad()`): what ran upstream of that input cannot get a gradient through it.
    The raw data and masks, made by no module, are no cut. The parameters judged are those of modules whose
    forward ended before the cut, held by an optimizer that stepped, with no gradient at any backward pass of the
    step (GradientsCleared's hooks): a cut
    whose upstream still gets a gradient by another path (an online probe on detached features, truncated
    backpropagation through time) is by design, and a module whose output the loss does not use (an unused head)
    has no cut above it. Nor are the parameters of a module that ran in eval mode: the program holds it in
    inference (Lightning's transfer-learning idiom: `feature_extractor.eval()`, its features computed under
    torch.no_grad()), frozen on purpose; a whole model in eval mode is the eval_mode relation's."""

    def __init__(self, module: torch.nn.Module):
        self._ended: dict = {}  # id(parameter) -> (order of its module's first forward end, parameter path)
        self._modes: dict = {}  # id(parameter) -> whether its module ran in train mode
        self._cuts: list = []  # (module path, how many module forwards had ended when it received a cut input)
        self._made: set = set()  # the storages of the float outputs of the modules that ran
        self._done = 0  # module forwards ended so far
        self._handles: list = []
        for path, m in named_modules(module):
            own = [(f"{path}.{name}" if path else name, p) for name, p in m.named_parameters(recurse=False)
                   if p.requires_grad]
            self._handles.append(m.register_forward_hook(self._after(own)))
            if any(p.requires_grad for p in m.parameters()):
                self._handles.append(m.register_forward_pre_hook(self._before(path), with_kwargs=True))

    def _after(self, own: list):
        def ended(module, args, output):
            self._done += 1
            for path, p in own:
                self._ended.setdefault(id(p), (self._done, path))
                self._modes.setdefault(id(p), module.training)
            self._made.update(_storage(t) for t in batch_tensors(output) if t.is_floating_point())
            self._made.discard(None)
            return None

        return ended

    def _before(self, path: str):
        def received(module, args, kwargs):
            if self._done and torch.is_grad_enabled() and any(
                    t.is_floating_point() and not t.requires_grad and _storage(t) in self._made
                    for t in batch_tensors((args, kwargs))):
                self._cuts.append((path, self._done))
            return None

        return received

    def cut_off(self, stepped: dict, received: set) -> tuple[list, str] | None:
        """(paths of the parameters cut off, the module below the cut), or None where none is: `stepped`, id ->
        parameter of those held by an optimizer that stepped; `received`, the ids that got a gradient."""
        for below, done in self._cuts:
            upstream = [path for key, (ended, path) in self._ended.items()
                        if ended <= done and key in stepped and key not in received and self._modes[key]]
            if upstream:
                return upstream, below
        return None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


WITNESSES = 4  # the smallest parameters of an optimizer copied before its step, to see whether the step changed any


class StepEffect:
    """Whether each optimizer step of a sampled step had gradients to apply, and whether it changed a parameter."""

    def __init__(self):
        self._steps: list = []  # per optimizer step: (id of the optimizer, parameters held, [device flag: no
        # gradient], witnesses)

    def before(self, optimizer, parameters, rates: dict) -> None:
        """`optimizer` is about to step `parameters` (those it holds that require a gradient); `rates`: id of a
        parameter -> its group's learning rate. Notes which have no gradient, and copies the witnesses."""
        parameters = [p for p in parameters if p.requires_grad]
        if not parameters:
            return
        empty = [True if p.grad is None else _all_zero(local_shard(p.grad)) for p in parameters]
        # under FSDP each rank reads its own shard (a rank may hold none of a small parameter: no gradient there)
        candidates = sorted(((local_shard(p), local_shard(p.grad), float(rates[id(p)])) for p in parameters
                             if p.grad is not None and p.grad.layout == torch.strided and not p.is_meta and
                             p.numel() and _positive(rates.get(id(p)))), key=lambda pgr: pgr[0].numel())
        witnesses = [(p, p.detach().clone(), grad.detach().any(), _shows(p, grad, rate))
                     for p, grad, rate in candidates[:WITNESSES]]
        self._steps.append((id(optimizer), len(parameters), empty, witnesses))

    def read(self, ran: set | None = None) -> dict[str, int]:
        """{relation: count} over this sample's optimizer steps (tripwire.core.rules.relations): `no_gradients`,
        the parameters of a step none of which had a gradient; `step_changed_nothing`, the parameters with a
        gradient that a step left as they were, where it changed none of them although an update of lr x their
        largest gradient would have shown in their dtype; `update_rounds_away` (only where broken), the same
        where no such update would have shown: the rate is too low for the weights' precision. `ran`: the ids of
        the optimizers whose step ran, where the plugin knows (a GradScaler skips a step whose gradients
        overflowed, by design: it is not judged). The flags are read in one copy; a relation no step could judge
        is absent."""
        steps, self._steps = [s for s in self._steps if ran is None or s[0] in ran], []
        flags = [f for _, _, empty, witnesses in steps for f in
                 [*(e for e in empty if isinstance(e, torch.Tensor)),
                  *(t for p, before, moved, shows in witnesses for t in (moved, (p.detach() != before).any(), shows))]]
        read = iter(torch.stack([f.to(flags[0].device) for f in flags]).cpu().tolist() if flags else [])
        counts: dict = {}  # a relation no step could be judged on is absent
        gradless: dict = {}  # id(optimizer) -> [(the parameters it holds, whether a step of it had no gradient)]
        for optimizer, held, empty, witnesses in steps:  # every flag is read: a list, not a generator all() stops
            gradless.setdefault(optimizer, []).append((held, all([e if isinstance(e, bool) else next(read)  # early
                                                                  for e in empty])))  # on
            moved = [(next(read), next(read), next(read)) for _ in witnesses]
            with_gradient = [(changed, shows) for has_gradient, changed, shows in moved if has_gradient]
            if not with_gradient:
                continue
            broken = not any(changed for changed, _ in with_gradient)
            if broken and not any(shows for _, shows in with_gradient):  # every update below the weights' precision
                counts["update_rounds_away"] = counts.get("update_rounds_away", 0) + len(with_gradient)
                broken = False
            counts["step_changed_nothing"] = counts.get("step_changed_nothing", 0) + broken * len(with_gradient)
        if steps:  # an optimizer that applied a gradient at another of its steps here is not one whose gradients are
            # cleared before it steps: its step without one ran at a loss of exactly 0 (a chunk it fits exactly)
            counts["no_gradients"] = sum(held for judged in gradless.values() if all(none for _, none in judged)
                                         for held, _ in judged)
        return counts


class UpdateWatch:
    """Between samples, whether each optimizer step changed what it applied a gradient to: so that a step that
    stops updating in the middle of a run (an overridden or wrapped step that returns early, a compiled step that
    never writes back) is told within a step of its first effect, not at the next sampled step.

    One witness per optimizer: its smallest parameter with a gradient and a learning rate above 0, copied just
    before the update and compared just after it (a few operations on a bias-sized tensor). On the CPU the answer
    is read at once; on an accelerator it is read late (LateRead: at a later step, once the device got there),
    so that no step waits, and told with the step it was about. A step that left the witness unchanged although
    its gradient was not zero, and although an update of `lr x largest |gradient|` would have shown in its dtype
    (late in a schedule, or in bf16, an update can round away), is broken; two of an optimizer's steps in a row
    are told, once per run. LBFGS is not judged: a converged search step changes nothing by design.

    Most optimizers write their parameters with operations torch counts (the tensor's version goes up); some do
    not (fused Adam on the CPU, a step through `.data`). Once TRUSTED steps of an optimizer changed the witness,
    each moving its version, its version alone says whether a step wrote it: no copy, no comparison, no kernel.
    A step that leaves the version where it was is judged as unchanged (it wrote nothing), and the
    optimizer's next steps are compared again, until they earn that trust back; an optimizer whose step changed
    the witness without moving its version is compared at every step."""

    IN_A_ROW = 2
    TRUSTED = 4

    def __init__(self):
        self._candidates: dict = {}  # id(optimizer) -> (parameter count, [(parameter, its group)] smallest first)
        self._copies: dict = {}  # id(optimizer) -> (parameter, copy before the update, gradient, learning rate)
        self._kept: dict = {}  # id(optimizer) -> the tensor its witness was last copied into, written over next time
        self._judged: dict = {}  # id(optimizer) -> steps of it judged so far (dropped reads included)
        self._broken: dict = {}  # id(optimizer) -> (the last judged step's number among them, steps in a row broken)
        self._answers = LateRead(width=3, dtype=torch.float32)  # (changed or max |change|, max |grad|, max |before|)
        self._trust: dict = {}  # id(optimizer) -> its steps (since it was last compared again) that changed the
        # witness and moved its version; None where one changed it without moving it
        self._witness: dict = {}  # id(optimizer) -> (parameter, its group) last chosen, while trusted: kept as long
        # as it has a gradient and a learning rate above 0 (the choice costs more than the check it serves)
        self.told = False

    def before(self, optimizer) -> None:
        """Just before `optimizer` applies its update (its gradients computed): copy its witness. A failure turns
        the watch off for the run, said once: it must never stop the training."""
        try:
            self._before(getattr(optimizer, "optimizer", optimizer))  # Lightning's LightningOptimizer unwrapped
        except Exception as exc:  # noqa: BLE001
            self._give_up(exc)

    def after(self, optimizer, step: int) -> int | None:
        """Just after `optimizer`'s update, the training's `step`: the step at which the relation broke, the first
        time an optimizer changed nothing IN_A_ROW steps in a row (on an accelerator, known a step or a few
        later); None otherwise."""
        try:
            return self._after(getattr(optimizer, "optimizer", optimizer), step)
        except Exception as exc:  # noqa: BLE001
            self._give_up(exc)
            return None

    def _give_up(self, exc: Exception) -> None:
        self.told, self._copies = True, {}
        log.warning("tripwire: the check that optimizer steps change the parameters failed (%s: %s); it is off for "
                    "the rest of this run", type(exc).__name__, exc)

    def _before(self, optimizer) -> None:
        key = id(optimizer)
        witness = self._witness.get(key)
        if witness is not None and not self.told:  # trusted: its version will say, no copy, no choice made again
            param, group = witness
            grad, rate = param.grad, group.get("lr")
            if grad is not None and _positive(rate):
                self._copies[key] = (param, None, grad, float(rate), param._version)
                return
        self._copies.pop(key, None)
        if self.told or isinstance(optimizer, torch.optim.LBFGS):
            return
        trusted = (self._trust.get(key) or 0) >= self.TRUSTED
        for held, group in self._candidates_of(optimizer):
            param, grad = local_shard(held), local_shard(held.grad)
            if grad is None or grad.layout != torch.strided or param.is_meta or not param.is_floating_point() \
                    or not param.numel():  # an empty parameter (or a rank's empty shard) has nothing to change
                continue
            rate = group.get("lr")
            if not _positive(rate):
                continue
            self._copies[key] = (param, None if trusted else self._copy(key, param.detach()), grad, float(rate),
                                 param._version)
            if trusted and param is held:  # not a DTensor's shard, which is made anew at each read
                self._witness[key] = (param, group)
            return

    def _copy(self, key: int, value: torch.Tensor) -> torch.Tensor:
        """A copy of `value`; on the CPU into the tensor the last copy went to where it fits (about half the cost
        of a clone, which allocates), compared before the next is made. An accelerator's copy is read late, by
        kernels that may still be queued: a new one each step."""
        kept = self._kept.get(key)
        if value.device.type != "cpu":
            return value.clone()
        if kept is None or kept.shape != value.shape or kept.dtype != value.dtype:
            kept = self._kept[key] = value.clone()
            return kept
        return kept.copy_(value)

    def _after(self, optimizer, step: int) -> int | None:
        copied = self._copies.pop(id(optimizer), None)
        if copied is not None:
            param, before, grad, rate, version = copied
            key = id(optimizer)
            written = param._version != version
            if before is None and written and self._answers.idle:  # trusted, and the version says it changed:
                self._broken.pop(key, None)  # no step in a row left it unchanged (the count of steps judged that
                return None  # `_judge` keeps is for such steps in a row, which this one ends)
            judged = self._judged[key] = self._judged.get(key, 0) + 1
            payload = (key, judged, step, rate, param.dtype, written)
            if before is None:  # trusted: the version says
                if written:
                    return self._judge(self._answers.ready() + [(payload, (1.0, 0.0, 0.0))])
                self._trust[key], before = 0, param.detach()  # as it was: judged unchanged, compared from now on
                self._witness.pop(key, None)
            if param.device.type == "cpu":  # judged at once, the cheap comparison first
                changed = not torch.equal(param.detach(), before)  # one call, no tensor made (NaN counts as changed)
                answer = (1.0, 0.0, 0.0) if changed else (0.0, float(_largest(grad)), float(_largest(before)))
                return self._judge(self._answers.ready() + [(payload, answer)])
            # the largest change in place of the flag, the three in three kernels (launches cost), read late
            rows = torch.stack([param.detach() - before, grad.detach().to(before.dtype), before]).reshape(3, -1)
            self._answers.put(torch.linalg.vector_norm(rows, float("inf"), dim=1, dtype=torch.float32), payload)
        return self._judge(self._answers.ready())

    def _judge(self, answers: list) -> int | None:
        """The answers read by now, in order: a step broken where it left the witness unchanged although its
        gradient was not zero and an update of `lr x largest |gradient|` is far above the rounding of the
        witness's largest value in its dtype (16 units in the last place)."""
        for (key, judged, step, rate, dtype, written), (changed, largest_gradient, largest_value) in answers:
            if changed and self._trust.get(key, 0) is not None:  # the version moved with the change, or did not
                self._trust[key] = self._trust.get(key, 0) + 1 if written else None
            broken = changed == 0 and largest_gradient > 0 and \
                rate * largest_gradient > 16 * torch.finfo(dtype).eps * largest_value
            last, in_a_row = self._broken.get(key, (0, 0))
            in_a_row = (in_a_row + 1 if judged == last + 1 else 1) if broken else 0
            self._broken[key] = (judged, in_a_row)
            if in_a_row >= self.IN_A_ROW and not self.told:
                self.told = True
                return step
        return None

    def _candidates_of(self, optimizer) -> list:
        count = sum(len(group["params"]) for group in optimizer.param_groups)
        known = self._candidates.get(id(optimizer))
        if known is None or known[0] != count:  # built once, again where a group was added
            held = [(p, group) for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
            known = self._candidates[id(optimizer)] = (count, sorted(held, key=lambda pg: pg[0].numel()))
        return known[1]


class BatchWatch:
    """Whether the batch changes from step to step. A loader that hands the model one batch again and again (a
    `next(iter(loader))` inside the loop with shuffling off, a dataset whose __getitem__ ignores its index, an
    iterable dataset that never moves on) trains the model on that batch alone, and the loss still goes down.

    Only where the framework says an epoch holds more than one batch: a full-batch training sees the same batch at
    every step by design (a plain loop's probe tells the two apart by its loader: tripwire.plugins.torch.loaders).
    Batches the plugin sees at consecutive steps (the first steps, where such a loader first shows, and
    consecutive sampled steps) are compared: every tensor of the batch against the last batch's, at a few
    positions first and in full where those agree. On an
    accelerator the comparison waits for the device, so it is made at sampled steps only, which wait for it
    anyway. The last batch is held by reference, not copied, and only where the plugin will show the next step's;
    a batch written into the last one's memory (a loader that reuses its buffer) is not judged. Two repeats in a
    row (three equal batches) are told, once per run."""

    IN_A_ROW = 2
    POSITIONS = 16  # compared first: batches that differ almost always differ there

    def __init__(self):
        self._last = None  # (step, [tensors]) of the last batch seen
        self._repeats = 0
        self.told = False

    def see(self, step: int, batch, sampled: bool = True, next_seen: bool = True) -> bool:
        """The batch of `step` (a tensor, or tuples, lists and dicts of them): True the first time it is the
        IN_A_ROW-th repeat in a row. `sampled`: the step waits for the device anyway (batches on an accelerator
        are compared then only); `next_seen`: the plugin will show the next step's batch (else this one is let go
        at once). A failure turns the watch off for the run, said once."""
        try:
            return self._see(step, batch, sampled, next_seen)
        except Exception as exc:  # noqa: BLE001 - it runs in the training step: it must never stop it
            self.told, self._last = True, None
            log.warning("tripwire: the check that batches change failed (%s: %s); it is off for the rest of this "
                        "run", type(exc).__name__, exc)
            return False

    def _see(self, step: int, batch, sampled: bool, next_seen: bool) -> bool:
        if self.told:
            return False
        tensors = [t.detach() for t in batch_tensors(batch)]
        comparable = bool(tensors) and all(t.layout == torch.strided and not t.is_meta for t in tensors)
        judged = comparable and (sampled or all(t.device.type == "cpu" for t in tensors))
        last, self._last = self._last, ((step, tensors) if comparable and next_seen else None)
        if last is None or not judged or not 0 <= step - last[0] <= 1 or not _equal_batches(last[1], tensors):
            self._repeats = 0
            return False
        self._repeats += 1
        self.told = self._repeats >= self.IN_A_ROW
        return self.told


def batch_tensors(value) -> list:
    """Every tensor in a batch: a tensor, or tuples, lists and dicts of them, nested."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in batch_tensors(v)]
    return []


def _equal_batches(last: list, batch: list) -> bool:
    """Every tensor equal to its counterpart, held in memory of its own (not the last batch's, overwritten)."""
    if len(last) != len(batch) or any(a.shape != b.shape or a.dtype != b.dtype or a.device != b.device or
                                       a.data_ptr() == b.data_ptr() for a, b in zip(last, batch)):
        return False
    for a, b in zip(last, batch):
        flat_a, flat_b = a.reshape(-1), b.reshape(-1)
        picks = torch.linspace(0, flat_a.numel() - 1, min(BatchWatch.POSITIONS, flat_a.numel()),
                               device=a.device).long()
        if not torch.equal(flat_a[picks], flat_b[picks]):
            return False
    return all(torch.equal(a, b) for a, b in zip(last, batch))


def _shows(param: torch.Tensor, grad: torch.Tensor, rate: float) -> torch.Tensor:
    """A device flag: an update of `rate` x the gradient's largest value is far above the rounding of the
    parameter's largest value in its dtype (16 units in the last place), so a step that applied it would show."""
    if not param.is_floating_point():
        return torch.tensor(True, device=param.device)
    return rate * _largest(grad) > 16 * torch.finfo(param.dtype).eps * _largest(param)


def _largest(t: torch.Tensor) -> torch.Tensor:
    """The largest |value| of a tensor, in float32, on its device (one kernel)."""
    return torch.linalg.vector_norm(t.detach(), float("inf"), dtype=torch.float32)


def _storage(t: torch.Tensor):
    """Where a tensor's values live (a view and a detached copy share it); None where it has no storage of its own
    to compare (sparse, nested, a tensor subclass)."""
    try:
        return t.untyped_storage().data_ptr() if t.layout == torch.strided and type(t) is torch.Tensor else None
    except (RuntimeError, NotImplementedError):
        return None


def _all_zero(grad: torch.Tensor):
    """A device flag: the gradient is all zero; False (it has one) for a sparse or meta gradient, not judged."""
    if grad.layout != torch.strided or grad.is_meta:
        return False
    return ~grad.detach().any()


def _positive(rate) -> bool:
    try:
        return float(rate) > 0
    except (TypeError, ValueError):
        return False


def overflowed(optimizers) -> bool:
    """Whether a gradient the optimizers hold has an Inf or NaN: a step skipped with such gradients was skipped by
    a GradScaler, not by gradient accumulation (one pass over the gradients and one read of the answer, on an
    accelerator too: at the steps judged only)."""
    finite = [torch.isfinite(local_shard(p.grad)).all() for optimizer in optimizers
              for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return bool(finite) and not bool(torch.stack([f.to(finite[0].device) for f in finite]).all())


def train_mode_modules(model: torch.nn.Module) -> int:
    """How many modules whose computation depends on the mode are in train mode (0 where the model as a whole is
    in eval mode)."""
    if not model.training:
        return 0
    return sum(isinstance(m, MODE_DEPENDENT) and m.training for m in model.modules())


def eval_mode_modules(model: torch.nn.Module) -> int:
    """How many modules whose computation depends on the mode are in eval mode, where the model as a whole is
    (0 where it is in train mode: a module frozen in eval mode on purpose, a BatchNorm while fine-tuning, is the
    user's choice)."""
    if model.training:
        return 0
    return sum(isinstance(m, MODE_DEPENDENT) and not m.training for m in model.modules())
