"""What a sampled series shows beyond its noise: the least-squares line through its samples, kept as running sums
(any number of samples in O(1) memory), and the spread of its samples about their trend.

A batch loss is noisy: two windows of a few samples say little where every sample together says much, and a
claim about a loss (it never went down, it levelled off) stands only where the samples show it.
"""

from __future__ import annotations

import numpy as np

TREND_Z = 1.0  # standard errors of a line's fall added to it: what the samples cannot rule out


class Trend:
    """The least-squares line through (step, value) samples, kept as running means and co-moments (Welford's
    update: stable at any step count)."""

    def __init__(self, samples=()):
        self.n, self.x, self.y, self.xx, self.xy, self.yy = 0, 0.0, 0.0, 0.0, 0.0, 0.0
        self.first_step = self.last_step = 0.0
        for step, value in samples:
            self.add(float(step), float(value))

    def add(self, step: float, value: float) -> None:
        if not self.n:
            self.first_step = step
        self.last_step = step
        self.n += 1
        dx, dy = step - self.x, value - self.y
        self.x += dx / self.n
        self.y += dy / self.n
        self.xx += dx * (step - self.x)
        self.xy += dx * (value - self.y)
        self.yy += dy * (value - self.y)

    def line(self) -> tuple[float, float] | None:
        """(slope per step, its standard error from the residuals' spread: the noise, and any curve the line
        misses); None below three samples or on a single step."""
        if self.n < 3 or self.xx <= 0:
            return None
        slope = self.xy / self.xx
        return slope, (max(self.yy - slope * self.xy, 0.0) / (self.n - 2) / self.xx) ** 0.5

    def fall_at_most(self) -> float | None:
        """The line's fall from the first sample's step to the newest, plus TREND_Z standard errors of it: the
        most the samples allow (a series that does not move, sampled often enough, has a fall near 0 with a small
        error; a slow descent, a fall that only gets surer); None below three samples."""
        line = self.line()
        return None if line is None else (TREND_Z * line[1] - line[0]) * (self.last_step - self.first_step)


def noise(values: np.ndarray) -> float:
    """The spread of a series' samples about its trend: from the median change between neighbours (for independent
    noise of spread s, the change has median 0.954 s), so a falling loss's own descent does not count as noise."""
    return float(np.median(np.abs(np.diff(values)))) / 0.954 + 1e-12 * float(np.abs(values).mean())
