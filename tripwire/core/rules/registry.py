"""Rule lookup: built-in names, or `module:Class` for a user's own rule.

Built-in rules are the named Rule subclasses defined in the modules of this
package; adding a rule is adding a class. A user's module is imported only
when their own config names it; nothing stored in a run is ever imported.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

from ..errors import TripwireError

_NOT_RULES = {"base", "engine", "registry"}


class RuleLoadError(TripwireError):
    pass


@lru_cache(maxsize=None)
def builtin_rules() -> dict[str, type]:
    from . import __path__ as package_path
    from .base import Rule

    found = {}
    for info in pkgutil.iter_modules(package_path):
        if info.name in _NOT_RULES:
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, Rule) and obj.__module__ == module.__name__ and obj.name:
                found[obj.name] = obj
    return dict(sorted(found.items()))


def rule_names() -> list[str]:
    return list(builtin_rules())


def rule_class(ref: str):
    """The Rule subclass a config's `rule:` names."""
    from .base import Rule

    if ref in builtin_rules():
        return builtin_rules()[ref]
    if ":" not in ref:
        raise RuleLoadError(f"unknown rule '{ref}'. Built-in rules: {', '.join(rule_names())}; "
                            "a rule of your own is written 'package.module:ClassName'.")
    module_name, _, attr = ref.partition(":")
    if not module_name.strip() or not attr.strip():
        raise RuleLoadError(f"'{ref}' names no rule: a rule of your own is written 'package.module:ClassName'.")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, ValueError, TypeError) as exc:  # ValueError, TypeError: not an importable name
        raise RuleLoadError(f"cannot import module '{module_name}' for rule '{ref}': {exc}. "
                            "Is it on the Python path of the training process?") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise RuleLoadError(f"module '{module_name}' has no '{attr}'.")
    if not (isinstance(cls, type) and issubclass(cls, Rule)):
        raise RuleLoadError(f"'{ref}' is not a subclass of tripwire.Rule.")
    return cls
