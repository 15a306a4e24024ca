"""Compare two runs step by step: do they compute the same thing, and if not, where do they first differ?

For migrations and refactors (TF1 → TF2, Keras → Lightning, a rewritten
loop). Every tensor both runs hold (run B's names renamed into run A's by an
optional name map) is compared at every step and mode both hold it: the full
values where both saved them, else the reductions both captured. The
tolerance is absolute up to `switch_step` (float noise has not grown yet, so
any real change shows) and relative after it (noise grows with training);
a NaN agrees only with a NaN in the other run at the same place. A reduction
that only one run holds (it does not apply, or was not captured there) is not
compared. The answer is the first diverging step and, at
that step, the diverging tensors in the order the model computes them, so the
earliest layer that differs comes first.

Used by `tripwire compare`, `tripwire.compare()`, `tripwire.testing` and the
`similar_across_runs` rule; reads any View (a stored run or the in-memory
history), so it imports no ML framework.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .errors import TripwireError, listing
from .namemap import load_name_map
from .naming import MODES, collection_of
from .run import open_run
from .view import View

# Reductions in the units of the elements: their relative error is taken against the tensor's largest element,
# so a mean that sits near zero (the gradient of a softmax layer's bias) is not judged by its own tiny size.
ELEMENT_UNITS = frozenset({"min", "max", "mean", "std", "abs_mean", "abs_min", "abs_max", "p5", "p95"})
SCALE_REDUCTIONS = ("min", "max", "abs_max")  # the largest element's magnitude, from reductions
# The phases of a training step in the order it computes them; within a phase, the order the plugin captured the
# tensors in (parameters as the model registers them, activations as the forward pass meets them).
PHASES = {"inputs": 0, "labels": 0, "weights": 1, "biases": 1, "activations": 2, "predictions": 3, "losses": 4,
          "gradients": 5, "optimizer": 6, "updates": 7}
LAST_PHASE = 8  # metrics, custom and anything else


@dataclass(frozen=True)
class Tolerance:
    """|a - b| <= atol at steps <= switch_step; relative error <= rtol after. A NaN passes only against a NaN."""

    atol: float = 1e-5
    rtol: float = 0.05
    switch_step: int = 10

    def describe(self) -> str:
        return f"|a-b| <= {self.atol:g} up to step {self.switch_step}, relative error <= {self.rtol:g} after"


@dataclass(frozen=True)
class Difference:
    """A tensor at a (mode, step) where the runs differ beyond tolerance."""

    name: str  # in run A's naming
    name_b: str
    mode: str
    worker: int
    step: int
    max_abs: float
    max_rel: float
    what: str  # "values", "value", or the reductions that differ
    note: str = ""

    @property
    def label(self) -> str:
        return self.name + (f" (B: {self.name_b})" if self.name_b != self.name else "") + \
            (f" [worker {self.worker}]" if self.worker else "")

    def describe(self, width: int = 0) -> str:
        return (f"{self.label:{width}}  max abs {self.max_abs:<10.4g} max rel {self.max_rel:<10.4g} {self.what}"
                + (f" ({self.note})" if self.note else ""))


@dataclass
class Comparison:
    """The result: each diverging tensor's first divergence, and what was (not) compared."""

    a: str
    b: str
    tolerance: Tolerance
    differences: list = field(default_factory=list)  # [Difference], by step, mode, then compute order
    tensors: int = 0  # tensor pairs compared
    steps: dict = field(default_factory=dict)  # mode -> number of steps compared
    only_a: list = field(default_factory=list)
    only_b: list = field(default_factory=list)
    not_compared: dict = field(default_factory=dict)  # name -> why

    @property
    def diverged(self) -> bool:
        return bool(self.differences)

    @property
    def equivalent(self) -> bool:
        """No divergence, and at least one step of one tensor was compared."""
        return not self.differences and any(self.steps.values())

    @property
    def first_step(self) -> int | None:
        return self.differences[0].step if self.differences else None

    @property
    def diverging(self) -> list:
        """The tensors that differ at the first diverging step (and mode), in compute order."""
        if not self.differences:
            return []
        first = self.differences[0]
        return [d for d in self.differences if (d.step, d.mode) == (first.step, first.mode)]

    def report(self, limit: int = 12) -> str:
        """The comparison as text: what was compared, and the first divergence in compute order."""
        steps = ", ".join(f"{n} {m}" for m, n in self.steps.items() if n) or "no"
        lines = [f"A  {self.a}", f"B  {self.b}", f"tolerance: {self.tolerance.describe()}",
                 f"compared {self.tensors} tensors at {steps} steps"]
        for side, names in (("A", self.only_a), ("B", self.only_b)):
            if names:
                lines.append(f"only in {side}: {listing(names, 8)}")
        if self.only_a and self.only_b:
            lines.append("  (a name map, --map, pairs tensors that are named differently)")
        lines += [f"not compared: {name}: {why}" for name, why in list(self.not_compared.items())[:limit]]
        if not self.differences:
            lines.append("EQUIVALENT: every tensor agrees at every common step." if self.equivalent else
                         "NOTHING COMPARED: the runs have no tensor, mode, worker or step in common. Pair differently "
                         "named tensors with a name map (--map), or widen --tensors.")
            return "\n".join(lines)
        here, later = self.diverging, self.differences[len(self.diverging):]
        width = min(max(len(d.label) for d in self.differences[:2 * limit]), 72)
        first = here[0]
        lines.append(f"DIVERGED at step {first.step} ({first.mode}): {len(here)} tensor(s) differ, in compute order:")
        lines += ["  " + d.describe(width) for d in here[:limit]]
        if len(here) > limit:
            lines.append(f"  … {len(here) - limit} more")
        if later:
            lines.append("then, each other tensor's first divergence:")
            lines += [f"  step {d.step:<6} {d.describe(width)}" for d in later[:limit]]
            if len(later) > limit:
                lines.append(f"  … {len(later) - limit} more")
        return "\n".join(lines)


