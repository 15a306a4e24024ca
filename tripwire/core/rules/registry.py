"""Rule lookup: built-in names, or `module:Class` for a user's own rule.

A user's module is imported only when their own config names it; nothing
stored in a run is ever imported.
"""

from __future__ import annotations

import importlib

from ..errors import TripwireError

BUILTIN = {
    "exploding_tensor": "tripwire.core.rules.tensors:ExplodingTensor",
    "vanishing_gradient": "tripwire.core.rules.gradients:VanishingGradient",
    "dead_relu": "tripwire.core.rules.activations:DeadRelu",
    "loss_not_decreasing": "tripwire.core.rules.losses:LossNotDecreasing",
    "overfit": "tripwire.core.rules.losses:Overfit",
}


class RuleLoadError(TripwireError):
    pass


def rule_names() -> list[str]:
    return sorted(BUILTIN)


def rule_class(ref: str):
    """The Rule subclass a config's `rule:` names."""
    from .base import Rule

    target = BUILTIN.get(ref)
    if target is None and ":" not in ref:
        raise RuleLoadError(f"unknown rule '{ref}'. Built-in rules: {', '.join(rule_names())}; "
                            "a rule of your own is written 'package.module:ClassName'.")
    module_name, _, attr = (target or ref).partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RuleLoadError(f"cannot import module '{module_name}' for rule '{ref}': {exc}. "
                            "Is it on the Python path of the training process?") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise RuleLoadError(f"module '{module_name}' has no '{attr}'.")
    if not (isinstance(cls, type) and issubclass(cls, Rule)):
        raise RuleLoadError(f"'{ref}' is not a subclass of tripwire.Rule.")
    return cls
