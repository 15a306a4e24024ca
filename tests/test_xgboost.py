"""The XGBoost plugin on real boosting: rules firing and not, stop, checkpoint, sklearn, CLI, Dask on 2 workers."""

import logging
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xgboost as xgb
from sklearn.datasets import load_breast_cancer, load_digits, make_classification

import tripwire
from benchmarks.zoo import cases as zoo_cases
from benchmarks.zoo.harness import CONFIGS, run_case
from tripwire.plugins.xgboost import TripwireCallback

# One config for every run below: the faulty runs fire their rule under it, the sane run fires nothing. overfit
# needs no parameters: the plugin reads the eval log as XGBoost's early stopping does (the last eval set is the
# validation set); loss_not_decreasing is pointed at the validation metric, the training loss always falls.
NOT_DECREASING = {"rule": "loss_not_decreasing", "params": {"collection": "metrics",
                                                            "tensor_regex": "^metrics/val/m?logloss$"}}
RULES = {"sampling": {"every": 1}, "collections": {"trees": {}, "feature_importance": {}},
         "rules": ["tree_depth", "feature_importance_overweight", "class_imbalance", "confusion", "overfit",
                   NOT_DECREASING]}
DEEP = {"objective": "binary:logistic", "max_depth": 12, "min_child_weight": 0, "lambda": 0}


def noisy(n=600):
    """Binary data with 20% of the labels flipped: deep trees learn the noise."""
    return make_classification(n_samples=n, n_features=20, n_informative=5, flip_y=0.2, random_state=0)


def leaking(n=1000, noise=0.1):
    """Binary data where feature 7 is the label plus a little noise."""
    x, y = make_classification(n_samples=n, n_features=20, n_informative=10, flip_y=0.1, random_state=0)
    x[:, 7] = y + np.random.default_rng(0).normal(0, noise, len(y))
    return x, y


def confused_digits():
    """Digits where half of the 7s are labelled 1 (in training and held-out data alike)."""
    x, y = load_digits(return_X_y=True)
    sevens = np.flatnonzero(y == 7)
    y = y.copy()
    y[sevens[np.random.default_rng(0).random(len(sevens)) < 0.5]] = 1
    return x, y


def separable(n=20000):
    """Balanced binary data, 10 informative features, well separated: a small model learns it without overfitting."""
    return make_classification(n_samples=n, n_features=20, n_informative=10, n_redundant=0, class_sep=2.5,
                               random_state=0)


def train(x, y, params, rounds, cut, config=RULES, **callback):
    """xgb.train with a train and a held-out eval set; returns (booster, callback, evals_result)."""
    xt, yt, xv, yv = x[:cut], y[:cut], x[cut:], y[cut:]
    cb = TripwireCallback(config, **{"eval_data": (xv, yv), **callback})
    dtrain, dval = xgb.DMatrix(xt, label=yt), xgb.DMatrix(xv, label=yv)
    result = {}
    booster = xgb.train({"nthread": 1, **params}, dtrain, rounds, evals=[(dtrain, "train"), (dval, "val")],
                        callbacks=[cb], evals_result=result, verbose_eval=False)
    return booster, cb, result


def fired(run_url):
    """Each rule's first fired verdict (in step order)."""
    first = {}
    for v in tripwire.open_run(run_url).verdicts():
        if v.fired:
            first.setdefault(v.rule, v)
    return first


def test_deep_trees_on_a_small_dataset_fire_overfit_and_tree_depth(tmp_path):
    x, y = noisy()
    booster, cb, result = train(x, y, DEEP, 30, 300, out_dir=tmp_path / "deep")
    verdicts = fired(cb.run_url)
    assert {"overfit", "tree_depth", "loss_not_decreasing"} <= set(verdicts)
    assert verdicts["tree_depth"].step == 0 and "depth 12" in verdicts["tree_depth"].message
    assert verdicts["tree_depth"].severity == "info"  # deep trees are a choice; overfit judges their effect
    # the validation loss bottoms out at round 1 (0.605) and is 10% above it from round 4: three in a row at 6
    overfit = verdicts["overfit"]
    assert (overfit.step, overfit.mode, overfit.severity) == (6, "eval", "warning")
    assert "from its best 0.6051 at step 1" in overfit.message
    rising = verdicts["loss_not_decreasing"]  # three windows of 5 rounds: the validation loss rose
    assert (rising.step, rising.severity, rising.finding) == (14, "warning", "rising")
    assert "max_depth" in verdicts["tree_depth"].hint
    assert booster.num_boosted_rounds() == 30 and cb.verdicts  # log only: training went on

    run = tripwire.open_run(cb.run_url)
    steps, values = run.tensor("metrics/val/logloss").series()
    assert steps.tolist() == list(range(30)) and np.allclose(values, result["val"]["logloss"])
    assert run.tensor("trees/depth").reduction(0) == 12
    assert run.tensor("trees/leaves").reduction(5) == run.tensor("trees/splits").reduction(5) + 1
    assert run.info["framework"] == "xgboost" and run.info["framework_version"].startswith("xgboost")
    assert run.info["hyperparameters"]["max_depth"] == "12" and run.info["num_features"] == 20
    assert run.info["status"] == "finished"


