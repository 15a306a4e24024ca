"""Whether a fit's batch changes from step to step: a `keras.utils.PyDataset` whose `__getitem__` ignores its
index, or a generator that yields one batch again and again, trains the model on that batch alone while its loss
goes down. Judged at the first steps, which are sampled (the inputs of steps 0-2 are captured for
training_relations), from digests of the inputs' bytes where they reach the host whole (on the CPU; on an
accelerator they are reduced there, and this is not judged); only where Keras says an epoch holds more than one
step, as a full-batch training repeats its one batch by design. A batch whose samples are all alike (a
placeholder of zeros for a train_step that makes its own data, a flat stretch of a series, one class's code in
data sorted by class) may well come again: it is not judged. Nor is a tf.data dataset that hands out one batch by
design, which Keras reports as an epoch of several batches where steps_per_epoch says so: full-batch training
(`Dataset.from_tensors((x, y)).repeat()`, or `from_tensor_slices((x, y)).repeat().batch(len(x))`), or one batch
taken and repeated to overfit it on purpose."""

from __future__ import annotations

IN_A_ROW = 2  # repeats in a row (three equal batches) that are told


class InputRepeats:
    """The digests of the inputs at consecutive sampled steps."""

    def __init__(self):
        self._last = None  # (step, digests) of the last step seen
        self._repeats = 0
        self.told = False

    def see(self, step: int, digests: dict) -> int | None:
        """The batches in a row that were the same, told once: IN_A_ROW + 1 where this step is the IN_A_ROW-th
        repeat, 0 where it was compared with the step before and differs or is not yet told; None where it was not
        compared (no digest, or no step just before it)."""
        if self.told or not digests:
            return None
        last, self._last = self._last, (step, digests)
        if last is None or last[0] != step - 1:
            self._repeats = 0
            return None
        self._repeats = self._repeats + 1 if digests == last[1] else 0
        self.told = self._repeats >= IN_A_ROW
        return IN_A_ROW + 1 if self.told else 0


def repeats_by_design(adapter) -> bool:
    """Whether the fit's data (its Keras data adapter, fitargs) is a tf.data dataset that hands out one batch by
    design: it repeats a dataset of one element, or batches a repeated dataset of N elements by a multiple of N
    (`from_tensor_slices((x, y)).repeat().batch(len(x))`)."""
    datasets = [(getattr(adapter, "_dataset", None), None)]  # each with the batch size of a batching above it
    while datasets:  # the pipeline, from its last step back to its sources (tf.data's `_inputs()`)
        dataset, batch = datasets.pop()
        batch = int(dataset._batch_size) if hasattr(dataset, "_batch_size") else batch
        if type(dataset).__name__ == "_RepeatDataset":
            elements = int(dataset._input_dataset.cardinality())
            if elements == 1 or elements > 0 and batch is not None and batch % elements == 0:
                return True
        datasets.extend((source, batch) for source in getattr(dataset, "_inputs", list)())
    return False
