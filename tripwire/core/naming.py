"""Tensor names and collections.

A tensor's name is `collection/path`, where the path is the framework's own
(`named_parameters()`, Keras variable paths, XGBoost feature names).
"""

from __future__ import annotations

import re

MODES = ("train", "eval", "predict")
# what a reader accepts as a mode from a stored run: a mode names folders (`tripwire export`), so never a path
MODE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")

# Every collection a plugin can fill. Scalar collections hold one number per
# step, stored under the reduction name "value"; the others hold tensors.
COLLECTIONS = {
    "weights": "trainable parameters that are not biases",
    "biases": "trainable bias parameters",
    "gradients": "gradients of the trainable parameters, read before the optimizer step",
    "updates": "the change of each parameter over the step (after minus before the optimizer step)",
    "activations": "outputs of the selected layers/modules",
    "losses": "the training loss (and eval loss where the framework reports one)",
    "metrics": "metrics the framework logs (Lightning callback_metrics, Keras logs, XGBoost evals_log)",
    "optimizer": "optimizer state: learning rate, momentum",
    "inputs": "the batch inputs",
    "labels": "the batch labels",
    "predictions": "the model's predictions for the batch",
    "custom": "tensors the user hands to the callback's save_tensor()",
    "trees": "XGBoost per-round tree statistics: depth, leaves, splits",
    "feature_importance": "XGBoost feature importance by type",
    "relations": "facts every healthy training step obeys, as counts of what broke them (0: held)",
}
SCALAR_COLLECTIONS = frozenset({"losses", "metrics", "optimizer", "trees", "feature_importance", "relations"})
VALUE = "value"  # the reduction name under which scalars are stored
CALL = "#"  # between a module's path and the number of its call in a forward pass (call_path)
CALLS_KEPT = 16  # the calls of one module in a forward pass that are captured, each under a name of its own


def collection_of(name: str) -> str:
    """The collection part of a tensor name (`gradients/net.0.weight` -> `gradients`)."""
    return name.split("/", 1)[0]


def path_of(name: str) -> str:
    """The framework path part of a tensor name (`gradients/net.0.weight` -> `net.0.weight`)."""
    return name.split("/", 1)[1] if "/" in name else name


def call_path(path: str, call: int) -> str | None:
    """The path under which the `call`-th call (from 1) of one module or layer in a forward pass is captured: its
    own path for the first, `path#<call>` for the others (a shared ReLU, torchvision's BasicBlock.relu, runs two or
    three times per forward, each on another layer's output); None past the CALLS_KEPT-th (a cell that a loop calls
    at every time step), so that what a step captures stays bounded."""
    return path if call == 1 else f"{path}{CALL}{call}" if call <= CALLS_KEPT else None


def next_call(calls: dict, path: str) -> str | None:
    """Count one more call of the module at `path` in `calls` ({path: calls so far in this forward pass}) and
    give the path it is captured under (call_path)."""
    calls[path] = calls.get(path, 0) + 1
    return call_path(path, calls[path])


def calls_left_out(path: str) -> str:
    """What the log says, once, of a module called more than CALLS_KEPT times in one forward pass."""
    return (f"tripwire: {path} is called more than {CALLS_KEPT} times in one forward pass; its first {CALLS_KEPT} "
            f"calls are captured ({path}, {path}{CALL}2, …), the others are not.")


def is_bias(path: str) -> bool:
    """Whether a parameter path names a bias (`net.0.bias`, `dense/bias`): it goes to `biases/`, not `weights/`."""
    return "bias" in path.replace("/", ".").rsplit(".", 1)[-1]
