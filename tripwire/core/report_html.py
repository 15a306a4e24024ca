"""`tripwire report`: one self-contained HTML file per run, and an index page over a folder of runs.

The file needs nothing but a browser: styles are inline, plots are inline
PNGs (see plots.py), and there is no script. A section the run has no data
for is replaced by a one-line note that says what to capture to get it. The
`report` action builds the same file from the training process, in a
background thread (`BackgroundReport`), because drawing takes seconds.
"""

from __future__ import annotations

import html
import json
import logging
import os
import threading
import time

import numpy as np

from .naming import VALUE, collection_of, path_of
from .progress import Progress

log = logging.getLogger("tripwire")
REPORT = "report.html"
INDEX = "index.html"
MAX_LAYERS = 8  # layers drawn in the distribution grids
MAX_STEPS = 8  # histogram columns (steps) per layer
MAX_PANELS = 12  # metric panels
MAX_MARKS = 20  # verdict marks on the curves
MODES_FOR_CLASSIFICATION = ("eval", "predict", "train")
MAX_TRIES = 20  # latest steps looked at for finite prediction scores


def cli(args, storage_options: dict) -> int:
    from .errors import RunNotFound
    from .listing import list_runs
    from .run import open_run
    from .store import MANIFEST, Store

    if Store(args.run, storage_options).exists(MANIFEST):
        where = write_report(open_run(args.run, storage_options), args.output, storage_options, progress=True,
                             steps=getattr(args, "steps", None))
        print(f"report written to {where}")
        return 0
    rows = list_runs(args.run, storage_options)
    if not rows:
        raise RunNotFound(f"no tripwire run at {args.run} and no runs under it (a run is a folder with a "
                          "run.json). `tripwire ls ROOT` lists the runs under a folder.")
    where = write_index(args.run, rows, args.output, storage_options, steps=getattr(args, "steps", None))
    print(f"index of {len(rows)} runs written to {where}")
    return 0


# -- writing ------------------------------------------------------------------------------------------------------
def write_report(run, output: str | None = None, storage_options: dict | None = None, verdicts=None,
                 progress: bool = False, steps=None) -> str:
    """Build the run's report and write it to `output` (a path or URL), or to report.html in the run.
    `steps`: the steps of the weight and gradient histograms (see build_report)."""
    text = build_report(run, verdicts, progress, steps=steps).encode()
    if output is None:
        run.store.put(REPORT, text)
        return run.store.url_of(REPORT)
    _write(output, text, storage_options)
    return output


def _write(url: str, data: bytes, storage_options: dict | None) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    fs.pipe_file(path, data)


def build_report(run, verdicts=None, progress: bool = False, steps=None) -> str:
    """The report of a run as one HTML document. `verdicts` overrides the stored ones (the training process
    knows its newest verdicts before the writer has stored them). `progress`: a bar on a terminal (the CLI's;
    never from a training process, whose terminal is the user's). `steps`: the steps at which weight and gradient
    histograms are drawn (each tensor at its saved step nearest to each; default: its first, middle and last
    saved steps)."""
    if steps is not None:
        steps = [int(s) for s in steps]
        if not 1 <= len(steps) <= MAX_STEPS:
            raise ValueError(f"steps: give 1 to {MAX_STEPS} steps (got {len(steps)}), or None for the first, "
                             "middle and last saved steps")
    from . import plots  # matplotlib: only now

    verdicts = sorted(run.verdicts() if verdicts is None else verdicts, key=lambda v: (v.step, v.time))
    info = run.info
    sections = [("summary", "Summary", lambda: _summary(run, info, verdicts)),
                ("verdicts", "Verdicts", lambda: _verdicts(verdicts, info)),
                ("curves", "Loss and metrics", lambda: _curves(plots, run, verdicts)),
                ("layers", "Layers over steps", lambda: _heatmaps(plots, run)),
                ("distributions", "Weight and gradient distributions", lambda: _distributions(plots, run, steps)),
                ("classification", "Classification", lambda: _classification(plots, run))]
    parts = []
    with Progress(len(sections) if progress else 0, "report") as bar:
        for anchor, title, make in sections:
            try:
                body = make()
            except Exception as exc:  # noqa: BLE001 - one section that cannot be drawn must not lose the others
                log.warning("tripwire: report section %r failed: %s: %s", title, type(exc).__name__, exc)
                body = [_note(f"this section could not be drawn: {type(exc).__name__}: {exc}")]
            parts.append(f'<section id="{anchor}"><h2>{title}</h2>{"".join(body)}</section>')
            bar.update()
    nav = " · ".join(f'<a href="#{a}">{t}</a>' for a, t, _ in sections)
    fired = sum(v.fired for v in verdicts)
    status = f'<span class="badge {html.escape(info["status"])}">{html.escape(info["status"])}</span>'
    head = (f"<h1>tripwire report: {_e(info.get('run_id') or run.url)} {status}</h1>"
            f'<p class="sub">{_e(run.url)} · {fired} rule(s) fired</p><nav>{nav}</nav>')
    return _page(f"tripwire report: {info.get('run_id') or run.url}", head, "".join(parts))


