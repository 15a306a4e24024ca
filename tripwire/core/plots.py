"""The report's figures, drawn with matplotlib and returned as inline PNG `<img>` tags.

Figures are made with `matplotlib.figure.Figure` and its Agg canvas, never
through pyplot: no global backend is switched (the training process may use
one of its own) and reports can be drawn from a background thread. This
module imports matplotlib, so import it only when a report is made.
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

WIDTH = 10.0  # inches; 100 dpi: 1000 px wide
DPI = 100
NONFINITE = "#e0119d"  # magenta: NaN or Inf in heatmaps
NONFINITE_LOSS = "#d62728"  # red: the step of the first NaN/Inf loss, on every plot over steps
MAX_LEGEND = 12


def figure(height: float, width: float = WIDTH, layout: str | None = "constrained") -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def _grid(fig: Figure, nrows: int, ncols: int, top_in: float = 0.5, bottom_in: float = 0.35):
    """Axes of a grid of small plots, placed by hand: constrained layout would take longer than the drawing."""
    height = fig.get_figheight()
    fig.subplots_adjust(left=0.05, right=0.99, top=1 - top_in / height, bottom=bottom_in / height,
                        wspace=0.18, hspace=0.6)
    return fig.subplots(nrows, ncols, squeeze=False).ravel()


def img(fig: Figure, alt: str) -> str:
    """The figure as an <img> with the PNG inline (no file, no network)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img class="plot" alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _finite(values: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(values), values, np.nan)


def _wide_positive(values) -> bool:
    """Whether a log axis shows these values better: all positive and spanning more than two decades."""
    v = np.concatenate([np.asarray(x, dtype=np.float64)[np.isfinite(x)] for x in values] or [np.empty(0)])
    return v.size > 1 and v.min() > 0 and v.max() / v.min() > 100


@dataclass(frozen=True)
class Marks:
    """What every plot over steps marks: the fired verdicts ([(step, rule)]) and the step of the run's first
    NaN/Inf loss (None where the loss stayed finite)."""

    verdicts: tuple = ()
    nonfinite: int | None = None


MARK_GAP = 0.035  # verdict labels closer than this share of the axis' width are one label (a rotated label's width)
MAX_LABEL = 28  # characters of a verdict label: it runs up from the bottom and must not reach the NaN label on top


def mark_groups(marks, lo: float, hi: float, position=lambda step: step) -> list[tuple[float, str]]:
    """Verdict marks as (x, label), one label per group of marks closer together than MARK_GAP of the axis
    (lo..hi): the first verdict at a step names its rule, several say how many (and over which steps), so no two
    labels overlap. `position`: a step's x on the axis."""
    width = max(hi - lo, 1e-12)
    groups: list = []  # [first x, first step, last step, rules]
    for step, rule in sorted(marks):
        x = position(step)
        if groups and x - groups[-1][0] < MARK_GAP * width:
            groups[-1][2] = step
            groups[-1][3].append(rule)
        else:
            groups.append([x, step, step, [rule]])
    out = []
    for x, first, last, rules in groups:
        rules = list(dict.fromkeys(rules))
        label = rules[0] if len(rules) == 1 else f"{len(rules)} verdicts" + (f", steps {first}-{last}"
                                                                              if last != first else "")
        out.append((x, label if len(label) <= MAX_LABEL else label[:MAX_LABEL - 1] + "…"))
    return out


def _marked_steps(marks: Marks | None) -> set:
    return {s for s, _ in marks.verdicts} | ({marks.nonfinite} - {None}) if marks is not None else set()


def _mark(ax, marks: Marks | None, position=lambda step: step) -> None:
    """Verdicts as dotted lines with their labels (rotated, from the bottom), the first NaN/Inf loss as a red
    dashed line labelled at the top, on one axis whose x limits are final."""
    if marks is None:
        return
    lo, hi = ax.get_xlim()
    for x, label in mark_groups(marks.verdicts, lo, hi, position):
        ax.axvline(x, color="0.4", linestyle=":", linewidth=1)
        ax.annotate(label, (x, 0.02), xycoords=("data", "axes fraction"), rotation=90, va="bottom", ha="right",
                    fontsize=7, color="0.3")
    if marks.nonfinite is not None:
        x = position(marks.nonfinite)
        ax.axvline(x, color=NONFINITE_LOSS, linestyle="--", linewidth=1.2)
        right = x > lo + 0.6 * (hi - lo)  # the label goes where the axis has room for it
        ax.annotate(f"loss NaN/Inf from step {marks.nonfinite}", (x, 0.98), xycoords=("data", "axes fraction"),
                    va="top", ha="right" if right else "left", fontsize=7, color=NONFINITE_LOSS,
                    xytext=(-3 if right else 3, 0), textcoords="offset points",
                    bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8})


