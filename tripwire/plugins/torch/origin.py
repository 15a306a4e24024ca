"""Where a NaN or Inf began: the first module whose output went non-finite, found by running the step's forward
once more, with a hook on every module, from the state the step's own forward ran in (before the optimizer's
update).

Anomaly mode finds it by checking every operation of every step (1.5-3x the step's time); here nothing runs on
a healthy step. The plugin notices a non-finite loss (or model output) before the optimizer applies the step,
at no more cost than the loss read it does anyway, and only then replays that one forward: the parameters,
inputs and buffers are those the NaN came from, so the module found is the one that made it, where the forward
is deterministic (dropout draws other masks in the replay). The replay changes nothing of the training: no
gradient is kept, buffers (BatchNorm's running statistics) and torchmetrics states are put back, the random
number generators are forked, Lightning's `self.log` is muted.

The facts go to the run as `origin/<module path>` in the sample of the step (tripwire.core.rules.tensors judges
them with the NaN): `nonfinite_count` of the module's output; `input_max_abs` (its input was finite: the module
made the NaN, an overflow if this is near the dtype's largest value) or `input_nonfinite_count` (its input held
NaN/Inf already: the data, or an operation outside the modules); `weight_nonfinite_count` where its own
parameters hold NaN/Inf (an earlier update). `origin/forward` is the model's own forward (an operation between
its submodules), `origin/loss` the loss computed from a finite model output (`output_max_abs`).
"""

from __future__ import annotations

import logging
import math
import sys

import torch

from tripwire.core.rules.origins import OWN_FORWARD, loss_facts, origin_facts

from .structure import named_modules, unwrapped

log = logging.getLogger("tripwire")


def find_origin(model: torch.nn.Module, forward, *, computes_loss: bool = False) -> dict:
    """{`origin/<path>`: facts} of the first module, in the order their forward passes end, whose output holds
    NaN/Inf, running `forward()` (the step's forward again) once; {} where the replay found none or failed.

    computes_loss: `forward` computes the loss too (Lightning's training step, a Transformers model given its labels),
    which was not finite: where every module's output was (the model's own aside), the loss computation is where it
    began (`origin/loss`, with the largest |value| of the output of the last of the model's parts with parameters
    to run)."""
    names = {module: path for path, module in named_modules(model)}
    parts = {module for module in unwrapped(model).children() if next(module.parameters(), None) is not None}
    found: dict = {}
    last = []  # the output of the last part to run

    def seen(module, args, kwargs, output):
        if found or (computes_loss and module is model):  # a model that computes its loss (Transformers'): where
            return  # its parts' outputs were finite, the loss is where it began
        if module in parts:
            last[:] = [output]
        bad = nonfinite_count(output)
        if not bad:
            return
        given = nonfinite_count((args, kwargs))
        found.update(origin_facts(names.get(module) or OWN_FORWARD, bad, given, 0.0 if given else
                                  max_abs((args, kwargs)),
                                  sum(nonfinite_count(p) for p in module.parameters(recurse=False))))

    handles = [module.register_forward_hook(seen, with_kwargs=True) for module in names]
    kept = _KeptState(model)
    try:
        with _forked_random_state(model), torch.no_grad(), _MutedLogging(model):
            forward()
    except Exception as exc:  # noqa: BLE001 - a replay that fails (a backward under no_grad) ends the look there
        log.debug("tripwire: the replay of the non-finite step stopped: %s: %s", type(exc).__name__, exc)
    finally:
        for handle in handles:
            handle.remove()
        kept.restore()
    if not found and computes_loss and last:
        return loss_origin(last[0])
    return found


def loss_origin(output) -> dict:
    """The facts for a non-finite loss made from a finite model output (its largest |value| where it can be
    read)."""
    try:
        top = max_abs(output)
    except Exception as exc:  # noqa: BLE001 - an output tripwire cannot read leaves the fact out
        log.debug("tripwire: the model's output could not be read: %s: %s", type(exc).__name__, exc)
        top = None
    return loss_facts(top)


