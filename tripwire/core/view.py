"""The read interface: one API over a stored run and over the in-memory recent history.

Rules are written against this interface, so a rule reads the same way in
the training process (recent history in memory), in `tripwire watch` and in
`tripwire check` (the store). `view.at(step, mode, worker)` gives the view
as of a step, with that mode and worker as defaults: what a rule sees.
"""

from __future__ import annotations

import re
from typing import Iterable

import numpy as np

from .errors import StepUnavailable, TensorUnavailable, did_you_mean, listing
from .naming import CALL, VALUE, collection_of

_EMPTY = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64))


class View:
    """Base of `Run` (store-backed) and `History` (memory-backed).

    Subclasses keep `_catalog`: {(worker, mode, name): set of reductions} (tensor
    entries are marked by the pseudo-reduction `TENSOR`), bump `_version` when it
    changes, and implement `_series`, `_steps`, `_tensor_steps` and `_value`.
    """

    TENSOR = "#tensor"
    default_mode = "train"
    default_worker: int | None = None
    upto: int | None = None
    model = None  # the model's structure (tripwire.core.model.ModelInfo) where the run recorded it

    def first_step_of(self, worker: int):
        """What the plugin saw of a worker's first step (tripwire.core.firststep.FirstStep), or None."""
        return None

    @property
    def first_step(self):
        """The first step's record of the default worker (0 where none is set), or None."""
        return self.first_step_of(self.default_worker or 0)

    def input_layer(self, activation: str) -> str | None:
        """The layer whose output an activation (its path; `path#<k>` for the k-th call of a module called several
        times in a forward pass, naming.call_path) takes: as the plugin saw it at its first step, else from the
        model's structure, for a module called once per forward pass only: the structure places each module once,
        and a shared one takes another layer's output at each call. None where not known, and where the input was
        no layer's output as such (a residual block's sum)."""
        first = self.first_step
        if first is not None and first.producers is not None:
            return first.producers.get(activation)
        if self.model is None or CALL in activation or \
                self.tensor_names("activations", f"^activations/{re.escape(activation)}{CALL}"):
            return None
        return self.model.activations.get(activation)

    def __init__(self):
        self._catalog: dict[tuple, set] = {}
        self._version = 0
        self._names_cache: dict = {}

    # -- primitives -----------------------------------------------------------------------------------------------
    def _series(self, name: str, reduction: str, mode: str, worker: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _steps(self, mode: str, worker: int) -> np.ndarray:
        raise NotImplementedError

    # a series may hold steps that are no row (scalars stored between samples, Recorder.scalars); `at()` views,
    # what the rules read, see the rows alone
    _between_rows = False

    def _row_series(self, name: str, reduction: str, mode: str, worker: int) -> tuple[np.ndarray, np.ndarray]:
        """The series at the rows (sampled steps) alone."""
        return self._series(name, reduction, mode, worker)

    def _tensor_steps(self, name: str, mode: str, worker: int) -> np.ndarray:
        raise NotImplementedError

    def _value(self, name: str, step: int, mode: str, worker: int) -> np.ndarray:
        raise NotImplementedError

    def _at(self, name: str, reduction: str, mode: str, worker: int, step: int) -> float | None:
        """One reduction at one step, or None. Subclasses may answer faster than through the series."""
        steps, values = self._series(name, reduction, mode, worker)
        i = int(np.searchsorted(steps, step))
        return float(values[i]) if i < len(steps) and steps[i] == step else None

    # -- public API -----------------------------------------------------------------------------------------------
    def workers(self) -> list[int]:
        return sorted({w for w, _, _ in self._catalog})

    def modes(self, worker: int | None = None) -> list[str]:
        """Modes with data, of one worker or of any."""
        return sorted({m for w, m, _ in self._catalog if worker is None or w == worker})

    def collections(self, worker: int | None = None) -> list[str]:
        """Collections with data, of one worker or of any."""
        return sorted({collection_of(n) for w, _, n in self._catalog if worker is None or w == worker})

    def steps(self, mode: str | None = None, worker: int | None = None) -> list[int]:
        """Sorted steps with any data, in a mode (default train), for one worker or all."""
        mode = mode or self.default_mode
        workers = [worker] if worker is not None else self._scope_workers()
        arrays = [self._clip(self._steps(mode, w)) for w in workers]
        merged = np.unique(np.concatenate(arrays)) if arrays else np.empty(0, dtype=np.int64)
        return merged.tolist()

    def tensor_names(self, collection: str | None = None, regex: str | None = None, *,
                     mode: str | None = None, worker: int | None = None, step: int | None = None) -> list[str]:
        """Tensor names in the order the run first captured them (the model's order for parameters and
        activations), optionally of one collection, matching a regex (re.search), in a mode, of a worker,
        with data (a reduction or the full tensor) at one step."""
        if self.upto is not None:  # a scoped view lists its own mode and worker unless told otherwise
            mode = mode or self.default_mode
            worker = self.default_worker if worker is None else worker
        if step is not None:
            at_step = self._names_at(step, mode or self.default_mode, worker)
            return [n for n in self.tensor_names(collection, regex, mode=mode, worker=worker)
                    if (n in at_step if at_step is not None else self._holds(n, step, mode, worker))]
        key = (self._version, collection, regex, mode, worker)
        cached = self._names_cache.get(key)
        if cached is not None:
            return cached
        pattern = re.compile(regex) if regex else None
        names = list(dict.fromkeys(n for w, m, n in self._catalog
                                   if (mode is None or m == mode) and (worker is None or w == worker)
                                   and (collection is None or collection_of(n) == collection)
                                   and (pattern is None or pattern.search(n))))
        if len(self._names_cache) > 256:
            self._names_cache.clear()
        self._names_cache[key] = names
        return names

    def tensor(self, name: str) -> "Tensor":
        key = (self._version, "#all names")  # rules look tensors up by name many times per step
        names = self._names_cache.get(key)
        if names is None:
            names = self._names_cache[key] = frozenset(n for _, _, n in self._catalog)
        if name not in names:
            raise TensorUnavailable(
                f"no tensor '{name}' in this run.{did_you_mean(name, names)} It holds {len(names)} tensors in "
                f"collections {listing(self.collections())}; list them with tensor_names().")
        return Tensor(self, name)

    def at(self, step: int, mode: str = "train", worker: int = 0) -> "View":
        """This view as of `step` (nothing later is visible), with mode and worker as the defaults, as the rules
        read it: series at the sampled steps (the rows) alone."""
        return _Scoped(self, step, mode, worker)

    # -- helpers ---------------------------------------------------------------------------------------------------
    def _names_at(self, step: int, mode: str, worker: int | None):
        """The set of names with data at this step, where a subclass knows it at once; None otherwise."""
        return None

    def _tail(self, name: str, reduction: str, mode: str, worker: int, n: int) -> tuple[list, list]:
        """The last n steps and values of a series, as lists: what rules that look back read at every sample.
        Subclasses may answer without building the series' arrays."""
        steps, values = self._clip(*self._series(name, reduction, mode, worker))
        return steps[-n:].tolist(), values[-n:].tolist()

    def _recorded_at(self, step: int, mode: str, worker: int) -> dict | None:
        """{collection: {name: {reduction: value}}} of everything recorded at this step, in the order it was
        recorded, where a subclass knows it at once (the newest step of the in-memory history); None
        otherwise. It is what the rules read at every sample in the training process, so it must not cost a
        lookup per tensor."""
        return None

    def _recorded(self, step: int) -> dict | None:
        """A scoped view's `_recorded_at` for its own mode and worker (see `at()`); None if unknown."""
        if self.upto is None or step > self.upto or self.default_worker is None:
            return None
        return self._recorded_at(step, self.default_mode, self.default_worker)

    def _holds(self, name: str, step: int, mode: str | None, worker: int | None) -> bool:
        if self.upto is not None and step > self.upto:
            return False
        mode = mode or self.default_mode
        for w in ([worker] if worker is not None else self.workers()):
            steps = self._name_steps(name, mode, w)
            i = int(np.searchsorted(steps, step))
            if i < len(steps) and steps[i] == step:
                return True
        return False

    def _name_steps(self, name: str, mode: str, worker: int) -> np.ndarray:
        """Every step at which a tensor has any data (a reduction or its full value), sorted."""
        entry = self._catalog.get((worker, mode, name), ())
        parts = [self._series(name, r, mode, worker)[0] for r in entry if r != self.TENSOR]
        if self.TENSOR in entry:
            parts.append(self._tensor_steps(name, mode, worker))
        return np.unique(np.concatenate(parts)) if parts else _EMPTY[0]

    def _scope_workers(self) -> list[int]:
        return [self.default_worker] if self.default_worker is not None else self.workers()

    def _clip(self, steps: np.ndarray, values: np.ndarray | None = None):
        if self.upto is None:
            return steps if values is None else (steps, values)
        end = int(np.searchsorted(steps, self.upto, side="right"))
        return steps[:end] if values is None else (steps[:end], values[:end])

    def _resolve(self, name: str, mode: str | None, worker: int | None) -> tuple[str, int, set]:
        mode = mode or self.default_mode
        if worker is None:
            worker = self.default_worker
        if worker is None:
            holders = sorted(w for w, m, n in self._catalog if n == name and m == mode)
            worker = holders[0] if holders else 0
        entry = self._catalog.get((worker, mode, name))
        if entry is None:
            where = sorted({f"{m}/worker {w}" for w, m, n in self._catalog if n == name})
            raise TensorUnavailable(f"'{name}' has no data in mode '{mode}' for worker {worker}. "
                                    f"It has data in: {listing(where)}.")
        return mode, worker, entry


class Tensor:
    """One tensor of a view: its series per reduction, its values at single steps, its full values where saved."""

    def __init__(self, view: View, name: str):
        self.view, self.name = view, name

    def __repr__(self):
        return f"Tensor({self.name!r})"

    @property
    def collection(self) -> str:
        return collection_of(self.name)

    def reductions(self, mode: str | None = None, worker: int | None = None) -> list[str]:
        _, _, entry = self.view._resolve(self.name, mode, worker)
        return sorted(r for r in entry if r != View.TENSOR)

    def _reduction_name(self, reduction: str | None, entry: set) -> str:
        if reduction is None:
            if VALUE in entry:
                return VALUE
            raise TensorUnavailable(f"'{self.name}' is a tensor; name a reduction: "
                                    f"{listing(r for r in entry if r != View.TENSOR)}.")
        if reduction not in entry:
            raise TensorUnavailable(
                f"'{self.name}' has no reduction '{reduction}'.{did_you_mean(reduction, entry)} "
                f"Captured: {listing(r for r in entry if r != View.TENSOR)}. Add it to the collection's "
                "`reductions:` in the config to capture it.")
        return reduction

    def series(self, reduction: str | None = None, mode: str | None = None, worker: int | None = None):
        """(steps int64, values float64) of one reduction, sorted by step. Scalars need no reduction name."""
        mode, worker, entry = self.view._resolve(self.name, mode, worker)
        reduction = self._reduction_name(reduction, entry)
        return self.view._clip(*self.view._series(self.name, reduction, mode, worker))

    def reduction(self, step: int, reduction: str | None = None, mode: str | None = None,
                  worker: int | None = None) -> float:
        mode, worker, entry = self.view._resolve(self.name, mode, worker)
        reduction = self._reduction_name(reduction, entry)
        value = None if self.view.upto is not None and step > self.view.upto else \
            self.view._at(self.name, reduction, mode, worker, step)
        if value is None:
            raise StepUnavailable(_Deferred(lambda: self._missing_step(step, self.series(reduction, mode,
                                                                                       worker)[0])))
        return value

    def tail(self, reduction: str | None = None, n: int = 1, mode: str | None = None,
             worker: int | None = None) -> tuple[list[int], list[float]]:
        """The last `n` (steps, values) of one reduction, as lists: a rule's look back over recent samples."""
        mode, worker, entry = self.view._resolve(self.name, mode, worker)
        return self.view._tail(self.name, self._reduction_name(reduction, entry), mode, worker, n)

    def steps(self, mode: str | None = None, worker: int | None = None, tensors: bool = False) -> list[int]:
        """Steps holding any of this tensor's reductions (or, with tensors=True, its full values). Reductions
        a rule reads only in a window of steps have steps of their own."""
        mode, worker, entry = self.view._resolve(self.name, mode, worker)
        if tensors and View.TENSOR not in entry:
            return []
        parts = [] if tensors else [self.view._series(self.name, r, mode, worker)[0] for r in entry
                                    if r != View.TENSOR]
        if not parts:
            return self.view._clip(self.view._tensor_steps(self.name, mode, worker)).tolist()
        return self.view._clip(np.unique(np.concatenate(parts)) if len(parts) > 1 else parts[0]).tolist()

    def value(self, step: int, mode: str | None = None, worker: int | None = None) -> np.ndarray:
        """The full tensor at a step, where the config saved it (`save: tensors`)."""
        mode, worker, entry = self.view._resolve(self.name, mode, worker)
        if View.TENSOR not in entry:
            raise TensorUnavailable(f"'{self.name}' was captured as reductions only; set `save: tensors` on "
                                    f"collection '{self.collection}' to keep full values.")
        steps = self.view._clip(self.view._tensor_steps(self.name, mode, worker))
        if step not in set(steps.tolist()):
            raise StepUnavailable(self._missing_step(step, steps, "full values"))
        return self.view._value(self.name, step, mode, worker)

    def _missing_step(self, step: int, steps: np.ndarray, what: str = "a value") -> str:
        if len(steps) == 0:
            return f"'{self.name}' has no steps yet."
        i = int(np.searchsorted(steps, step))
        near = sorted({int(steps[j]) for j in (i - 1, i) if 0 <= j < len(steps)})
        return (f"'{self.name}' has no {what} at step {step}; it has {len(steps)} steps from {int(steps[0])} to "
                f"{int(steps[-1])}, nearest {', '.join(map(str, near))}.")


class _Deferred:
    """An error message written only when it is read: rules probe steps that a series lacks all the time."""

    __slots__ = ("write",)

    def __init__(self, write):
        self.write = write

    def __str__(self) -> str:
        return self.write()

    def __repr__(self) -> str:
        return repr(self.write())


class _Scoped(View):
    """A view limited to steps <= upto, with a default mode and worker. Shares the base view's data."""

    def __init__(self, base: View, upto: int, mode: str, worker: int):
        self._base, self.upto, self.default_mode, self.default_worker = base, upto, mode, worker
        self._names_cache = base._names_cache

    @property
    def _catalog(self):
        return self._base._catalog

    @property
    def model(self):
        return self._base.model

    def first_step_of(self, worker: int):
        return self._base.first_step_of(worker)

    @property
    def _version(self):
        return self._base._version

    def _series(self, *args):
        return self._base._row_series(*args)

    def _steps(self, *args):
        return self._base._steps(*args)

    def _tensor_steps(self, *args):
        return self._base._tensor_steps(*args)

    def _value(self, *args):
        return self._base._value(*args)

    def _at(self, *args):
        return View._at(self, *args) if self._base._between_rows else self._base._at(*args)

    def _names_at(self, step, mode, worker):
        return self._base._names_at(step, mode, worker) if step <= self.upto else set()

    def _name_steps(self, *args):
        return self._base._name_steps(*args)

    def _recorded_at(self, *args):
        return self._base._recorded_at(*args)

    def _tail(self, name, reduction, mode, worker, n):
        if self._base._between_rows:
            return View._tail(self, name, reduction, mode, worker, n)
        steps, values = self._base._tail(name, reduction, mode, worker, n)
        if steps and steps[-1] > self.upto:  # the base holds later steps: read the series up to this view's step
            return View._tail(self, name, reduction, mode, worker, n)
        return steps, values

    def verdicts(self, worker: int | None = None) -> list:
        verdicts = getattr(self._base, "verdicts", lambda **_: [])(worker=worker)
        return [v for v in verdicts if v.step <= self.upto]


def merge_sorted(chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate (steps, values) chunks into one series sorted by step; a repeated step keeps its last value."""
    chunks = [c for c in chunks if len(c[0])]
    if not chunks:
        return _EMPTY
    steps = np.concatenate([c[0] for c in chunks])
    values = np.concatenate([c[1] for c in chunks])
    if len(steps) < 2 or np.all(steps[1:] > steps[:-1]):
        return steps, values
    last = len(steps) - 1 - np.unique(steps[::-1], return_index=True)[1]
    return steps[last], values[last]
