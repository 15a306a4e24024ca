"""Facts about a torch training step that every healthy training obeys (tripwire.core.rules.relations judges them).

- Gradients are cleared between optimizer steps: each parameter's gradient, at some backward pass of a step that
  follows an optimizer step, finds the parameter's `.grad` None or zero (`zero_grad()` ran since that step). A
  missing `zero_grad()` adds every step's gradient to all the earlier ones: the training "works", the loss goes
  down a little, and the steps grow. Seen through a hook on each trainable parameter's gradient, at sampled steps
  only: the hook notes whether `.grad` was clear when the gradient arrived (a device flag, read when the step ends,
  with the rest of the sample). Several backward passes in a step (accumulation, a GAN's two losses) are fine as
  long as one of them started from a cleared gradient.
- The model trains in train mode: a step in which an optimizer stepped, taken with the model in eval mode, runs
  its dropout and batch normalisation as at inference (no dropout, running statistics) — the usual cause being a
  validation loop's `model.eval()` not followed by `model.train()`. Read from the model's flag, at no cost.
"""

from __future__ import annotations

import torch

# Modules whose computation differs between train and eval mode: eval mode during training changes what they do.
MODE_DEPENDENT = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._BatchNorm,
                  torch.nn.modules.instancenorm._InstanceNorm)


class GradientsCleared:
    """Hooks on the trainable parameters' gradients for one step: which parameters received a gradient, and
    whether any of its arrivals found the parameter's `.grad` cleared."""

    def __init__(self, parameters):
        self._clear: dict = {}  # id(parameter) -> [bool or device bool tensor] per arrival of its gradient
        self._handles = [p.register_hook(self._hook_for(p)) for p in parameters if p.requires_grad]

    def _hook_for(self, param):
        def noted(grad):
            old = param.grad
            if old is None:
                clear = True
            elif old.layout != torch.strided or old.is_meta:
                clear = None  # a sparse or meta gradient: not judged
            else:
                clear = ~old.detach().any()
            self._clear.setdefault(id(param), []).append(clear)
            return None  # the gradient itself is left as it is

        return noted

    def stale(self) -> int | None:
        """Parameters whose gradient never arrived at a cleared `.grad` this step; None where no gradient arrived
        (no backward pass ran: nothing to judge). The device flags are read in one copy. Removes the hooks."""
        self.remove()
        if not self._clear:
            return None
        judged = [arrivals for arrivals in self._clear.values() if all(a is not None for a in arrivals)]
        flags = [a for arrivals in judged for a in arrivals if isinstance(a, torch.Tensor)]
        read = iter(torch.stack([f.to(flags[0].device) for f in flags]).cpu().tolist() if flags else [])
        clear = [[a if isinstance(a, bool) else next(read) for a in arrivals] for arrivals in judged]
        return sum(not any(arrivals) for arrivals in clear)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def eval_mode_modules(model: torch.nn.Module) -> int:
    """How many modules whose computation depends on the mode are in eval mode, where the model as a whole is
    (0 where it is in train mode: a module frozen in eval mode on purpose, a BatchNorm while fine-tuning, is the
    user's choice)."""
    if model.training:
        return 0
    return sum(isinstance(m, MODE_DEPENDENT) and not m.training for m in model.modules())
