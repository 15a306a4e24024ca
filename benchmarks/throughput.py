"""Family 3: full tensors written through tripwire's writer, against numpy.save of the same arrays.

Each "step" is the MLP's weights, biases and gradients (12 float32 arrays,
0.8 MB). tripwire: `Writer.put` per step (`on_full: block`, so nothing is
dropped) until `close()` has written every shard, the index and the status.
numpy: one `np.save` per array into the same kind of fresh folder. The
figure is tripwire's bytes per second as a fraction of numpy's.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np

from .common import Clock, Row, interleaved, median
from .model import WIDTHS

STEPS = 300


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for i, (n_in, n_out) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        for kind in ("weights", "gradients"):
            out[f"{kind}/{2 * i}.weight"] = rng.standard_normal((n_out, n_in), dtype=np.float32)
            out[f"{kind}/{2 * i}.bias"] = rng.standard_normal(n_out, dtype=np.float32)
    return out


def numpy_save(folder: str, tensors: dict, steps: int) -> dict:
    with Clock() as clock:
        for step in range(steps):
            for i, array in enumerate(tensors.values()):
                np.save(f"{folder}/{step}-{i}.npy", array)
    return clock.to_dict()


def tripwire_writer(folder: str, tensors: dict, steps: int) -> dict:
    from tripwire.core.config import WriterConfig
    from tripwire.core.store import Store
    from tripwire.core.sample import Sample
    from tripwire.core.writer import Writer

    with Clock() as clock:
        writer = Writer(Store(folder), 0, WriterConfig(on_full="block"))
        for step in range(steps):
            writer.put(Sample(step, "train", {}, dict(tensors)))
        writer.close()
    if writer.dropped_steps or writer.lost_steps:
        raise RuntimeError(f"the writer dropped {writer.dropped_steps} and lost {writer.lost_steps} steps")
    return clock.to_dict()


def run(repeats: int, work: str, **_) -> list[Row]:
    """Always STEPS steps (243 MB), --steps or not: smaller sizes measure the writer's fixed costs instead."""
    steps, tensors = STEPS, arrays()
    mb = steps * sum(a.nbytes for a in tensors.values()) / 1e6

    def case(write):
        def call():
            folder = tempfile.mkdtemp(dir=work)
            try:
                return write(folder, tensors, steps)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        return call

    results = interleaved({"numpy": case(numpy_save), "tripwire": case(tripwire_writer)}, repeats)
    rate = {k: [mb / r["seconds"] for r in v] for k, v in results.items()}
    fraction = [t / n for t, n in zip(rate["tripwire"], rate["numpy"])]
    return [Row("throughput", f"numpy.save, {mb:.0f} MB", median(rate["numpy"]), "MB/s", samples=rate["numpy"]),
            Row("throughput", "tripwire writer", median(rate["tripwire"]), "MB/s", samples=rate["tripwire"]),
            Row("throughput", "tripwire / numpy.save", median(fraction), "fraction", ">= 0.5", samples=fraction)]
