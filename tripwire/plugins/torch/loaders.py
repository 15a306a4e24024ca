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

from .relations import BatchWatch, batch_tensors

_watches: weakref.WeakSet = weakref.WeakSet()  # the open watches, which each note every iterator started
_installed: list = []  # (class, method name, the method, the wrapper in its place), while they are wrapped


def _noting_iter(original):
    """DataLoader.__iter__, noting each iterator it starts with the open watches."""

    def __iter__(loader):
        iterator = original(loader)
        if not _watches:  # every watch was let go without closing: nothing to note for
            _restore()
            return iterator
        for watch in list(_watches):
            watch.started[id(iterator)] = (iterator, _batches(loader), None)
        return iterator

    return __iter__


def _noting_next(original):
    """The DataLoader iterators' __next__, noting the first batch of each iterator a watch saw started."""

    def __next__(iterator):
        batch = original(iterator)
        for watch in list(_watches):
            noted = watch.started.get(id(iterator))
            if noted is not None and noted[0] is iterator and noted[2] is None:
                watch.started[id(iterator)] = (iterator, noted[1], batch)
        return batch

    return __next__


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
    """While open: the iterators started over torch DataLoaders, and the first batch of each. `end_step(inputs)`
    says whether, since it was last called, the loop started one over a loader of more than one batch, took a
    single batch from it, and trained on that batch (the model's inputs are a tensor of it). The iterators and
    their first batches are held until then (one the loop lets go of at once, as `next(iter(loader))` does, must
    still be read), and no longer."""

    def __init__(self):
        self.started: dict = {}  # id -> (iterator, the loader's batches, its first batch) since the last end_step()
        if not _installed:
            iterators = torch.utils.data.dataloader._BaseDataLoaderIter
            for owner, name, wrap in ((torch.utils.data.DataLoader, "__iter__", _noting_iter),
                                      (iterators, "__next__", _noting_next)):
                original = vars(owner)[name]
                _installed.append((owner, name, original, wrap(original)))
                setattr(owner, name, _installed[-1][3])
        _watches.add(self)

    def end_step(self, inputs) -> bool:
        """A first batch taken alone, from an iterator over a loader of several batches started this step, that
        holds the model's inputs of this step (`inputs`, a tensor, or None where none was seen)."""
        started, self.started = self.started, {}
        return isinstance(inputs, torch.Tensor) and any(
            batches is not None and batches > 1 and getattr(iterator, "_num_yielded", None) == 1 and
            any(_same(inputs, t) for t in batch_tensors(batch))
            for iterator, batches, batch in started.values())

    def close(self) -> None:
        """Stop noting; the last watch to close puts DataLoader's methods back."""
        _watches.discard(self)
        self.started = {}
        if not _watches:
            _restore()


def _same(inputs: torch.Tensor, drawn: torch.Tensor) -> bool:
    """The model's inputs are this tensor of a batch: the tensor itself, or equal to it (moved to a device, cast)."""
    if inputs is drawn:
        return True
    if inputs.shape != drawn.shape or inputs.layout != torch.strided or drawn.layout != torch.strided:
        return False
    return torch.equal(inputs.detach(), drawn.detach().to(inputs.device, inputs.dtype))


def _restore() -> None:
    """DataLoader's methods back as they were, unless something else has been put in their place since."""
    while _installed:
        owner, name, original, wrapper = _installed.pop()
        if vars(owner).get(name) is wrapper:
            setattr(owner, name, original)


class FirstBatchRepeats:
    """Over the loop's first steps (WINDOW): the model's training inputs equal at IN_A_ROW + 1 steps in a row
    (BatchWatch), each step's from an iterator started for it over a loader of several batches and left after its
    first (FirstBatchDraws). Then, or once the window has passed, it stops looking. Inputs on an accelerator are
    compared at once, which waits for the device at those few steps only."""

    WINDOW = 6

    def __init__(self):
        self._inputs = BatchWatch()
        self._draws = FirstBatchDraws()
        self._seen = None  # the inputs of this step's first forward that builds a graph (a training forward)
        self._repeated = False  # the inputs of this step repeat the last IN_A_ROW steps'
        self._drawn = 0  # steps in a row, up to this one, whose batch was a first batch drawn alone
        self.done = False

    def see_inputs(self, step: int, inputs) -> None:
        """The inputs of a forward in train mode of `step`: the first that builds a graph is the training's (one
        under torch.no_grad() evaluates)."""
        if self._seen is None and torch.is_grad_enabled():
            self._seen = inputs
            self._repeated = self._inputs.see(step, inputs, sampled=True)

    def end_step(self, step: int) -> int | None:
        """The steps in a row that trained on one repeated first batch, where this step tells it (once)."""
        self._drawn = self._drawn + 1 if self._draws.end_step(self._seen) else 0
        told, self._repeated, self._seen = self._repeated and self._drawn > BatchWatch.IN_A_ROW, False, None
        if told or step + 1 >= self.WINDOW:
            self.close()
        return BatchWatch.IN_A_ROW + 1 if told else None

    def close(self) -> None:
        self.done = True
        self._draws.close()
        self._inputs = None