def curves(panels: list, marks: Marks | None = None, ncols: int = 2) -> Figure:
    """Small multiples of line plots. panels: [(title, [(label, steps, values)])]; marks: drawn on every panel
    (verdicts, the first NaN/Inf loss). A series' first non-finite value is marked with a red x on the top edge."""
    ncols = min(ncols, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = figure(2.0 + 2.6 * nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (title, lines) in zip(axes, panels):
        broken = False
        for label, steps, values in lines:
            values = np.asarray(values, dtype=np.float64)
            ax.plot(steps, _finite(values), label=label, marker="." if len(steps) < 30 else None)
            bad = np.flatnonzero(~np.isfinite(values))
            if bad.size:
                broken = True
                ax.plot([steps[bad[0]]], [1.0], "x", color="red", markersize=10, transform=ax.get_xaxis_transform(),
                        clip_on=False, label=f"{label}: not finite from step {steps[bad[0]]}")
        if _wide_positive([v for _, _, v in lines]):
            ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _mark(ax, marks)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if (len(lines) > 1 or broken) and len(lines) <= MAX_LEGEND:
            ax.legend(fontsize=7)  # "best" keeps clear of the lines and of the marks' labels
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    return fig


FEW_STEPS = 12  # a heatmap of this many steps or fewer gives each step a column of its own, labelled


def heatmap(title: str, layers: list, steps: np.ndarray, matrix: np.ndarray, captured: np.ndarray, label: str,
            log: bool, marks: Marks | None = None) -> Figure:
    """Layers (rows) over steps (columns). Cells not captured stay blank; captured NaN/Inf cells are magenta.
    A few steps get a column each, labelled with its step (a true step axis would draw them as slivers, or one
    column on an axis of ±0.5); more are drawn on a true step axis, cells halfway between sampled steps."""
    fig = figure(max(2.6, 1.6 + 0.22 * len(layers)))  # room for a verdict's label under the NaN loss's label
    ax = fig.subplots()
    steps = np.asarray(steps)
    marked = _marked_steps(marks)
    few = len(set(steps.tolist()) | marked) <= FEW_STEPS
    if few and marked - set(steps.tolist()):  # a column for each marked step too, blank where nothing was taken
        steps, matrix, captured = _widened(steps, matrix, captured, marked)
    nonfinite = captured & ~np.isfinite(matrix)
    shown = np.where(captured & np.isfinite(matrix), matrix, np.nan)
    if log:
        with np.errstate(divide="ignore", invalid="ignore"):
            shown = np.where(shown > 0, np.log10(shown), np.nan)
    x, y = (np.arange(len(steps) + 1) if few else _edges(steps)), np.arange(len(layers) + 1)
    finite = shown[np.isfinite(shown)]
    # one value (a single step, or a constant) would make a colour scale of ±0.5 around it: widen it by 1%
    norm = {"vmin": finite.min() - 0.01 * abs(finite.min()) - 1e-12, "vmax": finite.max() + 0.01 * abs(finite.max())
            + 1e-12} if finite.size and finite.min() == finite.max() else {}
    mesh = ax.pcolormesh(x, y, np.ma.masked_invalid(shown), cmap="viridis", **norm)
    if nonfinite.any():
        ax.pcolormesh(x, y, np.ma.masked_where(~nonfinite, np.ones(matrix.shape)), cmap=ListedColormap([NONFINITE]))
        title += "  (magenta: NaN or Inf)"
    fig.colorbar(mesh, ax=ax, label=f"log10 {label}" if log else label, pad=0.01)
    ax.set_yticks(np.arange(len(layers)) + 0.5, layers, fontsize=7 if len(layers) > 12 else 8)
    ax.set_ylim(len(layers), 0)
    if few:
        ax.set_xticks(np.arange(len(steps)) + 0.5, [str(s) for s in steps], fontsize=8)
        ax.set_xlim(0, len(steps))
        _mark(ax, marks, lambda step: float(np.interp(step, steps, np.arange(len(steps)) + 0.5)))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _mark(ax, marks)
    ax.set_xlabel("step")
    ax.set_title(title, fontsize=10)
    return fig


def _widened(steps: np.ndarray, matrix: np.ndarray, captured: np.ndarray, more: set):
    """The heatmap with a blank column (not captured) at each of these further steps."""
    wide = np.array(sorted(set(steps.tolist()) | more), dtype=steps.dtype)
    columns = np.searchsorted(wide, steps)
    out = np.full((matrix.shape[0], len(wide)), np.nan)
    taken = np.zeros(out.shape, dtype=bool)
    out[:, columns], taken[:, columns] = matrix, captured
    return wide, out, taken


def _edges(steps: np.ndarray) -> np.ndarray:
    """Cell edges halfway between sampled steps, so irregular sampling keeps a true step axis."""
    steps = np.asarray(steps, dtype=np.float64)
    if steps.size == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    mid = (steps[1:] + steps[:-1]) / 2
    return np.r_[steps[0] - (mid[0] - steps[0]), mid, steps[-1] + (steps[-1] - mid[-1])]


def histograms(title: str, cells: list, ncols: int) -> Figure:
    """A grid of histograms. cells: [(subtitle, values) or None for a blank], row by row; non-finite values are
    counted, not drawn."""
    nrows = math.ceil(len(cells) / ncols)
    fig = figure(0.9 + 1.9 * nrows, layout=None)
    axes = _grid(fig, nrows, ncols)
    for ax, cell in zip(axes, cells):
        if cell is None:
            ax.set_visible(False)
            continue
        subtitle, values = cell
        values = np.asarray(values, dtype=np.float64).ravel()
        finite = values[np.isfinite(values)]
        bad = values.size - finite.size
        if finite.size:
            counts, edges = np.histogram(finite, bins=40)
            ax.stairs(counts, edges, fill=True, color="C0")
        else:
            ax.text(0.5, 0.5, "no finite value", ha="center", va="center", transform=ax.transAxes, color="red")
        ax.set_title(subtitle + (f"\n{bad} of {values.size} NaN/Inf" if bad else ""), fontsize=8,
                     color="red" if bad or "NaN" in subtitle else "black")
        ax.set_yticks([])  # counts matter less than the shape; fewer labels also draw much faster
        ax.locator_params(axis="x", nbins=5)
        ax.tick_params(labelsize=7)
    for ax in axes[len(cells):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    return fig


def bands(title: str, layers: list, ncols: int = 2, marks: Marks | None = None) -> Figure:
    """Per layer over steps: min..max (light), mean ± std (darker), mean (line). layers: [(name, steps, {reduction:
    values})] with any of min, max, mean, std. A few steps are drawn as points and bars (a band over one step has
    no width); steps whose values are NaN/Inf get a red x on the top edge."""
    nrows = math.ceil(len(layers) / ncols)
    fig = figure(0.9 + 1.8 * nrows, layout=None)
    axes = _grid(fig, nrows, ncols)
    for ax, (name, steps, r) in zip(axes, layers):
        steps = np.asarray(steps)
        get = {k: _finite(np.asarray(v, dtype=np.float64)) for k, v in r.items()}
        few = len(steps) <= FEW_STEPS
        if "min" in get and "max" in get:
            ax.fill_between(steps, get["min"], get["max"], color="C0", alpha=0.2, label="min..max")
            if few:
                ax.vlines(steps, get["min"], get["max"], color="C0", alpha=0.35, linewidth=6)
        if "mean" in get and "std" in get:
            ax.fill_between(steps, get["mean"] - get["std"], get["mean"] + get["std"], color="C0", alpha=0.45,
                            label="mean ± std")
            if few:
                ax.vlines(steps, get["mean"] - get["std"], get["mean"] + get["std"], color="C0", linewidth=2.5)
        if "mean" in get:
            ax.plot(steps, get["mean"], color="C0", label="mean", marker="o" if few else None, markersize=3)
        bad = steps[np.any([~np.isfinite(np.asarray(v, dtype=np.float64)) for v in r.values()], axis=0)] \
            if r else steps[:0]
        if bad.size:
            ax.plot(bad, np.ones(bad.size), "x", color="red", markersize=7, transform=ax.get_xaxis_transform(),
                    clip_on=False, label="NaN/Inf")
        if few:  # the steps and the marked ones, each a tick
            shown = sorted(set(steps.tolist()) | _marked_steps(marks))
            ax.set_xticks(shown)
            ax.set_xlim(shown[0] - 0.5, shown[-1] + 0.5)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _mark(ax, marks)
        spread = np.concatenate([np.abs(v[np.isfinite(v)]) for v in get.values()] or [np.empty(0)])
        if spread.size and spread.max() > 1e3 * max(np.median(spread), 1e-12):  # values blew up: keep both ends
            ax.set_yscale("asinh", linear_width=max(float(np.median(spread)), 1e-12))
        ax.set_title(name, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    if layers:
        axes[0].legend(fontsize=7)
    for ax in axes[len(layers):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    return fig


def roc_pr(roc: list, pr: list, positive_rate: float | None) -> Figure:
    """ROC and precision-recall side by side. roc: [(label, fpr, tpr)]; pr: [(label, recall, precision)]."""
    fig = figure(4.2)
    left, right = fig.subplots(1, 2)
    for label, fpr, tpr in roc:
        left.plot(fpr, tpr, label=label, drawstyle="default")
    left.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1)
    left.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC", xlim=(0, 1), ylim=(0, 1.02))
    for label, recall, precision in pr:
        right.plot(recall, precision, label=label, drawstyle="steps-post")
    if positive_rate is not None:
        right.axhline(positive_rate, color="0.6", linestyle="--", linewidth=1)
    right.set(xlabel="recall", ylabel="precision", title="precision-recall", xlim=(0, 1), ylim=(0, 1.02))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right" if ax is left else "lower left")
    return fig


def score_distributions(panels: list) -> Figure:
    """Per class, the score among that class's samples against the score among the others.
    panels: [(class label, scores of the class's samples, scores of the others)]. One class (binary scores):
    two histograms; more: a pair of box plots per class."""
    fig = figure(3.2 if len(panels) == 1 else 3.6)
    ax = fig.subplots()
    if len(panels) == 1:
        _, inside, outside = panels[0]
        bins = np.linspace(0.0, 1.0, 41)
        for values, color, label in ((outside, "C1", "negative samples"), (inside, "C0", "positive samples")):
            counts, _ = np.histogram(values, bins=bins)
            ax.stairs(counts / max(len(values), 1), bins, fill=True, alpha=0.55, color=color, label=label)
        ax.set(xlabel="predicted probability of the positive class", ylabel="share of samples")
        ax.legend(fontsize=8)
    else:
        at = np.arange(len(panels)) * 3.0
        for offset, column, color, label in ((0.0, 1, "C0", "samples of the class"), (1.0, 2, "C1", "other samples")):
            parts = ax.boxplot([p[column] for p in panels], positions=at + offset, widths=0.8, patch_artist=True,
                               showfliers=False, medianprops={"color": "black"})
            for box in parts["boxes"]:
                box.set(facecolor=color, alpha=0.6)
            ax.plot([], [], color=color, linewidth=8, alpha=0.6, label=label)
        ax.set_xticks(at + 0.5, [p[0] for p in panels], fontsize=8)
        ax.set(xlabel="class", ylabel="predicted probability of the class", ylim=(-0.02, 1.02))
        ax.legend(fontsize=8, loc="upper right")
    ax.set_title("score distribution per class", fontsize=10)
    ax.grid(alpha=0.3)
    return fig


def confusion(matrix: np.ndarray, classes: list) -> Figure:
    """Counts of true (rows) against predicted (columns) classes."""
    size = min(2.5 + 0.45 * len(classes), 8.0)
    fig = figure(size, width=size + 1.2)
    ax = fig.subplots()
    shown = ax.imshow(matrix, cmap="Blues")
    fig.colorbar(shown, ax=ax, pad=0.01)
    ticks = np.arange(len(classes))
    ax.set_xticks(ticks, classes, fontsize=8)
    ax.set_yticks(ticks, classes, fontsize=8)
    ax.set(xlabel="predicted", ylabel="true", title="confusion matrix")
    if len(classes) <= 20:
        top = matrix.max() or 1
        for (i, j), count in np.ndenumerate(matrix):
            ax.text(j, i, str(int(count)), ha="center", va="center", fontsize=7,
                    color="white" if count > top / 2 else "black")
    return fig
