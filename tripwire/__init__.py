"""tripwire: a debugger for machine-learning training.

Add a plugin's `TripwireCallback` to your trainer; read runs with `open_run`.
Attributes load on first use, so `import tripwire` stays fast.
"""

from __future__ import annotations

__version__ = "0.1.0"

_EXPORTS = {
    "load_config": "tripwire.core.config",
    "Config": "tripwire.core.config",
    "open_run": "tripwire.core.run",
    "Run": "tripwire.core.run",
    "compare": "tripwire.core.compare",
    "Verdict": "tripwire.core.verdict",
    "Rule": "tripwire.core.rules.base",
    "Requirement": "tripwire.core.rules.base",
    "TripwireError": "tripwire.core.errors",
    "ConfigError": "tripwire.core.errors",
    "RunNotFound": "tripwire.core.errors",
    "RunDamaged": "tripwire.core.errors",
    "TensorUnavailable": "tripwire.core.errors",
    "StepUnavailable": "tripwire.core.errors",
    "OutsideRun": "tripwire.core.errors",
    "StorageError": "tripwire.core.errors",
    "StoreUnavailable": "tripwire.core.errors",
    "RuleFired": "tripwire.core.errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tripwire' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