def compare(run_a, run_b, *, atol: float = 1e-5, rtol: float = 0.05, switch_step: int = 10, tensors=None,
            name_map=None, modes=None, steps=None, workers=None, storage_options: dict | None = None) -> Comparison:
    """Compare two runs (Run/View objects or URLs) step by step; see the module docstring.

    tensors: a regex (re.search) or a predicate on run A's names; name_map: a path, dict or NameMap renaming
    run B's names into run A's; modes, steps, workers: restrict the comparison to these."""
    a, b = _open(run_a, storage_options), _open(run_b, storage_options)
    result = Comparison(getattr(a, "url", repr(a)), getattr(b, "url", repr(b)),
                        Tolerance(float(atol), float(rtol), int(switch_step)))
    renames, select = load_name_map(name_map), _selector(tensors)
    wanted = None if steps is None else np.asarray(sorted(steps), dtype=np.int64)
    common_workers = [w for w in a.workers() if w in b.workers() and (workers is None or w in workers)]
    common_modes = [m for m in MODES if m in a.modes() and m in b.modes() and (modes is None or m in modes)]
    matched, compared, seen_a, seen_b = set(), set(), set(), {}
    for mode in common_modes:
        held: set = set()
        for worker in common_workers:
            names_a = [n for n in a.tensor_names(mode=mode, worker=worker) if select(n)]
            pairs = {name: (name_b, rule) for name_b, (name, rule)
                     in renames.rename_all(b.tensor_names(mode=mode, worker=worker)).items() if select(name)}
            seen_a.update(names_a)
            seen_b.update({name: name_b for name, (name_b, _) in pairs.items()})
            found = []
            for name in names_a:
                if name not in pairs:
                    continue
                matched.add(name)
                name_b, rule = pairs[name]
                outcome = _compare_tensor(a.tensor(name), b.tensor(name_b), mode, worker, wanted, result.tolerance,
                                          rule)
                if isinstance(outcome, str):
                    result.not_compared[name] = outcome
                    continue
                difference, steps_held = outcome
                compared.add(name)
                held |= steps_held
                if difference is not None:
                    found.append(difference)
            order = {n: i for i, n in enumerate(names_a)}  # the capture order: the model's, within a phase
            result.differences += sorted(found, key=lambda d: (d.step, _phase(d.name), order[d.name]))
        result.steps[mode] = len(held)
    result.tensors = len(compared)
    result.only_a = sorted(seen_a - matched)
    result.only_b = sorted(name_b for name, name_b in seen_b.items() if name not in matched)
    result.differences.sort(key=lambda d: (d.step, MODES.index(d.mode), d.worker))  # stable: compute order kept
    return result


