"""`tripwire report`: one self-contained HTML file per run (the index over a folder of runs: report_index.py).

The file needs nothing but a browser: styles are inline, plots are inline
PNGs (see plots.py), and there is no script. The sections are those of the
data the run holds (an XGBoost run: feature importance, trees, eval metrics
per set; a neural network: layers, distributions, classification), none for
what was not captured. Every plot over steps marks the fired verdicts and the
step of the first NaN/Inf loss. The
`report` action builds the same file from the training process, in a
background thread (`BackgroundReport`), because drawing takes seconds.
"""

from __future__ import annotations

import html
import json
import logging

import numpy as np

from .htmlpage import escape, note, page, when, write_url
from .naming import VALUE, collection_of, path_of
from .progress import Progress
from .verdict import SEVERITIES

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
    from .cli import say_damage
    from .errors import RunNotFound
    from .listing import list_runs
    from .run import open_run
    from .store import MANIFEST, Store

    if Store(args.run, storage_options).exists(MANIFEST):
        run = open_run(args.run, storage_options)
        where = write_report(run, args.output, storage_options, progress=True, steps=getattr(args, "steps", None))
        print(f"report written to {where}")
        say_damage(run, "report")
        return 0
    rows = list_runs(args.run, storage_options)
    if not rows:
        raise RunNotFound(f"no tripwire run at {args.run} and no runs under it (a run is a folder with a "
                          "run.json). `tripwire ls ROOT` lists the runs under a folder.")
    from .report_index import write_index

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
    write_url(output, text, storage_options)
    return output


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
    marks = plots.Marks(tuple(dict.fromkeys((v.step, v.rule) for v in verdicts if v.fired))[:MAX_MARKS],
                        first_nonfinite_loss(run))
    sections = [("summary", "Summary", lambda: _summary(run, info, verdicts)),
                ("diagnosis", "Diagnosis", lambda: _diagnoses(verdicts)),
                ("verdicts", "Verdicts", lambda: _verdicts(verdicts, info)),
                *_data_sections(plots, run, marks, steps)]
    parts = []
    with Progress(len(sections) if progress else 0, "report") as bar:
        for anchor, title, make in sections:
            try:
                body = make()
            except Exception as exc:  # noqa: BLE001 - one section that cannot be drawn must not lose the others
                log.warning("tripwire: report section %r failed: %s: %s", title, type(exc).__name__, exc)
                body = [note(f"this section could not be drawn: {type(exc).__name__}: {exc}")]
            parts.append(f'<section id="{anchor}"><h2>{title}</h2>{"".join(body)}</section>')
            bar.update()
    nav = " · ".join(f'<a href="#{a}">{t}</a>' for a, t, _ in sections)
    counted, info_only = sum(v.counts for v in verdicts), sum(v.fired and not v.counts for v in verdicts)
    status = f'<span class="badge {html.escape(info["status"])}">{html.escape(info["status"])}</span>'
    head = (f"<h1>tripwire report: {escape(info.get('run_id') or run.url)} {status}</h1>"
            f'<p class="sub">{escape(run.url)} · {counted} finding(s) at warning or error, {info_only} at info</p>'
            f"<nav>{nav}</nav>")
    return page(f"tripwire report: {info.get('run_id') or run.url}", head, "".join(parts))


def _data_sections(plots, run, marks, steps) -> list:
    """(anchor, title, make) of the sections over captured data, each only where the run holds its data: an
    XGBoost run gets feature importance, trees and eval metrics per set, a neural network its layers,
    distributions and classification; nothing is shown for what was not captured."""
    held = set(run.collections())
    candidates = [
        ("curves", "Loss and metrics", bool(_scalars(run, per_set=False)), lambda: _curves(plots, run, marks)),
        ("eval_metrics", "Eval metrics per set", bool(_scalars(run, per_set=True)),
         lambda: _eval_metrics(plots, run, marks)),
        ("importance", "Feature importance over rounds", "feature_importance" in held,
         lambda: _importance(plots, run, marks)),
        ("trees", "Trees over rounds: depth, leaves, splits", "trees" in held, lambda: _trees(plots, run, marks)),
        ("layers", "Layers over steps", any(_heatmap_names(run, c, r) for _, c, r, _, _ in HEATMAPS),
         lambda: _heatmaps(plots, run, marks)),
        ("distributions", "Weight and gradient distributions", bool({"weights", "gradients"} & held),
         lambda: _distributions(plots, run, steps, marks)),
        ("classification", "Classification", {"labels", "predictions"} <= held,
         lambda: _classification(plots, run)),
    ]
    return [(anchor, title, make) for anchor, title, wanted, make in candidates if wanted]


def first_nonfinite_loss(run) -> int | None:
    """The first step at which a loss (`losses/*`, any mode) is NaN or Inf; None where every loss is finite."""
    first = None
    for mode in run.modes():
        for name in run.tensor_names(collection="losses", mode=mode):
            tensor = run.tensor(name)
            if VALUE not in tensor.reductions(mode=mode):
                continue
            steps, values = tensor.series(VALUE, mode=mode)
            bad = steps[~np.isfinite(values)]
            if bad.size and (first is None or bad[0] < first):
                first = int(bad[0])
    return first


