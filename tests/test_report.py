"""HTML reports: exact ROC/PR curves (held to scikit-learn), report sections, the `report` action off the
training thread, the index of a folder of runs, and a faulty Lightning run's report rendered in headless Chromium."""

import asyncio
import base64
import json
import html
import os
import pty
import re
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn import metrics

import helpers
import tripwire
from tripwire.core import curves, report, report_html
from tripwire.core.recorder import Recorder

CHROMIUM = "/usr/bin/chromium"


# -- exact curves -------------------------------------------------------------------------------------------------
def assert_curves_match(y, score):
    for ours, theirs in zip(curves.roc_curve(y, score), metrics.roc_curve(y, score)):
        np.testing.assert_array_equal(ours, theirs)
    for ours, theirs in zip(curves.roc_curve(y, score, drop_intermediate=False),
                            metrics.roc_curve(y, score, drop_intermediate=False)):
        np.testing.assert_array_equal(ours, theirs)
    for ours, theirs in zip(curves.precision_recall_curve(y, score), metrics.precision_recall_curve(y, score)):
        np.testing.assert_array_equal(ours, theirs)
    assert curves.roc_auc(y, score) == pytest.approx(metrics.roc_auc_score(y, score), abs=1e-12)
    assert curves.average_precision(y, score) == pytest.approx(metrics.average_precision_score(y, score), abs=1e-12)


def test_binary_curves_with_ties_match_scikit_learn():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 2000)
    score = np.round(rng.normal(size=2000) + y, 1)  # rounded: hundreds of tied scores across both classes
    assert len(np.unique(score)) < 100
    assert_curves_match(y, score)
    assert_curves_match(np.array([0, 1, 0, 1]), np.array([0.5, 0.5, 0.5, 0.5]))  # one threshold: AUC 0.5
    assert_curves_match(np.array([0, 0, 1, 1]), np.array([0.1, 0.2, 0.8, 0.9]))  # perfect
    assert curves.roc_auc([0, 1, 0, 1], [0.5] * 4) == 0.5


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(-3, 3)), min_size=2, max_size=40)
       .filter(lambda rows: len({label for label, _ in rows}) == 2))
def test_curves_match_scikit_learn_on_any_small_tied_data(rows):
    y, score = (np.array(column) for column in zip(*rows))
    assert_curves_match(y, score.astype(float))


def test_logits_rank_like_probabilities_without_saturating():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 500)
    logits = rng.normal(size=(500, 2)) * 3 + np.eye(2)[y] * 2
    data = curves.class_scores(y, logits)
    softmax = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert curves.roc_auc(y, data["rank"][:, 0]) == pytest.approx(metrics.roc_auc_score(y, softmax[:, 1]), abs=1e-12)
    np.testing.assert_allclose(data["prob"][:, 0], softmax[:, 1])
    huge = np.array([[0.0, 60.0], [0.0, 80.0], [0.0, 70.0], [0.0, -5.0]])  # probabilities all round to 1.0
    assert curves.roc_auc([1, 1, 0, 0], curves.class_scores([1, 1, 0, 0], huge)["rank"][:, 0]) == 0.75

    y3 = rng.integers(0, 4, 400)
    logits3 = rng.normal(size=(400, 4)) + np.eye(4)[y3]
    data3 = curves.class_scores(y3, logits3)
    softmax3 = np.exp(logits3) / np.exp(logits3).sum(axis=1, keepdims=True)
    macro = np.mean([curves.roc_auc(y3 == c, data3["rank"][:, c]) for c in range(4)])
    assert macro == pytest.approx(metrics.roc_auc_score(y3, softmax3, multi_class="ovr"), abs=1e-12)
    np.testing.assert_array_equal(data3["predicted"], logits3.argmax(axis=1))
    with pytest.raises(ValueError, match="NaN"):
        curves.class_scores([0, 1], [np.nan, 0.3])


# -- report sections ----------------------------------------------------------------------------------------------
FULL = {"collections": {"weights": {"save": "tensors"}, "gradients": {}, "updates": {}, "losses": {}, "metrics": {},
                        "activations": {"reductions": ["zero_fraction"]}, "labels": {"save": "tensors"},
                        "predictions": {"save": "tensors"}},
        "sampling": {"every": 1}, "writer": {"flush_every_s": 0.05},
        "rules": [{"rule": "exploding_tensor", "actions": ["stop", "report"]}]}
LOSSES = {"collections": {"losses": {}}, "sampling": {"every": 1}, "writer": {"flush_every_s": 0.05},
          "rules": [{"rule": "exploding_tensor", "actions": ["stop"]}]}