def cli(args, storage_options: dict) -> int:
    """`tripwire compare A B`: the report on stdout; exit 0 equivalent, 1 diverged, 2 nothing compared."""
    from .cli import say_damage

    runs = [open_run(url, storage_options) for url in (args.a, args.b)]
    result = compare(*runs, atol=args.atol, rtol=args.rtol, switch_step=args.switch_step, tensors=args.tensors,
                     name_map=args.map)
    print(result.report())
    for run in runs:
        say_damage(run, "compare")
    return 1 if result.diverged else (0 if result.equivalent else 2)


# -- one tensor -------------------------------------------------------------------------------------------------------
def _compare_tensor(ta, tb, mode, worker, wanted, tol, rule):
    """(first Difference or None, steps compared), or a string saying why the pair cannot be compared."""
    reductions = [r for r in ta.reductions(mode, worker) if r in set(tb.reductions(mode, worker))]
    full = np.intersect1d(np.asarray(ta.steps(mode, worker, tensors=True), dtype=np.int64),
                          np.asarray(tb.steps(mode, worker, tensors=True), dtype=np.int64))
    if not reductions and not len(full):
        return (f"no reduction in common and no full values saved by both (A has "
                f"{listing(ta.reductions(mode, worker))}, B has {listing(tb.reductions(mode, worker))})")
    grid, va, vb = _reduction_table(ta, tb, reductions, mode, worker)
    if wanted is not None:
        full, keep = full[np.isin(full, wanted)], np.isin(grid, wanted)
        grid, va, vb = grid[keep], va[keep], vb[keep]
    first = None
    by_reduction = ~np.isin(grid, full)  # where both saved full values, those decide
    if by_reduction.any():
        steps_r = grid[by_reduction]
        diff, rel = _errors(va[by_reduction], vb[by_reduction], [r in ELEMENT_UNITS for r in reductions],
                            _scales(va[by_reduction], vb[by_reduction], reductions))
        bad = _exceeds(steps_r, diff, rel, tol)
        rows = np.flatnonzero(bad.any(axis=1))
        if len(rows):
            i = rows[0]
            what = "value" if reductions == ["value"] else \
                "reductions " + ", ".join(r for r, b in zip(reductions, bad[i]) if b)
            first = _difference(ta, tb, mode, worker, int(steps_r[i]), diff[i], rel[i], what)
    for step in full:
        if first is not None and step >= first.step:
            break
        difference = _compare_values(ta, tb, mode, worker, int(step), tol, rule)
        if difference is not None:
            first = difference
    return first, set(grid.tolist()) | set(full.tolist())


def _reduction_table(ta, tb, reductions, mode, worker):
    """(steps where both runs hold any common reduction, A's values [steps x reductions], B's values). Where one
    reduction is missing at a step both get 0 there, which agrees, so the reductions both hold still decide."""
    held = []
    for r in reductions:
        (sa, va), (sb, vb) = ta.series(r, mode, worker), tb.series(r, mode, worker)
        steps, ia, ib = np.intersect1d(sa, sb, assume_unique=True, return_indices=True)
        held.append((steps, va[ia], vb[ib]))
    grid = np.unique(np.concatenate([h[0] for h in held])) if held else np.empty(0, dtype=np.int64)
    va, vb = np.zeros((len(grid), len(held))), np.zeros((len(grid), len(held)))
    for j, (steps, a, b) in enumerate(held):
        rows = np.searchsorted(grid, steps)
        va[rows, j], vb[rows, j] = a, b
    return grid.astype(np.int64), va, vb


