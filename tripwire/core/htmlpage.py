"""The page around tripwire's HTML reports: inline styles (no network needed to open it), escaping, and
writing it to any fsspec URL."""

from __future__ import annotations

import html
import time


def write_url(url: str, data: bytes, storage_options: dict | None) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    fs.pipe_file(path, data)


def escape(value) -> str:
    return html.escape(str(value), quote=True)


def note(text: str) -> str:
    return f'<p class="note">{escape(text)}</p>'


def when(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "?"


STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d1d1f;background:#f6f7f9}
header,main{max-width:1100px;margin:0 auto;padding:0 24px}
h1{font-size:22px;margin:20px 0 4px} h2{font-size:17px;margin:0 0 10px;border-bottom:1px solid #ddd;padding-bottom:4px}
section{background:#fff;border:1px solid #e3e5e8;border-radius:8px;padding:14px 18px;margin:14px auto}
.sub{color:#666;margin:0 0 8px;word-break:break-all} nav a{margin-right:4px}
table{border-collapse:collapse;width:100%} th,td{text-align:left;vertical-align:top;padding:5px 8px;
border-bottom:1px solid #eee} table.summary th{width:170px;color:#555;font-weight:600}
table.verdicts td:first-child{font-variant-numeric:tabular-nums} table.verdicts td:nth-child(4){width:42%}
tr.fired td{background:#fff4f4}tr.fired.info td{background:#f4f8ff}
tr.no_data td,tr.error td{color:#666} pre{background:#f3f4f6;padding:6px 8px;border-radius:4px;font-size:12px;
white-space:pre-wrap;word-break:break-word;margin:6px 0 0} .note{color:#777;font-style:italic;margin:4px 0}
img.plot{max-width:100%;height:auto;display:block;margin:8px 0}
.badge{font-size:12px;padding:2px 8px;border-radius:10px;vertical-align:middle;background:#ddd;color:#333}
.badge.finished{background:#d9f2dd;color:#145c22} .badge.stopped{background:#ffe8c2;color:#7a4b00}
.badge.failed,.badge.crashed{background:#ffd6d6;color:#8a1010} .badge.running{background:#d6e8ff;color:#0b4a8a}
footer{color:#888;font-size:12px;text-align:center;margin:20px}
div.diagnosis{border-left:4px solid #c33;padding:4px 12px;margin:8px 0} div.diagnosis.warning{border-color:#d90}
div.diagnosis.info{border-color:#69c} p.marks{color:#555;font-size:12px;margin:0 0 8px}
span.nonfinite{color:#d62728;font-weight:600}
div.diagnosis h3{font-size:15px;margin:2px 0} div.diagnosis p{margin:3px 0}
"""


def page(title: str, head: str, body: str) -> str:
    from .. import __version__

    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            '<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">'
            f"<style>{STYLE}</style></head><body><header>{head}</header><main>{body}</main>"
            f"<footer>tripwire {__version__} · written {when(time.time())}</footer></body></html>")
