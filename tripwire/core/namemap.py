"""A name map between two runs: how run B's tensor names (and kernel layouts) correspond to run A's.

For runs from different frameworks or code versions (`tripwire compare --map map.yaml`): regex renames
tried in order, and transposes for layouts such as Keras `(in, out)` kernels against torch `(out, in)`.
Validated like a rule config: a mistake names the file, line and key.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

from .configcheck import Checker
from .errors import ConfigError
from .yamlsource import load_yaml


@dataclass(frozen=True)
class Rename:
    """B's names that fully match `pattern` become `to` (a re template; None keeps the name). `axes`: B's full
    values are A's transposed: True reverses the axes, a tuple is numpy.transpose's `axes`, None leaves them."""

    pattern: re.Pattern
    to: str | None = None
    axes: tuple | bool | None = None
    line: int | None = None


@dataclass(frozen=True)
class NameMap:
    """How run B's tensor names correspond to run A's: renames tried in order, the first that matches wins;
    a name no rename matches keeps its name."""

    renames: tuple = ()
    source: str = "<dict>"

    def rename(self, name_b: str) -> tuple[str, Rename | None]:
        for rule in self.renames:
            match = rule.pattern.fullmatch(name_b)
            if match is None:
                continue
            try:
                return (name_b if rule.to is None else match.expand(rule.to)), rule
            except (re.error, IndexError) as exc:
                raise ConfigError(f"cannot rename '{name_b}' with '{rule.to}': {exc}.", source=self.source,
                                  line=rule.line) from None
        return name_b, None

    def rename_all(self, names_b) -> dict:
        """{B's name: (A's name, the rename used)}; two of B's names renamed onto one is an error."""
        out, taken = {}, {}
        for name_b in names_b:
            name, rule = self.rename(name_b)
            if name in taken:
                raise ConfigError(f"the name map renames both '{taken[name]}' and '{name_b}' of run B to '{name}'; "
                                  "make the patterns tell them apart.", source=self.source,
                                  line=rule.line if rule else None)
            taken[name] = name_b
            out[name_b] = (name, rule)
        return out


MAP_KEYS = ("rename",)
RENAME_KEYS = ("from", "to", "transpose")


def load_name_map(spec=None) -> NameMap:
    """A path to a YAML file, a YAML string, a dict, a NameMap, or None (no renames) -> a validated NameMap."""
    if spec is None or isinstance(spec, NameMap):
        return spec or NameMap()
    if isinstance(spec, Mapping):
        return _build_map(dict(spec), Checker("<dict>", {}))
    if not isinstance(spec, (str, os.PathLike)):
        raise ConfigError(f"a name map is a path, a dict or a NameMap, not {type(spec).__name__}.")
    source = os.fspath(spec)
    if "\n" in source:
        text, source = source, "<string>"
    elif os.path.isfile(source):
        with open(source, encoding="utf-8", errors="replace") as f:
            text = f.read()
    else:
        raise ConfigError(f"no name map file at '{source}' (working directory {os.getcwd()}).", source=source)
    data, lines = load_yaml(text, source)
    return _build_map(data, Checker(source, lines))


def _build_map(data, c) -> NameMap:
    """Check the whole map, then raise every mistake at once (as a config) or build it."""
    data = c.section(data, (), MAP_KEYS)
    renames: list = []
    with c.part():
        renames = c.listing(data.get("rename"), ("rename",), lambda raw, path: _rename(raw, path, c))
    c.done()
    return NameMap(tuple(renames), c.source)


def _rename(raw, path, c) -> Rename:
    given, raw = raw, c.mapping(raw, path, RENAME_KEYS)
    c.needs(raw, given, "from", path, "each rename needs `from:`, a regex matched against run B's whole tensor name.")
    pattern = re.compile(c.regex(raw["from"], path + ("from",)))
    to = raw.get("to")
    if to is not None:
        _check_template(c.string(to, path + ("to",)), pattern, path + ("to",), c)
    return Rename(pattern, to, _axes(raw.get("transpose", False), path + ("transpose",), c), c.lines.get(path))


def _check_template(to: str, pattern: re.Pattern, path, c) -> None:
    for ref in re.finditer(r"\\(\d+)|\\g<([^>]*)>", to):
        group = ref.group(1) or ref.group(2)
        known = int(group) <= pattern.groups if group.isdigit() else group in pattern.groupindex
        if not known:
            named = f", named {', '.join(pattern.groupindex)}" if pattern.groupindex else ""
            c.fail(path, f"'{to}' refers to group {group}, which '{pattern.pattern}' does not have "
                         f"({pattern.groups} groups{named}).")


def _axes(value, path, c):
    if value is False:
        return None
    if value is True:
        return True
    if not isinstance(value, list):
        c.fail(path, f"expected true, false or a list of axes like [1, 0]; got {type(value).__name__} {value!r}.")
    axes = tuple(c.integer(v, path + (i,), minimum=0) for i, v in enumerate(value))
    if sorted(axes) != list(range(len(axes))):
        c.fail(path, f"{list(axes)} is not a permutation: list each axis 0..{len(axes) - 1} once.")
    return axes
