"""The zoo: realistic healthy and faulty training setups per framework, that every rule is measured on.

`make test` runs every case (tests/test_zoo.py); `make zoo` runs the longer
versions and writes the table to benchmarks/results/zoo.md (`python -m
benchmarks.zoo.run`). Cases live in one module per framework and are
collected here; a framework's module is imported only when its cases are
asked for, so the Keras cases can run on the backend a process chose.
"""

from __future__ import annotations

import importlib

from .case import Attach, Case, Outcome  # noqa: F401

MODULES = {"lightning": "torch_cases", "torch": "torch_cases", "keras": "keras_cases", "xgboost": "xgboost_cases",
           "transformers": "transformers_cases"}
FRAMEWORKS = tuple(MODULES)


def cases(framework: str | None = None) -> list[Case]:
    """Every case of one framework (or of all), in the order their modules list them."""
    out = []
    for module in dict.fromkeys(MODULES[f] for f in ([framework] if framework else FRAMEWORKS)):
        out += importlib.import_module(f"{__name__}.{module}").CASES
    return [c for c in out if framework is None or c.framework == framework]