def _scales(va, vb, reductions) -> np.ndarray:
    """Per step, the largest element magnitude the reductions show (0 where none of them tells)."""
    cols = [i for i, r in enumerate(reductions) if r in SCALE_REDUCTIONS]
    if not cols:
        return np.zeros(len(va))
    with np.errstate(invalid="ignore"):
        return np.fmax.reduce(np.abs(np.concatenate([va[:, cols], vb[:, cols]], axis=1)), axis=1)


def _errors(a, b, element_units, scale):
    """Absolute and relative errors, elementwise. Relative to max(|a|, |b|), and for numbers in the elements'
    units also to the tensor's largest element `scale` (one per row). Equal infinities agree, and so do NaNs at
    the same place (both runs hold a NaN there: they computed the same); a NaN against a number stays NaN."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        diff = np.where((a == b) | (np.isnan(a) & np.isnan(b)), 0.0, np.abs(a - b))
        floor = np.where(np.asarray(element_units, dtype=bool)[None, :], np.asarray(scale)[:, None], 0.0)
        rel = np.where(diff == 0, 0.0, diff / np.fmax(np.fmax(np.abs(a), np.abs(b)), floor))
    return diff, np.where(np.isinf(diff), np.inf, rel)


def _exceeds(steps, diff, rel, tol: Tolerance) -> np.ndarray:
    absolute = (np.asarray(steps) <= tol.switch_step)[:, None]
    return ~np.where(absolute, diff <= tol.atol, rel <= tol.rtol)  # NaN compares False: never within tolerance


def _compare_values(ta, tb, mode, worker, step, tol, rule) -> Difference | None:
    a = np.asarray(ta.value(step, mode, worker), dtype=np.float64)
    b = np.asarray(tb.value(step, mode, worker), dtype=np.float64)
    if rule is not None and rule.axes is not None:
        axes = tuple(reversed(range(b.ndim))) if rule.axes is True else rule.axes
        if len(axes) != b.ndim:
            return _difference(ta, tb, mode, worker, step, [np.inf], [np.inf], "values",
                               f"the map transposes axes {list(axes)} but B's tensor has shape {b.shape}")
        b = b.transpose(axes)
    if a.shape != b.shape:
        return _difference(ta, tb, mode, worker, step, [np.inf], [np.inf], "values",
                           f"shapes differ: A {a.shape}, B {b.shape}" + ("" if rule and rule.axes else
                                                                       "; a `transpose` in the name map may fit"))
    a, b = a.reshape(1, -1), b.reshape(1, -1)
    with np.errstate(invalid="ignore"):
        scale = np.fmax.reduce(np.abs(np.concatenate([a, b], axis=1)), axis=1) if a.size else np.zeros(1)
    diff, rel = _errors(a, b, [True] * a.shape[1], scale)
    if not _exceeds([step], diff, rel, tol).any():
        return None
    return _difference(ta, tb, mode, worker, step, diff[0], rel[0], "values")


def _difference(ta, tb, mode, worker, step, diff, rel, what, note="") -> Difference:
    return Difference(ta.name, tb.name, mode, worker, step, _max(diff), _max(rel), what, note)


def _max(values) -> float:
    values = np.asarray(values, dtype=np.float64)
    return float(np.max(values)) if values.size else 0.0  # NaN if any is NaN: it is reported as such


def _phase(name: str) -> int:
    return PHASES.get(collection_of(name), LAST_PHASE)


def _selector(tensors) -> Callable[[str], bool]:
    if tensors is None or tensors == "":
        return lambda name: True
    if callable(tensors):
        return tensors
    try:
        pattern = re.compile(tensors)
    except re.error as exc:
        raise TripwireError(f"--tensors '{tensors}' is not a valid regular expression: {exc}.") from None
    return lambda name: pattern.search(name) is not None


def _open(run, storage_options):
    return run if isinstance(run, View) else open_run(run, storage_options)