# -- sections -----------------------------------------------------------------------------------------------------
def _summary(run, info: dict, verdicts: list) -> list:
    import yaml

    known = {"format_version", "run_id", "framework", "framework_version", "tripwire_version", "created",
             "world_size", "config", "status", "workers", "lost_steps", "dropped_steps"}
    framework, version = str(info.get("framework")), str(info.get("framework_version", ""))
    rows = [("framework", version if version.startswith(framework) else f"{framework} {version}"),
            ("status", info["status"]),
            ("created", _when(info.get("created"))),
            ("tripwire", info.get("tripwire_version")),
            ("workers", f"world size {info.get('world_size', 1)}; with data: {', '.join(map(str, run.workers()))}")]
    for mode in run.modes():
        steps = run.steps(mode=mode)
        if steps:
            rows.append((f"steps ({mode})", f"{len(steps)} sampled, {steps[0]} to {steps[-1]}"))
    for collection in run.collections():
        names = run.tensor_names(collection=collection)
        rows.append((f"collection {collection}", f"{len(names)}: {', '.join(names[:4])}"
                     + (f" and {len(names) - 4} more" if len(names) > 4 else "")))
    if info.get("lost_steps") or info.get("dropped_steps"):
        rows.append(("lost", f"{info['lost_steps']} steps lost to storage errors, {info['dropped_steps']} dropped"))
    rows.append(("verdicts", ", ".join(f"{sum(v.status == s for v in verdicts)} {s}"
                                       for s in ("fired", "no_data", "error"))))
    rows += [(key, value if isinstance(value, str) else json.dumps(value, default=str))
             for key, value in info.items() if key not in known]
    table = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    config = yaml.safe_dump(info.get("config", {}), sort_keys=False, default_flow_style=None, width=100)
    return [f'<table class="summary">{table}</table>',
            f"<details><summary>config</summary><pre>{_e(config)}</pre></details>"]


def _verdicts(verdicts: list, info: dict) -> list:
    if not verdicts:
        rules = ", ".join(r.get("name", r["rule"]) for r in info.get("config", {}).get("rules", [])) or "none"
        return [_note(f"no verdicts: no rule fired (rules configured: {rules}).")]
    rows = []
    for v in verdicts:
        evidence = json.dumps(v.to_dict()["evidence"], separators=(", ", ": ")) if v.evidence else ""
        rows.append(f'<tr class="{_e(v.status)}"><td>{v.step}</td><td>{_e(v.mode)} / {v.worker}</td>'
                    f"<td><b>{_e(v.rule)}</b><br><small>{_e(v.status)} · {_e(v.source)}</small></td>"
                    f'<td>{_e(v.message)}{f"<pre>{_e(evidence)}</pre>" if evidence else ""}</td>'
                    f"<td>{_e(v.hint)}</td></tr>")
    return ['<table class="verdicts"><tr><th>step</th><th>mode / worker</th><th>rule</th><th>message and evidence'
            "</th><th>hint</th></tr>" + "".join(rows) + "</table>"]


def _curves(plots, run, verdicts: list) -> list:
    losses, metrics = [], {}
    for mode in run.modes():
        for name in run.tensor_names(mode=mode):
            collection = collection_of(name)
            if collection not in ("losses", "metrics", "optimizer"):
                continue
            tensor = run.tensor(name)
            if VALUE not in tensor.reductions(mode=mode):
                continue
            steps, values = tensor.series(VALUE, mode=mode)
            line = (f"{name} ({mode})", steps, values)
            if collection == "losses" or "loss" in path_of(name).lower():
                losses.append(line)
            else:
                metrics.setdefault(name, []).append(line)
    if not losses and not metrics:
        return [_note("no losses or metrics were captured: add `losses: {}` (and `metrics: {}`) to `collections`.")]
    marks = list(dict.fromkeys((v.step, v.rule) for v in verdicts if v.fired))[:MAX_MARKS]
    panels = ([("loss", losses)] if losses else []) + list(metrics.items())[:MAX_PANELS]
    return [plots.img(plots.curves(panels, marks), "loss and metric curves")]


