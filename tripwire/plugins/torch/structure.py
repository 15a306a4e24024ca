"""The structure of a torch model for tripwire.core.model, read from its module classes.

Shared by the Lightning callback and the plain-loop probe. A parameter's layer
type and role come from the class of the module that holds it (a
`BatchNorm2d` weight is a normalisation scale, an `LSTM`'s `weight_hh_l0` a
recurrent kernel), never from its name. What follows a layer is taken from
the order the model registers its modules, which is the order most models
compute them in; where it is not, a kernel is only judged as though its
output were not normalised.
"""

from __future__ import annotations

import math
import sys

from torch import nn

from tripwire.core.model import ModelInfo, Parameter

_NORMS = tuple(c for c in (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
                           getattr(nn, "RMSNorm", None)) if c is not None)
# Modules that pass a layer's output on without changing what follows it: skipped when looking for it.
PASS_THROUGH = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.Flatten, nn.Unflatten,
                 nn.Identity, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
                 nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd)
_ROLES = {
    "dense": {"weight": "kernel", "bias": "bias"},
    "conv": {"weight": "kernel", "bias": "bias"},
    "norm": {"weight": "norm_scale", "bias": "norm_shift"},
    "embedding": {"weight": "embedding"},
    "attention": {"in_proj_weight": "kernel", "q_proj_weight": "kernel", "k_proj_weight": "kernel",
                  "v_proj_weight": "kernel", "in_proj_bias": "bias", "bias_k": "bias", "bias_v": "bias"},
}


# Modules that wrap the user's model and add no layer of their own, with the attribute that holds it: its segment
# is left out of every path, so that a tensor is named as the user's model names it, wrapped or not
# (`net.0.weight`, not `_orig_mod.net.0.weight` under torch.compile or `module.net.0.weight` under DDP), and the
# runs of one model compare. Each class is looked up where its module is imported already: nothing is imported.
_WRAPPERS = (("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
             ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
             ("torch.nn.parallel.data_parallel", "DataParallel", "module"),
             ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper",
              "_checkpoint_wrapped_module"))


def _wrapped_under(module) -> str | None:
    """The attribute under which `module` holds the module it wraps, where it is one of the _WRAPPERS."""
    for where, name, attribute in _WRAPPERS:
        wrapper = getattr(sys.modules.get(where), name, None)
        if wrapper is not None and isinstance(module, wrapper):
            return attribute
    return None


def unwrapped(model: nn.Module) -> nn.Module:
    """The user's model inside the wrappers around it (_WRAPPERS)."""
    while (attribute := _wrapped_under(model)) is not None:
        model = getattr(model, attribute)
    return model


def called_modules(model: nn.Module) -> list[nn.Module]:
    """The modules a training loop calls: the model itself, or, where it has no forward of its own (an
    `nn.ModuleDict` holding a GAN's two networks, which the loop calls one by one), each of its children with
    parameters that has, found the same way. Empty where none has (each layer's `forward` called by hand)."""
    if getattr(model.forward, "__func__", None) is not nn.Module.forward:  # torch.compile's sets an instance's
        return [model]
    return [called for child in model.children() if next(child.parameters(), None) is not None
            for called in called_modules(child)]


def _user_path(model: nn.Module, path: str) -> str:
    """`path` of a module or parameter in `model` without the segments of the wrappers on the way (_WRAPPERS)."""
    kept, module = [], model
    for part in path.split(".") if path else ():
        if _wrapped_under(module) != part:
            kept.append(part)
        module = getattr(module, part, None)
    return ".".join(kept)


def named_modules(model: nn.Module, remove_duplicate: bool = True):
    """`model.named_modules()`, each path as the user's model names it (_user_path); a wrapper shares the path of
    the module it wraps."""
    for path, module in model.named_modules(remove_duplicate=remove_duplicate):
        yield _user_path(model, path), module


def named_parameters(model: nn.Module):
    """`model.named_parameters()`, each path as the user's model names it (_user_path)."""
    for path, param in model.named_parameters():
        yield _user_path(model, path), param


def _transposed_dense(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2, GPT): a dense layer whose weight is laid out [in, out], known by its class
    name and its `nf` (output features), so that torch alone is imported here."""
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)


def layer_type(module: nn.Module) -> str:
    if isinstance(module, nn.MultiheadAttention):
        return "attention"
    if isinstance(module, (nn.Linear, nn.Bilinear)) or _transposed_dense(module):
        return "dense"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if isinstance(module, _NORMS):
        return "norm"
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "embedding"
    if isinstance(module, (nn.RNNBase, nn.RNNCellBase)):
        return "recurrent"
    return "other"


def _role(kind: str, name: str) -> str:
    if kind == "recurrent":
        return "recurrent_kernel" if name.startswith("weight_hh") else ("bias" if name.startswith("bias") else
                                                                        "kernel")
    return _ROLES.get(kind, {}).get(name, "other")


def _fans(shape: tuple, kind: str) -> tuple[int | None, int | None]:
    """Inputs per output unit and outputs per input of a kernel laid out [out, in, *kernel] (a convolution's
    `in` is already per group), as torch's own initialisers count them."""
    if len(shape) < 2:
        return None, None
    receptive = math.prod(shape[2:]) if kind == "conv" else 1
    return int(math.prod(shape[1:]) if kind != "conv" else shape[1] * receptive), int(shape[0] * receptive)


