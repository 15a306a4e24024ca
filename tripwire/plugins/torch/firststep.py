"""What a torch training step does with its loss, seen once, at the first step (tripwire.core.firststep).

`LossSpy` is a torch function mode: while it is active, every torch function the step calls passes through it.
It notes which operation produced each tensor (following views and reshapes back to the operation that made the
values), and, for each loss function called (`F.cross_entropy`, `nn.BCELoss`, `F.mse_loss`, …), what produced its
input, the input's class dimension and the targets. It is active for the first sampled step's forward pass and
loss only: no other step pays for it. Where the loop says when that step begins (the probe: at the end of the step
before it), the spy is armed from there: it follows only which tensors are computed from a parameter, until the
model's training forward begins the look, so that a DQN's target, computed by its target network before the
model's forward, is known for the model's own.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import warnings
import weakref
from dataclasses import replace

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from tripwire.core.firststep import READS, FirstStep, loss_use

from .objectives import Objectives

log = logging.getLogger("tripwire")

# Operations whose output is the activation named (the rest of the output layer's operations are linear maps).
PRODUCERS = {"softmax": "softmax", "log_softmax": "log_softmax", "sigmoid": "sigmoid", "tanh": "tanh",
             "relu": "relu", "linear": "linear", "addmm": "linear", "matmul": "linear", "conv1d": "linear",
             "conv2d": "linear", "conv3d": "linear", "bilinear": "linear", "einsum": "linear", "mm": "linear",
             "bmm": "linear"}
# Operations that pass their input's values on, rearranged or cast: the producer is the input's.
PASS_ON = {"__getitem__", "squeeze", "unsqueeze", "view", "reshape", "flatten", "contiguous", "float", "double",
           "half", "bfloat16", "to", "type_as", "permute", "transpose", "t", "clone", "view_as", "reshape_as",
           "select", "narrow", "expand", "expand_as", "unflatten", "movedim"}
# Where the code of torch and of tripwire lies: a warning raised under the look is the caller's below both.
_OWN_CODE = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["tripwire"]))
# Class dimension of a loss's input: 1 for the categorical losses (N, C, …), the last for the others.
CLASS_DIM = {"cross_entropy": 1, "nll_loss": 1}
# Losses of the distance between their two arguments: either may be the model's output (F.mse_loss(x, model(x))).
SYMMETRIC = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss")
# Operations that read no value of their input, only its shape, dtype and device: what they make is not computed
# from a parameter, whatever they are given (the targets of torch.ones_like(prediction)).
SHAPE_ONLY = {"ones_like", "zeros_like", "full_like", "empty_like", "rand_like", "randn_like", "randint_like",
              "new_ones", "new_zeros", "new_full", "new_empty", "new_tensor", "size", "dim", "numel"}
FOLLOWED = 10_000  # tensors computed from a parameter followed, at least, before the freed ones are forgotten
# Operations that draw random values from the distribution their input gives (torch.distributions' samples): drawn
# from the model's output, they are the model's own choices (a policy's actions)
SAMPLING = {"multinomial", "bernoulli", "normal", "poisson"}


class LossSpy(TorchFunctionMode):
    def __init__(self, model: torch.nn.Module | None = None, looking: bool = True):
        """model: the module trained. A tensor computed from its parameters, or from any parameter that takes a
        gradient, is the model's making (a target network's, a teacher's being trained too); from a frozen
        parameter outside it, a fixed network's (fast neural style's frozen VGG features): those targets stay
        put as the model trains. Every parameter counts where `model` is None.
        looking: False arms the spy: it follows which tensors are computed from a parameter, until `look()`."""
        super().__init__()
        self._own = None if model is None else {id(p) for p in model.parameters()}
        self.losses: list = []
        self._made_by: dict = {}  # id(tensor) -> (weak reference, producing activation, softmax over one unit)
        self._reshaped: dict = {}  # id(2-D tensor) -> (weak reference, the shape of 3 or more axes it was viewed from)
        self._from_model: dict = {}  # id(tensor) -> weak reference, for the tensors computed from a parameter
        self._followed = FOLLOWED  # how many, before the freed ones are forgotten
        self.looking = looking
        self.done = False
        self.samples_own = False  # the step drew samples from the model's output (FirstStep.samples_own_output)

    def look(self) -> None:
        """The step's training forward begins: from here, the loss and what produced its input are seen too."""
        self.looking = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.done:
            return func(*args, **kwargs)
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            out = func(*args, **kwargs)
        for warning in raised:  # from the user's line, as without the look: not from this one, and not twice
            _warn_from_caller(warning)
        try:
            self._note(getattr(func, "__name__", ""), args, kwargs, out)
        except Exception as exc:  # noqa: BLE001 - a look at the step must never change it
            log.debug("tripwire: first-step look at %s failed: %s", func, exc)
        return out

    def _note(self, name: str, args, kwargs, out) -> None:
        if name in READS and self.looking:
            self._loss(name, args, kwargs)
        if name in SAMPLING and self.looking and self._computed_from_model(args, kwargs):
            self.samples_own = True
        if name not in SHAPE_ONLY and self._computed_from_model(args, kwargs):
            if len(self._from_model) >= self._followed:  # armed over a long stretch of the loop: forget the freed
                self._from_model = {key: ref for key, ref in self._from_model.items() if ref() is not None}
                self._followed = max(FOLLOWED, 2 * len(self._from_model))
            for tensor in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(tensor, torch.Tensor):
                    self._from_model[id(tensor)] = weakref.ref(tensor)
        if not isinstance(out, torch.Tensor) or not self.looking:
            return
        self._note_reshape(name, args, out)
        if name in PRODUCERS:
            over_one = name == "softmax" and _softmax_over_one(out, args, kwargs)
            self._made_by[id(out)] = (weakref.ref(out), PRODUCERS[name], over_one, _softmax_axis(name, out, args,
                                                                                                  kwargs))
        elif name in PASS_ON and args and isinstance(args[0], torch.Tensor):
            made = self._producer(args[0])
            if made is not None:  # a reshape moves the axes: which one the softmax ran over is no longer known
                self._made_by[id(out)] = (weakref.ref(out), *made[:2], None)

    def _note_reshape(self, name: str, args, out: torch.Tensor) -> None:
        """A view of a tensor of 3 or more axes as rows (B, C, T viewed as -1, C), and what passes it on as it is
        (contiguous, a cast): where a categorical loss reads such rows, where the classes lay before matters."""
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is None or name not in PASS_ON:
            return
        if name in ("view", "reshape") and source.dim() >= 3 and out.dim() == 2:
            self._reshaped[id(out)] = (weakref.ref(out), tuple(int(d) for d in source.shape))
        elif out.shape == source.shape and (entry := self._reshaped.get(id(source))) and entry[0]() is source:
            self._reshaped[id(out)] = (weakref.ref(out), entry[1])

    def _computed_from_model(self, args, kwargs) -> bool:
        """Whether an operation reads one of the model's parameters (__init__), or a tensor computed from one
        (one level into lists)."""
        for value in (*args, *kwargs.values()):
            for item in (value if isinstance(value, (tuple, list)) else (value,)):
                if isinstance(item, torch.nn.Parameter) and (self._own is None or item.requires_grad or
                                                             id(item) in self._own) or self._is_from_model(item):
                    return True
        return False

    def _is_from_model(self, tensor) -> bool:
        ref = self._from_model.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        return ref is not None and ref() is tensor

    def _producer(self, tensor) -> tuple | None:
        entry = self._made_by.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return None
        return entry[1:]

    def _loss(self, name: str, args, kwargs) -> None:
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        prediction = kwargs.get("input", inputs[0] if inputs else None)
        target = kwargs.get("target", inputs[1] if len(inputs) > 1 else None)
        if not isinstance(prediction, torch.Tensor):
            return
        if name in SYMMETRIC and isinstance(target, torch.Tensor) and target.requires_grad and \
                not prediction.requires_grad:  # F.mse_loss(x, model(x)): the model's output is the prediction
            prediction, target = target, prediction
        made = self._producer(prediction)
        dim = CLASS_DIM.get(name, -1)
        if prediction.dim() >= 2:  # outputs per sample: the class dimension; a 1-D output is one per sample
            units = int(prediction.shape[dim])
        else:
            units = 1 if prediction.dim() == 1 and dim == -1 else None
        labels = target.detach().to("cpu").numpy() if isinstance(target, torch.Tensor) and \
            target.layout == torch.strided and not target.is_meta else None
        settings = {k: v for k, v in kwargs.items() if k in ("reduction", "label_smoothing", "ignore_index")}
        terms = _summed_terms(name, prediction, target) if settings.get("reduction") == "sum" else None
        axes = {}
        if made is not None and made[2] is not None and name in CLASS_DIM and prediction.dim() >= 2:
            axes = {"softmax_axis": made[2], "class_axis": CLASS_DIM[name] % prediction.dim()}
        reshaped = self._reshaped.get(id(prediction))
        if reshaped is not None and reshaped[0]() is prediction and name in CLASS_DIM:
            axes["reshaped_from"] = reshaped[1]
        weight = kwargs.get("weight")  # a categorical loss's weight per class (a binary loss's is per element)
        if isinstance(weight, torch.Tensor) and weight.dim() == 1 and name in CLASS_DIM:
            axes["zero_weight"] = tuple(torch.nonzero(weight == 0).flatten().tolist()) or None
        use = loss_use(name, made[0] if made else None, units, bool(made and made[1]), labels, terms,
                       bootstrapped=_bootstrapped(target, self._is_from_model(target)),
                       input_shape=tuple(int(d) for d in prediction.shape), **axes, **settings)
        if use is not None:
            self.losses.append(use)

    def finish(self, step: int) -> FirstStep:
        """Stop looking (leaving the mode where it is still the innermost one) and give what was seen."""
        self.done = True
        stack = _get_current_function_mode_stack()
        if stack and stack[-1] is self:
            self.__exit__(None, None, None)
        elif self in stack:  # a mode the step entered is still on top: this one passes everything through
            log.debug("tripwire: the first-step look stays under another torch function mode")
        self._made_by, self._from_model, self._reshaped = {}, {}, {}
        return FirstStep(step, tuple(self.losses), samples_own_output=self.samples_own)


