"""Reports written into a run: `report.json`, the verdicts and a summary (the HTML report builds on it)."""

from __future__ import annotations

import time

from .store import Store


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