def is_activation(module: nn.Module) -> bool:
    """ReLU, GELU, Tanh, Softmax, …: the classes of torch.nn.modules.activation but the attention layer there."""
    return type(module).__module__ == nn.modules.activation.__name__ and not isinstance(module, nn.MultiheadAttention)


def _sequence(model: nn.Module) -> list:
    """(path, module) of the layers with parameters, the normalisations and the activations, in the order the
    model registers them (the order most models compute them in)."""
    return [(path, m) for path, m in named_modules(model)
            if path and not isinstance(m, PASS_THROUGH) and
            (has_parameters(m) or isinstance(m, _NORMS) or is_activation(m))]


def has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def _followers(sequence: list) -> dict[str, str]:
    """{layer path: what follows it}: 'norm', an activation's name (lower case), or the next layer's type."""
    out = {}
    for (path, module), (_, after) in zip(sequence, sequence[1:]):
        if has_parameters(module):
            out[path] = type(after).__name__.lower() if is_activation(after) else layer_type(after)
    return out


def _activation_inputs(sequence: list) -> dict[str, str]:
    """{activation path: the layer with parameters right before it}: the layer whose output it takes."""
    out, last = {}, None
    for path, module in sequence:
        if is_activation(module) and last is not None:
            out[path] = last
        elif has_parameters(module):
            last = path
    return out


def describe(model: nn.Module, optimizers=None) -> ModelInfo:
    """Every parameter of `model` with its layer, type, role, shape and fans; frozen ones (requires_grad False,
    or held by none of `optimizers` where some are given) with trainable False; tied ones with tied_to. No optimizer
    at all (a loop that updates its parameters by hand, `p.data.add_(p.grad, alpha=-lr)`) tells nothing of which
    parameters train."""
    optimized = None
    if optimizers:
        optimized = {id(p) for o in optimizers for g in getattr(getattr(o, "optimizer", o), "param_groups", ())
                     for p in g["params"]}
    sequence = _sequence(model)
    followers = _followers(sequence)
    first: dict[int, str] = {}
    parameters = {}
    for layer, module in named_modules(model, remove_duplicate=False):
        kind = layer_type(module)
        for name, param in module.named_parameters(recurse=False):
            path = f"{layer}.{name}" if layer else name
            if path in parameters:
                continue
            role = _role(kind, name)
            fan_in, fan_out = _fans(tuple(param.shape), kind) if role in ("kernel", "recurrent_kernel") else \
                (None, None)
            if _transposed_dense(module):
                fan_in, fan_out = fan_out, fan_in
            trainable = param.requires_grad and (optimized is None or id(param) in optimized)
            parameters[path] = Parameter(path=path, layer=layer, layer_type=kind, layer_class=type(module).__name__,
                                         role=role, shape=tuple(param.shape), trainable=trainable, fan_in=fan_in,
                                         fan_out=fan_out, tied_to=first.get(id(param)),
                                         followed_by=followers.get(layer))
            first.setdefault(id(param), path)
    classes = tuple(type(getattr(o, "optimizer", o)).__name__ for o in optimizers or () if o is not None)
    scaled = type(sequence[0][1]).__name__ if sequence and isinstance(sequence[0][1], _NORMS) else ""
    return ModelInfo(type(unwrapped(model)).__name__, _in_parameter_order(model, parameters),
                     _activation_inputs(sequence),
                     classes, scaled, _running_keep(model))


def _running_keep(model: nn.Module) -> float | None:
    """The largest share of its running statistics a BatchNorm (or InstanceNorm tracking them) keeps per step,
    1 - momentum; None where there are none. momentum None is a cumulative average, which holds nothing of its
    initial values after the first step."""
    kept = [1.0 - float(m.momentum) for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats and m.momentum is not None]
    return max(kept) if kept else None


def _in_parameter_order(model: nn.Module, parameters: dict) -> dict:
    """The parameters in `named_parameters()` order, the order tripwire captures them in, then the tied aliases."""
    order = [path for path, _ in named_parameters(model)]
    return {**{p: parameters[p] for p in order if p in parameters}, **parameters}
