"""The checker a config (and a compare name map) is validated with: every mistake is noted at its file, line and
key, and the part of the config it is in is left out, so that checking goes on; `done` raises one ConfigError
that lists them all."""

from __future__ import annotations

import re
from contextlib import contextmanager

from .errors import ConfigError, did_you_mean
from .ranges import ANY, Range, finite


class Invalid(Exception):
    """A value `Checker.fail` reported: the part of the config it is in is left out (`Checker.part`), and
    checking goes on with the next."""


class Checker:
    """Type, key and range checks that note each mistake at its file, line and key. `done` raises one ConfigError
    that lists them all: a config with four mistakes takes one run to fix, not four."""

    def __init__(self, source: str, lines: dict, imports: bool = True):
        self.source, self.lines, self.imports = source, lines, imports
        self.left_out: list = []  # custom rules not imported (imports=False)
        self.problems: list[ConfigError] = []

    def error(self, path: tuple, message: str) -> ConfigError:
        line = None
        for i in range(len(path), -1, -1):
            if path[:i] in self.lines:
                line = self.lines[path[:i]]
                break
        key = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in path).replace(".[", "[") or None
        return ConfigError(message, source=self.source, line=line, key=key)

    def report(self, path: tuple, message: str) -> None:
        """Note a mistake; checking goes on."""
        self.problems.append(self.error(path, message))

    def fail(self, path: tuple, message: str):
        """Note a mistake and leave out the part of the config being checked."""
        self.report(path, message)
        raise Invalid

    @contextmanager
    def part(self):
        """Check one part of the config (a key, a list item, a rule): a mistake in it leaves it out, and checking
        goes on with the next part."""
        try:
            yield
        except Invalid:
            pass

    def done(self) -> None:
        """Raise every mistake noted, in line order, as one ConfigError."""
        if self.problems:
            raise ConfigError.of(sorted(self.problems, key=lambda p: p.line or 0))

    def mapping(self, value, path, allowed) -> dict:
        """The mapping without its unknown keys, each reported."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.fail(path, f"expected a mapping with keys {', '.join(allowed)}; got {shown(value)}.")
        for key in value:
            if key not in allowed:
                self.report(path + (key,), f"unknown key '{key}'. Allowed here: {', '.join(allowed)}."
                            + did_you_mean(key, allowed))
        return {k: v for k, v in value.items() if k in allowed}

    def needs(self, raw: dict, given, key: str, path, message: str) -> None:
        """`raw` (the checked mapping `given`) must hold `key`: `message` says so, unless a key reported as unknown
        (misspelt) stands for it."""
        if key not in raw:
            if given and len(raw) < len(given):
                raise Invalid
            self.fail(path, message)

    def section(self, value, path, allowed) -> dict:
        """A mapping of the config, or {} where it is not one (reported): its keys' defaults then stand."""
        with self.part():
            return self.mapping(value, path, allowed)
        return {}

    def integer(self, value, path, minimum=None, optional=False):
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"expected an integer{' or null' if optional else ''}; got {shown(value)}.")
        if minimum is not None and value < minimum:
            self.fail(path, f"must be at least {minimum}; got {value}.")
        return value

    def number(self, value, path, limits: Range = ANY):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(path, f"expected a number; got {shown(value)}.")
        return float(self.within(value, path, limits))

    def within(self, value, path, limits: Range):
        """A number, checked to be finite and within its range."""
        if not finite(value):
            self.fail(path, f"must be a finite number; got {value} ({_YAML_WORDS[str(value)]} in YAML). "
                            f"Valid: {limits}.")
        if value not in limits:
            self.fail(path, f"`{path[-1]}` must be {limits}; found {value}.")
        return value

    def boolean(self, value, path):
        if not isinstance(value, bool):
            self.fail(path, f"expected true or false; got {shown(value)}.")
        return value

    def string(self, value, path):
        if not isinstance(value, str):
            self.fail(path, f"expected a string; got {shown(value)}.")
        return value

    def choice(self, value, path, choices):
        if value not in choices:
            self.fail(path, f"'{value}' is not allowed. Choose one of: {', '.join(map(str, choices))}."
                      + did_you_mean(value, [str(c) for c in choices]))
        return value

    def listing(self, value, path, item) -> list:
        """The items that pass `item(value, path)`; each that does not is reported and left out."""
        if value is None:
            return []
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list):
            self.fail(path, f"expected a list; got {shown(value)}.")
        out = []
        for i, v in enumerate(value):
            with self.part():
                out.append(item(v, path + (i,)))
        return out

    def regex(self, value, path):
        import re

        self.string(value, path)
        try:
            re.compile(value)
        except re.error as exc:
            self.fail(path, f"'{value}' is not a valid regular expression: {exc}.")
        return value


_YAML_WORDS = {"inf": ".inf", "-inf": "-.inf", "nan": ".nan"}


def shown(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) < 60 else text[:57] + '...'}"
