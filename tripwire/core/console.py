"""Where tripwire's lines go when the user has not configured logging: the console, around the progress bar.

tripwire speaks through Python's `logging` (logger "tripwire"). Left alone, Python prints a library's WARNING lines
through its last-resort handler and drops its INFO lines, so the line that says a healthy run was checked and nothing
fired would never be seen; and a line written to stderr while tqdm draws a progress bar (Lightning, Hugging Face
Trainer) lands in the middle of the bar. So, as Lightning does for its own logger, tripwire gives its logger one
handler when neither it nor the root logger has one, and that handler writes through `tqdm.write` when tqdm is in
use: the bar is cleared, the line printed, the bar drawn again. A user who configures logging keeps full control.
"""

from __future__ import annotations

import logging
import sys

LOGGER = "tripwire"


class ConsoleHandler(logging.Handler):
    """Lines to stderr (the stream of the moment, so a redirected or captured stderr is honoured), through tqdm's
    writer while tqdm is loaded. tqdm is never imported here: if the framework has not loaded it, no bar is drawn."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            tqdm = sys.modules.get("tqdm")
            if tqdm is not None and hasattr(tqdm, "tqdm"):
                tqdm.tqdm.write(line, file=sys.stderr)
            else:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's own policy: report through handleError, never raise
            self.handleError(record)


def show_on_console() -> None:
    """Give the "tripwire" logger a ConsoleHandler at INFO, unless logging is configured already (a handler on
    it or on the root logger, or a level the user set); once per process."""
    logger = logging.getLogger(LOGGER)
    if logger.handlers or logging.getLogger().handlers or logger.level != logging.NOTSET:
        return
    handler = ConsoleHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the root logger has no handler: propagating would add Python's last resort