def test_the_whole_eval_log_is_stored_every_round_with_the_default_config(tmp_path):
    """XGBoost hands the whole eval log to every call: with config=None (sampling every 100 rounds) an 87-round
    classifier still stores each of its 87 rounds, for every metric of every eval set, and the training loss."""
    x, y = noisy()
    model = xgb.XGBClassifier(n_estimators=87, max_depth=3, n_jobs=1, eval_metric=["logloss", "error"],
                              callbacks=[TripwireCallback(None, out_dir=tmp_path / "run")])
    model.fit(x[:400], y[:400], eval_set=[(x[:400], y[:400]), (x[400:], y[400:])], verbose=False)
    run = tripwire.open_run(tmp_path / "run")
    logged = model.evals_result()
    for data in ("validation_0", "validation_1"):
        for metric in ("logloss", "error"):
            steps, values = run.tensor(f"metrics/{data}/{metric}").series()
            assert steps.tolist() == list(range(87)) and np.allclose(values, logged[data][metric])
    assert run.tensor("losses/train").steps() == list(range(87))


def test_a_leaking_feature_fires_feature_importance_overweight(tmp_path):
    x, y = leaking()
    _, cb, _ = train(x, y, {"objective": "binary:logistic", "max_depth": 3}, 20, 700, out_dir=tmp_path / "leak")
    verdict = fired(cb.run_url)["feature_importance_overweight"]
    assert verdict.step == 10 and "f7" in verdict.message  # start_step 10
    names = tripwire.open_run(cb.run_url).tensor_names("feature_importance")
    assert {f"feature_importance/{t}/f7" for t in ("weight", "gain", "cover", "total_gain", "total_cover")} \
        <= set(names)


def imbalanced(n_minority, ratio=50, seed=0):
    """Binary data with exactly `ratio` negatives per positive, shuffled: labels built explicitly, not drawn."""
    rng = np.random.default_rng(seed)
    y = rng.permutation(np.r_[np.zeros(ratio * n_minority, dtype=np.int64), np.ones(n_minority, dtype=np.int64)])
    x = rng.normal(size=(len(y), 20))
    x[:, :5] += 1.5 * y[:, None]  # five informative features
    return x, y


def test_a_1_to_50_split_fires_class_imbalance_with_the_sklearn_estimator(tmp_path):
    xt, yt = imbalanced(40, seed=0)
    xv, yv = imbalanced(20, seed=1)
    assert np.bincount(yt).tolist() == [2000, 40] and np.bincount(yv).tolist() == [1000, 20]  # exactly 1:50
    cb = TripwireCallback(RULES, out_dir=tmp_path / "imbalance", eval_data=(xv, yv))
    model = xgb.XGBClassifier(n_estimators=20, max_depth=3, n_jobs=1, callbacks=[cb])
    model.fit(xt, yt, eval_set=[(xt, yt), (xv, yv)], verbose=False)
    verdict = fired(cb.run_url)["class_imbalance"]
    assert verdict.step == 0 and "50.0x" in verdict.message and verdict.evidence["counts"] == {"0": 1000, "1": 20}
    run = tripwire.open_run(cb.run_url)
    assert "metrics/validation_1/logloss" in run.tensor_names()  # the sklearn estimator's eval set names
    assert np.array_equal(run.tensor("labels").value(19), yv)
    assert np.allclose(run.tensor("predictions").value(19), model.predict_proba(xv)[:, 1], atol=1e-6)
    assert pickle.loads(pickle.dumps(model)).get_booster().num_boosted_rounds() == 20  # the callback pickles


def test_confused_classes_fire_confusion(tmp_path):
    x, y = confused_digits()
    _, cb, _ = train(x, y, {"objective": "multi:softprob", "num_class": 10, "max_depth": 3}, 20, 1200,
                     out_dir=tmp_path / "confused")
    verdict = fired(cb.run_url)["confusion"]
    # once the model has learned, the pair stands out against the overall error over two pools of fresh labels;
    # info: 39% of one predicted class is not half of it (a hard class, or labels to check, not a broken run)
    assert verdict.step == 6 and verdict.severity == "info" and "predicted as class 7 are class 1" in verdict.message
    matrix = np.array(verdict.evidence["matrix"])
    assert matrix.shape == (10, 10) and matrix.sum() >= 500


def test_a_sane_model_fires_nothing(tmp_path):
    x, y = separable()
    booster, cb, _ = train(x, y, {"objective": "binary:logistic", "max_depth": 2, "eta": 0.3}, 20, 13333,
                           out_dir=tmp_path / "sane")
    run = tripwire.open_run(cb.run_url)
    assert run.verdicts() == [] and cb.verdicts == []
    assert set(run.collections()) == {"losses", "metrics", "trees", "feature_importance", "labels", "predictions"}
    assert run.steps() == list(range(20)) and booster.num_boosted_rounds() == 20


