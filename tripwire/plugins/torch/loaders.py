"""The DataLoader iterators a plain loop starts, and how far it takes them: what tells a loader that repeats its
first batch from a full-batch training.

`x, y = next(iter(loader))` inside the loop starts a fresh iterator at every step and takes one batch of it: with
shuffling off, the first batch, again and again. A full-batch training also hands the model equal batches at
every step, by design, but from one tensor, or from a loader of one batch. The difference is the iterator: one
started at every step over a loader of several batches, and left after its first. A plain loop's probe sees no
loader, so while it looks (its first steps) the iterators started over torch DataLoaders are noted, through the
class's `__iter__`, wrapped for that time only: the loop's own calls and what they return are left untouched.
"""

from __future__ import annotations

import weakref

import torch

from .relations import BatchWatch

_watches: weakref.WeakSet = weakref.WeakSet()  # the open watches, which each note every iterator started
_installed = None  # (DataLoader.__iter__, the wrapper in its place), while it is wrapped


def _noting(original):
    """DataLoader.__iter__, noting each iterator it starts with the open watches."""

    def __iter__(loader):
        iterator = original(loader)
        if not _watches:  # every watch was let go without closing: nothing to note for
            _restore()
            return iterator
        for watch in list(_watches):
            watch.started.append((iterator, _batches(loader)))
        return iterator

    return __iter__


def _batches(loader) -> int | None:
    """The batches an epoch of a loader holds; None where it cannot say without a side effect (the length of an
    IterableDataset's loader, once read, is held against what it yields) or at all."""
    if isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset):
        return None
    try:
        return len(loader)
    except Exception:  # noqa: BLE001 - a sampler without a length: unknown
        return None


class FirstBatchDraws:
    """While open: the iterators started over torch DataLoaders. `end_step()` says whether, since it was last
    called, the loop started one over a loader of more than one batch and took a single batch from it. The
    iterators are held until then (one the loop lets go of at once, as `next(iter(loader))` does, must still be
    read), and no longer."""

    def __init__(self):
        global _installed
        self.started: list = []  # (iterator, the loader's batches) since the last end_step()
        if _installed is None:
            original = torch.utils.data.DataLoader.__iter__
            _installed = (original, _noting(original))
            torch.utils.data.DataLoader.__iter__ = _installed[1]
        _watches.add(self)

    def end_step(self) -> bool:
        """A first batch taken alone, from an iterator over a loader of several batches, started this step."""
        started, self.started = self.started, []
        return any(batches is not None and batches > 1 and getattr(iterator, "_num_yielded", None) == 1
                   for iterator, batches in started)

    def close(self) -> None:
        """Stop noting; the last watch to close puts DataLoader.__iter__ back."""
        _watches.discard(self)
        self.started = []
        if not _watches:
            _restore()


def _restore() -> None:
    """DataLoader.__iter__ back as it was, unless something else has been put in its place since."""
    global _installed
    if _installed is not None:
        original, wrapper = _installed
        if vars(torch.utils.data.DataLoader).get("__iter__") is wrapper:
            torch.utils.data.DataLoader.__iter__ = original
        _installed = None


class FirstBatchRepeats:
    """Over the loop's first steps (WINDOW): the model's training inputs equal at IN_A_ROW + 1 steps in a row
    (BatchWatch), each step's from an iterator started for it over a loader of several batches and left after its
    first (FirstBatchDraws). Then, or once the window has passed, it stops looking. Inputs on an accelerator are
    compared at once, which waits for the device at those few steps only."""

    WINDOW = 6

    def __init__(self):
        self._inputs = BatchWatch()
        self._draws = FirstBatchDraws()
        self._repeated = False  # the inputs of this step repeat the last IN_A_ROW steps'
        self._drawn = 0  # steps in a row, up to this one, whose batch was a first batch drawn alone
        self.done = False

    def see_inputs(self, step: int, inputs) -> None:
        """The first training forward's inputs of `step`."""
        self._repeated = self._inputs.see(step, inputs, sampled=True)

    def end_step(self, step: int) -> int | None:
        """The steps in a row that trained on one repeated first batch, where this step tells it (once)."""
        self._drawn = self._drawn + 1 if self._draws.end_step() else 0
        told, self._repeated = self._repeated and self._drawn > BatchWatch.IN_A_ROW, False
        if told or step + 1 >= self.WINDOW:
            self.close()
        return BatchWatch.IN_A_ROW + 1 if told else None

    def close(self) -> None:
        self.done = True
        self._draws.close()
        self._inputs = None