# -- sections -----------------------------------------------------------------------------------------------------
def _summary(run, info: dict, verdicts: list) -> list:
    import yaml

    known = {"format_version", "run_id", "framework", "framework_version", "tripwire_version", "created",
             "world_size", "config", "status", "workers", "lost_steps", "dropped_steps", "partial_steps"}
    framework, version = str(info.get("framework")), str(info.get("framework_version", ""))
    rows = [("framework", version if version.startswith(framework) else f"{framework} {version}"),
            ("status", info["status"]),
            ("created", when(info.get("created"))),
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
    if info.get("lost_steps") or info.get("dropped_steps") or info.get("partial_steps"):
        rows.append(("lost", f"{info['lost_steps']} steps lost to storage errors, {info['dropped_steps']} dropped, "
                             f"{info.get('partial_steps', 0)} stored without their full tensors"))
    for rel, why in sorted(run.damaged.items()):
        rows.append(("damaged", f"{rel}: {why}"))
    rows.append(("verdicts", ", ".join([*(f"{sum(v.fired and v.severity == s for v in verdicts)} {s}"
                                          for s in SEVERITIES),
                                        *(f"{sum(v.status == s for v in verdicts)} {s}" for s in ("no_data", "error"))])))
    rows += [(key, value if isinstance(value, str) else json.dumps(value, default=str))
             for key, value in info.items() if key not in known]
    table = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows)
    config = yaml.safe_dump(info.get("config", {}), sort_keys=False, default_flow_style=None, width=100)
    return [f'<table class="summary">{table}</table>',
            f"<details><summary>config</summary><pre>{escape(config)}</pre></details>"]


def _diagnoses(verdicts: list) -> list:
    """One block per root cause: what went wrong and from when, the evidence, the fix, the symptoms it explains."""
    from .diagnosis import diagnose

    found = diagnose(verdicts)
    if not found:
        return [note("no rule fired.")]
    blocks = []
    for d in found:
        p = d.primary
        explains = (f"<p><small>explains {len(d.symptoms)} more verdict(s): "
                    f"{escape(', '.join(dict.fromkeys(v.rule for v in d.symptoms)))}</small></p>" if d.symptoms else "")
        blocks.append(f'<div class="diagnosis {escape(d.severity)}"><h3>{escape(d.cause)} <small>{escape(d.severity)}'
                      f", from step {d.began} ({escape(p.mode)}, worker {p.worker})</small></h3>"
                      f"<p><b>{escape(p.rule)}</b> at step {p.step}: {escape(p.message)}</p>"
                      f"<p><b>fix:</b> {escape(p.hint)}</p>{explains}</div>")
    return blocks


def _verdicts(verdicts: list, info: dict) -> list:
    if not verdicts:
        rules = ", ".join(r.get("name", r["rule"]) for r in info.get("config", {}).get("rules", [])) or "none"
        return [note(f"no verdicts: no rule fired (rules configured: {rules}).")]
    rows = []
    for v in verdicts:
        evidence = json.dumps(v.to_dict()["evidence"], separators=(", ", ": ")) if v.evidence else ""
        what = v.severity if v.fired else v.status
        rows.append(f'<tr class="{escape(v.status)} {escape(what)}"><td>{v.step}</td><td>{escape(v.mode)} / '
                    f"{v.worker}</td><td><b>{escape(v.rule)}</b><br><small>{escape(what)} · {escape(v.source)}"
                    "</small></td>"
                    f'<td>{escape(v.message)}{f"<pre>{escape(evidence)}</pre>" if evidence else ""}</td>'
                    f"<td>{escape(v.hint)}</td></tr>")
    return ['<table class="verdicts"><tr><th>step</th><th>mode / worker</th><th>rule</th><th>message and evidence'
            "</th><th>hint</th></tr>" + "".join(rows) + "</table>"]


def _scalars(run, per_set: bool) -> list:
    """(name, mode) of the scalar series the curves draw: losses, metrics, optimizer state; with `per_set`, only
    the metrics of an XGBoost eval set (`metrics/<set>/<metric>`, drawn per metric), else all the others."""
    booster = run.info.get("framework") == "xgboost"
    return [(name, mode) for mode in run.modes() for name in run.tensor_names(mode=mode)
            if collection_of(name) in ("losses", "metrics", "optimizer")
            and (booster and collection_of(name) == "metrics" and "/" in path_of(name)) == per_set
            and VALUE in run.tensor(name).reductions(mode=mode)]


def _lines(run, per_set: bool) -> list:
    """(name, mode, steps, values) of the series `_scalars` names."""
    return [(name, mode, *run.tensor(name).series(VALUE, mode=mode)) for name, mode in _scalars(run, per_set)]


def _curves(plots, run, marks) -> list:
    losses, metrics = [], {}
    for name, mode, steps, values in _lines(run, per_set=False):
        line = (f"{name} ({mode})", steps, values)
        if collection_of(name) == "losses" or "loss" in path_of(name).lower():
            losses.append(line)
        else:
            metrics.setdefault(name, []).append(line)
    panels = ([("loss", losses)] if losses else []) + list(metrics.items())[:MAX_PANELS]
    return [plots.img(plots.curves(panels, marks), "loss and metric curves"), _marks_legend(marks)]


