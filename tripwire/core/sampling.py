"""When to sample: per-collection, per-mode schedules, and the plan a plugin consults every step.

The plugin asks `plan.at(mode, step)` on every step. On an unsampled step
this is one comparison against the next sampled step, cached per mode.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
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
        explicit = _first_from(self._sorted_steps, step)
        if self.every <= 0:
            return explicit
        first = self.start if step <= self.start else self.start + -(-(step - self.start) // self.every) * self.every
        if self.end is not None and first >= self.end:
            return explicit
        return first if explicit is None or first < explicit else explicit

    @functools.cached_property
    def _sorted_steps(self) -> tuple:
        return tuple(sorted(self.steps))


def _first_from(ordered: tuple, step: int) -> int | None:
    """The first of these sorted steps at or after `step`, or None."""
    i = bisect.bisect_left(ordered, step)
    return ordered[i] if i < len(ordered) else None


@dataclass(frozen=True, eq=False)
class CollectionPlan:
    """What to capture for one collection: which tensors, which reductions, whether full tensors, when."""

    name: str
    reductions: tuple
    save_tensors: bool
    schedules: dict  # mode -> Schedule, as configured
    include: tuple = ()
    exclude: tuple = ()
    # (steps, reductions, save): reductions, and full tensors where `save`, only a rule with a window of steps
    # reads (e.g. percentiles in the first steps of training, the first batch's inputs). Those steps are sampled
    # too, and at a step sampled only for a window, only the window's reductions are computed.
    windows: tuple = ()
    _patterns: tuple = field(default=(), repr=False)
    _variants: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        compile_ = lambda ps: tuple(re.compile(p, re.IGNORECASE) for p in ps)  # noqa: E731
        object.__setattr__(self, "_patterns", (compile_(self.include), compile_(self.exclude)))
        object.__setattr__(self, "selects", lru_cache(maxsize=None)(self._selects))

    def __getstate__(self) -> dict:
        """Pickled without its caches (Lightning's ddp_spawn sends the callback, plan and all, to each process)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("selects", "_window_steps")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "selects", lru_cache(maxsize=None)(self._selects))

    def at_step(self, step: int | None, mode: str = "train") -> CollectionPlan:
        """This plan as due at `step`: its reductions (and full tensors) where its schedule samples the step, plus
        the windowed ones due there; only the latter at a step sampled for a window alone. None: everything."""
        if not self.windows:
            return self
        scheduled = step is None or self.schedules[mode].sampled(step)
        due = [w for w in self.windows if step is None or step in w[0]]
        extra = tuple(dict.fromkeys(r for _, reductions, _ in due for r in reductions
                                    if not (scheduled and r in self.reductions)))
        save = (scheduled and self.save_tensors) or any(w[2] for w in due)
        if scheduled and not extra and save == self.save_tensors:
            return self
        key = (scheduled, extra, save)
        variant = self._variants.get(key)
        if variant is None:
            variant = self._variants[key] = dataclasses.replace(
                self, reductions=(self.reductions if scheduled else ()) + extra, save_tensors=save, windows=(),
                _variants={})
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
        return schedule is not None and (schedule.sampled(step) or any(step in w[0] for w in self.windows))

    def next_from(self, mode: str, step: int) -> int | None:
        """The first step at or after `step` sampled in this mode, or None."""
        schedule = self.schedules.get(mode)
        if schedule is None:
            return None
        scheduled = schedule.next_from(step)
        windowed = _first_from(self._window_steps, step) if self.windows else None
        return scheduled if windowed is None or (scheduled is not None and scheduled < windowed) else windowed

    @functools.cached_property
    def _window_steps(self) -> tuple:
        return tuple(sorted({s for w in self.windows for s in w[0]}))


class CapturePlan:
    """All collections to capture, and the fast per-step question: which are sampled now?"""

    def __init__(self, collections: dict[str, CollectionPlan]):
        self.collections = collections
        self._cache: dict[str, tuple[int, int | None]] = {}  # mode -> (from step, next sampled step)
        self._due: dict[str, dict] = {}  # mode -> {collection: its next sampled step at or after the from step}

    def __contains__(self, name: str) -> bool:
        return name in self.collections

    def at(self, mode: str, step: int) -> tuple[CollectionPlan, ...]:
        """The collections sampled at this step in this mode; () on an unsampled step.

        Each collection's next sampled step is kept, so a sampled step looks up only the collections due
        there; a step before the last one asked (a loop that starts again) looks them all up afresh."""
        cached = self._cache.get(mode)
        if cached is not None and cached[0] <= step and (cached[1] is None or step < cached[1]):
            return ()
        due = self._due.get(mode)
        if due is None or cached is None or step < cached[0]:
            due = self._due[mode] = {name: c.next_from(mode, step) for name, c in self.collections.items()}
        sampled = []
        for name, n in due.items():
            if n is not None and n < step:  # the loop skipped ahead
                n = due[name] = self.collections[name].next_from(mode, step)
            if n == step:
                collection = self.collections[name]
                sampled.append(collection.at_step(step, mode))
                due[name] = collection.next_from(mode, step + 1)
        self._cache[mode] = (step + 1, min((n for n in due.values() if n is not None), default=None))
        return tuple(sampled)

    def next_sampled(self, mode: str, step: int) -> int | None:
        """The first step at or after `step` that samples anything in this mode, or None."""
        return min((n for c in self.collections.values() for n in (c.next_from(mode, step),) if n is not None),
                   default=None)
