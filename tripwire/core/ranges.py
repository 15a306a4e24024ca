"""The ranges a number of a config may take: a rule's parameters (`Rule.limits`) and the config's own settings.

A Range says its bounds and what the number is ("a percentage"), so that a config error can say what is allowed,
and `tripwire rules NAME` and docs/rules.md can list it. Rules of the user's take their ranges from here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """The values a number of the config may take: from `low` to `high` (None: no bound on that side), each end
    included unless `low_open`/`high_open` says otherwise; `what` says what the number is ("a percentage").
    Every number of a config is finite besides."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    what: str = ""

    def __contains__(self, value) -> bool:
        above = self.low is None or value > self.low or (value == self.low and not self.low_open)
        below = self.high is None or value < self.high or (value == self.high and not self.high_open)
        return finite(value) and above and below

    def __str__(self) -> str:
        low = None if self.low is None else f"{'greater than' if self.low_open else 'at least'} {_number(self.low)}"
        high = None if self.high is None else f"{'below' if self.high_open else 'at most'} {_number(self.high)}"
        if low and high and not (self.low_open or self.high_open):
            text = f"between {_number(self.low)} and {_number(self.high)}"
        else:
            text = " and ".join(filter(None, (low, high))) or "any finite number"
        return text + (f" ({self.what})" if self.what else "")


def finite(value) -> bool:
    """Not inf or NaN (an int of any size is finite; math.isfinite would overflow converting it to a float)."""
    return not isinstance(value, float) or math.isfinite(value)


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


ANY = Range()
AT_LEAST_0 = Range(0)
POSITIVE = Range(0, low_open=True)
COUNT = Range(1)
PERCENT = Range(0, 100, what="a percentage")
SHARE = Range(0, 1, what="a share")
