"""XGBoost zoo cases: boosted trees on sklearn's packaged data sets and a synthetic ranking task.

Every case trains as users do: `xgb.train` (or an sklearn estimator) with a training and a validation eval set,
one thread and a fixed seed, tripwire's callback in `callbacks=[...]`, given the validation data as `eval_data` in
the classifier cases. A round is a step. The longer version (`long=True`) boosts four times the rounds at a quarter
of the learning rate: the same model, trained more finely.

The faulty cases reuse the binary classifier on breast cancer with one real fault injected: a feature that leaks
the label, a booster free to memorise a small training set, labels scaled like pixels, labels shuffled apart from
their rows.
"""

from __future__ import annotations

import numpy as np
import xgboost as xgb
from sklearn.metrics import accuracy_score, f1_score, ndcg_score, r2_score

from . import data
from .case import SILENT, Case, Outcome

SEED = 0
COMMON = {"nthread": 1, "seed": SEED}


def schedule(long: bool, rounds: int, eta: float) -> tuple[int, float]:
    """Boosting rounds and learning rate: the longer version boosts 4x the rounds at a quarter of the rate."""
    return (rounds * 4, eta / 4) if long else (rounds, eta)


def callbacks(attach, eval_data=None) -> list:
    """tripwire's callback, as a user adds it, or none when the harness trains without tripwire."""
    return [] if attach is None else [attach.xgboost(eval_data=eval_data)]


def dmatrix(split) -> xgb.DMatrix:
    """A DMatrix of (x, y) or, for ranking, (x, relevance, query ids)."""
    x, y, *qid = split
    return xgb.DMatrix(x, label=y, qid=qid[0] if qid else None)


def boost(attach, params: dict, train, val, rounds: int, eval_data=None, **kwargs) -> xgb.Booster:
    """xgb.train with a `train` and a `validation` eval set, tripwire attached."""
    dtrain, dval = dmatrix(train), dmatrix(val)
    return xgb.train({**COMMON, **params}, dtrain, rounds, evals=[(dtrain, "train"), (dval, "validation")],
                     callbacks=callbacks(attach, eval_data), verbose_eval=False, **kwargs)


# -- binary classification on breast cancer, healthy and with faults ---------------------------------------------

def boost_binary(attach, long: bool, train, val, **fault) -> xgb.Booster:
    """A binary:logistic booster on breast cancer, the validation set as eval_data; `fault` overrides parameters."""
    rounds, eta = schedule(long, 100, 0.1)
    params = {"objective": "binary:logistic", "eval_metric": ["logloss", "auc"], "eta": eta, "max_depth": 4,
              "subsample": 0.8, "colsample_bytree": 0.8, **fault}
    return boost(attach, params, train, val, rounds, eval_data=val)


def accuracy_outcome(y_val, predicted, rounds: int, target: float) -> Outcome:
    """Validation accuracy against the case's target."""
    accuracy = accuracy_score(y_val, predicted)
    return Outcome(accuracy >= target, f"val_acc {accuracy:.3f} (>= {target})", rounds)


def binary_outcome(booster: xgb.Booster, x_val, y_val) -> Outcome:
    """Validation accuracy at the 0.5 threshold, against the true 0/1 labels."""
    return accuracy_outcome(y_val, booster.inplace_predict(x_val) > 0.5, booster.num_boosted_rounds(), 0.93)


def binary(attach, long: bool) -> Outcome:
    """Healthy: binary:logistic on breast cancer, depth 4, row and column subsampling, logloss and AUC eval log."""
    train, val = data.breast_cancer(standardise=False)
    return binary_outcome(boost_binary(attach, long, train, val), *val)


def with_leak(split, seed: int):
    """The split with one more column: the label plus a little noise (a feature computed from the target)."""
    x, y = split
    noise = np.random.default_rng(seed).normal(0, 0.1, len(y))
    return np.column_stack([x, y + noise]).astype(np.float32), y


def leaky_feature(attach, long: bool) -> Outcome:
    """Fault: target leakage, a column derived from the label (plus noise) is among the features."""
    train, val = data.breast_cancer(standardise=False)
    train, val = with_leak(train, seed=1), with_leak(val, seed=2)
    return binary_outcome(boost_binary(attach, long, train, val), *val)


