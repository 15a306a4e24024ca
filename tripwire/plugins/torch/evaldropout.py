"""Dropout applied as a function with its `training` flag on, while the model evaluates.

`model.eval()` turns off the dropout modules (nn.Dropout reads `self.training`); a dropout applied as a function,
`F.dropout(x, 0.5)`, takes `training=True` by default and knows nothing of the model's mode: the evaluation
drops units at random, its metrics are noisier and worse than the model, and nothing fails. The first
evaluation forward is watched under a torch function mode for such calls; nothing is watched after it.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

F = torch.nn.functional
# F.dropout's (input, p, training, inplace) and its kin's, whose `training` defaults to True
FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}


class DropoutInEval(TorchFunctionMode):
    """Counts the dropout functions called with `training` on and a p above 0 while it is entered."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.done = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.done and func in FUNCTIONS and _drops(args, kwargs):
            self.calls += 1
        return func(*args, **kwargs)

    def leave(self) -> int:
        """Stop watching (where this mode is still the innermost one: a mode the forward entered and left in place
        stays above it, and this one then passes everything through); the calls seen."""
        self.done = True
        stack = _get_current_function_mode_stack()
        if stack and stack[-1] is self:
            self.__exit__(None, None, None)
        return self.calls


def _drops(args, kwargs) -> bool:
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    training = kwargs.get("training", args[2] if len(args) > 2 else True)
    return bool(training) and isinstance(p, (int, float)) and p > 0
