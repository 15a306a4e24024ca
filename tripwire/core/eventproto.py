"""TensorBoard's Event and Summary protos, and the record framing of an event file, from the writer installed.

The `tensorboard` package holds the protos, but it is TensorBoard's whole web server; `tensorboardX` is a small
package holding the same protos under its own package name (the bytes on the wire are the same, so TensorBoard
reads either's files). `tripwire-training[tensorboard]` installs tensorboardX; where `tensorboard` is there
anyway, its protos are used and tensorboardX is not needed.

An event file is a TFRecord file: each record is its length (uint64), the masked CRC-32C of the length, the
bytes, the masked CRC-32C of the bytes, all little-endian. The framing is written here, once for both
backends; the CRC-32C is the backend's own.
"""

from __future__ import annotations

import functools
import importlib
import struct
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

from .errors import install

# The protos' modules and the masked CRC-32C in each backend, in the order they are preferred.
BACKENDS = {
    "tensorboard": {"event": "tensorboard.compat.proto.event_pb2", "summary": "tensorboard.compat.proto.summary_pb2",
                    "tensor": "tensorboard.compat.proto.tensor_pb2",
                    "tensor_shape": "tensorboard.compat.proto.tensor_shape_pb2",
                    "text": "tensorboard.plugins.text.plugin_data_pb2",
                    "crc": "tensorboard.compat.tensorflow_stub.pywrap_tensorflow"},
    "tensorboardX": {"event": "tensorboardX.proto.event_pb2", "summary": "tensorboardX.proto.summary_pb2",
                     "tensor": "tensorboardX.proto.tensor_pb2", "tensor_shape": "tensorboardX.proto.tensor_shape_pb2",
                     "text": "tensorboardX.proto.plugin_text_pb2", "crc": "tensorboardX.record_writer"},
}


@dataclass(frozen=True)
class Protos:
    """One backend's proto modules (`event.Event`, `summary.Summary`, …) and its masked CRC-32C."""

    backend: str
    event: ModuleType
    summary: ModuleType
    tensor: ModuleType
    tensor_shape: ModuleType
    text: ModuleType
    masked_crc32c: Callable[[bytes], int]

    def record(self, data: bytes) -> bytes:
        """`data` (a serialised Event) framed as one TFRecord."""
        length = struct.pack("<Q", len(data))
        return (length + struct.pack("<I", self.masked_crc32c(length)) + data
                + struct.pack("<I", self.masked_crc32c(data)))


@functools.cache
def protos(backend: str | None = None) -> Protos:
    """The protos of `backend` ("tensorboard" or "tensorboardX"), or of the first of them installed (None)."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"no TensorBoard backend {backend!r}: choose {' or '.join(BACKENDS)}.")
    for name in [backend] if backend else BACKENDS:
        try:
            modules = {key: importlib.import_module(module) for key, module in BACKENDS[name].items()}
        except ModuleNotFoundError as exc:
            if backend or exc.name is None or exc.name.split(".")[0] != name:
                raise  # asked for by name, or the backend is there but broken: say what is missing
            continue
        crc = modules.pop("crc").masked_crc32c
        return Protos(name, masked_crc32c=crc, **modules)
    raise ModuleNotFoundError(f"TensorBoard event files need tensorboardX (or tensorboard), and neither is "
                              f"installed: {install('tensorboard')}.", name="tensorboardX")
