"""A progress bar for long commands (report, export, ls over S3): drawn on a terminal, silent anywhere else.

Written here rather than taken from tqdm so that tripwire needs no extra
dependency; it draws at most ten times a second and erases itself when done,
so a log or a pipe never sees it.
"""

from __future__ import annotations

import shutil
import sys
import time

_WIDTH = 30


class Progress:
    """`with Progress(total, "label") as bar: … bar.update()`; draws on stderr only if stderr is a terminal."""

    def __init__(self, total: int, label: str, stream=None):
        self.total, self.label, self.done = max(int(total), 0), label, 0
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty()) and self.total > 1
        self._drawn = 0.0
        self._columns = max(shutil.get_terminal_size().columns - 1, 40)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.done + n, self.total)
        now = time.monotonic()
        if self.enabled and (now - self._drawn >= 0.1 or self.done == self.total):
            self._drawn = now
            filled = _WIDTH * self.done // self.total
            line = f"\r{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {self.done}/{self.total} {note}"
            self.stream.write(line[:self._columns].ljust(self._columns))
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\r" + " " * self._columns + "\r")
            self.stream.flush()
            self._drawn = 0.0