def overfitting_booster(attach, long: bool) -> Outcome:
    """Fault: a booster free to memorise (depth 12, eta 1, min_child_weight 0) on 60 training rows."""
    (x, y), val = data.breast_cancer(standardise=False)
    booster = boost_binary(attach, long, (x[:60], y[:60]), val, max_depth=12, eta=1.0, min_child_weight=0)
    return binary_outcome(booster, *val)


def labels_not_class_ids(attach, long: bool) -> Outcome:
    """Fault: labels divided by 255 like pixels; binary:logistic silently takes 0 and 1/255 as probabilities."""
    (xt, yt), (xv, yv) = data.breast_cancer(standardise=False)
    booster = boost_binary(attach, long, (xt, yt / 255.0), (xv, yv / 255.0))
    return binary_outcome(booster, xv, yv)


def shuffled_labels(attach, long: bool) -> Outcome:
    """Fault: the training labels were permuted on their own, out of line with their rows."""
    (xt, yt), val = data.breast_cancer(standardise=False)
    booster = boost_binary(attach, long, (xt, np.random.default_rng(SEED).permutation(yt)), val)
    return binary_outcome(booster, *val)


# -- other objectives and APIs, healthy ---------------------------------------------------------------------------

def multiclass(attach, long: bool) -> Outcome:
    """Healthy: multi:softprob on the 10 digit classes, depth 4, mlogloss and merror eval log."""
    train, (x_val, y_val) = data.digits(standardise=False)
    rounds, eta = schedule(long, 60, 0.3)
    params = {"objective": "multi:softprob", "num_class": 10, "eval_metric": ["mlogloss", "merror"], "eta": eta,
              "max_depth": 4, "subsample": 0.8, "colsample_bytree": 0.8}
    booster = boost(attach, params, train, (x_val, y_val), rounds, eval_data=(x_val, y_val))
    return accuracy_outcome(y_val, booster.inplace_predict(x_val).argmax(1), booster.num_boosted_rounds(), 0.93)


def r2_outcome(booster: xgb.Booster, x_val, y_val, target: float = 0.3, **predict) -> Outcome:
    """Validation R^2 of a regressor (a linear fit reaches 0.37 on this split of diabetes)."""
    r2 = r2_score(y_val, booster.inplace_predict(x_val, **predict))
    return Outcome(r2 >= target, f"val_r2 {r2:.3f} (>= {target})", booster.num_boosted_rounds())


def regression(attach, long: bool) -> Outcome:
    """Healthy: reg:squarederror on diabetes, shallow trees (depth 2), RMSE eval log."""
    train, val = data.diabetes(standardise=False)
    rounds, eta = schedule(long, 100, 0.05)
    params = {"objective": "reg:squarederror", "eval_metric": "rmse", "eta": eta, "max_depth": 2, "subsample": 0.8}
    return r2_outcome(boost(attach, params, train, val, rounds), *val)


def early_stopping(attach, long: bool) -> Outcome:
    """Healthy: reg:squarederror on diabetes with up to 1000 rounds, ended by early stopping on the validation RMSE."""
    train, val = data.diabetes(standardise=False)
    eta = 0.025 if long else 0.1  # the longer version takes finer steps, so more rounds before it stops
    params = {"objective": "reg:squarederror", "eval_metric": "rmse", "eta": eta, "max_depth": 3, "subsample": 0.8}
    booster = boost(attach, params, train, val, 1000, early_stopping_rounds=20)
    return r2_outcome(booster, *val, iteration_range=(0, booster.best_iteration + 1))


def early_stopping_on_training_data(attach, long: bool) -> Outcome:
    """The early-stopping booster whose validation set is the training DMatrix passed twice: early stopping never
    stops, and every round of the 1000 fits the training rows harder."""
    train, val = data.diabetes(standardise=False)
    eta = 0.025 if long else 0.1
    params = {**COMMON, "objective": "reg:squarederror", "eval_metric": "rmse", "eta": eta, "max_depth": 3,
              "subsample": 0.8}
    dtrain = dmatrix(train)
    booster = xgb.train(params, dtrain, 1000, evals=[(dtrain, "train"), (dtrain, "validation")],
                        early_stopping_rounds=20, callbacks=callbacks(attach), verbose_eval=False)
    return r2_outcome(booster, *val, iteration_range=(0, booster.best_iteration + 1))