def synthetic_run(url, steps=20, nan_at=None, only_losses=False):
    """A run with every kind of data the report draws (or only the loss), written through the recorder like a
    plugin would."""
    rng = np.random.default_rng(0)
    rec = Recorder(LOSSES if only_losses else FULL, run_url=url, framework="test")
    rec.start()
    for step in range(steps):
        bad = step == nan_at
        values = {"losses/train": {"value": float("nan") if bad else 1 / (step + 1)}}
        tensors = {}
        for layer in ("net.0.weight", "net.2.weight"):
            w = rng.normal(size=(8, 4)).astype(np.float32)
            values[f"weights/{layer}"] = {"l2": float(np.linalg.norm(w)), "min": float(w.min()), "max": float(w.max())}
            values[f"gradients/{layer}"] = {"l2": 0.1 / (step + 1), "mean": 0.0, "std": 0.01, "min": -0.1, "max": 0.1}
            values[f"updates/{layer}"] = {"l2": 0.01}
            tensors[f"weights/{layer}"] = w
        values["activations/net.1"] = {"zero_fraction": 0.5}
        y = rng.integers(0, 2, 64)
        tensors["labels"], tensors["predictions"] = y, rng.normal(size=64) + 2 * y
        if only_losses:
            values, tensors = {"losses/train": values["losses/train"]}, {}
        elif step % 5 == 4:
            rec.record(step, "eval", {"metrics/val_loss": {"value": 1.2 / (step + 1)}})
        if rec.record(step, "train", values, tensors).stop:
            break
    rec.finish("stopped" if nan_at is not None else "finished")
    return tripwire.open_run(url)


def test_report_holds_every_section(tmp_path):
    run = synthetic_run(str(tmp_path / "run"), nan_at=12)
    page = (tmp_path / "run" / "report.html").read_text()  # written by the report action at the end
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http" not in page.split("<body>")[1]
    for text in ("exploding_tensor", "losses/train is not finite", "learning rate", "gradient L2 norm",
                 "weight L2 norm", "update ratio", "activation zero fraction",
                 'alt="weights histograms at steps 0, 6, 12"',
                 'alt="gradients distributions"', "ROC AUC", 'alt="confusion matrix"', "config</summary>"):
        assert text in page, text
    assert page.count("data:image/png;base64,") == 1 + 4 + 2 + 3  # curves, heatmaps, distributions, classification
    assert "not captured" not in page
    # the AUC printed is the one of the last step's scores
    step = run.tensor("labels").steps(tensors=True)[-1]
    y, score = run.tensor("labels").value(step), run.tensor("predictions").value(step)
    assert f"ROC AUC <b>{metrics.roc_auc_score(y, score):.4f}</b>" in page


def test_sections_without_data_are_left_out(tmp_path):
    run = synthetic_run(str(tmp_path / "run"), steps=5, only_losses=True)
    out = tmp_path / "out" / "r.html"
    assert report_html.write_report(run, str(out)) == str(out)
    page = out.read_text()
    assert page.count("data:image/png;base64,") == 1  # the loss curve
    assert re.findall(r"<h2>(.*?)</h2>", page) == ["Summary", "Diagnosis", "Verdicts", "Loss and metrics"]
    assert "not captured" not in page and "no verdicts: no rule fired" in page


def test_verdict_labels_never_overlap_and_the_first_nan_loss_is_marked_on_every_plot():
    """Five verdicts at step 0 and more at the next steps of a short run: labels closer than a label's width
    become one ('5 verdicts'), and no two labels drawn overlap; the first NaN loss is a labelled line on every
    plot over steps, heatmaps and weight bands included."""
    from tripwire.core import plots

    rules = ["exploding_tensor", "vanishing_gradient", "dead_relu", "tensor_variance", "weight_update_ratio"]
    marks = plots.Marks(tuple((0, r) for r in rules) + ((1, "overfit"), (5, "loss_not_decreasing")), nonfinite=5)
    steps = np.arange(6)
    figures = [plots.curves([("loss", [("losses/train", steps, [1, 2, 4, 8, 16, np.nan])])], marks),
               plots.heatmap("weight L2 norm", ["a", "b"], np.array([0]), np.ones((2, 1)), np.ones((2, 1), bool),
                             "L2 norm", True, marks),
               plots.bands("weights", [("a", np.array([0]), {"min": [-1.0], "max": [1.0], "mean": [0.0]})],
                           marks=marks)]
    for fig in figures:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        texts = [t for ax in fig.axes for t in ax.texts]
        labels = [t.get_text() for t in texts]
        assert "loss NaN/Inf from step 5" in labels, labels
        assert "5 verdicts" in labels or "6 verdicts, steps 0-1" in labels, labels
        assert not set(rules) & set(labels)  # none of the five drawn on its own
        boxes = [t.get_window_extent(renderer) for t in texts]
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), (labels, boxes)
    assert plots.mark_groups([(0, "a"), (0, "a"), (50, "b"), (100, "c")], 0, 100) == \
        [(0, "a"), (50, "b"), (100, "c")]


