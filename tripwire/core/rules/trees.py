"""Rules over boosted trees: their shape (`trees/…`) and what they split on (`feature_importance/…`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..ranges import COUNT, SHARE
from .base import NotApplicable, Requirement, Rule


@dataclass
class TreeDepth(Rule):
    """Boosted trees that grow deeper than a limit: on small data, deep trees memorise it."""

    depth: int = 6

    name = "tree_depth"
    severity = "info"  # deep trees are a choice (max_depth) that overfit judges by its effect
    condition = "the deepest of the trees added in the round (`trees/depth`, root = depth 0) is deeper than `depth`"
    hint = ("The trees grow deep. A tree of depth d splits the data into up to 2^d leaves, so on a small dataset "
            "deep trees end with a few samples per leaf and learn its noise. Try: a lower `max_depth` (3-6), "
            "a larger `min_child_weight`, `gamma` (min_split_loss) > 0, `max_leaves` with grow_policy lossguide, "
            "subsample/colsample_bytree < 1; check the held-out metric (rule overfit).")
    source = ("smdebug TreeDepth (depth 4, estimated as log2 of the largest node id). smdebug does not document "
              "which side fires; here deeper fires, the depth is exact (from the model dump), and the default is "
              "XGBoost's own default max_depth 6, so that models at XGBoost's defaults never fire.")

    def requires(self):
        return [Requirement("trees")]

    def check(self, run, step):
        if "trees/depth" not in run.tensor_names("trees"):
            return None
        try:
            depth = run.tensor("trees/depth").reduction(step)
        except LookupError:
            return None
        if depth > self.depth:
            return self.fire(step, f"the round's trees reach depth {depth:.0f}; limit {self.depth}.",
                             depth=depth, limit=self.depth)
        return None


@dataclass
class FeatureImportanceOverweight(Rule):
    """A model that rests on a few features: a label leaking into the data, or fragility to their drift."""

    threshold: float = 0.8
    nfeatures: int = 3
    importance_type: str = "total_gain"  # weight, gain, cover, total_gain or total_cover
    start_step: int = 10  # rounds before it are not checked: the first trees split on the few strongest features
    leak_share: float = 0.5  # one feature holding this much of the importance, with a perfect score: a leak
    min_samples: int = 50  # labelled samples a perfect score must hold

    name = "feature_importance_overweight"
    limits = {"threshold": SHARE, "nfeatures": COUNT, "leak_share": SHARE}
    condition = ("from `start_step` on, the `nfeatures` most important features hold more than `threshold` of the "
                 "model's importance of type `importance_type` (`feature_importance/<type>/*`, summed over the "
                 "features): info, a dataset may have a few strong features. A warning where one feature holds "
                 "more than `leak_share` and the model classifies its held-out labels (`eval_data`, at least "
                 "`min_samples`) without a single error: too good to be true, the signature of a leak")
    hint = ("A few features carry the model. If one of them is the target in disguise (an id, a timestamp, a "
            "column computed from the label, data from the future) the model will fail in production: check "
            "how each top feature is made. If they are genuine, the model is fragile to their drift; "
            "colsample_bytree/colsample_bynode < 1 spreads the splits.")
    source = ("smdebug FeatureImportanceOverweight: threshold 0.8, nfeatures 3, on feature_importance/weight. The "
              "default type here is total_gain: a leaking feature removes most of the loss in a few splits, which "
              "the split count (weight) hardly shows. Healthy data sets often hold one dominant feature, so the "
              "concentration alone is info; a perfect held-out score with it is tripwire's own test for a leak.")

    def __post_init__(self):
        if self.importance_type not in ("weight", "gain", "cover", "total_gain", "total_cover"):
            raise ValueError(f"importance_type '{self.importance_type}' is not one of weight, gain, cover, "
                             "total_gain, total_cover")

    def requires(self):
        return [Requirement("feature_importance", include=(f"^{self.importance_type}/",)),
                Requirement("labels", save_tensors=True, optional=True),
                Requirement("predictions", save_tensors=True, optional=True)]

    def check(self, run, step):
        if step < self.start_step:
            return None
        values = {}
        prefix = f"feature_importance/{self.importance_type}/"
        for name in run.tensor_names("feature_importance", regex="^" + re.escape(prefix)):
            try:
                values[name[len(prefix):]] = run.tensor(name).reduction(step)
            except LookupError:
                continue
        total = sum(values.values())
        if not total > 0:
            return None
        top = sorted(values, key=values.get, reverse=True)[:self.nfeatures]
        share = sum(values[f] for f in top) / total
        if share <= self.threshold:
            return None
        shares = {f: values[f] / total for f in top}
        listed = ", ".join(f"{f} {s:.0%}" for f, s in shares.items())
        leak = shares[top[0]] > self.leak_share and _perfect(run, step, self.min_samples)
        return self.fire(step, f"the top {len(top)} of {len(values)} features hold {share:.0%} of the "
                               f"{self.importance_type} importance ({listed}); limit {self.threshold:.0%}"
                               + (f", and the model makes no error on its {self.min_samples}+ held-out labels: "
                                  f"check how {top[0]} is made." if leak else "."),
                         severity="warning" if leak else "info", finding="leak" if leak else "concentrated",
                         shares=shares, share=share)


def _perfect(run, step: int, min_samples: int) -> bool:
    """Whether the labels and predictions saved at this step are a classifier's and agree on every sample."""
    from .classification import NotClassIds, _classified

    names = run.tensor_names(step=step)
    if "labels" not in names or "predictions" not in names:
        return False
    try:
        y, predicted = _classified(run.tensor("labels").value(step), run.tensor("predictions").value(step), 0.5)
    except (NotApplicable, NotClassIds, LookupError):
        return False
    return len(y) >= min_samples and bool(np.all(y == predicted))
