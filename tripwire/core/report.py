"""Reports written into a run: `report.json`, the verdicts and a summary; `report.html` (report_html.py) builds on
it. The `report` action writes both off the training thread (`BackgroundReport`): storage that is slow or hangs
holds only that thread, never a training step."""

from __future__ import annotations

import logging
import threading
import time

from .errors import install
from .store import Store

log = logging.getLogger("tripwire")


def write_json_report(store: Store, verdicts: list) -> None:
    fired = [v for v in verdicts if v.fired]
    store.put_json("report.json", {
        "run": store.url,
        "written": time.time(),
        "fired": len(fired),
        "first_fired_step": min((v.step for v in fired), default=None),
        "rules_fired": sorted({v.rule for v in fired}),
        "verdicts": [v.to_dict() for v in verdicts],
    })


class BackgroundReport:
    """Writes a run's report.json, and with `html` its report.html, in a background thread, one build at a time. A
    request during a build makes one more build after it (requests in between coalesce into it), so the last
    request is always honoured."""

    def __init__(self, store, html: bool = True):
        self.store, self.html = store, html
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wanted: list | None = None
        self._warned: set = set()

    def request(self, verdicts: list) -> None:
        with self._lock:
            self._wanted = list(verdicts)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tripwire-report", daemon=True)
                self._thread.start()

    def wait(self, timeout: float = 300.0) -> None:
        """Wait for the builds asked for so far (at the end of training), at most `timeout` seconds."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _loop(self) -> None:
        from . import report_html
        from .run import Run

        while True:
            with self._lock:
                verdicts, self._wanted = self._wanted, None
                if verdicts is None:
                    self._thread = None
                    return
            self._attempt("report.json", lambda: write_json_report(self.store, verdicts))
            if self.html:
                started = time.monotonic()
                if self._attempt(report_html.REPORT, lambda: report_html.write_report(Run(self.store),
                                                                                      verdicts=verdicts)):
                    log.info("tripwire: report written to %s in %.1fs", self.store.url_of(report_html.REPORT),
                             time.monotonic() - started)

    def _attempt(self, what: str, write) -> bool:
        try:
            write()
            return True
        except Exception as exc:  # noqa: BLE001 - a report must never take training down
            if what not in self._warned:
                self._warned.add(what)
                hint = f" ({install('report')})" if isinstance(exc, ImportError) else ""
                log.warning("tripwire: could not write the %s%s: %s: %s", what, hint, type(exc).__name__, exc)
            return False