HEATMAPS = (  # (title, collection, reduction, colour bar label, log scale)
    ("gradient L2 norm", "gradients", "l2", "L2 norm", True),
    ("weight L2 norm", "weights", "l2", "L2 norm", True),
    ("update ratio ‖update‖ / ‖weight‖", "updates", "l2", "ratio", True),
    ("activation zero fraction", "activations", "zero_fraction", "zero fraction", False),
)


def _heatmaps(plots, run) -> list:
    out = []
    for title, collection, reduction, label, log_scale in HEATMAPS:
        names = [n for n in run.tensor_names(collection=collection, mode="train")
                 if reduction in run.tensor(n).reductions(mode="train")]
        if not names:
            out.append(_note(f"{title}: not captured (needs collection `{collection}` with reduction "
                             f"`{reduction}`)."))
            continue
        series = {n: run.tensor(n).series(reduction, mode="train") for n in names}
        if collection == "updates":
            series = _update_ratios(run, series)
            if not series:
                out.append(_note(f"{title}: `updates` were captured but not the L2 norm of their weights."))
                continue
        steps, matrix, captured = _matrix(series)
        fig = plots.heatmap(title, [path_of(n) for n in series], steps, matrix, captured, label, log_scale)
        out.append(plots.img(fig, title))
    return out


