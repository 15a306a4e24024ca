"""The tripwire configurations the overhead benchmarks compare, shared by the Lightning and plain-loop families.

None is the packaged default (rules.yaml: everything its rules read every 100
steps, and weights and gradients in the first 10). The others capture every step and run no rules, so
that they measure capture and writing alone.
"""

DEFAULT = None
PARAMS = ("weights", "biases", "gradients")

EVERY_STEP = {
    "w+g reductions every step": {"sampling": {"every": 1}, "collections": {c: {} for c in PARAMS}},
    "w+g full tensors every step": {"sampling": {"every": 1},
                                    "collections": {c: {"save": "tensors"} for c in PARAMS}},
    "activations every step": {"sampling": {"every": 1}, "collections": {"activations": {}}},
}