@pytest.mark.parametrize("slope, trees", [(1.0, False), (1.0, True), (100.0, True)])
def test_a_booster_whose_trees_never_split_is_told_at_once(tmp_path, slope, trees):
    """reg:pseudohubererror on diabetes targets (25-346) with huber_slope 1 (XGBoost's default): the hessian falls
    as the cube of slope / residual, no split keeps min_child_weight of it on each side, every round adds one leaf
    and the training loss stays the same number. loss_not_decreasing waited its 300 steps of a slow start: it
    never came in 100 rounds. A series that has not moved at all is told at once; where the trees are captured, as
    a booster that never splits. At huber_slope 100 the trees split and the model learns: silent."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    config = {"collections": {"trees": {}}, "rules": ["loss_not_decreasing"]} if trees else None
    _, cb, result = train(x, y, {"objective": "reg:pseudohubererror", "huber_slope": slope}, 100, 330,
                          config=config, out_dir=tmp_path / "run")
    told = [(v.step, v.severity, v.finding) for v in cb.verdicts if v.rule == "loss_not_decreasing" and v.counts]
    if slope == 100.0:
        assert result["train"]["mphe"][-1] < 0.5 * result["train"]["mphe"][0] and told == []
        assert result["val"]["mphe"][-1] < 0.95 * result["val"]["mphe"][0]
    else:
        assert len(set(result["train"]["mphe"])) == 1  # not one round changed the model
        assert told == [(14, "error", "no_splits" if trees else "never")]
        (verdict,) = [v for v in cb.verdicts if v.rule == "loss_not_decreasing" and v.counts]
        assert "Not one of its 15 samples differs from the first" in verdict.message
        assert ("None of the trees of its last" in verdict.message) is trees


def test_stop_ends_boosting_and_checkpoint_writes_a_loadable_booster(tmp_path):
    x, y = noisy()
    # overfit is a warning: `stop` acts on errors unless told to act on warnings too
    config = {"sampling": {"every": 1}, "rules": [{"rule": "overfit", "actions": ["log", "checkpoint",
                                                                                  {"stop": "warning"}]}]}
    booster, cb, _ = train(x, y, DEEP, 30, 300, config=config, out_dir=tmp_path / "stop")
    step = fired(cb.run_url)["overfit"].step
    assert step == 6 and booster.num_boosted_rounds() == step + 1
    run = tripwire.open_run(cb.run_url)
    assert run.info["status"] == "stopped" and run.steps() == list(range(7))
    saved = xgb.Booster(model_file=str(tmp_path / "stop" / "checkpoints" / f"step{step}.ubj"))
    data = xgb.DMatrix(x[300:])
    assert saved.num_boosted_rounds() == 7 and np.array_equal(saved.predict(data), booster.predict(data))


def test_stop_acts_on_errors_only_unless_the_config_lowers_it(tmp_path):
    """The same warning with a plain `stop`: logged and checkpointed, training goes on to the end."""
    x, y = noisy()
    config = {"sampling": {"every": 1}, "rules": [{"rule": "overfit", "actions": ["log", "checkpoint", "stop"]}]}
    booster, cb, _ = train(x, y, DEEP, 30, 300, config=config, out_dir=tmp_path / "go-on")
    assert fired(cb.run_url)["overfit"].severity == "warning" and booster.num_boosted_rounds() == 30
    assert tripwire.open_run(cb.run_url).info["status"] == "finished"
    assert (tmp_path / "go-on" / "checkpoints" / "step6.ubj").exists()


@pytest.mark.parametrize("fmt", ["json", "ubj"])
def test_checkpoint_writes_the_chosen_format_into_a_memory_run(fmt):
    import json
    import uuid

    import fsspec

    x, y = noisy()
    url = f"memory://tripwire-tests/xgb-checkpoint-{fmt}-{uuid.uuid4().hex[:8]}"
    config = {"sampling": {"every": 1}, "rules": [{"rule": "overfit", "actions": ["checkpoint", {"stop": "warning"}]}]}
    booster, cb, _ = train(x, y, DEEP, 30, 300, config=config, out_dir=url, checkpoint_format=fmt)
    fs = fsspec.filesystem("memory")
    try:
        assert cb.run_url == url and booster.num_boosted_rounds() == 7
        names = [p.rsplit("/", 1)[1] for p in fs.ls(f"{url}/checkpoints", detail=False)]
        assert names == [f"step6.{fmt}"]
        with fsspec.open(f"{url}/checkpoints/step6.{fmt}", "rb") as f:
            raw = f.read()
        if fmt == "json":
            assert json.loads(raw)["learner"]["gradient_booster"]["name"] == "gbtree"
        else:
            assert raw[:1] == b"{" and b"learner" in raw[:64]  # UBJSON: an object, not JSON text
            with pytest.raises(ValueError):
                json.loads(raw)
        saved = xgb.Booster()
        saved.load_model(bytearray(raw))
        data = xgb.DMatrix(x[300:])
        assert saved.num_boosted_rounds() == 7 and np.array_equal(saved.predict(data), booster.predict(data))
        assert tripwire.open_run(url).info["status"] == "stopped"
    finally:
        fs.rm(url, recursive=True)


def test_raise_action_raises_rule_fired_and_closes_the_run(tmp_path):
    x, y = noisy()
    config = {"sampling": {"every": 1}, "rules": [{"rule": "tree_depth", "actions": [{"raise": "info"}]}]}
    with pytest.raises(tripwire.RuleFired):
        train(x, y, DEEP, 30, 300, config=config, out_dir=tmp_path / "raise", checkpoint_format="json")
    assert tripwire.open_run(tmp_path / "raise").info["status"] == "stopped"


def test_the_packaged_xgboost_yaml_runs_as_documented(tmp_path, monkeypatch):
    """`TripwireCallback("xgboost.yaml")` as docs/xgboost.md and README show it, with no such file in the working
    directory: the packaged config, whose every rule finds its data on a classifier given eval_data."""
    monkeypatch.chdir(tmp_path)
    x, y = separable(3000)
    xt, yt, xv, yv = x[:2000], y[:2000], x[2000:], y[2000:]
    cb = TripwireCallback("xgboost.yaml", out_dir=tmp_path / "docs", eval_data=(xv, yv))
    assert cb.config.source == "xgboost.yaml (packaged)"
    dtrain, dval = xgb.DMatrix(xt, label=yt), xgb.DMatrix(xv, label=yv)
    xgb.train({"nthread": 1, "max_depth": 3, "objective": "binary:logistic"}, dtrain, 12,
              evals=[(dtrain, "train"), (dval, "validation")], callbacks=[cb], verbose_eval=False)
    run = tripwire.open_run(cb.run_url)
    assert not [v for v in run.verdicts() if not v.fired]  # every rule found its data
    assert {"metrics/validation/logloss", "metrics/val_loss", "trees/depth", "labels"} <= set(run.tensor_names())


@pytest.mark.parametrize("case", zoo_cases("xgboost"), ids=lambda case: case.name)
def test_the_packaged_xgboost_yaml_is_silent_on_healthy_boosters_and_catches_faults(case, tmp_path, monkeypatch):
    """The packaged xgboost.yaml on every XGBoost case of the zoo: no verdict at warning or error on a healthy
    booster (overfit included, where more rounds merely stop helping), none stopped; each fault caught by a rule
    that names it."""
    monkeypatch.chdir(tmp_path)  # no xgboost.yaml of the user's here: the packaged one
    monkeypatch.setitem(CONFIGS, "xgboost.yaml", lambda framework: "xgboost.yaml")
    result = run_case(case, "xgboost.yaml", root=str(tmp_path))
    assert not result.failures, "\n".join(result.failures)
    assert case.healthy or result.right_rule, f"{case.fault}: fired {result.rules or 'nothing'}, not {case.catch}"


@pytest.mark.parametrize("labels, scores, expected", [
    (np.repeat([0, 1], 3), np.r_[np.full(3, 0.1), 0.2, 0.2, 0.9], [0, 0, 0, 0, 0, 1]),  # one probability each
    (np.repeat([0, 1], 3), np.r_[np.full(3, -2.1), np.full(3, 1.7)], [0, 0, 0, 1, 1, 1]),  # logits, threshold 0
    (np.eye(3)[[0, 1, 2]], np.eye(3)[[0, 2, 2]] * 5, [0, 2, 2]),  # one-hot labels, [n, C] scores
    (np.array([0, 1, 2]), np.array([0.0, 2.0, 2.0]), [0, 2, 2]),  # class ids predicted
    (np.array([[1, 2, -100]]), np.eye(4)[[[1, 3, 0]]], [1, 3]),  # tokens: [n, T] ids, [n, T, V] logits, padding
    (np.array([[0], [2], [1]]), np.eye(3)[[0, 1, 1]], [0, 1, 1]),  # [n, 1] ids (Keras' sparse losses take them)
])
def test_class_rules_read_labels_and_predictions_in_every_format(labels, scores, expected):
    from tripwire.core.rules.classification import _classified

    threshold = 0.0 if scores.min() < 0 else 0.5
    y, predicted = _classified(labels, scores, threshold)
    assert predicted.tolist() == expected and len(y) == len(expected)


def test_data_that_is_not_a_classifiers_is_not_judged_and_labels_that_are_not_class_ids_are_a_finding():
    from tripwire.core.history import History
    from tripwire.core.rules.base import NotApplicable
    from tripwire.core.rules.classification import ClassImbalance, NotClassIds, _classified

    rng = np.random.default_rng(0)
    with pytest.raises(NotApplicable, match="regressor's targets"):  # one score per sample, continuous targets
        _classified(rng.normal(size=300), rng.normal(size=(300, 1)), 0.5)
    with pytest.raises(NotApplicable, match="not a classifier's"):  # reconstructions [n, 64] against [n, 8]
        _classified(rng.normal(size=(300, 8)), rng.normal(size=(300, 64)), 0.5)
    with pytest.raises(NotClassIds, match="like 0.003922"):  # digits divided by 255, scores per class
        _classified(np.repeat([0, 1, 2], 100) / 255, rng.normal(size=(300, 3)), 0.5)
    history = History(16, 16)  # the rule: a fired verdict that says so, with its own hint
    history.add(0, "train", 20, {}, {"labels": np.repeat([0, 1], 300) / 255, "predictions": rng.random(600)})
    verdict = ClassImbalance().check(history.at(20, "train", 0), 20)
    assert verdict.finding == "not_class_ids" and verdict.severity == "warning" and "divided by 255" in verdict.hint
    history = History(16, 16)
    history.add(0, "train", 21, {}, {"labels": np.repeat([0, 0, 1], 200), "predictions": rng.random(600)})
    assert ClassImbalance(samples=601).check(history.at(21, "train", 0), 21) is None  # too few labels yet


def cli(*args):
    return subprocess.run([sys.executable, "-m", "tripwire", *args], capture_output=True, text=True, timeout=120)


def test_a_booster_refreshing_its_trees_in_place_trains_on_and_a_continued_one_is_read_as_itself(tmp_path, caplog):
    """XGBoost's update_process demo: a booster refreshed in place (process_type=update) refuses a slice of one
    round's trees until all are refreshed; with trees captured, tripwire's read of them raised into xgb.train and
    ended a healthy training. A training continued from a model (xgb_model=) counts its rounds from 0 again: the
    trees and predictions captured were the first rounds', not the continued model's. Its steps are the booster's
    own rounds (8, 9 after 8), those of a booster refreshed in place the rounds it refreshes (0 to 7)."""
    x, y = load_digits(return_X_y=True)
    y = (y == 3).astype(int)
    dtrain = xgb.DMatrix(x[:1200], label=y[:1200])
    config = CONFIGS["all_rules"]("xgboost")
    base = xgb.train({"objective": "binary:logistic", "max_depth": 3, "nthread": 1}, dtrain, 8)
    refresh = TripwireCallback(config, out_dir=tmp_path / "refresh")
    refreshed = xgb.train({"objective": "binary:logistic", "process_type": "update", "updater": "refresh",
                           "refresh_leaf": True, "nthread": 1}, dtrain, 8, xgb_model=base,
                          evals=[(dtrain, "train")], callbacks=[refresh], verbose_eval=False)
    assert refreshed.num_boosted_rounds() == 8
    said = [r.getMessage() for r in caplog.records if "could not read the trees" in r.getMessage()]
    assert len(said) == 1 and "not captured for the rest of this training" in said[0]
    assert tripwire.open_run(refresh.run_url).info["status"] == "finished"
    assert tripwire.open_run(refresh.run_url).steps() == list(range(8))

    continued = TripwireCallback(config, out_dir=tmp_path / "continued", eval_data=(x[1200:], y[1200:]))
    booster = xgb.train({"objective": "binary:logistic", "max_depth": 3, "nthread": 1}, dtrain, 2,
                        xgb_model=base, evals=[(dtrain, "train")], callbacks=[continued], verbose_eval=False)
    run = tripwire.open_run(continued.run_url)
    assert run.steps() == [8, 9]
    predicted = run.tensor("predictions").value(8)
    np.testing.assert_allclose(predicted, booster.inplace_predict(x[1200:], iteration_range=(0, 9)), rtol=1e-6)
    leaves = sum(text.count('"leaf"') for text in booster[8:9].get_dump(dump_format="json"))
    assert run.tensor("trees/leaves").reduction(8) == leaves


def test_a_booster_trained_further_is_not_judged_as_an_untrained_one(tmp_path):
    """A booster trained further (xgb_model=) starts fitted: its training loss at the first round (0.007) against the
    validation loss (0.08) is an ordinary gap, which first_evaluation (default config) told as 'the model computes
    something else in evaluation' (12x). Its steps go on from its rounds (60 to 99), so the rule sees that training
    began before the run: no data, said why. The booster trained from scratch is judged as before."""
    x, y = load_breast_cancer(return_X_y=True)
    dtrain, dvalid = xgb.DMatrix(x[:400], label=y[:400]), xgb.DMatrix(x[400:], label=y[400:])
    params = {"objective": "binary:logistic", "max_depth": 4, "nthread": 1}
    first, more = TripwireCallback(out_dir=tmp_path / "first"), TripwireCallback(out_dir=tmp_path / "more")
    booster = xgb.train(params, dtrain, 60, evals=[(dtrain, "train"), (dvalid, "valid")], callbacks=[first],
                        verbose_eval=False)
    further = xgb.train(params, dtrain, 40, evals=[(dtrain, "train"), (dvalid, "valid")], xgb_model=booster,
                        callbacks=[more], verbose_eval=False)
    assert further.num_boosted_rounds() == 100
    run = tripwire.open_run(more.run_url)
    assert run.steps()[0] == 60 and run.steps()[-1] == 99
    assert [v for v in run.verdicts() if v.counts] == []
    (verdict,) = [v for v in run.verdicts() if v.rule == "first_evaluation"]
    assert verdict.status == "no_data"
    assert "step 60's, not step 0's" in verdict.message and "a booster trained further" in verdict.message
    assert [v for v in tripwire.open_run(first.run_url).verdicts() if v.counts] == []


def test_a_metric_that_goes_up_is_never_read_as_the_loss(tmp_path, caplog):
    """XGBoost's Higgs demo logs auc and ams@0.15 (higher is better): the first metric that was not auc, aucpr, pre,
    map or ndcg was taken for the training loss, and loss_not_decreasing called it rising as the model learnt.
    Only metrics that go down are losses: XGBoost's own, or custom ones named so (scikit-learn's `*_error`). The
    log says once why the loss rules have no data, and what to add."""
    caplog.set_level(logging.WARNING, logger="tripwire")
    x, y = separable(4000)
    dtrain = xgb.DMatrix(x[:3000], label=y[:3000])
    rising = TripwireCallback(None, out_dir=tmp_path / "ams")
    xgb.train({"objective": "binary:logitraw", "eval_metric": ["auc", "ams@0.15"], "max_depth": 3, "nthread": 1},
              dtrain, 30, evals=[(dtrain, "train")], callbacks=[rising], verbose_eval=False)
    run = tripwire.open_run(rising.run_url)
    assert "losses/train" not in run.tensor_names() and "metrics/train/ams@0.15" in run.tensor_names()
    assert [v for v in run.verdicts() if v.fired] == []
    assert {v.rule for v in run.verdicts() if v.status == "no_data"} >= {"loss_not_decreasing"}
    told = [r.getMessage() for r in caplog.records if "which go up as the model learns" in r.getMessage()]
    assert len(told) == 1 and "log ams@0.15, auc," in told[0] and "add a loss to eval_metric" in told[0]
    caplog.clear()

    from sklearn.metrics import mean_absolute_error
    named = TripwireCallback(None, out_dir=tmp_path / "named")
    model = xgb.XGBRegressor(n_estimators=20, max_depth=3, n_jobs=1, eval_metric=mean_absolute_error,
                             callbacks=[named])
    model.fit(x[:3000], y[:3000].astype(float), eval_set=[(x[:3000], y[:3000].astype(float)),
                                                          (x[3000:], y[3000:].astype(float))], verbose=False)
    losses = tripwire.open_run(named.run_url).tensor("losses/train").series("value")[1]
    assert len(losses) == 20 and losses[-1] < losses[0]
    assert not any("which go up" in r.getMessage() for r in caplog.records)


def test_a_ranker_s_clicks_and_a_booster_s_own_output_are_not_judged_as_a_classifier_s(tmp_path):
    """XGBoost's learning-to-rank demo on clicks (relevance 0 or 1): class_imbalance read the ranker as a binary
    classifier ("class 0 has 47.8x the samples of class 1"). A built-in objective reads its own output, and the
    eval log's loss is on other data than eval_data's predictions: output_loss_mismatch matched binary:logitraw's
    margins against an unrelated metric on the Higgs demo."""
    x, y = separable(3000)
    clicks = (y & (np.random.default_rng(0).random(len(y)) < 0.1)).astype(int)  # 1 in 20 clicked
    config = {"sampling": {"every": 1}, "rules": ["class_imbalance", "output_loss_mismatch"]}
    ranked = TripwireCallback(config, out_dir=tmp_path / "rank", eval_data=(x[2000:], clicks[2000:]))
    xgb.train({"objective": "rank:ndcg", "eval_metric": "ndcg@10", "nthread": 1},
              xgb.DMatrix(x[:2000], label=clicks[:2000], qid=np.repeat(np.arange(100), 20)), 10,
              callbacks=[ranked])
    margins = TripwireCallback(config, out_dir=tmp_path / "margins", eval_data=(x[2000:], y[2000:]))
    xgb.train({"objective": "binary:logitraw", "nthread": 1}, xgb.DMatrix(x[:2000], label=y[:2000]), 10,
              evals=[(xgb.DMatrix(x[:2000], label=y[:2000]), "train")], callbacks=[margins], verbose_eval=False)
    for callback, rules in ((ranked, {"class_imbalance": "ranking's"}),
                            (margins, {"output_loss_mismatch": "binary:logitraw"})):
        verdicts = tripwire.open_run(callback.run_url).verdicts()
        assert [v for v in verdicts if v.fired] == []
        for rule, why in rules.items():
            (verdict,) = [v for v in verdicts if v.rule == rule]
            assert verdict.status == "no_data" and why in verdict.message


def test_check_and_show_handle_xgboost_runs(tmp_path):
    x, y = noisy()
    _, faulty, _ = train(x, y, DEEP, 10, 300, out_dir=tmp_path / "faulty")
    x, y = separable(3000)
    _, sane, _ = train(x, y, {"objective": "binary:logistic", "max_depth": 2}, 10, 2000,
                       config={"sampling": {"every": 2}, "rules": ["tree_depth", "class_imbalance"]},
                       out_dir=tmp_path / "sane")

    bad = cli("check", faulty.run_url)
    assert bad.returncode == 1 and "[tree_depth] info at step 0" in bad.stdout and "[overfit] warning" in bad.stdout
    ok = cli("check", sane.run_url)
    assert ok.returncode == 0 and "0 finding(s) at warning or error" in ok.stdout
    (tmp_path / "deeper.yaml").write_text("rules: [{rule: tree_depth, params: {depth: 1}}]\n")
    deeper = cli("check", sane.run_url, "--config", str(tmp_path / "deeper.yaml"))  # info: worth a look, exit 0
    assert deeper.returncode == 0 and "[tree_depth] info at step 0" in deeper.stdout and "1 at info" in deeper.stdout
    show = cli("show", faulty.run_url)
    assert show.returncode == 0 and "xgboost" in show.stdout and "trees/depth" in show.stdout


@pytest.fixture(scope="module")
def dask_client():
    from dask import distributed

    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None) \
            as cluster, distributed.Client(cluster) as client:
        yield client


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", ["zero", "all"])
def test_dask_two_workers_record_and_stop_together(tmp_path, dask_client, workers):
    import dask.array as da
    import xgboost.dask as dxgb

    x, y = noisy()
    config = {"workers": workers, "sampling": {"every": 1}, "collections": {"labels": {"save": "tensors"}},
              "rules": [{"rule": "overfit", "actions": ["log", "checkpoint", {"stop": "warning"}]}]}
    cb = TripwireCallback(config, out_dir=tmp_path / "dask", eval_data=(x[300:], y[300:]))
    dtrain, dval = (dxgb.DaskDMatrix(dask_client, da.from_array(a, chunks=150), da.from_array(b, chunks=150))
                    for a, b in ((x[:300], y[:300]), (x[300:], y[300:])))
    out = dxgb.train(dask_client, DEEP, dtrain, 30, evals=[(dtrain, "train"), (dval, "val")], callbacks=[cb])

    run = tripwire.open_run(cb.run_url)
    verdicts = [v for v in run.verdicts() if v.fired]
    assert {v.step for v in verdicts} == {6} and out["booster"].num_boosted_rounds() == 7  # both workers stopped
    assert run.workers() == ([0] if workers == "zero" else [0, 1]) == sorted(v.worker for v in verdicts)
    assert run.info["world_size"] == 2 and run.info["status"] == "stopped"
    assert run.steps() == list(range(7)) and np.array_equal(run.tensor("labels").value(6), y[300:])
    assert (tmp_path / "dask" / "checkpoints" / "step6.ubj").exists()


@pytest.mark.timeout(180)
def test_dask_a_stop_decided_on_rank_1_alone_stops_both_workers_at_the_same_round(tmp_path, dask_client):
    import dask.array as da
    import xgboost.dask as dxgb

    x, y = noisy()
    config = {"workers": "all", "sampling": {"every": 1},
              "rules": [{"rule": "custom_rules:OnRank", "params": {"rank": 1, "start": 4},
                         "actions": ["log", "checkpoint", "stop"]}]}
    cb = TripwireCallback(config, out_dir=tmp_path / "rank1")
    dtrain, dval = (dxgb.DaskDMatrix(dask_client, da.from_array(a, chunks=150), da.from_array(b, chunks=150))
                    for a, b in ((x[:300], y[:300]), (x[300:], y[300:])))
    out = dxgb.train(dask_client, DEEP, dtrain, 30, evals=[(dtrain, "train"), (dval, "val")], callbacks=[cb])

    run = tripwire.open_run(cb.run_url)
    verdicts = [v for v in run.verdicts() if v.fired]
    assert [(v.rule, v.worker, v.step) for v in verdicts] == [("custom_rules:OnRank", 1, 4)]  # rank 0 saw nothing
    assert out["booster"].num_boosted_rounds() == 5  # and still stopped after round 4, with rank 1
    assert run.workers() == [0, 1] and run.info["status"] == "stopped"
    for worker in (0, 1):
        steps, _ = run.tensor("metrics/val/logloss").series(worker=worker)
        assert steps.tolist() == [0, 1, 2, 3, 4]
    # rank 0 writes the checkpoint that rank 1 asked for
    assert (tmp_path / "rank1" / "checkpoints" / "step4.ubj").exists()


def test_a_training_without_an_eval_set_is_told_what_to_pass(tmp_path, caplog):
    """XGBoost logs a loss only for the eval sets it is given: without one the loss rules have nothing to judge,
    and the run is empty under the default config. The user is told once, with what to pass; with an eval set,
    not. And the end-of-training line does not read "checked up to step None"."""
    x, y = load_breast_cancer(return_X_y=True)
    caplog.set_level(logging.INFO, logger="tripwire")
    xgb.XGBClassifier(n_estimators=20, callbacks=[TripwireCallback(out_dir=tmp_path / "bare")]).fit(x, y)
    said = [r.getMessage() for r in caplog.records]
    assert sum("has no eval set" in m and "eval_set=[(X_train, y_train)" in m for m in said) == 1
    assert any("had nothing to check" in m for m in said) and not any("step None" in m for m in said)
    caplog.clear()
    model = xgb.XGBClassifier(n_estimators=20, callbacks=[TripwireCallback(out_dir=tmp_path / "evals")])
    model.fit(x, y, eval_set=[(x, y)], verbose=False)
    assert not any("has no eval set" in r.getMessage() for r in caplog.records)
    assert model.evals_result()["validation_0"]["logloss"][-1] < 0.2  # it learns


@pytest.mark.parametrize("api", ["train", "sklearn"])
@pytest.mark.parametrize("order", ["permuted", "same"])
def test_validation_columns_in_another_order_are_told_at_the_first_round(tmp_path, api, order):
    """numpy data carries no feature names for XGBoost to check: a validation set whose columns come in another
    order (a frame built with its columns sorted, another query) is judged on features the trees never split on,
    and early stopping picks its round on that. Told at round 0 under the default config, naming the columns, by
    xgb.train and the sklearn estimator alike; the same columns in order are silent, and the model is right on
    the validation set."""
    from sklearn.model_selection import train_test_split

    x, y = load_breast_cancer(return_X_y=True)
    x_train, x_valid, y_train, y_valid = train_test_split(x, y, test_size=0.3, random_state=0, stratify=y)
    fed = x_valid[:, np.random.default_rng(0).permutation(x.shape[1])] if order == "permuted" else x_valid
    cb = TripwireCallback(None, out_dir=tmp_path / "run")
    params = {"objective": "binary:logistic", "max_depth": 3, "eta": 0.1, "nthread": 1}
    if api == "train":
        valid = xgb.DMatrix(fed, label=y_valid)
        booster = xgb.train(params, xgb.DMatrix(x_train, label=y_train), 100, verbose_eval=False, callbacks=[cb],
                            evals=[(valid, "validation")])
        accuracy = float(np.mean((booster.predict(valid) > 0.5) == y_valid))
    else:
        model = xgb.XGBClassifier(n_estimators=100, max_depth=3, learning_rate=0.1, n_jobs=1, callbacks=[cb])
        model.fit(x_train, y_train, eval_set=[(fed, y_valid)], verbose=False)
        accuracy = float(np.mean(model.predict(fed) == y_valid))
    found = [(v.rule, v.finding, v.step) for v in tripwire.open_run(cb.run_url).verdicts() if v.counts]
    if order == "permuted":
        assert accuracy < 0.8
        assert found[0] == ("loss_setup", "columns_swapped", 0), found
        verdict = next(v for v in tripwire.open_run(cb.run_url).verdicts() if v.finding == "columns_swapped")
        assert "validation column 8 is like 23" in verdict.message
    else:
        assert found == [] and accuracy > 0.9


def test_eval_sets_that_cannot_be_read_never_stop_the_training(tmp_path, monkeypatch):
    """Reading xgb.train's eval sets as it begins (their columns against the training set's) runs inside
    xgb.train: a failure there is left out of the judgement, and the booster trains as without tripwire."""
    from tripwire.plugins.xgboost import callback as callback_module

    def unreadable(*args):
        raise ValueError("a matrix tripwire cannot read")

    monkeypatch.setattr(callback_module, "swapped_columns", unreadable)
    x, y = load_breast_cancer(return_X_y=True)
    train, valid = xgb.DMatrix(x[:400], label=y[:400]), xgb.DMatrix(x[400:], label=y[400:])
    cb = TripwireCallback(None, out_dir=tmp_path / "run")
    booster = xgb.train({"objective": "binary:logistic", "max_depth": 3, "nthread": 1}, train, 50,
                        evals=[(valid, "validation")], verbose_eval=False, callbacks=[cb])
    assert float(np.mean((booster.predict(valid) > 0.5) == y[400:])) > 0.9
    assert [v for v in cb.verdicts if v.counts] == []
