"""`tripwire report ROOT`: every run's report written into the run, and an index page over them with the
runs' loss curves overlaid, for comparison."""

from __future__ import annotations

import os

from .naming import VALUE, collection_of, path_of
from .progress import Progress
from .htmlpage import escape, note, page, when, write_url
from .report_html import INDEX, write_report


def write_index(root: str, rows: list, output: str | None, storage_options: dict | None, steps=None) -> str:
    """Write each run's report into the run, then an index page (root/index.html or `output`) linking them,
    with the runs' losses overlaid. `steps`: as for build_report."""
    from . import plots
    from .run import open_run

    output = output or f"{root.rstrip('/')}/{INDEX}"
    train, evaluation, lines = [], [], []
    with Progress(len(rows), "reports") as bar:
        for row in rows:
            link, problem = None, row.get("error")
            if not problem:
                try:
                    run = open_run(row["url"], storage_options)
                    link = _link(write_report(run, steps=steps), output)
                    train += _loss_lines(run, row["name"], "train")
                    evaluation += _loss_lines(run, row["name"], "eval")
                except Exception as exc:  # noqa: BLE001 - one unreadable run must not stop the index
                    problem = f"{type(exc).__name__}: {exc}"
            name = f'<a href="{escape(link)}">{escape(row["name"])}</a>' if link else escape(row["name"])
            lines.append(f'<tr><td>{name}</td><td>{escape(row["framework"] or "?")}</td>'
                         f'<td><span class="badge {escape(row["status"])}">{escape(row["status"])}</span></td>'
                         f'<td>{"?" if row.get("steps") is None else row["steps"]}</td>'
                         f'<td>{"-" if row["last_step"] is None else row["last_step"]}</td>'
                         f'<td>{when(row["created"])}</td><td>{row["verdicts"]}</td>'
                         f'<td>{escape(problem or "")}</td></tr>')
            bar.update()
    panels = [(title, data) for title, data in (("train loss", train), ("eval loss", evaluation)) if data]
    plot = plots.img(plots.curves(panels), "loss curves of the runs") if panels else \
        note("no run holds a loss: nothing to compare.")
    body = ('<section><h2>Runs</h2><table class="runs"><tr><th>run</th><th>framework</th><th>status</th>'
            "<th>steps</th><th>last step</th><th>created</th><th>rules fired</th><th></th></tr>" + "".join(lines)
            + f"</table></section><section><h2>Loss curves</h2>{plot}</section>")
    html_page = page(f"tripwire runs under {root}", f"<h1>tripwire runs under {escape(root)}</h1>", body)
    write_url(output, html_page.encode(), storage_options)
    return output


def _loss_lines(run, label: str, mode: str) -> list:
    lines = []
    for name in run.tensor_names(mode=mode):
        if collection_of(name) == "losses" or (collection_of(name) == "metrics" and "loss" in name.lower()):
            steps, values = run.tensor(name).series(VALUE, mode=mode)
            lines.append((f"{label}: {path_of(name)}", steps, values))
    return lines


def _link(report_url: str, index_url: str) -> str:
    """A relative link when the index and the report share a file system (the folder can be moved or served as
    it is), else the report's URL."""
    (report_fs, report_path), (index_fs, index_path) = _split(report_url), _split(index_url)
    if report_fs != index_fs or report_fs == "memory":
        return report_url
    return os.path.relpath(report_path, os.path.dirname(index_path))


def _split(url: str) -> tuple[str, str]:
    return tuple(url.split("://", 1)) if "://" in url else ("file", os.path.abspath(url))
