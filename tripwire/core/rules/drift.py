"""How the kernels' weights moved over a run: the distance their steps travelled and how their norm moved along
the way. A model leaving the flat plateau a small initialisation or a saddle starts it on drifts one way, faster
and faster, before its loss shows it; steps that learn nothing that holds go every way and cancel, or fit what
little they can at a steady pace (loss_not_decreasing's `slow` finding).
"""

from __future__ import annotations

import numpy as np

from ..model import KERNEL_ROLES
from .base import of_roles, values_at

DRIFT = 0.03  # of the distance the kernels' steps travelled, by which their norm grew: a drift, not a random walk
SPEEDUP = 2.0  # times the norm's growth over the first half of the steps, over the second: a drift that speeds up


class Drift:
    """How far the kernels' steps travelled since the first sample that held their weights and updates (each
    sample's update norm times the steps since the one before), and how their norm moved along the way: a drift
    (the norm moved by a fair share of the travel), not a random walk (by about step / 2‖w‖ of it); and one that
    speeds up (a model leaving a plateau, faster and faster) or not. The course, (step, norm) at the samples, is
    kept at no more than 2 × POINTS points (every other one dropped when full)."""

    POINTS = 32

    def __init__(self):
        self.travelled = 0.0
        self._course: list = []  # (step, norm) at samples, thinned
        self._last = None

    @property
    def first(self) -> float:
        return self._course[0][1]

    @property
    def norm(self) -> float:
        return self._course[-1][1]

    def see(self, run, step: int) -> None:
        updates = of_roles(run, values_at(run, step, "l2", ["updates"]), KERNEL_ROLES)
        weights = values_at(run, step, "l2", ["weights"])
        pairs = [(weights.get("weights/" + name.split("/", 1)[1]), moved) for name, moved in updates.items()]
        pairs = [(w, u) for w, u in pairs if w is not None and np.isfinite(w) and np.isfinite(u)]
        if not pairs:
            return
        if self._course:
            self.travelled += float(np.sqrt(sum(u * u for _, u in pairs))) * max(step - self._last, 0)
        self._course.append((step, float(np.sqrt(sum(w * w for w, _ in pairs)))))
        self._last = step
        if len(self._course) > 2 * self.POINTS:
            self._course = self._course[:-1:2] + self._course[-1:]

    def slow_start(self) -> float | None:
        """The norm's change as a share of the travel, where that is DRIFT or more and the norm moved at least
        SPEEDUP times as far over the second half of the steps since the first sample as over the first half;
        else None."""
        if self.travelled <= 0:
            return None
        share = (self.norm - self.first) / self.travelled
        steps, norms = zip(*self._course)
        middle = float(np.interp((steps[0] + steps[-1]) / 2, steps, norms))
        if share < DRIFT or self.norm - middle < SPEEDUP * max(middle - self.first, 0.0):
            return None
        return share
