"""What a shard or index header declares, checked against the format (docs/format.md) before the reader
uses any of it: a file that does not fit is skipped whole, and no step of it becomes visible."""

from __future__ import annotations

from dataclasses import dataclass

from .naming import MODE_RE
from .shardfile import Entry, ShardFormatError
from .shardfile import entry as shard_entry
from .store import FORMAT_VERSION, INDEX_RE, SHARD_RE


@dataclass
class StoredFile:
    """A shard or index as the reader knows it: its path in the run, its entries and its metadata."""

    rel: str
    entries: dict
    meta: dict

    def section(self) -> tuple[int, int] | None:
        sec = self.meta.get("section")
        if not sec or not self.entries:
            return None
        base = min(e.begin for e in self.entries.values())
        return base, base + int(sec)


_INT_DTYPES = ("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8")


def _fail(what: str):
    raise ShardFormatError(what)


def _int(x, what: str, low: int = 0) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < low:
        _fail(f"{what} is {x!r}, not an integer >= {low}")
    return x


def _str(x, what: str) -> str:
    if not isinstance(x, str) or not x:
        _fail(f"{what} is {x!r}, not a name")
    return x


def _mode(x, what: str) -> str:
    """A mode names folders where a run is exported: a plain word, never a path."""
    if not isinstance(x, str) or not MODE_RE.fullmatch(x):
        _fail(f"{what} is {x!r:.40}, not a mode (a lowercase word)")
    return x


def checked(file: StoredFile):
    """Everything a shard or index header declares, checked against the format (docs/format.md) and its name.

    Returns (worker, [(mode, steps entry)], [(mode, name, reduction, values entry, steps entry)],
    [(mode, name, step, (shard rel, Entry))], rows). Raises ShardFormatError on the first thing that does not
    fit: a field of the wrong type, an entry that does not exist or has the wrong shape, series whose steps
    and values differ in length, or (in an index) a tensor location that is not a shard of this run."""
    meta, entries = file.meta, file.entries
    folder, name = file.rel.split("/", 1)
    kind = "index" if folder == "index" else "shard"
    match = (INDEX_RE if kind == "index" else SHARD_RE).fullmatch(name)
    if not match:
        _fail(f"{name!r} is not a {kind} name")
    version = meta.get("format_version", 1)
    if _int(version, "format_version", 1) > FORMAT_VERSION:
        _fail(f"store format {version} is newer than this tripwire's ({FORMAT_VERSION})")
    if meta.get("kind", kind) != kind:
        _fail(f"metadata says kind {meta.get('kind')!r} for a file in {folder}/")
    worker = _int(meta.get("worker"), "worker")
    if worker != int(match.group(1)):
        _fail(f"metadata names worker {worker}, the file name worker {int(match.group(1))}")
    number = meta.get("upto" if kind == "index" else "seq", int(match.group(2)))
    if _int(number, "upto" if kind == "index" else "seq") != int(match.group(2)):
        _fail(f"metadata numbers the file {number}, its name {int(match.group(2))}")
    if meta.get("section") is not None:
        _int(meta["section"], "section")

    def vector(key, what: str, integers: bool = False) -> Entry:
        if not isinstance(key, str) or key not in entries:
            _fail(f"{what} names entry {key!r}, which the file does not hold")
        e = entries[key]
        if len(e.shape) != 1 or (integers and e.dtype not in _INT_DTYPES):
            _fail(f"{what} entry {key!r} is {e.dtype}{list(e.shape)}, not a 1-D {'integer ' if integers else ''}array")
        return e

    step_map = meta.get("steps", {})
    if not isinstance(step_map, dict):
        _fail(f"steps is {type(step_map).__name__}, not a mapping of mode to entry")
    steps = [(_mode(mode, "a mode"), vector(key, f"steps of mode {mode!r}", integers=True))
             for mode, key in step_map.items()]
    row_map = meta.get("rows", {m: e.shape[0] for m, e in steps})
    if not isinstance(row_map, dict):
        _fail(f"rows is {type(row_map).__name__}, not a mapping of mode to count")
    rows = sum(_int(count, f"rows of mode {mode!r}") for mode, count in row_map.items())

    series = []
    listed = meta.get("series", [])
    if not isinstance(listed, list):
        _fail(f"series is {type(listed).__name__}, not a list")
    for item in listed:
        if not isinstance(item, list) or len(item) != 5:
            _fail(f"series item {item!r:.80} is not [mode, name, reduction, values, steps]")
        mode = _mode(item[0], "a series' mode")
        tensor, reduction = (_str(x, "a series' " + w) for x, w in zip(item[1:3], ("name", "reduction")))
        values = vector(item[3], f"values of {tensor}/{reduction}")
        at = vector(item[4], f"steps of {tensor}/{reduction}", integers=True)
        if values.dtype == "BOOL" or values.shape != at.shape:
            _fail(f"series {tensor}/{reduction} has {values.shape[0]} values of {values.dtype} for {at.shape[0]} steps")
        series.append((mode, tensor, reduction, values, at))

    tensors = []
    listed = meta.get("tensors", [])
    if not isinstance(listed, list):
        _fail(f"tensors is {type(listed).__name__}, not a list")
    for item in listed:
        if not isinstance(item, list) or len(item) not in ((8, 9) if kind == "index" else (4,)) \
                or kind == "index" and len(item) == 8 and version >= 2:
            _fail(f"tensor item {item!r:.80} does not have the {kind}'s layout")
        mode, tensor = _mode(item[0], "a tensor's mode"), _str(item[1], "a tensor's name")
        step = _int(item[2], f"step of {tensor}", low=-(1 << 62))
        if kind == "shard":  # [mode, name, step, entry]
            if not isinstance(item[3], str) or item[3] not in entries:
                _fail(f"tensor {tensor} at step {step} names entry {item[3]!r}, which the file does not hold")
            tensors.append((mode, tensor, step, (file.rel, entries[item[3]])))
            continue
        # in an index: [mode, name, step, "shards/<file>", begin, end, dtype, shape, crc32 (format 2)]; the shard
        # is a path read later, so it must be a plain shard name of this worker inside shards/, never '..', an
        # absolute path or a URL
        shard = item[3]
        plain = isinstance(shard, str) and shard.startswith("shards/")
        m = SHARD_RE.fullmatch(shard[len("shards/"):]) if plain else None
        if m is None or int(m.group(1)) != worker or int(m.group(2)) > int(match.group(2)):
            _fail(f"tensor {tensor} at step {step} points to {shard!r:.80}, not a shard of worker {worker} "
                  f"numbered <= {int(match.group(2))} inside shards/")
        where = shard_entry(item[6], item[7], item[4], item[5], what=f"tensor {tensor} at step {step}",
                            crc=item[8] if len(item) == 9 else None)
        tensors.append((mode, tensor, step, (shard, where)))
    return worker, steps, series, tensors, rows