def _update_ratios(run, updates: dict) -> dict:
    """‖update‖ / ‖weight‖ per parameter at the steps where both norms were captured."""
    out = {}
    for name, (steps, norms) in updates.items():
        path = path_of(name)
        weight = next((f"{c}/{path}" for c in ("weights", "biases")
                       if f"{c}/{path}" in run.tensor_names(collection=c, mode="train")), None)
        if weight is None or "l2" not in run.tensor(weight).reductions(mode="train"):
            continue
        w_steps, w_norms = run.tensor(weight).series("l2", mode="train")
        common, i, j = np.intersect1d(steps, w_steps, return_indices=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            out[name] = (common, norms[i] / w_norms[j])
    return out


def _matrix(series: dict):
    """{name: (steps, values)} -> (all steps, [names x steps] values, [names x steps] captured?)."""
    steps = np.unique(np.concatenate([s for s, _ in series.values()]))
    matrix = np.full((len(series), len(steps)), np.nan)
    captured = np.zeros(matrix.shape, dtype=bool)
    for row, (s, v) in enumerate(series.values()):
        columns = np.searchsorted(steps, s)
        matrix[row, columns] = v
        captured[row, columns] = True
    return steps, matrix, captured


def _distributions(plots, run, wanted=None) -> list:
    out = []
    for collection in ("weights", "gradients"):
        names = run.tensor_names(collection=collection, mode="train")
        full = [n for n in names if run.tensor(n).steps(mode="train", tensors=True)]
        banded = [n for n in names if {"min", "max", "mean", "std"} & set(run.tensor(n).reductions(mode="train"))]
        if full:
            cells, ncols, drawn = [], 3 if wanted is None else len(wanted), set()
            for name in full[:MAX_LAYERS]:
                chosen = _chosen(run.tensor(name).steps(mode="train", tensors=True), wanted)
                cells += [(f"{path_of(name)} @ step {s}", run.tensor(name).value(s, mode="train")) for s in chosen]
                cells += [None] * (ncols - len(chosen))
                drawn.update(chosen)
            at = ("the first, middle and last saved steps" if wanted is None else
                  f"the saved steps nearest to {', '.join(map(str, wanted))}")
            title = f"{collection}: histograms at {at}{_first(full)}"
            alt = f"{collection} histograms at steps {', '.join(map(str, sorted(drawn)))}"
            out.append(plots.img(plots.histograms(title, cells, ncols=ncols), alt))
        elif banded:
            layers = []
            for name in banded[:MAX_LAYERS]:
                tensor = run.tensor(name)
                got = {r: tensor.series(r, mode="train") for r in ("min", "max", "mean", "std")
                       if r in tensor.reductions(mode="train")}
                steps = next(iter(got.values()))[0]
                layers.append((path_of(name), steps, {r: v for r, (s, v) in got.items() if len(s) == len(steps)}))
            title = f"{collection}: min..max and mean ± std over steps (from reductions; no full tensors saved)"
            out.append(plots.img(plots.bands(title + _first(banded), layers), f"{collection} distributions"))
        else:
            out.append(_note(f"{collection}: not captured (save full tensors with `save: tensors`, or capture the "
                             "reductions min, mean, std, max)."))
    return out


def _first(names: list) -> str:
    return f" (first {MAX_LAYERS} of {len(names)} layers)" if len(names) > MAX_LAYERS else ""


def _chosen(steps: list, wanted: list | None = None) -> list:
    """The first, middle and last of the steps (fewer if there are fewer); or for each wanted step, the nearest of
    the steps (the earlier on a tie), each once."""
    if not steps:
        return []
    if wanted is None:
        return list(dict.fromkeys([steps[0], steps[len(steps) // 2], steps[-1]]))
    return list(dict.fromkeys(min(steps, key=lambda s: (abs(s - w), s)) for w in wanted))


def _classification(plots, run) -> list:
    from .curves import average_precision, precision_recall_curve, roc_auc, roc_curve

    found = _labels_and_predictions(run)
    if isinstance(found, str):
        return [_note(found)]
    mode, step, data = found
    y, classes = data["y"], data["classes"]
    binary = data["rank"].shape[1] == 1
    positives = [1] if binary else list(range(classes))
    roc, pr, aucs, aps = [], [], {}, {}
    for k, c in enumerate(positives):
        truth = y == c
        if truth.all() or not truth.any():
            continue  # one-vs-rest needs both kinds of sample
        rank = data["rank"][:, k]
        aucs[c], aps[c] = roc_auc(truth, rank), average_precision(truth, rank)
        fpr, tpr, _ = roc_curve(truth, rank)
        precision, recall, _ = precision_recall_curve(truth, rank)
        label = "" if binary else f"class {c} "
        roc.append((f"{label}AUC {aucs[c]:.4f}", fpr, tpr))
        pr.append((f"{label}AP {aps[c]:.4f}", recall, precision))
    if not aucs:
        areas = "Only one class is present: no ROC curve."
    elif binary:
        areas = f"ROC AUC <b>{aucs[1]:.4f}</b>, average precision <b>{aps[1]:.4f}</b>."
    else:
        areas = (f"Macro ROC AUC (one-vs-rest) <b>{np.mean(list(aucs.values())):.4f}</b>, macro average precision "
                 f"<b>{np.mean(list(aps.values())):.4f}</b>, over the {len(aucs)} classes present.")
    out = [f"<p>{len(y)} samples of {mode} step {step}, {classes} classes; scores ranked exactly (every distinct "
           f"score is a threshold). {areas}</p>"]
    if roc:
        out.append(plots.img(plots.roc_pr(roc, pr, float(np.mean(y == 1)) if binary else None), "ROC and PR curves"))
    prob = data["prob"]
    panels = ([("1", prob[y == 1, 0], prob[y != 1, 0])] if binary else
              [(str(c), prob[y == c, c], prob[y != c, c]) for c in range(classes)])
    out.append(plots.img(plots.score_distributions(panels), "score distribution per class"))
    matrix = np.zeros((classes, classes), dtype=np.int64)
    np.add.at(matrix, (y, data["predicted"]), 1)
    out.append(plots.img(plots.confusion(matrix, [str(c) for c in range(classes)]), "confusion matrix"))
    return out


def _labels_and_predictions(run):
    """(mode, step, class_scores(...)) at the latest step holding usable labels and predictions, or a note."""
    from .curves import class_scores

    reason = ("no labels and predictions saved as full tensors: add `labels: {save: tensors}` and `predictions: "
              "{save: tensors}` to `collections` (predictions come from the step's outputs).")
    for mode in MODES_FOR_CLASSIFICATION:
        labels = run.tensor_names(collection="labels", mode=mode)
        predictions = run.tensor_names(collection="predictions", mode=mode)
        if not labels or not predictions:
            continue
        lt, pt = run.tensor(labels[0]), run.tensor(predictions[0])
        steps = sorted(set(lt.steps(mode=mode, tensors=True)) & set(pt.steps(mode=mode, tensors=True)))
        for step in reversed(steps[-MAX_TRIES:]):
            try:
                return mode, step, class_scores(lt.value(step, mode=mode), pt.value(step, mode=mode))
            except ValueError as exc:
                reason = f"{labels[0]} and {predictions[0]} at {mode} step {step} cannot be used: {exc}."
    return reason


# -- index of runs ------------------------------------------------------------------------------------------------
def write_index(root: str, rows: list, output: str | None, storage_options: dict | None, steps=None) -> str:
    """Write each run's report into the run, then an index page (root/index.html or `output`) linking them,
    with the runs' losses overlaid. `steps`: as for build_report."""
    from . import plots
    from .run import open_run

    output = output or f"{root.rstrip('/')}/{INDEX}"
    train, evaluation, lines = [], [], []
    with Progress(len(rows), "reports") as bar:
        for row in rows:
            link, note = None, row.get("error")
            if not note:
                try:
                    run = open_run(row["url"], storage_options)
                    link = _link(write_report(run, steps=steps), output)
                    train += _loss_lines(run, row["name"], "train")
                    evaluation += _loss_lines(run, row["name"], "eval")
                except Exception as exc:  # noqa: BLE001 - one unreadable run must not stop the index
                    note = f"{type(exc).__name__}: {exc}"
            name = f'<a href="{_e(link)}">{_e(row["name"])}</a>' if link else _e(row["name"])
            lines.append(f'<tr><td>{name}</td><td>{_e(row["framework"] or "?")}</td>'
                         f'<td><span class="badge {_e(row["status"])}">{_e(row["status"])}</span></td>'
                         f'<td>{"?" if row.get("steps") is None else row["steps"]}</td>'
                         f'<td>{"-" if row["last_step"] is None else row["last_step"]}</td>'
                         f'<td>{_when(row["created"])}</td><td>{row["verdicts"]}</td>'
                         f'<td>{_e(note or "")}</td></tr>')
            bar.update()
    panels = [(title, data) for title, data in (("train loss", train), ("eval loss", evaluation)) if data]
    plot = plots.img(plots.curves(panels), "loss curves of the runs") if panels else \
        _note("no run holds a loss: nothing to compare.")
    body = ('<section><h2>Runs</h2><table class="runs"><tr><th>run</th><th>framework</th><th>status</th>'
            "<th>steps</th><th>last step</th><th>created</th><th>rules fired</th><th></th></tr>" + "".join(lines)
            + f"</table></section><section><h2>Loss curves</h2>{plot}</section>")
    page = _page(f"tripwire runs under {root}", f"<h1>tripwire runs under {_e(root)}</h1>", body)
    _write(output, page.encode(), storage_options)
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


# -- the report action, off the training thread -------------------------------------------------------------------
class BackgroundReport:
    """Builds a run's HTML report in a background thread, one build at a time. A request during a build makes one
    more build after it (requests in between coalesce into it), so the last request is always honoured."""

    def __init__(self, store):
        self.store = store
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wanted: list | None = None
        self._warned = False

    def request(self, verdicts: list) -> None:
        with self._lock:
            self._wanted = list(verdicts)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tripwire-report", daemon=True)
                self._thread.start()

    def wait(self, timeout: float = 300.0) -> None:
        """Wait for the builds asked for so far (at the end of training)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _loop(self) -> None:
        from .run import Run

        while True:
            with self._lock:
                verdicts, self._wanted = self._wanted, None
                if verdicts is None:
                    self._thread = None
                    return
            started = time.monotonic()
            try:
                write_report(Run(self.store), verdicts=verdicts)
                log.info("tripwire: report written to %s in %.1fs", self.store.url_of(REPORT),
                         time.monotonic() - started)
            except Exception as exc:  # noqa: BLE001 - a report must never take training down
                if not self._warned:
                    self._warned = True
                    hint = " (pip install 'tripwire[report]')" if isinstance(exc, ImportError) else ""
                    log.warning("tripwire: could not write the HTML report%s: %s: %s", hint, type(exc).__name__, exc)


# -- HTML ---------------------------------------------------------------------------------------------------------
def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _note(text: str) -> str:
    return f'<p class="note">{_e(text)}</p>'


def _when(t) -> str:
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
tr.fired td{background:#fff4f4}
tr.no_data td,tr.error td{color:#666} pre{background:#f3f4f6;padding:6px 8px;border-radius:4px;font-size:12px;
white-space:pre-wrap;word-break:break-word;margin:6px 0 0} .note{color:#777;font-style:italic;margin:4px 0}
img.plot{max-width:100%;height:auto;display:block;margin:8px 0}
.badge{font-size:12px;padding:2px 8px;border-radius:10px;vertical-align:middle;background:#ddd;color:#333}
.badge.finished{background:#d9f2dd;color:#145c22} .badge.stopped{background:#ffe8c2;color:#7a4b00}
.badge.failed,.badge.crashed{background:#ffd6d6;color:#8a1010} .badge.running{background:#d6e8ff;color:#0b4a8a}
footer{color:#888;font-size:12px;text-align:center;margin:20px}
"""


def _page(title: str, head: str, body: str) -> str:
    from .. import __version__

    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            '<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">'
            f"<style>{STYLE}</style></head><body><header>{head}</header><main>{body}</main>"
            f"<footer>tripwire {__version__} · written {_when(time.time())}</footer></body></html>")
