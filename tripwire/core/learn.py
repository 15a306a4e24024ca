"""`tripwire learn`: the ranges healthy runs of a pipeline held, as a rule file a later run is checked against.

Every captured reduction of every tensor is pooled by kind (`rules.learned.kind_of`: the gradients of Linear
kernels, the activations after Dense layers, the loss, the learning rate), by mode, and by step band, over every
sampled step of every run given. Each pool becomes one invariant: the smallest and largest value seen, widened
by a margin (`widen`), judged at the steps the pool was seen at.

Step bands are decades: step 0, steps 1-9, 10-99, 100-999, … Training moves fastest at its start (initial
weights, the first updates, a warm-up) and ever more slowly after, about evenly on a log scale of steps, so a band
per decade keeps the first steps apart from the rest, and the start of training from its end, without depending
on how long the runs were. An invariant is judged only at the steps its band was seen at in the healthy runs (a
run longer than them is not judged past their last step: what they never reached, they cannot vouch for).

A reduction that was ever not finite in a healthy run is left unbounded, and so is `size` (the shape, not the
training).
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from .naming import VALUE, collection_of
from .rules.learned import Invariant, kind_of

# Reductions that count: judged exactly as seen (a count of non-finite values that was always 0 stays 0).
COUNTS = ("nonfinite_count",)
# Reductions that are shares of a tensor's elements or units, from 0 to 1.
SHARES = ("zero_fraction", "dead_fraction", "saturated_fraction")
# Reductions of a tensor that are never negative by definition: their size, not their sign, is learned.
MAGNITUDES = ("l1", "l2", "std", "var", "abs_mean", "abs_min", "abs_max")
# A tensor's extremes vary by factors, as magnitudes do, and may cross 0, as means do (the largest gradient of a
# 64-unit BatchNorm scale is negative at some steps): they take the wider bounds of the two.
EXTREMES = ("min", "max")
SKIPPED_REDUCTIONS = ("size",)
# Left out: under row or column subsampling, which features a booster's first trees split on is drawn anew by
# each seed, so one feature's importance ranges over orders of magnitude between healthy runs of one pipeline (20x
# beyond two seeds' range in the zoo's booster). feature_importance_overweight judges them.
SKIPPED_COLLECTIONS = ("feature_importance",)
# An invariant rests on at least this many samples: the range of a few says little (of 2 samples, a third lands
# outside their range two times in three).
MIN_SAMPLES = 8
DECADES = 10 ** np.arange(19, dtype=np.int64)  # the first step of each band after step 0
# The margins (see `widen`).
FACTOR = 4.0
SPANS = 5.0
SHARE_MARGIN = 0.25


def bands_of(steps: np.ndarray) -> np.ndarray:
    """The decade each step is in: 0 for step 0, 1 for steps 1-9, 2 for 10-99, …"""
    return np.searchsorted(DECADES, steps, side="right")


def widen(reduction: str, low: float, high: float) -> tuple[float | None, float | None]:
    """The bounds judged for values seen from `low` to `high`; None for a side without a bound.

    Another seed of the same pipeline draws other initial weights and batches, so its values scatter around the
    same range and a little beyond it; a fault moves them by orders of magnitude (a learning rate 1000x, biases at
    -20, every unit dead, a NaN). The margins sit between the two, sized on the zoo's pipelines (the Lightning ReLU
    MLP, the Keras MLP, the XGBoost binary classifier; 2 epochs, 100 rounds): learned from every pair of 9 seeds,
    checked on the 7 others and 3 more. Then checked as they are on 4 seeds more of each, and on the Lightning
    BatchNorm MLP (every pair of 9 seeds): no verdict on a healthy seed; the zoo's faults of these pipelines (dead
    ReLU biases, a learning rate 1000x, an overfitting booster, labels divided by 255) caught from every pair.

    - counts are exact: a NaN count that was 0 at every healthy step stays 0;
    - shares (0 to 1) widen by SHARE_MARGIN, a quarter of the scale, on each side (a third seed went at most 0.13
      beyond two seeds' range), and a bound past 0 or 1 is none: a layer with a tenth of its units dead may have a
      third dead in another seed, not all of them;
    - magnitudes (norms, standard deviations) and scalars (the loss, the learning rate, a tree's depth) vary by
      factors and keep their sign: on the log scale, their range widens by its own width on each side and by
      FACTOR (4x) more, so a quantity that varied 10x across healthy steps may reach 40x beyond that, a constant one
      4x; a third seed went at most 3.4x beyond the range's width. Toward 0 a magnitude widens by that factor
      squared: a batch the model already fits gives a gradient near 0 (the 3-sample last batch of a Keras epoch,
      150x below two seeds' range), while a dead layer's is exactly 0: a norm that was never 0 must stay so (the
      tensor is never all zero). A scalar's is not squared: a training loss that falls faster than the healthy
      runs' is how the zoo's overfitting booster shows;
    - means, sums and percentiles take either sign by chance (the mean of a layer's outputs at initialisation):
      they widen by SPANS (5) times their span on each side (a third seed needed up to 3.3 spans: the mean
      gradient of a Keras layer on an epoch's 3-sample last batch); a side at exactly 0 stays there (a ReLU
      output's min), and values that never varied are exact;
    - a tensor's extremes (min, max) take the wider bounds of the two: they grow by factors, and may cross 0."""
    if reduction in COUNTS:
        return low, high
    if reduction in SHARES:
        bottom, top = low - SHARE_MARGIN, high + SHARE_MARGIN
        return (bottom if bottom > 0 else None), (top if top < 1 else None)
    span = (high - low) * SPANS
    linear = (0.0 if low == 0 else low - span), (0.0 if high == 0 else high + span)
    if not (low > 0 or high < 0) or reduction not in (*MAGNITUDES, *EXTREMES, VALUE):
        return linear
    factor = FACTOR * (high / low if low > 0 else low / high)
    inward = factor ** 2 if reduction in MAGNITUDES else factor
    logarithmic = (low / inward, high * factor) if low > 0 else (low * factor, high / inward)
    if reduction in EXTREMES:
        return min(linear[0], logarithmic[0]), max(linear[1], logarithmic[1])
    return logarithmic


def learn(runs) -> list[Invariant]:
    """The invariants every sampled step of every run held, in the order their tensors were first captured."""
    pools: dict = defaultdict(lambda: ([], [], set()))  # (kind, mode, reduction, band) -> steps, values, runs
    for index, run in enumerate(runs):
        for worker in run.workers():
            for mode in run.modes(worker):
                for name in run.tensor_names(mode=mode, worker=worker):
                    if collection_of(name) in SKIPPED_COLLECTIONS:
                        continue
                    kind = tuple(sorted(kind_of(run, name).items()))
                    tensor = run.tensor(name)
                    for reduction in tensor.reductions(mode=mode, worker=worker):
                        if reduction in SKIPPED_REDUCTIONS:
                            continue
                        steps, values = tensor.series(reduction, mode=mode, worker=worker)
                        bands = bands_of(steps)
                        for band in np.unique(bands).tolist():
                            pool = pools[(kind, mode, reduction, band)]
                            pool[0].append(steps[bands == band])
                            pool[1].append(values[bands == band])
                            pool[2].add(index)
    invariants = []
    for (kind, mode, reduction, _), (steps, values, held_by) in pools.items():
        steps, values = np.concatenate(steps), np.concatenate(values)
        if len(held_by) < len(runs) or len(values) < MIN_SAMPLES or not np.isfinite(values).all():
            continue
        seen = (float(values.min()), float(values.max()))
        low, high = widen(reduction, *seen)
        if low is None and high is None:
            continue
        invariants.append(Invariant(kind, mode, (int(steps.min()), int(steps.max())), reduction, seen, low, high))
    return invariants


def learned_config(invariants: list[Invariant], sources: list[str], sampling: dict | None = None) -> str:
    """The rule file: a config of one rule, `learned_invariants`, each invariant a line of its own (so that a
    config error names its line), loadable by `tripwire.load_config`. `sampling`: the learned runs' schedule, so
    that a run trained with this file is sampled at the steps the invariants were seen at."""
    lines = [f"# Learned by `tripwire learn` on {time.strftime('%Y-%m-%d %H:%M')} from {len(sources)} healthy "
             f"run(s): {len(invariants)} invariants.",
             "# Check a run against them: tripwire check RUN --config THIS_FILE; or train with it as the callback's",
             "# config (sampled as the first of those runs was), or add its rule to your own config.",
             "version: 1", *([f"sampling: {_flow(sampling)}"] if sampling else []),
             "rules:", "  - rule: learned_invariants", "    params:",
             f"      learned_from: [{', '.join(_text(s) for s in sources)}]", "      invariants:"]
    lines += [f"        - {_flow(i.to_dict())}" for i in invariants]
    return "\n".join(lines) + "\n"


def _flow(entry: dict) -> str:
    """A mapping as one line of YAML flow style."""
    return "{" + ", ".join(f"{k}: {_flow_value(v)}" for k, v in entry.items()) + "}"


def _flow_value(value) -> str:
    if isinstance(value, dict):
        return _flow(value)
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, list):
        return "[" + ", ".join(_flow_value(v) for v in value) + "]"
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, float):
        return _float(value)
    return str(value)


def _text(value: str) -> str:
    """A string as YAML reads it back: plain where YAML reads it as that string, else quoted as JSON (valid
    YAML)."""
    import json

    import yaml

    plain = value and value == value.strip() and not any(c in value for c in ",:[]{}#&*!|>'\"%@`")
    return value if plain and yaml.safe_load(value) == value else json.dumps(value)


def _float(value: float) -> str:
    """A float as YAML 1.1 reads it back as a float: `repr`, with a '.' in the mantissa where an exponent
    follows ('1e-05' is a string to PyYAML, '1.0e-05' a float)."""
    text = repr(value)
    mantissa, e, exponent = text.partition("e")
    if e and "." not in mantissa:
        text = f"{mantissa}.0e{exponent}"
    return text


def cli(args, storage_options: dict) -> int:
    """`tripwire learn RUN [RUN ...] -o FILE`: write the rule file; exit 0 written, 2 nothing learned, a damaged
    run, or a file that cannot be written."""
    import sys

    from .cli import say_damage
    from .run import open_run

    runs = [open_run(url, storage_options) for url in args.runs]
    if any([say_damage(run, "learn") for run in runs]):
        print("tripwire learn: nothing written: a range learned from a damaged run would leave out what its damaged "
              "files held. Restore them, or learn from the other runs.", file=sys.stderr)
        return 2
    for run in runs:
        doubt = _doubt(run)
        if doubt:
            print(f"tripwire learn: {run.url} {doubt}; learning from it all the same: give healthy runs only.",
                  file=sys.stderr)
    invariants = learn(runs)
    if not invariants:
        print(f"tripwire learn: nothing learned: no tensor of every run given had a reduction sampled at least "
              f"{MIN_SAMPLES} times in one band of steps (step 0, 1-9, 10-99, …) with finite values. Sample more "
              "often (`sampling: {every: 10}`) or capture more collections when training the healthy runs.",
              file=sys.stderr)
        return 2
    try:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(learned_config(invariants, [run.url for run in runs], _sampling(runs[0])))
    except OSError as exc:
        print(f"tripwire learn: could not write {args.output}: {exc.strerror or exc}.", file=sys.stderr)
        return 2
    kinds = len({(i.kind, i.mode) for i in invariants})
    print(f"learned {len(invariants)} invariants over {kinds} kinds of tensors from {len(runs)} run(s); wrote "
          f"{args.output}.\nCheck a run against them: tripwire check RUN --config {args.output}")
    return 0


def _sampling(run) -> dict | None:
    """The `sampling:` of the config a run was trained with, where it stored one."""
    config = run.info.get("config")
    sampling = config.get("sampling") if isinstance(config, dict) else None
    return sampling if isinstance(sampling, dict) and sampling else None


def _doubt(run) -> str:
    """Why a run may not be healthy (not finished, or holding verdicts at warning or error); '' if none."""
    status = run.info["status"]
    counted = [v for v in run.verdicts() if v.counts]
    if counted:
        return f"holds {len(counted)} verdict(s) at warning or error (the first: {counted[0].rule})"
    return "" if status == "finished" else f"is {status}, not finished"