def tensors_in(value) -> list:
    """The floating-point tensors in a forward's arguments or output: a tensor, or tuples, lists and dicts (a
    Hugging Face ModelOutput is one) of them, nested."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() or value.is_complex() else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


def nonfinite_count(value) -> int:
    """NaN/Inf values in the tensors of `value` (sparse and meta tensors left out)."""
    return sum(int((~torch.isfinite(t.detach())).sum()) for t in tensors_in(value)
               if t.layout == torch.strided and not t.is_meta and t.numel())


def max_abs(value) -> float:
    """The largest |value| over the finite values of the tensors of `value` (0.0 where they hold none)."""
    tops = [float(torch.where(torch.isfinite(t), t.abs(), torch.zeros_like(t.abs())).max())
            for t in (t.detach() for t in tensors_in(value)) if t.layout == torch.strided and not t.is_meta
            and t.numel() and not t.is_complex()]
    return max(tops, default=0.0)


def finite_on_host(value) -> bool | None:
    """Whether the tensors of a model's output hold only finite values, read at once where they are on the CPU
    (one sum each: about the cost of reading a loss); None where they are on an accelerator (reading them would
    wait for it) or hold nothing to judge."""
    tensors = [t for t in tensors_in(value) if t.layout == torch.strided and not t.is_meta and t.numel()]
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return None
    total = sum(float(t.detach().sum()) for t in tensors)
    return math.isfinite(total) or nonfinite_count(tensors) == 0  # a sum of finite values may overflow


def _forked_random_state(model: torch.nn.Module):
    """fork_rng over the CPU's generator and those of the accelerator the model's parameters are on: a dropout on a
    GPU draws from the GPU's generator, and a replay that advanced it would change every later step's masks."""
    devices = {p.device for p in model.parameters() if p.device.type not in ("cpu", "meta")}
    if not devices:
        return torch.random.fork_rng(devices=[])  # the CPU's alone (a device_type of None fails before torch 2.12)
    device_type = min(d.type for d in devices)  # one accelerator type
    return torch.random.fork_rng(devices=sorted({d.index or 0 for d in devices if d.type == device_type}),
                                 device_type=device_type)


class _KeptState:
    """What a replay of a forward could change, kept to put back: buffers (BatchNorm's running statistics and
    batch count), which gradient tensor each parameter holds, and torchmetrics' accumulated states (a metric
    updated in the training step)."""

    def __init__(self, model: torch.nn.Module):
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        # references, not copies (a copy of every gradient would double their memory): the replay runs with
        # gradients off, and at most a zero_grad() in Lightning's closure sets them to None
        self.grads = [(p, p.grad) for p in model.parameters()]
        metric = getattr(sys.modules.get("torchmetrics"), "Metric", None)
        self.metrics = [(m, m.__dict__.copy(), {k: _copied(getattr(m, k)) for k in m._defaults})
                        for m in model.modules() if metric is not None and isinstance(m, metric)]

    def restore(self) -> None:
        """Puts back what the replay changed, and only that: writing into a tensor the step's backward still needs
        (a position-ids buffer, where the replay runs before the backward pass) would break that backward."""
        with torch.no_grad():
            for buffer, value in self.buffers:
                if not torch.equal(buffer, value):
                    buffer.copy_(value)
            for param, grad in self.grads:
                if param.grad is not grad:
                    param.grad = grad
        for metric, attributes, states in self.metrics:
            metric.__dict__.update(attributes)
            for name, value in states.items():
                setattr(metric, name, value)


def _copied(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value


class _MutedLogging:
    """Lightning's `self.log` / `self.log_dict` do nothing during the replay: the step logged its values once."""

    def __init__(self, model):
        self.model = model
        self.muted = ["log", "log_dict"] if callable(getattr(type(model), "log_dict", None)) else []

    def __enter__(self):
        for name in self.muted:
            self.model.__dict__[name] = _nothing
        return self

    def __exit__(self, *exc):
        for name in self.muted:
            self.model.__dict__.pop(name, None)
        return False


def _nothing(*args, **kwargs) -> None:
    return None
