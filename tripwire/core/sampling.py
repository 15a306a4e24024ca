"""When to sample: per-collection, per-mode schedules, and the plan a plugin consults every step.

The plugin asks `plan.at(mode, step)` on every step. On an unsampled step
this is one comparison against the next sampled step, cached per mode.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from functools import lru_cache


SCHEDULE_KEYS = ("every", "start", "end", "steps")  # as a config writes a schedule


@dataclass(frozen=True)
class Schedule:
    """Steps `start, start+every, …` before `end` (exclusive), plus the explicit `steps`. every=0: only `steps`."""

    every: int = 100
    start: int = 0
    end: int | None = None
    steps: frozenset = frozenset()

    def sampled(self, step: int) -> bool:
        if step in self.steps:
            return True
        if self.every <= 0 or step < self.start or (self.end is not None and step >= self.end):
            return False
        return (step - self.start) % self.every == 0

    def next_from(self, step: int) -> int | None:
        """The first sampled step at or after `step`, or None if there is none."""
        candidates = [s for s in self.steps if s >= step]
        if self.every > 0:
            first = self.start if step <= self.start else self.start + -(-(step - self.start) // self.every) * self.every
            if self.end is None or first < self.end:
                candidates.append(first)
        return min(candidates) if candidates else None


@dataclass(frozen=True, eq=False)
class CollectionPlan:
    """What to capture for one collection: which tensors, which reductions, whether full tensors, when."""

    name: str
    reductions: tuple
    save_tensors: bool
    schedules: dict  # mode -> Schedule
    include: tuple = ()
    exclude: tuple = ()
    # (steps, reductions): reductions only a rule with a window of steps reads (e.g. percentiles in the first
    # steps of training), computed at those steps only instead of at every sample
    windows: tuple = ()
    _patterns: tuple = field(default=(), repr=False)
    _variants: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        compile_ = lambda ps: tuple(re.compile(p, re.IGNORECASE) for p in ps)  # noqa: E731
        object.__setattr__(self, "_patterns", (compile_(self.include), compile_(self.exclude)))
        object.__setattr__(self, "selects", lru_cache(maxsize=None)(self._selects))

    def at_step(self, step: int | None) -> CollectionPlan:
        """This plan with the windowed reductions due at `step` (all of them for None); itself if none are."""
        if not self.windows:
            return self
        extra = tuple(dict.fromkeys(r for steps, reductions in self.windows if step is None or step in steps
                                    for r in reductions if r not in self.reductions))
        if not extra:
            return self
        variant = self._variants.get(extra)
        if variant is None:
            variant = self._variants[extra] = dataclasses.replace(self, reductions=self.reductions + extra,
                                                                  windows=(), _variants={})
        return variant

    def _selects(self, path: str, kind: str = "") -> bool:
        """Whether a tensor at this path (of this layer kind, e.g. 'ReLU') belongs to the collection.

        Patterns are searched, case-insensitively, in the path and in the kind."""
        include, exclude = self._patterns
        hit = lambda p: p.search(path) or (kind and p.search(kind))  # noqa: E731
        if include and not any(hit(p) for p in include):
            return False
        return not any(hit(p) for p in exclude)

    def sampled(self, mode: str, step: int) -> bool:
        schedule = self.schedules.get(mode)
        return schedule is not None and schedule.sampled(step)


class CapturePlan:
    """All collections to capture, and the fast per-step question: which are sampled now?"""

    def __init__(self, collections: dict[str, CollectionPlan]):
        self.collections = collections
        self._cache: dict[str, tuple[int, int | None]] = {}  # mode -> (from step, next sampled step)

    def __contains__(self, name: str) -> bool:
        return name in self.collections

    def at(self, mode: str, step: int) -> tuple[CollectionPlan, ...]:
        """The collections sampled at this step in this mode; () on an unsampled step."""
        cached = self._cache.get(mode)
        if cached is not None and cached[0] <= step and (cached[1] is None or step < cached[1]):
            return ()
        sampled = tuple(c.at_step(step) for c in self.collections.values() if c.sampled(mode, step))
        nexts = [n for c in self.collections.values() if mode in c.schedules
                 for n in (c.schedules[mode].next_from(step + 1),) if n is not None]
        self._cache[mode] = (step + 1, min(nexts) if nexts else None)
        return sampled

    def any_at(self, mode: str, step: int) -> bool:
        return bool(self.at(mode, step))
