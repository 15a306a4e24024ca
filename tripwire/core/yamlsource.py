"""Safe YAML loading that remembers the line of every key, so config errors can name it.

PyYAML's own loaders lose line numbers, expand aliases without limit (a
"billion laughs" file takes all memory) and recurse once per nesting level
(`[[[[…]]]]` 2,000 deep raises RecursionError, 100,000 deep overflows the C
stack). Here the text is first read as a stream of events, which is
iterative, to refuse nesting deeper than `MAX_DEPTH` before anything is
built; then the document is composed into nodes and converted by hand: with
a budget on the number of values built, the same depth limit through aliases,
a cap on the file size, duplicate keys refused, and a `lines` map from key
path to line. A tab used to indent, which PyYAML reports as a "character that
cannot start any token", is named as a tab.
"""

from __future__ import annotations

from typing import Any

import yaml

from .errors import ConfigError

MAX_BYTES = 1_000_000
MAX_VALUES = 100_000
MAX_DEPTH = 64  # nested lists and mappings; a real config nests five or six levels

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(text: str, source: str) -> tuple[Any, dict[tuple, int]]:
    """Parse YAML text into plain Python values and a {key path: line} map (lines start at 1)."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"the file is {len(text):,} bytes; a config may hold at most {MAX_BYTES:,}.", source=source)
    loader = _Loader(text)
    try:
        _check_depth(text, source)
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise _tab(text, mark, source) or ConfigError(
            f"malformed YAML: {exc.problem or exc.context}. Fix the syntax at this line.",
            source=source,
            line=mark.line + 1 if mark else None,
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"malformed YAML: {exc}", source=source) from None
    finally:
        loader.dispose()
    if node is None:
        return {}, {}
    lines: dict[tuple, int] = {(): node.start_mark.line + 1}
    budget = [MAX_VALUES]
    return _convert(node, (), lines, budget, source), lines


def _tab(text: str, mark, source: str) -> ConfigError | None:
    """The error for a tab in the indentation of the line PyYAML failed at, which it words as "found character
    that cannot start any token" (a tab elsewhere, between a key and its value or inside a block of text, is
    valid YAML and reads fine); None where there is none."""
    lines = text.split("\n")
    if mark is None or mark.line >= len(lines):
        return None
    line = lines[mark.line]
    indent = line[:len(line) - len(line.lstrip(" \t"))]
    if "\t" not in indent:
        return None
    column = indent.index("\t") + 1
    return ConfigError(f"a tab at line {mark.line + 1}, column {column}: YAML indents with spaces, not tabs. Replace "
                       "the tab with spaces.", source=source, line=mark.line + 1)


def _too_deep(source: str, mark) -> ConfigError:
    return ConfigError(f"lists and mappings are nested more than {MAX_DEPTH} levels deep here; a config may nest at "
                       f"most {MAX_DEPTH} (a real one needs five or six). Flatten the structure.",
                       source=source, line=mark.line + 1 if mark else None)


def _check_depth(text: str, source: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH from the event stream (the parser keeps an explicit stack, so this
    neither recurses nor builds anything; it stops at the first event past the limit)."""
    loader = _Loader(text)
    depth = 0
    try:
        while loader.check_event():
            event = loader.get_event()
            if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    raise _too_deep(source, event.start_mark)
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                depth -= 1
    except yaml.MarkedYAMLError as exc:
        # libyaml (PyYAML >= 6.0.4's C loader) has its own nesting limit, far above ours, and its scanner reads a
        # whole flow collection ahead of the parser, so its error can come before our first event past MAX_DEPTH
        if "nesting depth" in (exc.problem or ""):
            raise _too_deep(source, exc.problem_mark) from None
        raise
    finally:
        loader.dispose()


def _convert(node, path: tuple, lines: dict, budget: list, source: str, depth: int = 0) -> Any:
    if depth >= MAX_DEPTH and isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        raise _too_deep(source, node.start_mark)  # aliases can stack collections deeper than the text shows
    budget[0] -= 1
    if budget[0] < 0:
        raise ConfigError(
            f"the document expands to more than {MAX_VALUES:,} values (nested aliases?); "
            "write the config out without alias chains.",
            source=source,
            line=node.start_mark.line + 1,
        )
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and node.tag not in _PLAIN_TAGS:
        raise ConfigError(f"unsupported YAML tag {node.tag}; use plain strings, numbers, lists and mappings.",
                          source=source, line=node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise ConfigError("merge keys ('<<') are not supported in a config.", source=source,
                                  line=key_node.start_mark.line + 1)
            key = _convert(key_node, path, {}, budget, source, depth + 1)
            if isinstance(key, (list, dict)):
                raise ConfigError("a key must be a plain value.", source=source, line=key_node.start_mark.line + 1)
            if key in out:
                raise ConfigError(f"key '{key}' appears twice; keep one.", source=source,
                                  line=key_node.start_mark.line + 1, key=_dotted(path + (key,)))
            lines[path + (key,)] = key_node.start_mark.line + 1
            out[key] = _convert(value_node, path + (key,), lines, budget, source, depth + 1)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            items.append(_convert(item, path + (i,), lines, budget, source, depth + 1))
        return items
    return _scalar(node, source)


def _scalar(node, source: str) -> Any:
    constructor = yaml.SafeLoader.yaml_constructors.get(node.tag)
    if constructor is None:
        raise ConfigError(f"unsupported YAML tag {node.tag}; use plain strings, numbers, lists and mappings.",
                          source=source, line=node.start_mark.line + 1)
    try:
        return constructor(_SCALAR_LOADER, node)
    except (yaml.YAMLError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot read this value: {exc}", source=source, line=node.start_mark.line + 1) from None


def _dotted(path: tuple) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in path).replace(".[", "[")


_SCALAR_LOADER = yaml.SafeLoader("")
_PLAIN_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")
