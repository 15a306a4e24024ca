"""Layers that do not train: weights no step changes, and layers frozen between trained ones (UnchangedTensor)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..model import KERNEL_ROLES
from ..naming import collection_of
from ..ranges import Range
from .base import Requirement, Rule, of_roles, schedule_ended


# Optimizers that end a step without an update once their own tolerance is met (torch's L-BFGS: the gradient below
# tolerance_grad, or a step or loss change below tolerance_change): weights that stop changing have converged.
CONVERGING = frozenset({"LBFGS"})
CONVERGED_HINT = ("The optimizer has converged: further steps change nothing. Stop here (fewer outer steps), or, "
                  "if the fit is not good enough, lower tolerance_grad / tolerance_change or change the model.")


@dataclass
class UnchangedTensor(Rule):
    """Layers that do not train: weights that no step changes, and layers frozen in the middle of a trained model."""

    num_steps: int = 3
    rtol: float = 0.0
    atol: float = 0.0
    collections: list = field(default_factory=lambda: ["weights"])
    regex: str = ""

    name = "unchanged_tensor"
    limits = {"num_steps": Range(2, what="samples: one has nothing to compare with")}
    condition = ("(a) a trainable kernel's or embedding table's values are allclose (rtol, atol; by default: equal) "
                "over its last `num_steps` samples: its full values where saved, else every captured reduction (l2, "
                "mean, min, max); not judged once the learning rate has decayed below 1/1000 of its largest value so "
                "far (the end of a schedule), an error where the learning rate has been 0 at every sample; info "
                "(finding `converged`) where the model's every optimizer ends its steps without an update once its "
                "own tolerance is met (torch's LBFGS) and each such tensor was seen changing before; (b) at the first "
                "step, from the model's structure: a frozen kernel (requires_grad False, trainable False, or held by "
                "no optimizer) with trained kernels before it, in a model that trains most of its kernel weights "
                "(fine-tuning freezes a first part, adapters leave most frozen)")
    hint = ("These layers do not train. Likely causes: their parameters are frozen by mistake (requires_grad / "
            "trainable False left over from a freezing loop) or missing from the optimizer (built before a layer "
            "was added or unfrozen), a learning rate of 0 (a schedule bug), gradients that never reach them "
            "(detached graph, dead units). Try: check requires_grad / trainable of the layers named, the "
            "optimizer's param groups (rebuild it after changing them; recompile in Keras), the learning-rate "
            "schedule, and the gradients collection for these layers.")
    source = ("smdebug UnchangedTensor: num_steps 3, rtol 1e-5, atol 1e-8 (numpy.allclose defaults). Here equality "
              "by default: a layer under a small learning rate changes by less than 1e-5 of itself per step and "
              "still trains. The structural check (b) is tripwire's.")

    def __post_init__(self):
        self._structure_judged: set = set()  # workers
        self._top_rate: dict = {}  # worker -> the largest learning rate seen (memory holds only the last samples)
        self._moved: dict = {}  # worker -> names of the tensors seen changing over `num_steps` samples

    @property
    def history(self):
        return self.num_steps

    def requires(self):
        return [*(Requirement(c, ("l2", "mean", "min", "max")) for c in self.collections),
                Requirement("optimizer", optional=True)]

    def check(self, run, step):
        found = []
        frozen = self._frozen_between_trained(run)
        if frozen:
            found.append(self.fire(step, f"{', '.join(frozen[:5])}{' …' if len(frozen) > 5 else ''} "
                                         f"{'is' if len(frozen) == 1 else 'are'} frozen while kernels before and after "
                                         "train.", finding="frozen", frozen=frozen))
        unchanged = self._unchanged(run, step)
        if unchanged:
            found.append(unchanged)
        return found or None

    def _frozen_between_trained(self, run) -> list[str]:
        """Frozen kernels with a trained kernel before and after them, where most kernel weights train; judged once
        per worker, from the structure."""
        model = run.model
        if model is None or run.default_worker in self._structure_judged:
            return []
        self._structure_judged.add(run.default_worker)
        kernels = [p for p in model.kernels(trainable=None) if p.tied_to is None]
        trained = [i for i, p in enumerate(kernels) if p.trainable]
        if not trained or 2 * sum(kernels[i].size for i in trained) < sum(p.size for p in kernels):
            return []
        return [p.path for p in kernels[trained[0] + 1:trained[-1]] if not p.trainable]

    def _unchanged(self, run, step):
        pattern = re.compile(self.regex) if self.regex else None
        names = [n for n in run.tensor_names(step=step) if collection_of(n) in self.collections
                 and (pattern is None or pattern.search(n))]
        # a kernel left out of the optimizer is captured (it has a gradient) and judged: it is what (a) is for
        names = list(of_roles(run, dict.fromkeys(names), (*KERNEL_ROLES, "embedding"), trainable_only=False))
        rate = self._rate(run, step)
        ended = schedule_ended(rate, self._top_rate, run.default_worker)  # the largest rate kept at every sample
        same = {n: self._same(run.tensor(n), step) for n in names}
        unchanged = [n for n, s in same.items() if s]
        moved = self._moved.setdefault(run.default_worker, set())
        moved.update(n for n, s in same.items() if s is False)
        if not unchanged:
            return None
        if ended:
            return None  # the schedule brought the learning rate down to about 0: the end of training
        never = rate is not None and not self._top_rate.get(run.default_worker)
        training = [n for n in names if n not in unchanged]
        optimizers = run.model.optimizers if run.model is not None else ()
        if optimizers and set(optimizers) <= CONVERGING and moved.issuperset(unchanged):
            return self.fire(step, f"{len(unchanged)} of {len(names)} tensors stopped changing after they trained: "
                                   f"{', '.join(unchanged[:5])}{' …' if len(unchanged) > 5 else ''}. "
                                   f"{' and '.join(sorted(set(optimizers)))} ends a step without an update once its "
                                   "own tolerance is met (tolerance_grad, tolerance_change): the fit has converged.",
                             severity="info", finding="converged", unchanged=unchanged, hint=CONVERGED_HINT)
        what = "the learning rate has been 0 at every sample so far" if never else \
            f"{len(training)} other tensors changed"
        return self.fire(step, f"{len(unchanged)} of {len(names)} tensors did not change over their last "
                               f"{self.num_steps} samples ({what}): {', '.join(unchanged[:5])}"
                               + (" …" if len(unchanged) > 5 else "") + ".",
                         severity="error" if never or not training else "warning",
                         finding="lr0" if never else ",".join(unchanged), unchanged=unchanged,
                         still_training=training)

    def _rate(self, run, step: int) -> float | None:
        """The first parameter group's learning rate at this step (None where the run holds none)."""
        if "optimizer/lr" not in run.tensor_names("optimizer"):
            return None
        steps, values = run.tensor("optimizer/lr").tail(None, 1)
        if not steps or steps[-1] != step:
            return None
        return values[-1]

    def _same(self, tensor, step) -> bool | None:
        """Whether the tensor's last `num_steps` samples, the newest at `step`, are alike; None where it has fewer
        or none at `step`."""
        saved = tensor.steps(tensors=True)[-self.num_steps:]
        if len(saved) == self.num_steps and saved[-1] == step:  # full values: compare them
            values = [tensor.value(s) for s in saved]
            return all(np.allclose(a, b, self.rtol, self.atol) for a, b in zip(values, values[1:]))
        compared = False
        captured = tensor.reductions()
        for reduction in ("l2", "mean", "min", "max"):  # one at a time: a tensor that trains differs in the first
            if reduction not in captured:
                continue
            steps, last = tensor.tail(reduction, self.num_steps)
            if len(steps) < self.num_steps or steps[-1] != step:
                return None
            # np.allclose's test, without its cost for a few numbers
            if not all(a == b or abs(a - b) <= self.atol + self.rtol * abs(b) for a, b in zip(last[1:], last)):
                return False
            compared = True
        return True if compared else None
