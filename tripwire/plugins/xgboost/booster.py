"""What a Booster tells tripwire: its hyperparameters, the shape of a round's trees, feature importance.

Read on sampled rounds only. Tree statistics come from the JSON dump of the
round's own trees (a slice of the booster), so their cost does not grow with
the number of rounds already boosted.
"""

from __future__ import annotations

import json

from tripwire.core.firststep import FirstStep, loss_use

IMPORTANCE_TYPES = ("weight", "gain", "cover", "total_gain", "total_cover")
TREE_BOOSTERS = ("gbtree", "dart")


def booster_config(booster) -> dict:
    return json.loads(booster.save_config())


def hyperparameters(config: dict) -> dict:
    """The booster's parameters, flattened: every `*_param` section of its config ({name: value as a string})."""
    flat: dict = {}

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key.endswith("_param") and isinstance(value, dict):
                    flat.update({k: v for k, v in value.items() if not isinstance(v, (dict, list))})
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(config)
    return dict(sorted(flat.items()))


def booster_kind(config: dict) -> str:
    return config["learner"]["gradient_booster"]["name"]


def tree_stats(booster, iteration: int) -> dict[str, float]:
    """Depth (deepest tree; a lone leaf is 0), leaves and splits (summed) of the trees added in one round."""
    depth, leaves, splits = 0, 0, 0
    for text in booster[iteration:iteration + 1].get_dump(dump_format="json"):
        stack = [(json.loads(text), 0)]
        while stack:
            node, level = stack.pop()
            children = node.get("children")
            if children:
                splits += 1
                stack.extend((child, level + 1) for child in children)
            else:
                leaves += 1
                depth = max(depth, level)
    return {"depth": float(depth), "leaves": float(leaves), "splits": float(splits)}


def importance(booster, kinds=IMPORTANCE_TYPES) -> dict[str, dict[str, float]]:
    """{type: {feature: score}} for these importance types; features the trees never split on are absent."""
    out = {}
    for kind in kinds:
        scores = booster.get_score(importance_type=kind)
        out[kind] = {f: float(s) for f, s in scores.items() if isinstance(s, (int, float))}
    return out


def feature_names(booster) -> list[str]:
    """The names XGBoost reports features by: the data's own, or f0, f1, …"""
    return booster.feature_names or [f"f{i}" for i in range(booster.num_features())]


# The metrics that go down as the model learns: XGBoost's losses (named before any "@" parameter) and custom ones
# named as losses (scikit-learn's convention: `*_loss`, `*_error`, `*_deviance`; `PyRMSLE`), then error rates,
# read as the loss where a set logs no loss. Others go up (auc, aucpr, ndcg, map, pre, ams,
# interval-regression-accuracy, a `*_score`) or are a custom metric whose direction its name does not say:
# none of them is read as a loss, which a rule would call rising as the model improves.
LOSSES = ("rmse", "rmsle", "mae", "mape", "mphe", "logloss", "poisson-nloglik", "gamma-nloglik", "gamma-deviance",
          "tweedie-nloglik", "cox-nloglik", "aft-nloglik", "quantile", "expectile", "loss", "_error", "deviance")
ERROR_RATES = ("error",)
TRAIN_NAMES = ("train", "training", "dtrain")


def eval_losses(evals_log) -> tuple[float | None, float | None]:
    """(training loss, validation loss) of the round, read from the eval log as XGBoost's EarlyStopping reads it:
    the last eval set is the validation set; the training set is the one named train (or training, dtrain), else the
    first of two or more. Each one's loss is its first built-in loss metric (logloss, rmse, …: an objective's default
    metric comes first), else its first error rate. None where there is no such set or metric."""
    names = list(evals_log)
    train = next((n for n in names if n.lower() in TRAIN_NAMES), names[0] if len(names) >= 2 else None)
    validation = next((n for n in reversed(names) if n != train), None)
    return tuple(_loss(evals_log[name]) if name is not None else None for name in (train, validation))


def repeated_eval_sets(evals_log) -> int | None:
    """How many eval sets logged, at every round so far, exactly the metrics of an eval set before them: the same
    data passed twice under two names — most often the training set as the validation set, where early stopping
    never stops and no overfitting shows (tripwire.core.rules.relations). None before two sets have two rounds:
    one round alike may be chance."""
    histories = [{metric: list(values) for metric, values in metrics.items()} for metrics in evals_log.values()]
    histories = [h for h in histories if h and min(len(values) for values in h.values()) >= 2]
    if len(histories) < 2:
        return None
    return sum(history in histories[:i] for i, history in enumerate(histories))


def _loss(metrics) -> float | None:
    """The newest value of the set's first loss metric (its first error rate where it logs none)."""
    for known in (LOSSES, ERROR_RATES):
        for metric, history in metrics.items():
            if metric.split("@")[0].lower().endswith(known):
                value = history[-1]
                return float(value[0] if isinstance(value, (tuple, list)) else value)  # (mean, std) in xgb.cv
    return None

# XGBoost's objective families, as the losses of tripwire.core.firststep: what the booster learns
OBJECTIVES = {"reg": "regression", "count": "regression", "survival": "regression", "binary": "binary",
              "multi": "multiclass", "rank": "ranking"}


def first_step(config: dict, step: int, labels=None, column_swaps: tuple | None = None) -> FirstStep:
    """The booster's objective as the loss of its first round, with the labels of the eval data where given, and
    the eval set's columns that are the training set's in another order (FirstStep.column_swaps)."""
    objective = config["learner"]["objective"]["name"]
    loss = "binary" if objective == "reg:logistic" else OBJECTIVES.get(objective.split(":")[0])
    classes = int(config["learner"]["learner_model_param"].get("num_class", 0) or 0)
    use = loss_use(loss, units=classes or None, labels=labels, objective=objective) if loss else None
    return FirstStep(step, (use,) if use is not None else (), column_swaps=column_swaps)
