"""Recent history in memory: what the in-process rule engine reads.

It holds the last `capacity` samples of each series and the last
`tensor_capacity` full values of each tensor of the collections a rule reads
whole (`tensor_collections`; the others are the writer's alone), so memory
stays bounded however long training runs. It answers through the same `View` interface as
a stored run.
"""

from __future__ import annotations

import collections

import numpy as np

from .naming import collection_of
from .view import View


class _Ring:
    """Steps and values of one series, trimmed to the newest `capacity` entries (amortised O(1) append)."""

    __slots__ = ("steps", "values", "capacity")

    def __init__(self, capacity: int):
        self.steps: list = []
        self.values: list = []
        self.capacity = capacity

    def add(self, step: int, value: float) -> None:
        if self.steps and self.steps[-1] == step:  # the same step recorded again: keep the latest
            self.values[-1] = value
            return
        self.steps.append(step)
        self.values.append(value)
        if len(self.steps) >= 2 * self.capacity:
            del self.steps[:-self.capacity], self.values[:-self.capacity]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        n = self.capacity
        return np.array(self.steps[-n:], dtype=np.int64), np.array(self.values[-n:], dtype=np.float64)


class History(View):
    def __init__(self, capacity: int = 64, tensor_capacity: int = 1, tensor_collections=None):
        """tensor_collections: the collections whose full values are kept (None: all)."""
        super().__init__()
        self.capacity, self.tensor_capacity = max(2, capacity), max(1, tensor_capacity)
        self.tensor_collections = None if tensor_collections is None else frozenset(tensor_collections)
        self._rings: dict[tuple, _Ring] = {}
        self._row_steps: dict[tuple, _Ring] = {}
        self._tensors: dict[tuple, collections.OrderedDict] = {}
        # (worker, mode) -> (newest step, names recorded at it, {collection: {name: reductions}} there): what
        # the rules read
        self._latest: dict[tuple, tuple[int, set, dict]] = {}
        self.first_steps: dict = {}  # worker -> FirstStep, as the recorder was handed it

    def first_step_of(self, worker: int):
        return self.first_steps.get(worker)

    def add(self, worker: int, mode: str, step: int, values: dict, tensors: dict | None = None) -> None:
        """Add one sample: {name: {reduction: float}} and {name: array}."""
        rows = self._row_steps.get((worker, mode))
        if rows is None:
            rows = self._row_steps[(worker, mode)] = _Ring(self.capacity)
        rows.add(step, 0.0)
        latest = self._latest.get((worker, mode))
        if latest is None or latest[0] != step:
            latest = self._latest[(worker, mode)] = (step, set(), {})
        latest[1].update(values)
        latest[1].update(tensors or ())
        for name, reductions in values.items():
            group = latest[2].setdefault(collection_of(name), {})
            kept = group.get(name)
            group[name] = reductions if kept is None else {**kept, **reductions}
            for reduction, value in reductions.items():
                ring = self._rings.get((worker, mode, name, reduction))
                if ring is None:
                    ring = self._rings[(worker, mode, name, reduction)] = _Ring(self.capacity)
                    self._catalog.setdefault((worker, mode, name), set()).add(reduction)
                    self._version += 1
                ring.add(step, value)
        for name, array in (tensors or {}).items():
            if self.tensor_collections is not None and collection_of(name) not in self.tensor_collections:
                continue
            kept = self._tensors.get((worker, mode, name))
            if kept is None:
                kept = self._tensors[(worker, mode, name)] = collections.OrderedDict()
                self._catalog.setdefault((worker, mode, name), set()).add(self.TENSOR)
                self._version += 1
            kept[step] = array
            while len(kept) > self.tensor_capacity:
                kept.popitem(last=False)

    def _series(self, name, reduction, mode, worker):
        return self._rings[(worker, mode, name, reduction)].arrays()

    def _steps(self, mode, worker):
        ring = self._row_steps.get((worker, mode))
        return ring.arrays()[0] if ring else np.empty(0, dtype=np.int64)

    def _tensor_steps(self, name, mode, worker):
        return np.array(sorted(self._tensors.get((worker, mode, name), {})), dtype=np.int64)

    def _value(self, name, step, mode, worker):
        return self._tensors[(worker, mode, name)][step]

    def _names_at(self, step, mode, worker):
        """Rules ask for the newest step: its names are known without looking at any series."""
        if worker is not None:  # a rule's view: the set kept for the step itself, not a copy
            latest = self._latest.get((worker, mode))
            return latest[1] if latest is not None and latest[0] == step else None
        latest = [self._latest.get((w, mode)) for w in self.workers()]
        if all(entry is not None and entry[0] == step for entry in latest):
            return set().union(*(entry[1] for entry in latest))
        return None

    def _tail(self, name, reduction, mode, worker, n):
        ring = self._rings[(worker, mode, name, reduction)]
        return ring.steps[-n:], ring.values[-n:]

    def _recorded_at(self, step, mode, worker):
        latest = self._latest.get((worker, mode))
        return latest[2] if latest is not None and latest[0] == step else None

    def _at(self, name, reduction, mode, worker, step):
        ring = self._rings.get((worker, mode, name, reduction))
        if ring is not None and ring.steps:
            if ring.steps[-1] == step:
                return float(ring.values[-1])
            if step > ring.steps[-1]:  # rules ask for the newest step; most series were not sampled there
                return None
        return super()._at(name, reduction, mode, worker, step)