def test_the_report_action_builds_off_the_training_thread(monkeypatch):
    built, release = [], threading.Event()

    def slow_build(run, output=None, storage_options=None, verdicts=None):
        built.append((threading.current_thread().name, list(verdicts)))
        release.wait(5)

    monkeypatch.setattr(report_html, "write_report", slow_build)
    monkeypatch.setattr(report, "write_json_report", lambda store, verdicts: None)
    monkeypatch.setattr("tripwire.core.run.Run", lambda store: store)
    background = report.BackgroundReport(store=types.SimpleNamespace(url_of=lambda rel: rel))
    started = time.monotonic()
    background.request([0])
    while not built:  # the first build is under way ...
        time.sleep(0.01)
    for i in range(1, 5):  # ... requests meanwhile coalesce into one more
        background.request([i])
    assert time.monotonic() - started < 1.0
    release.set()
    background.wait()
    assert [b[0] for b in built] == ["tripwire-report"] * 2 and built[-1][1] == [4]


def test_report_of_a_folder_of_runs_is_an_index(tmp_path):
    synthetic_run(str(tmp_path / "root" / "a"), steps=6, only_losses=True)
    synthetic_run(str(tmp_path / "root" / "b" / "c"), steps=8, nan_at=5, only_losses=True)
    out = subprocess.run([sys.executable, "-m", "tripwire", "report", str(tmp_path / "root")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    index = (tmp_path / "root" / "index.html").read_text()
    assert 'href="a/report.html"' in index and 'href="b/c/report.html"' in index
    assert index.count("data:image/png;base64,") == 1 and "stopped" in index
    assert (tmp_path / "root" / "b" / "c" / "report.html").exists()
    missing = subprocess.run([sys.executable, "-m", "tripwire", "report", str(tmp_path / "nothing")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no tripwire run" in missing.stderr


def tripwire_cli(*args, stderr=subprocess.PIPE):
    return subprocess.run([sys.executable, "-m", "tripwire", *args], stdout=subprocess.PIPE, stderr=stderr,
                          text=True, timeout=120)


def test_cli_report_to_a_file_is_self_contained_with_the_verdict_and_its_hint(tmp_path):
    run = synthetic_run(str(tmp_path / "run"), nan_at=12)
    verdict = next(v for v in run.verdicts() if v.fired)
    target = tmp_path / "elsewhere" / "faulty.html"
    out = tripwire_cli("report", str(tmp_path / "run"), "-o", str(target))
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.strip() == f"report written to {target}"
    page = target.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    # nothing to fetch: every src and href is an inline image or an anchor in the page, no CSS url(), no script
    refs = re.findall(r"""\b(?:src|href)\s*=\s*["']?([^"'\s>]*)""", page, flags=re.IGNORECASE)
    assert refs and all(r.startswith(("data:", "#")) for r in refs), [r[:40] for r in refs]
    assert sum(r.startswith("data:image/png;base64,") for r in refs) == 10  # the plots, inline
    assert not re.search(r"(src|href)\s*=\s*[\"']?\s*(https?:)?//", page, flags=re.IGNORECASE)
    assert "url(" not in page and "<script" not in page and "@import" not in page
    assert verdict.rule == "exploding_tensor" and verdict.step == 12
    assert html.escape(verdict.message) in page and html.escape(verdict.hint) in page
    assert 'class="badge stopped"' in page


def test_report_steps_choose_the_histogram_steps(tmp_path):
    run = synthetic_run(str(tmp_path / "run"))  # full weights saved at steps 0..19
    default = report_html.build_report(run)
    assert 'alt="weights histograms at steps 0, 10, 19"' in default
    chosen = report_html.build_report(run, steps=[3, 7, 100])  # 100 is past the end: the last saved step
    assert 'alt="weights histograms at steps 3, 7, 19"' in chosen and "at steps 0, 10, 19" not in chosen
    with pytest.raises(ValueError, match="1 to 8 steps"):
        report_html.build_report(run, steps=[])

    out = tripwire_cli("report", str(tmp_path / "run"), "--steps", "5,15", "-o", str(tmp_path / "r.html"))
    assert out.returncode == 0, out.stderr
    assert 'alt="weights histograms at steps 5, 15"' in (tmp_path / "r.html").read_text()
    bad = tripwire_cli("report", str(tmp_path / "run"), "--steps", "5,x")
    assert bad.returncode == 2 and "not a comma-separated list of steps" in bad.stderr


def test_long_commands_are_silent_off_a_terminal_and_draw_a_bar_on_one(tmp_path):
    """report, export tensorboard and ls: nothing on stderr when it is a pipe; a progress bar when it is a
    terminal (a pseudo-terminal here), which shows that the silence comes from the check, not from no bar."""
    run = str(tmp_path / "root" / "run")
    synthetic_run(run, steps=8)
    synthetic_run(str(tmp_path / "root" / "other"), steps=4, only_losses=True)
    commands = {"report": ["report", run, "-o", str(tmp_path / "r.html")],
                "export": ["export", "tensorboard", run, str(tmp_path / "tb")],
                "listing runs": ["ls", str(tmp_path / "root")]}
    for label, args in commands.items():
        out = tripwire_cli(*args)
        assert out.returncode == 0 and out.stderr == "", (args, out.stderr)
        assert out.stdout
        leader, follower = pty.openpty()
        try:
            on_tty = tripwire_cli(*args, stderr=follower)
            os.close(follower)
            drawn = b""
            while True:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: the writing side is closed and everything was read
                    break
                if not chunk:
                    break
                drawn += chunk
        finally:
            os.close(leader)
        assert on_tty.returncode == 0
        assert f"{label} [".encode() in drawn and b"#" in drawn, (args, drawn[-200:])


# -- a faulty Lightning run in headless Chromium ------------------------------------------------------------------
def faulty_module():
    """lr=50 blows the MLP up within a few steps; training_step also hands back its logits as predictions."""
    import torch

    module = helpers.mlp_module(lr=50.0, hidden=(32, 32))

    def training_step(batch, batch_idx):
        x, y = batch
        logits = module.net(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, y), "predictions": logits.detach()}

    module.training_step = training_step
    return module


NETWORK_SECTIONS = ("Layers over steps", "Weight and gradient distributions")
BOOSTER_SECTIONS = ("Eval metrics per set", "Feature importance over rounds",
                    "Trees over rounds: depth, leaves, splits")


def browse(report, tmp_path, name: str) -> dict:
    """The report as headless Chromium shows it (skipped where Chromium is missing), with a screenshot kept under
    TRIPWIRE_TEST_ARTIFACTS; it loads without errors and every image draws."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is not installed: `apt-get install chromium` (.ci/run installs it)")
    pytest.importorskip("aiohttp", reason="the DevTools client needs aiohttp (installed with s3fs)")
    artifacts = os.environ.get("TRIPWIRE_TEST_ARTIFACTS", str(tmp_path))
    screenshot = os.path.join(artifacts, f"report-{name}.png")
    page = asyncio.run(render(report, screenshot, tmp_path / "chromium"))
    assert page["errors"] == [] and page["broken"] == 0
    with open(screenshot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "not captured" not in page["text"]
    return page


def test_faulty_lightning_run_report_renders_in_chromium(tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is not installed: `apt-get install chromium` (.ci/run installs it)")
    from tripwire.plugins.lightning import TripwireCallback

    config = {**FULL, "sampling": {"every": 2}}
    cb = TripwireCallback(config, out_dir=tmp_path / "run")
    helpers.fit(cb, faulty_module(), max_epochs=2)
    verdict = next(v for v in cb.verdicts if v.fired)
    assert verdict.rule == "exploding_tensor"
    run = tripwire.open_run(cb.run_url)
    steps, losses = run.tensor("losses/train").series()
    assert steps.tolist() == list(range(steps[-1] + 1))  # the loss of every step, not only the sampled ones
    nan_step = int(steps[~np.isfinite(losses)][0])

    page = browse(tmp_path / "run" / "report.html", tmp_path, "lightning")
    assert "exploding_tensor" in page["text"] and verdict.message in page["text"]
    assert "lower the learning rate" in page["text"]  # the hint
    assert f"loss NaN/Inf from step {nan_step}" in page["text"]  # under the curves, and drawn on every plot
    assert f"step {verdict.step}: exploding_tensor" in page["text"]  # the verdicts the plots mark, by step
    assert page["images"] >= 10
    assert page["headings"] == ["Summary", "Diagnosis", "Verdicts", "Loss and metrics", *NETWORK_SECTIONS,
                                "Classification"]


def test_keras_run_report_renders_in_chromium_with_the_loss_of_every_step(tmp_path):
    from keras_models import fit
    from tripwire.plugins.keras import TripwireCallback

    cb = TripwireCallback(None, out_dir=tmp_path / "run")
    fit(cb, epochs=2)
    run = tripwire.open_run(cb.run_url)
    assert run.tensor("metrics/loss").steps() == list(range(86))
    report_html.write_report(run, str(tmp_path / "report.html"))
    page = browse(tmp_path / "report.html", tmp_path, "keras")
    assert page["headings"] == ["Summary", "Diagnosis", "Verdicts", "Loss and metrics", *NETWORK_SECTIONS]
    assert "metrics/loss" in page["text"] and "NaN/Inf" not in page["text"]


def test_xgboost_run_report_renders_in_chromium_with_the_sections_of_a_booster(tmp_path):
    import xgboost as xgb
    from sklearn.datasets import make_classification
    from tripwire.plugins.xgboost import TripwireCallback

    x, y = make_classification(n_samples=600, n_features=20, n_informative=5, flip_y=0.2, random_state=0)
    cb = TripwireCallback({"collections": {"trees": {}, "feature_importance": {}, "metrics": {}, "losses": {}},
                           "sampling": {"every": 10}, "rules": ["overfit"]}, out_dir=tmp_path / "run")
    model = xgb.XGBClassifier(n_estimators=60, max_depth=6, n_jobs=1, callbacks=[cb])
    model.fit(x[:400], y[:400], eval_set=[(x[:400], y[:400]), (x[400:], y[400:])], verbose=False)
    verdict = next(v for v in cb.verdicts if v.fired)
    run = tripwire.open_run(cb.run_url)
    report_html.write_report(run, str(tmp_path / "report.html"))
    page = browse(tmp_path / "report.html", tmp_path, "xgboost")
    assert page["headings"] == ["Summary", "Diagnosis", "Verdicts", "Loss and metrics", *BOOSTER_SECTIONS]
    assert page["images"] == 4 and f"step {verdict.step}: overfit" in page["text"]
    assert "metrics/validation_1/logloss" in page["text"]  # the summary's collections


async def render(path, screenshot, profile) -> dict:
    """Load a file in headless Chromium through the DevTools protocol: console errors, text, images, a
    full-page screenshot."""
    import aiohttp

    profile.mkdir()
    proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                             "--no-first-run", "--disable-background-networking", "--disable-component-update",
                             "--disable-sync", f"--user-data-dir={profile}", "--remote-debugging-port=0",
                             "--window-size=1200,900", "about:blank"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            assert time.monotonic() < deadline and proc.poll() is None, "chromium did not start"
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
                target = next(t for t in await response.json() if t["type"] == "page")
            async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                return await _drive(ws, path, screenshot)
    finally:
        proc.terminate()
        proc.wait(10)


async def _drive(ws, path, screenshot) -> dict:
    ids, errors = iter(range(1, 10**6)), []

    async def call(method, **params):
        i = next(ids)
        await ws.send_json({"id": i, "method": method, "params": params})
        while True:
            message = json.loads((await ws.receive()).data)
            note(message)
            if message.get("id") == i:
                assert "error" not in message, message
                return message["result"]

    def note(message):
        event, params = message.get("method"), message.get("params", {})
        if event == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            errors.append(params["args"])
        elif event == "Runtime.exceptionThrown":
            errors.append(params["exceptionDetails"])
        elif event == "Log.entryAdded" and params["entry"]["level"] == "error":
            errors.append(params["entry"])
        elif event == "Page.loadEventFired":
            loaded.set()

    loaded = asyncio.Event()
    for domain in ("Page", "Runtime", "Log"):
        await call(f"{domain}.enable")
    await call("Page.navigate", url=f"file://{path}")
    deadline = time.monotonic() + 30
    while not loaded.is_set():
        assert time.monotonic() < deadline, "the page did not load"
        note(json.loads((await asyncio.wait_for(ws.receive(), 30)).data))
    probe = ("JSON.stringify({text: document.body.innerText, images: document.images.length,"
             " broken: [...document.images].filter(i => !i.complete || i.naturalWidth === 0).length,"
             " headings: [...document.querySelectorAll('h2')].map(h => h.textContent)})")
    result = json.loads((await call("Runtime.evaluate", expression=probe, returnByValue=True))["result"]["value"])
    size = (await call("Page.getLayoutMetrics"))["cssContentSize"]
    shot = await call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                      clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})
    with open(screenshot, "wb") as f:
        f.write(base64.b64decode(shot["data"]))
    return {**result, "errors": errors}