def _marks_legend(marks) -> str:
    """The verdicts and the first NaN/Inf loss the plots mark, by step, in words (on a plot, the labels of
    verdicts close together merge into one)."""
    by_step: dict = {}
    for step, rule in marks.verdicts:
        by_step.setdefault(step, []).append(rule)
    items = [f"step {step}: {', '.join(rules)}" for step, rules in sorted(by_step.items())]
    nan = (f'<span class="nonfinite">loss NaN/Inf from step {marks.nonfinite}</span>'
           if marks.nonfinite is not None else "")
    if not items and not nan:
        return ""
    listed = f"verdicts marked: {escape('; '.join(items))}" if items else ""
    return f'<p class="marks">{listed}{" · " if listed and nan else ""}{nan}</p>'


def _eval_metrics(plots, run, marks) -> list:
    """XGBoost's eval log: one panel per metric, one line per eval set."""
    panels: dict = {}
    for name, mode, steps, values in _lines(run, per_set=True):
        data, metric = path_of(name).rsplit("/", 1)
        panels.setdefault(metric, []).append((f"{data}" + ("" if mode == "train" else f" ({mode})"), steps, values))
    return [plots.img(plots.curves(list(panels.items())[:MAX_PANELS], marks), "eval metrics per set")]


MAX_FEATURES = 10  # features drawn per importance type: the most important at the last round


def _importance(plots, run, marks) -> list:
    """Per importance type (weight, gain, …) the features' scores over rounds: the MAX_FEATURES most important
    at the last round."""
    kinds: dict = {}
    for name in run.tensor_names(collection="feature_importance", mode="train"):
        kind, feature = path_of(name).split("/", 1)
        kinds.setdefault(kind, []).append((feature, *run.tensor(name).series(VALUE, mode="train")))
    panels = []
    for kind, lines in kinds.items():
        lines.sort(key=lambda line: -line[2][-1] if len(line[2]) else 0)
        title = kind + (f" (top {MAX_FEATURES} of {len(lines)} features)" if len(lines) > MAX_FEATURES else "")
        panels.append((title, lines[:MAX_FEATURES]))
    return [plots.img(plots.curves(panels, marks), "feature importance over rounds")]


def _trees(plots, run, marks) -> list:
    """The trees added at each sampled round: depth of the deepest, leaves and splits summed."""
    panels = [(path_of(name), [(path_of(name), *run.tensor(name).series(VALUE, mode="train"))])
              for name in run.tensor_names(collection="trees", mode="train")]
    return [plots.img(plots.curves(panels, marks, ncols=3), "tree depth, leaves and splits over rounds")]


HEATMAPS = (  # (title, collection, reduction, colour bar label, log scale)
    ("gradient L2 norm", "gradients", "l2", "L2 norm", True),
    ("weight L2 norm", "weights", "l2", "L2 norm", True),
    ("update ratio ‖update‖ / ‖weight‖", "updates", "l2", "ratio", True),
    ("activation zero fraction", "activations", "zero_fraction", "zero fraction", False),
)


def _heatmap_names(run, collection: str, reduction: str) -> list:
    return [n for n in run.tensor_names(collection=collection, mode="train")
            if reduction in run.tensor(n).reductions(mode="train")]


def _heatmaps(plots, run, marks) -> list:
    out = []
    for title, collection, reduction, label, log_scale in HEATMAPS:
        names = _heatmap_names(run, collection, reduction)
        if not names:
            continue
        series = {n: run.tensor(n).series(reduction, mode="train") for n in names}
        if collection == "updates":
            series = _update_ratios(run, series)
            if not series:
                out.append(note(f"{title}: `updates` were captured but not the L2 norm of their weights."))
                continue
        steps, matrix, captured = _matrix(series)
        fig = plots.heatmap(title, [path_of(n) for n in series], steps, matrix, captured, label, log_scale, marks)
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


def _distributions(plots, run, wanted=None, marks=None) -> list:
    out = []
    after = marks.nonfinite if marks is not None else None  # steps from here on come after the first NaN loss
    for collection in ("weights", "gradients"):
        names = run.tensor_names(collection=collection, mode="train")
        full = [n for n in names if run.tensor(n).steps(mode="train", tensors=True)]
        banded = [n for n in names if {"min", "max", "mean", "std"} & set(run.tensor(n).reductions(mode="train"))]
        if full:
            cells, ncols, drawn = [], 3 if wanted is None else len(wanted), set()
            for name in full[:MAX_LAYERS]:
                chosen = _chosen(run.tensor(name).steps(mode="train", tensors=True), wanted)
                cells += [(f"{path_of(name)} @ step {s}" + (" (loss NaN/Inf)" if after is not None and s >= after
                                                             else ""), run.tensor(name).value(s, mode="train"))
                          for s in chosen]
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
            out.append(plots.img(plots.bands(title + _first(banded), layers, marks=marks),
                                 f"{collection} distributions"))
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
        return [note(found)]
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
