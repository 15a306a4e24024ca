"""A slow start told from a loss that learns nothing (loss_not_decreasing's `slow` finding): a loss on its way
down, too slowly to have covered `min_drop` yet, or kernels whose weights drift one way, faster and faster, as a
model leaving the flat plateau a small initialisation or a saddle starts it on does before its loss shows it.
Steps that learn nothing that holds go every way and cancel, or fit what little they can at a steady pace.
"""

from __future__ import annotations

import numpy as np

from ..model import KERNEL_ROLES
from .base import of_roles, values_at
from .trend import Trend

DRIFT = 0.03  # of the distance the kernels' steps travelled, by which their norm grew: a drift, not a random walk
SPEEDUP = 2.0  # times the norm's growth over the first half of the steps, over the second: a drift that speeds up
SLOW_Z = 3.0  # standard errors by which the line through every sample falls: a descent, however slow
SLOW_HINT = ("The loss has not gone down far yet, but it is on its way (it falls steadily, or the weights drift one "
             "way): the model is leaving the flat plateau it began on (small initial weights, a saddle), slowly. Not "
             "a fault yet. To shorten it: initial weights at the usual scale (He, Glorot), a larger learning rate "
             "where the steps change the weights by less than 0.1 % of their norm, a larger batch.")


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


def slow_start(trend: Trend, drift: Drift | None) -> str | None:
    """Why a loss that has not gone down by `min_drop` yet is a slow start, in words to add to the verdict; None
    where it is not one. The line through every sample the rule saw falls by SLOW_Z standard errors or more (a
    loss that learns nothing stays level); or the kernels' norm grew by DRIFT or more of the distance their steps
    travelled since the rule's first sample, SPEEDUP times as much over the second half of those steps as over
    the first."""
    line = trend.line()
    if line is not None and line[1] > 0 and -line[0] >= SLOW_Z * line[1]:
        fall = -line[0] * (trend.last_step - trend.first_step)
        return (f" But it is on its way down: the line through its {trend.n} samples falls by {fall:.3g}, "
                f"{-line[0] / line[1]:.1f} standard errors (a loss that learns nothing stays level): a slow start.")
    share = drift.slow_start() if drift is not None else None
    if share is None:
        return None
    return (f" But the weights are on their way: the kernels' norm grew from {drift.first:.4g} to {drift.norm:.4g}, "
            f"{share:.0%} of the {drift.travelled:.3g} their steps travelled (steps that learn nothing cancel out), "
            "most of it lately: a slow start, the model leaving the plateau it began on.")