def _bootstrapped(target, from_model: bool) -> bool:
    """Whether a loss's target is the model's own making: computed from a parameter with no gradient through it
    (under no_grad or detached: a TD target from a target network, a teacher's or a momentum encoder's output; the
    spy counts a frozen network's outside the model as data). One that takes a gradient is a second output of the
    model trained against the first (a siamese pair)."""
    return from_model and isinstance(target, torch.Tensor) and not target.requires_grad


def _summed_terms(name: str, prediction: torch.Tensor, target) -> int | None:
    """The terms a torch loss with reduction="sum" adds up: one per element of its target, or, for a categorical
    loss handed class probabilities (a target shaped as its input), one per row of them."""
    if not isinstance(target, torch.Tensor):
        return None
    if name in CLASS_DIM and target.shape == prediction.shape and target.dim() >= 2:
        return target.numel() // max(int(target.shape[CLASS_DIM[name]]), 1)
    return target.numel()


def _warn_from_caller(warning) -> None:
    """Issue a warning a torch function raised under the look again, from the first frame of the caller's code
    (outside torch and tripwire), with that module's registry: the filters and the once-per-line rule apply as
    they would have, and the same warning at the next step, not looked at, is the same line's."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_CODE):
        frame = frame.f_back
    if frame is None:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        return
    module_globals = frame.f_globals
    warnings.warn_explicit(warning.message, warning.category, frame.f_code.co_filename, frame.f_lineno,
                           module=module_globals.get("__name__"),
                           registry=module_globals.setdefault("__warningregistry__", {}),
                           module_globals=module_globals)


def _softmax_axis(name: str, out: torch.Tensor, args, kwargs) -> int | None:
    """The axis (from 0) a softmax or log_softmax normalised over, where its call says."""
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None) if name in ("softmax", "log_softmax") else None
    return dim % out.dim() if isinstance(dim, int) and out.dim() > 0 else None


def _softmax_over_one(out: torch.Tensor, args, kwargs) -> bool:
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    return isinstance(dim, int) and out.dim() > 0 and out.shape[dim] == 1


def look_once(owner, method: str, step: int, seen, optimizers=()) -> None:
    """Run the next call of `owner.<method>` (a LightningModule's training_step, a Transformers model's forward)
    under a LossSpy, once, and hand what it saw to `seen(FirstStep)`; the method is put back as it was before
    that call runs, so every later call is the user's own. The wrapper keeps the method's signature (the Trainer
    reads forward's to pick the columns it feeds). Where `optimizers` are given, the FirstStep says how many
    objectives the call trained in turn (tripwire.plugins.torch.objectives: a manual-optimisation GAN's steps
    run inside its training_step)."""
    spy, own = LossSpy(owner if isinstance(owner, torch.nn.Module) else None), owner.__dict__.get(method)
    original = getattr(owner, method)

    @functools.wraps(original)
    def looked_at(*args, **kwargs):
        if own is None:
            delattr(owner, method)
        else:
            setattr(owner, method, own)
        objectives, hooks = Objectives(optimizers), []
        try:
            for o in optimizers:
                hooks += [o.register_step_pre_hook(objectives.before), o.register_step_post_hook(objectives.after)]
        except Exception as exc:  # noqa: BLE001 - an optimizer of another kind (a strategy's wrapper): not counted
            objectives.fail(exc)
        try:
            with spy:
                out = original(*args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        facts = spy.finish(step)
        seen(replace(facts, objectives=objectives.count) if optimizers else facts)
        return out

    setattr(owner, method, looked_at)