def imbalanced_binary(attach, long: bool) -> Outcome:
    """Healthy: "is it a 0?" on digits (1 positive in 10), weighted with scale_pos_weight = negatives / positives."""
    (xt, yt), (xv, yv) = data.digits(standardise=False)
    train, val = (xt, (yt == 0).astype(np.int64)), (xv, (yv == 0).astype(np.int64))
    rounds, eta = schedule(long, 60, 0.1)
    params = {"objective": "binary:logistic", "eval_metric": ["logloss", "aucpr"], "eta": eta, "max_depth": 3,
              "scale_pos_weight": float((train[1] == 0).sum() / train[1].sum())}
    booster = boost(attach, params, train, val, rounds, eval_data=val)
    f1, target = f1_score(val[1], booster.inplace_predict(xv) > 0.5), 0.9
    return Outcome(f1 >= target, f"val_f1 {f1:.3f} (>= {target})", booster.num_boosted_rounds())


def mean_ndcg(relevance, scores, qid, k: int = 5) -> float:
    """NDCG@k averaged over the queries."""
    return float(np.mean([ndcg_score([relevance[qid == q]], [scores[qid == q]], k=k) for q in np.unique(qid)]))


def ranking(attach, long: bool) -> Outcome:
    """Healthy: rank:ndcg on query groups of 10 documents with graded relevance, NDCG@5 eval log."""
    train, (xv, rv, qv) = data.ranking()
    rounds, eta = schedule(long, 60, 0.1)
    params = {"objective": "rank:ndcg", "eval_metric": "ndcg@5", "eta": eta, "max_depth": 4}
    booster = boost(attach, params, train, (xv, rv, qv), rounds)
    ndcg = mean_ndcg(rv, booster.inplace_predict(xv), qv)
    chance = mean_ndcg(rv, np.random.default_rng(SEED).random(len(rv)), qv)
    margin = 0.2
    return Outcome(ndcg >= chance + margin, f"val_ndcg@5 {ndcg:.3f} (>= random {chance:.3f} + {margin})",
                   booster.num_boosted_rounds())


def sklearn_eval_set(attach, long: bool) -> Outcome:
    """Healthy: XGBClassifier on wine's 3 classes, fitted with a training and a validation eval_set."""
    train, (x_val, y_val) = data.wine(standardise=False)
    rounds, eta = schedule(long, 100, 0.1)
    model = xgb.XGBClassifier(n_estimators=rounds, learning_rate=eta, max_depth=3, subsample=0.8, n_jobs=1,
                              random_state=SEED, eval_metric="mlogloss",
                              callbacks=callbacks(attach, (x_val, y_val)))
    model.fit(*train, eval_set=[train, (x_val, y_val)], verbose=False)
    return accuracy_outcome(y_val, model.predict(x_val), model.get_booster().num_boosted_rounds(), 0.9)


CASES: list[Case] = [
    Case("xgboost", "binary", binary),
    Case("xgboost", "multiclass", multiclass),
    Case("xgboost", "regression", regression),
    Case("xgboost", "ranking", ranking),
    Case("xgboost", "sklearn_eval_set", sklearn_eval_set),
    Case("xgboost", "early_stopping", early_stopping),
    Case("xgboost", "imbalanced_binary", imbalanced_binary),
    Case("xgboost", "leaky_feature", leaky_feature, fault="a feature is the label plus noise: target leakage",
         catch=("feature_importance_overweight",)),
    Case("xgboost", "overfitting_booster", overfitting_booster,
         fault="depth 12, eta 1, min_child_weight 0 on 60 rows: memorises", catch=("overfit",)),
    Case("xgboost", "labels_not_class_ids", labels_not_class_ids, fault="labels / 255: not class ids",
         catch=("loss_setup", "class_imbalance", "confusion")),
    Case("xgboost", "early_stopping_on_training_data", early_stopping_on_training_data,
         fault="the training DMatrix passed as the validation set", catch=("training_relations",), tags=SILENT),
    Case("xgboost", "shuffled_labels", shuffled_labels, fault="training labels permuted against the rows",
         catch=("loss_not_decreasing", "overfit")),
]
