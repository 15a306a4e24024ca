"""Shard files: the safetensors layout, written and read with numpy alone.

    8 bytes   little-endian uint64 N
    N bytes   JSON header: {"__metadata__": {"tripwire": "<JSON>", "tripwire_crc32": "<8 hex>"},
                            "<entry>": {"dtype", "shape", "data_offsets"}}
    data      the entries' bytes, back to back, offsets relative to the end of the header

Any safetensors reader opens these files; no pickle, no code. Entries are
read one at a time by byte range, so one series never needs the full tensors.

Every byte is checked (format 2): the metadata's `crc32` maps each entry to
the crc32 of its bytes, verified whenever the entry is read; `tripwire_crc32`
is the crc32 of the N header bytes as they are with its own 8 digits read as
zeros, verified before anything of the header is used.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
_CODES = {np.dtype(t): code for code, t in DTYPES.items()}
MAX_HEADER = 16 << 20  # a header longer than this is refused unread; the writer never writes one
HEADER_CRC = "tripwire_crc32"
_CRC_FIELD = f'"{HEADER_CRC}":"'.encode()
_NO_CRC = b"00000000"


class ShardFormatError(ValueError):
    """A file that is not a readable shard (truncated, corrupt or foreign)."""


@dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple
    begin: int  # absolute byte offsets in the file
    end: int
    crc: str | None = None  # crc32 of the bytes, 8 hex digits (None in files of format 1)

    def decode(self, data: bytes) -> np.ndarray:
        dtype = np.dtype(DTYPES[self.dtype]).newbyteorder("<")
        count = int(np.prod(self.shape)) if self.shape else 1
        if len(data) != self.end - self.begin or count * dtype.itemsize != len(data):
            raise ShardFormatError(f"entry holds {len(data)} bytes, expected {count * dtype.itemsize}")
        if self.crc is not None and crc_of(data) != self.crc:
            raise ShardFormatError(f"the {len(data)} bytes at [{self.begin}, {self.end}) do not match their "
                                   "checksum: the file was changed after it was written")
        return np.frombuffer(data, dtype=dtype).reshape(self.shape)


def crc_of(data) -> str:
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def encode(entries: dict[str, np.ndarray], metadata: dict) -> list:
    """One shard as a list of byte chunks (header, then each entry's bytes, uncopied where possible).

    Entries are written in the order given: put the small, often-read ones first. The entries' checksums are
    added to `metadata` under "crc32"."""
    layout: dict = {}
    blobs, offset = [], 0
    metadata["crc32"] = crcs = {}
    for key, array in entries.items():
        array = np.ascontiguousarray(array)
        code = dtype_code(array)
        if code is None:
            raise TypeError(f"cannot store dtype {array.dtype} (entry {key!r}); convert it to a float or int type")
        array = array.astype(array.dtype.newbyteorder("<"), copy=False)
        blob = memoryview(array.reshape(-1)).cast("B") if array.size else b""
        layout[key] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        crcs[key] = crc_of(blob)
        blobs.append(blob)
        offset += len(blob)
    header = {"__metadata__": {"tripwire": json.dumps(metadata, separators=(",", ":")),
                               HEADER_CRC: _NO_CRC.decode()}, **layout}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # data starts 8-byte aligned
    at = head.index(_CRC_FIELD) + len(_CRC_FIELD)
    head = head[:at] + crc_of(head).encode() + head[at + 8:]
    return [struct.pack("<Q", len(head)) + head, *blobs]


def header_crc_problem(head: bytes) -> str | None:
    """Why the header's own checksum fails (None if it holds, or if the header has none: format 1)."""
    at = head.find(_CRC_FIELD)
    if at < 0:
        return None
    at += len(_CRC_FIELD)
    claimed = head[at:at + 8]
    if crc_of(head[:at] + _NO_CRC + head[at + 8:]).encode() != claimed:
        return "the header does not match its checksum: the file was changed after it was written"
    return None


def dtype_code(array: np.ndarray) -> str | None:
    """The format's name of an array's dtype (F32, I64, …), or None if the format cannot hold it."""
    return _CODES.get(array.dtype.newbyteorder("="))


def entry_ranges(chunks: list, keys) -> dict[str, tuple[int, int]]:
    """The absolute byte range of each entry in the chunks `encode` made of them (keys in the same order)."""
    ranges, begin = {}, len(chunks[0])
    for key, blob in zip(keys, chunks[1:]):
        ranges[key] = (begin, begin + len(blob))
        begin += len(blob)
    return ranges


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def entry(dtype, shape, begin, end, what: str = "entry", crc=None) -> Entry:
    """An Entry from untrusted header fields: a known dtype, a shape of counts, offsets that hold exactly it."""
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ShardFormatError(f"{what} has unknown dtype {dtype!r}")
    if not isinstance(shape, (list, tuple)) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ShardFormatError(f"{what} has shape {shape!r}, not a list of counts")
    if not (_is_int(begin) and _is_int(end)) or not 0 <= begin <= end:
        raise ShardFormatError(f"{what} has byte offsets [{begin!r}, {end!r}]")
    count = 1
    for d in shape:
        count *= d
    nbytes = count * np.dtype(DTYPES[dtype]).itemsize
    if nbytes != end - begin:
        raise ShardFormatError(f"{what}: shape {list(shape)} of {dtype} needs {nbytes} bytes, its offsets hold "
                               f"{end - begin}")
    if crc is not None and not (isinstance(crc, str) and len(crc) == 8):
        raise ShardFormatError(f"{what} has checksum {crc!r:.20}, not 8 hex digits")
    return Entry(dtype, tuple(shape), begin, end, crc)


def header_length(prefix: bytes) -> int:
    """The header length N from the file's first 8 bytes."""
    if len(prefix) < 8:
        raise ShardFormatError("file shorter than 8 bytes")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER:
        raise ShardFormatError(f"header length {n} is implausible")
    return n


def decode_header(head: bytes, size: int | None = None) -> tuple[dict[str, Entry], dict]:
    """Entries (with absolute offsets and checksums) and tripwire metadata from the bytes [8, 8+N) of a shard,
    the header's checksum verified first. A file of format 2 or later must carry every checksum."""
    problem = header_crc_problem(head)
    if problem:
        raise ShardFormatError(problem)
    try:
        raw = json.loads(head)
        outer = raw.pop("__metadata__", {})
        meta = json.loads(outer.get("tripwire", "{}"))
        if not isinstance(meta, dict):
            raise ShardFormatError("metadata is not a mapping")
        checksummed = not isinstance(meta.get("format_version"), int) or meta["format_version"] >= 2
        if checksummed and HEADER_CRC not in outer:
            raise ShardFormatError("the header carries no checksum, which its format requires")
        crcs = meta.get("crc32", {}) if checksummed else {}
        if not isinstance(crcs, dict):
            raise ShardFormatError("crc32 is not a mapping of entry to checksum")
        base = 8 + len(head)
        entries = {}
        for key, e in raw.items():
            begin, end = e["data_offsets"]
            crc = crcs.get(key)
            if checksummed and not (isinstance(crc, str) and len(crc) == 8):
                raise ShardFormatError(f"entry {key!r} has checksum {crc!r:.20}, not 8 hex digits")
            entries[key] = entry(e["dtype"], e["shape"], base + begin, base + end, what=f"entry {key!r}", crc=crc)
            if size is not None and base + end > size:
                raise ShardFormatError(f"entry {key!r} ends at byte {base + end}, past the end of the file ({size})")
    except ShardFormatError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ShardFormatError(f"unreadable header: {exc}") from None
    return entries, meta
