"""The loss of each training step, told from the loss Keras logs: Keras hands its callbacks the mean over the
epoch's batches so far, on the host at every step, not the step's own loss (what loss_spike judges); and a
non-finite one among the losses a step logs."""

from __future__ import annotations

import math


class StepLosses:
    """Each call's own loss from the running mean logged after it: with `mean_j` the epoch's mean after batch j,
    the steps after batch i up to j have the mean ((j + 1) mean_j - (i + 1) mean_i) / (j - i). Batches are weighed
    alike: the epoch's shorter last batch comes out between its loss and the mean, never beyond either. One call
    runs `span` steps (steps_per_execution): its value is their mean."""

    def __init__(self, span: int = 1):
        self.span = span
        self._last = None  # (batch index, the epoch's mean after it) of the last call this epoch

    def see(self, batch: int, mean) -> float | None:
        """The loss of the steps since the last call, `batch` being the epoch's index of this call's last step and
        `mean` the loss Keras logged after it; None where it cannot be told (the mean is not a finite number, or
        the epoch's earlier calls were not seen)."""
        try:
            mean = float(mean)
        except (TypeError, ValueError):
            mean = math.nan
        last, self._last = self._last, ((batch, mean) if math.isfinite(mean) else None)
        if self._last is None:
            return None
        if last is None or last[0] >= batch:  # an epoch's first call: its mean is its own
            return mean if batch < self.span else None
        before, earlier = last
        return ((batch + 1) * mean - (before + 1) * earlier) / (batch - before)


def nonfinite_logged_loss(logs) -> float | None:
    """The first non-finite training loss among those Keras logs after a step, None where each is finite: `loss`,
    and those a train step of the user's own returns under names of its own (a GAN's `d_loss` and `g_loss`;
    `<output>_loss` of a model with several outputs). Any of them NaN is a NaN in training."""
    for key, value in (logs or {}).items():
        if key == "loss" or key.endswith("_loss"):
            try:
                value = float(value)
            except (TypeError, ValueError):  # not one number
                continue
            if not math.isfinite(value):
                return value
    return None
