"""Every command and snippet in README.md works as written (issue 23), and the snippets of docs/ too: each ```python
block runs in a fresh process, in a folder of its own, after a prelude that makes what the reader brings (`model`,
`train_loader`, `params`, …) as a real small model on sklearn's data; each `tripwire …` command in README's shell
blocks runs against runs those snippets wrote, with the exit status README gives; each `make` target exists; the
outputs README shows are what tripwire prints. The `pip install` lines are checked by tests/test_install.py
(distribution and extras)."""

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tripwire

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = ["README.md", *sorted(f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md"))]


def blocks(doc: str = "README.md") -> list[tuple[str, str]]:
    """(language, text) of every fenced block of a Markdown file, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", (ROOT / doc).read_text(), re.M | re.S)


def shell_lines(doc: str = "README.md") -> list[str]:
    """Every command of a document's shell blocks, without its comment (in a console block, the lines after `$ `)."""
    lines = []
    for lang, text in blocks(doc):
        if lang in ("sh", "bash"):
            lines += [line.split("#", 1)[0].strip() for line in text.splitlines()]
        elif lang == "console":
            lines += [line[2:].split("#", 1)[0].strip() for line in text.splitlines() if line.startswith("$ ")]
    return [line for line in lines if line]


def assert_shows(shown: str, printed: list[str]) -> None:
    """Each line a document shows is one of the lines printed, in order, consecutive: `…` in a line stands for any
    text, a line of `…` alone for lines left out."""
    at, skip = 0, False
    for line in shown.splitlines():
        if line.strip() == "…":
            skip = True
            continue
        pattern = re.compile(".*".join(map(re.escape, line.split("…"))))
        while skip and at < len(printed) and not pattern.fullmatch(printed[at]):
            at += 1
        assert at < len(printed) and pattern.fullmatch(printed[at]), f"shown:\n{line}\nprinted:\n" + "\n".join(printed)
        at, skip = at + 1, False


def readme_config() -> str:
    (config,) = [text for lang, text in blocks() if lang == "yaml"]
    return config


def snippet(doc: str, marker: str) -> str:
    """The one python block of `doc` that holds `marker`."""
    (found,) = [text for lang, text in blocks(doc) if lang == "python" and marker in text]
    return found


DIGITS = """
import numpy as np
from sklearn.datasets import load_digits

x_all, y_all = load_digits(return_X_y=True)
x_all = ((x_all - x_all.mean(0)) / (x_all.std(0) + 1e-6)).astype(np.float32)
"""

TORCH_DIGITS = DIGITS + """
import torch

torch.manual_seed(0)
dataset = lambda a, b: torch.utils.data.TensorDataset(torch.tensor(x_all[a:b]), torch.tensor(y_all[a:b]))
"""

CANCER = """
import xgboost as xgb
from sklearn.datasets import load_breast_cancer

X, y = load_breast_cancer(return_X_y=True)
X_train, y_train, X_val, y_val = X[:400], y[:400], X[400:], y[400:]
dtrain = xgb.DMatrix(X_train, label=y_train)
dval = xgb.DMatrix(X_val, label=y_val)
params = {"objective": "binary:logistic", "eval_metric": "logloss", "max_depth": 3, "eta": 0.1}
"""
INIT_XGBOOST = "tripwire init --framework xgboost"
XGB_TRAIN = ("docs/xgboost.md", 'cb = TripwireCallback("xgboost.yaml", out_dir="runs/exp1"')

COMPARE = ("docs/compare.md", "result = tripwire.compare(")
LEARN = ("docs/learn.md", "for seed in (1, 2, 3):")
ANALYSE = ("docs/analyse.md", 'run = tripwire.open_run("s3://bucket/runs/exp1")')
LIGHTNING = ("README.md", "from tripwire.plugins.lightning import TripwireCallback")
READING = ("README.md", 'run = tripwire.open_run("runs/exp1")')

# What each snippet needs from the reader, keyed by its document and a line of it; `check` runs after it and asserts
# what the document says the snippet does; `setup`, a command of the document run first (default: `tripwire init`,
# the reader's copy of rules.yaml). `folder`: "shared" runs it in the folder of README's Lightning run (runs/exp1),
# which the later snippets and commands read.
CASES = {
    LIGHTNING: dict(folder="shared", prelude=TORCH_DIGITS + """
import lightning.pytorch as pl


class MyModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


model = MyModule()
train_loader = torch.utils.data.DataLoader(dataset(0, 640), batch_size=32, shuffle=True)
val_loader = torch.utils.data.DataLoader(dataset(1200, None), batch_size=256)
""", check="""
assert callback.run_url.endswith("runs/exp1"), callback.run_url
assert not [v for v in callback.verdicts if v.counts], callback.verdicts
assert trainer.global_step == 200
"""),
    ("README.md", "from tripwire.plugins.keras import TripwireCallback"): dict(prelude=DIGITS + """
import keras

keras.utils.set_random_seed(0)
x, y, x_val, y_val = x_all[:1200], y_all[:1200], x_all[1200:], y_all[1200:]
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
""", check="""
import tripwire

assert callback.run_url.endswith("runs/exp1"), callback.run_url
assert not [v for v in callback.verdicts if v.counts], callback.verdicts
run = tripwire.open_run(callback.run_url)
assert run.info["framework"] == "keras" and run.steps(mode="train")[-1] == 300, run.steps(mode="train")
assert "metrics/val_loss" in run.tensor_names() and "gradients/sequential/dense/kernel" in run.tensor_names()
"""),
    ("README.md", "from tripwire.plugins.transformers import TripwireCallback"): dict(prelude=DIGITS + """
import torch
from transformers import BertConfig, BertForSequenceClassification

torch.manual_seed(0)
tokens = load_digits().data.astype(np.int64)  # each pixel's intensity, 0 to 16, as a token id
config = BertConfig(vocab_size=17, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                    max_position_embeddings=64, num_labels=10)
model = BertForSequenceClassification(config)
examples = [{"input_ids": torch.tensor(t), "labels": torch.tensor(label)} for t, label in zip(tokens, y_all)]
train, val = examples[:96], examples[96:160]
""", check="""
import tripwire

assert callback.run_url.endswith("out/tripwire"), callback.run_url
run = tripwire.open_run(callback.run_url)
assert run.info["framework"] == "transformers" and "metrics/val_loss" in run.tensor_names()
"""),
    ("README.md", "from tripwire.plugins.xgboost import TripwireCallback"): dict(setup=INIT_XGBOOST, prelude=CANCER,
                                                                                 check="""
import tripwire

assert callback.run_url.endswith("runs/exp1"), callback.run_url
run = tripwire.open_run(callback.run_url)
assert "metrics/validation/logloss" in run.tensor_names() and "trees/depth" in run.tensor_names()
assert "tree_depth" in [rule["rule"] for rule in run.info["config"]["rules"]]  # xgboost.yaml's rules
"""),
    ("README.md", "from tripwire.plugins.torch import TripwireProbe"): dict(prelude=TORCH_DIGITS + """
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = torch.nn.CrossEntropyLoss()
loader = torch.utils.data.DataLoader(dataset(0, 1200), batch_size=32, shuffle=True)
""", check="""
import tripwire

assert probe.run_url.endswith("runs/exp1") and not probe.should_stop
assert tripwire.open_run(probe.run_url).steps(mode="train") == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], probe.run_url
"""),
    READING: dict(folder="shared", check="""
assert run.info["status"] == "finished" and steps.tolist() == [0, 100]
assert run.tensor("weights/net.0.weight").value(100).shape == (32, 64)  # README's config saves net.0's weights
assert run.wait_for_step(500, timeout=60) is False  # a finished run: at once
"""),
    ("docs/probe.md", "model = Net()"): dict(prelude=TORCH_DIGITS + """
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)


loader = torch.utils.data.DataLoader(dataset(0, 1200), batch_size=32, shuffle=True)
""", check="""
import tripwire

assert probe.run_url.endswith("runs/exp1") and not [v for v in probe.verdicts if v.counts], probe.verdicts
assert tripwire.open_run(probe.run_url).steps(mode="train")[-1] == 9
"""),
    ("docs/rules.md", 'limits = {"threshold": POSITIVE}'): dict(setup=None, check="""
import tripwire

try:
    tripwire.load_config({"rules": [{"rule": "__main__:LargeGradient", "params": {"threshold": 0}}]})
except tripwire.ConfigError as err:
    assert "`threshold` must be greater than 0; found 0" in str(err), err
else:
    raise AssertionError("a threshold of 0 passed the rule's limits")
"""),
    XGB_TRAIN: dict(setup=INIT_XGBOOST, prelude=CANCER, check="""
assert cb.run_url.endswith("runs/exp1") and not [v for v in cb.verdicts if v.counts], cb.verdicts
"""),
    ("docs/xgboost.md", "model = xgb.XGBClassifier("): dict(setup=INIT_XGBOOST, prelude=CANCER + """
from tripwire.plugins.xgboost import TripwireCallback

cb = TripwireCallback("xgboost.yaml", out_dir="runs/exp1", eval_data=(X_val, y_val))
""", check="""
import tripwire

assert "metrics/validation_1/logloss" in tripwire.open_run(cb.run_url).tensor_names()
"""),
    ("docs/xgboost.md", 'run.tensor("trees/depth").series()'): dict(setup=INIT_XGBOOST,
                                                                    prelude=CANCER + snippet(*XGB_TRAIN), check="""
assert run.info["hyperparameters"]["max_depth"] == "3" and len(logloss) == 500  # as XGBoost reports it
"""),
    COMPARE: dict(folder="compare", prelude=TORCH_DIGITS + """
import tripwire
from tripwire.plugins.torch import TripwireProbe


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)


def train(out, lr_from_step_5):  # 12 steps, every one captured, the full weights and biases among them
    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.tensor(x_all[:256]), torch.tensor(y_all[:256])
    config = {"sampling": {"every": 1}, "collections": {"weights": {"save": "tensors"}, "biases": {"save": "tensors"},
                                                        "losses": {}, "optimizer": {}}}
    with TripwireProbe(net, optimizer, config, out_dir=out) as probe:
        for step in range(12):
            if step == 5:
                optimizer.param_groups[0]["lr"] = lr_from_step_5
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            probe.step(loss)


train("runs/reference", 0.1)
train("runs/refactor", 0.05)  # the refactor's learning rate differs from step 5
""", check="""
assert (result.equivalent, result.first_step) == (False, 5)
assert result.diverging[0].name == "optimizer/lr" and abs(result.diverging[0].max_abs - 0.05) < 1e-6
"""),
    ANALYSE: dict(folder="shared", check="""
assert run.tensor("weights/net.0.weight").value(100).shape == (32, 64) and steps.tolist() == [0, 100]
"""),
}
# docs/learn.md trains README's Lightning model with several seeds: the reader's module and loader, as README's.
CASES[LEARN] = dict(folder="learn", prelude=CASES[LIGHTNING]["prelude"], check="""
import tripwire

assert [tripwire.open_run(f"runs/{name}").info["status"] for name in ("seed1", "seed2", "seed3", "broken")] == \\
    ["finished"] * 4
""")
# The custom rule is a module of the reader's project, named by README's config: the shared run imports it.
MODULES = {("README.md", "class LargeGradient(Rule):"): "my_project/rules.py"}
# Snippets not run, with the reason.
NOT_RUN_SNIPPETS = {
    ("docs/compare.md", "def test_refactor_trains_the_same"): "`...` stands for the reader's own training",
    ("docs/xgboost.md", "LocalCluster("): "a Dask cluster of 4 workers writing to S3; tests/test_xgboost.py trains "
                                         "on a Dask cluster",
}


def env(tmp: Path) -> dict:
    """A reader's environment: this checkout's tripwire, Keras on TensorFlow with its home in tmp, no warnings."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "KERAS_HOME": str(tmp / "keras-home"), "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3",
            "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}  # one thread: XGBoost's crawl on shared cores


def missing(source: str) -> list[str]:
    """The packages a script imports that are not installed (and TensorFlow for Keras, the backend env() sets)."""
    modules = set(re.findall(r"^\s*(?:import|from) (\w+)", source, re.M))
    if "keras" in modules:
        modules.add("tensorflow")
    return sorted(m for m in modules if importlib.util.find_spec(m) is None)


def run_snippet(key: tuple[str, str], folder: Path, case: dict | None = None,
                extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """Prelude, the snippet as its document has it, check: one script in `folder`, run as a reader runs theirs;
    skipped where a package it imports is not installed."""
    case = case or CASES[key]
    source = "\n".join([textwrap.dedent(case.get("prelude", "")), snippet(*key),
                        textwrap.dedent(case.get("check", ""))])
    if missing(source):
        pytest.skip(f"not installed: {', '.join(missing(source))}")
    script = folder / "snippet.py"
    script.write_text(source)
    out = subprocess.run([sys.executable, str(script)], cwd=folder, env={**env(folder), **(extra_env or {})},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"snippet {key}:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


def cli(folder: Path, command: str) -> subprocess.CompletedProcess:
    """A README `tripwire …` command, run as `python -m tripwire …` in `folder`."""
    args = shlex.split(command)
    assert args[0] == "tripwire", command
    return subprocess.run([sys.executable, "-m", "tripwire", *args[1:]], cwd=folder, env=env(folder),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """The folder of the Lightning snippet's run, trained once: rules.yaml is README's config (its custom rule is
    README's `LargeGradient`, in my_project/rules.py), as a reader who edited the copy `tripwire init` wrote has."""
    folder = tmp_path_factory.mktemp("shared")
    (folder / "rules.yaml").write_text(readme_config())
    (folder / "my_project").mkdir()
    (folder / "my_project" / "__init__.py").write_text("")
    for key, path in MODULES.items():
        (folder / path).write_text(snippet(*key))
    run_snippet(LIGHTNING, folder)
    return folder


def test_every_python_snippet_is_run():
    known = [*CASES, *MODULES, *NOT_RUN_SNIPPETS]
    for doc in DOCS:
        for lang, text in blocks(doc):
            found = [marker for where, marker in known if where == doc and marker in text]
            assert lang != "python" or len(found) == 1, f"{doc}: a snippet with no case (or several):\n{text}"
    for key in known:
        assert snippet(*key)  # each marker names one snippet


def test_the_lightning_snippet_with_readme_s_config(shared):
    run = tripwire.open_run(shared / "runs" / "exp1")
    assert run.info["status"] == "finished"
    rules = [rule["rule"] for rule in run.info["config"]["rules"]]
    assert rules == ["exploding_tensor", "vanishing_gradient", "my_project.rules:LargeGradient"]
    assert "activations/net.1" in run.tensor_names() and (shared / "tb" / "exp1" / "train").is_dir()


def test_reading_runs(shared):
    run_snippet(READING, shared)


def test_the_read_api_over_s3(shared, s3_server):
    """docs/analyse.md's read API over the shared run, copied to `s3://bucket/runs/exp1` on a local S3 server: the
    AWS variables of the environment reach it, as they reach a reader's."""
    import s3fs

    s3_server.bucket("bucket")
    s3fs.S3FileSystem(**s3_server.storage_options).put(str(shared / "runs" / "exp1"), "bucket/runs/exp1",
                                                       recursive=True)
    run_snippet(ANALYSE, shared, extra_env=s3_server.env)
    out = subprocess.run([sys.executable, "-m", "tripwire", *shlex.split(S3_LS)[1:]], cwd=shared,
                         env={**env(shared), **s3_server.env}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and [r["name"] for r in json.loads(out.stdout)] == ["exp1"], out.stdout + out.stderr


def test_the_compare_output_shown(tmp_path):
    """docs/compare.md's snippet over two runs whose learning rates part at step 5, and its `tripwire compare`
    of them, which prints what the page shows and exits 1 (diverged)."""
    run_snippet(COMPARE, tmp_path)
    (shown,) = [text for lang, text in blocks("docs/compare.md") if lang == "console"]
    out = cli(tmp_path, COMPARE_CLI)
    assert out.returncode == 1, out.stdout + out.stderr
    assert_shows("\n".join(shown.splitlines()[1:]), out.stdout.splitlines())


def test_the_learn_commands_shown(tmp_path):
    """docs/learn.md: its snippet trains three healthy runs and a broken one; each of its console blocks, run as
    written there, prints what the page shows: learned from two seeds, the third passes (exit 0), the broken run
    does not (exit 1). Its YAML example is a config that loads."""
    run_snippet(LEARN, tmp_path)
    shown = [text for lang, text in blocks("docs/learn.md") if lang == "console"]
    assert [block.splitlines()[0][2:] for block in shown] == LEARN_CLI
    for block, code in zip(shown, (0, 0, 1)):
        command, *lines = block.splitlines()
        out = cli(tmp_path, command[2:])
        assert out.returncode == code, out.stdout + out.stderr
        assert_shows("\n".join(lines), out.stdout.splitlines())
    (example,) = [text for lang, text in blocks("docs/learn.md") if lang == "yaml"]
    assert len(tripwire.load_config(example).rules[0].create().requires()) == 2


def test_the_custom_rule_fires_when_its_threshold_is_reached(shared):
    """README's LargeGradient, loaded by name from the reader's project: silent at threshold 20 in the shared run,
    firing on the same run at a threshold every gradient passes."""
    (shared / "strict.yaml").write_text("rules: [{rule: 'my_project.rules:LargeGradient', params: {threshold: 0}}]\n")
    out = cli(shared, "tripwire check runs/exp1 --config strict.yaml")
    assert out.returncode == 1 and "gradients/net.0.weight reached" in out.stdout, out.stdout + out.stderr
    assert "failed" not in out.stdout  # judged only where gradients were stored, not at the loss-only steps
    out = cli(shared, "tripwire check runs/exp1 --config rules.yaml")
    assert out.returncode == 0 and "0 finding(s)" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("key", [key for key, case in CASES.items() if "folder" not in case],
                         ids=lambda key: f"{key[0]}: {key[1]}")
def test_snippet(key, tmp_path):
    setup = CASES[key].get("setup", "tripwire init")
    if setup:
        assert setup in (ROOT / key[0]).read_text() + README.read_text()
        init = cli(tmp_path, setup)
        assert init.returncode == 0 and "wrote" in init.stdout, init.stdout + init.stderr
    run_snippet(key, tmp_path)


# Shell lines that are neither run here nor checked elsewhere, with the reason.
NOT_RUN = {
    "git clone <this repository's URL> tripwire && cd tripwire": "the test runs in a clone already",
    "export TRIPWIRE_STORAGE_OPTIONS='{\"client_kwargs\": {\"endpoint_url\": \"http://minio:9000\"}, \"key\": \"…\", "
    "\"secret\": \"…\"}'": "a placeholder server and keys; test_the_read_api_over_s3 passes a real one that way",
}
# The commands of docs/ that a test of their own runs (README's all run in test_shell_commands_over_the_shared_run).
S3_LS = "tripwire ls s3://bucket/runs --json"
COMPARE_CLI = "tripwire compare runs/reference runs/refactor"
LEARN_CLI = ["tripwire learn runs/seed1 runs/seed2 -o learned.yaml", "tripwire check runs/seed3 --config learned.yaml",
             "tripwire check runs/broken --config learned.yaml"]
EXPORT = "tripwire export tensorboard runs/exp1 tb/exp1 && tensorboard --logdir tb"  # TensorBoard serves: not run
BENCH = ".venv/bin/python -m benchmarks.run"  # minutes each: `--help` says the options exist


def commands(lines: list[str]) -> list[str]:
    """Each line as the commands it stands for: `tripwire ls runs/ [--json]` is with and without `--json`."""
    out = []
    for line in lines:
        optional = re.search(r" \[([^]]+)\]", line)
        out += [line] if not optional else [line.replace(optional[0], ""), line.replace(optional[0], " " + optional[1])]
    return out


def test_every_shell_command_is_checked():
    """Each line is a `make` target (checked below), a `pip install` (tests/test_install.py checks its extras), a
    `tripwire` command (run below or as a snippet's setup), a benchmark, or in NOT_RUN with its reason."""
    run = {*commands(shell_lines()), *(case["setup"] for case in CASES.values() if case.get("setup")), S3_LS,
           COMPARE_CLI, EXPORT, *LEARN_CLI}
    for doc in DOCS:
        for line in commands(shell_lines(doc)):
            assert line.split()[0] in ("make", "pip") or line in run or line in NOT_RUN or line.startswith(BENCH), \
                f"{doc}: {line}"
    everywhere = {line for doc in DOCS for line in shell_lines(doc)}
    assert {*NOT_RUN, S3_LS, COMPARE_CLI, EXPORT, *LEARN_CLI} <= everywhere, \
        "a command named here that no document has"


def test_make_targets_exist():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = {line.split()[1] for doc in DOCS for line in shell_lines(doc) if line.startswith("make ")}
    named |= {target for doc in DOCS for target in re.findall(r"`make (\w+)`", (ROOT / doc).read_text())}
    assert named and named <= targets, named - targets


def test_the_benchmark_commands_name_options_and_families_it_has():
    lines = [line for line in shell_lines("docs/benchmarks.md") if line.startswith(BENCH)]
    usage = subprocess.run([sys.executable, *shlex.split(BENCH)[1:], "--help"], cwd=ROOT, env=env(ROOT),
                           capture_output=True, text=True, timeout=300)
    assert lines and usage.returncode == 0, usage.stderr
    for line in lines:
        args = shlex.split(line)[3:]
        assert {a for a in args if a.startswith("--")} <= set(re.findall(r"--[a-z]+", usage.stdout)), line
        if "--only" in args:
            assert set(args[args.index("--only") + 1].split(",")) <= set(re.findall(r"\w+", usage.stdout)), line


def test_tripwire_commands_in_prose_exist(capsys):
    """`tripwire VERB` and every `--option` README names in its text are the CLI's own."""
    from tripwire.core.cli import main

    text = README.read_text()
    verbs = {m.split()[1] for m in re.findall(r"`(tripwire \w+)[^`]*`", text)} | {
        line.split()[1] for line in shell_lines() if line.startswith("tripwire ")}
    helps = ""
    for verb in sorted(verbs):
        with pytest.raises(SystemExit) as done:
            main([verb, "--help"])
        assert done.value.code == 0, verb
        helps += capsys.readouterr().out
    options = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", text))
    assert options and {o for o in options if o not in helps} == set()


def test_shell_commands_over_the_shared_run(shared):
    """README's `tripwire` commands, as written, over the Lightning snippet's run: runs/a and runs/b are copies
    of it (so `compare` finds them equivalent), other.yaml the config `tripwire init -o other.yaml` writes."""
    pytest.importorskip("matplotlib")  # tripwire report
    for name in ("a", "b"):
        shutil.copytree(shared / "runs" / "exp1", shared / "runs" / name)
    assert cli(shared, "tripwire init -o other.yaml").returncode == 0
    setups = {case["setup"] for case in CASES.values() if case.get("setup")}
    ran = []
    for command in commands([line for line in shell_lines() if line.startswith("tripwire ")]):
        if command in setups:
            continue
        out = cli(shared, command)
        verb = command.split()[1]
        said = out.stdout + out.stderr
        if verb == "check":  # exit 0 none fired, 1 fired
            fired = int(re.search(r"^(\d+) finding\(s\) at warning or error", out.stdout, re.M)[1])
            assert out.returncode == (1 if fired else 0), said
        else:
            assert out.returncode == 0, f"{command}:\n{said}"
        ran.append(command)
    assert (shared / "report.html").is_file() and (shared / "runs" / "index.html").is_file()
    assert list((shared / "tb").glob("train/events.out.tfevents.*"))
    assert len(ran) == 8, ran
    out = cli(shared, EXPORT.split(" && ")[0])  # docs/analyse.md: one run's events in a folder of its own
    assert out.returncode == 0 and list((shared / "tb" / "exp1").glob("train/events.out.tfevents.*")), out.stderr


def test_the_config_error_shown_is_the_one_such_a_file_gives(tmp_path, monkeypatch):
    """README shows the ConfigError of a rules.yaml with three mistakes, at lines 3, 7 and 10: this is such a file."""
    (shown,) = [text for lang, text in blocks() if lang == "" and "mistakes; fix them all" in text]
    monkeypatch.chdir(tmp_path)
    Path("rules.yaml").write_text(textwrap.dedent("""\
        version: 1
        sampling:
          evry: 100
        rules:
          - rule: exploding_tensor
          - rule: exploding_gradient
            params: {ratio_threshold: -1}
        writer:
          flush_every_s: 1.0
          max_queue_mb: .inf
        """))
    with pytest.raises(tripwire.ConfigError) as err:
        tripwire.load_config("rules.yaml")
    assert str(err.value) == shown.strip()


def test_the_output_shown_is_what_a_training_that_blows_up_prints(tmp_path):
    """The Lightning snippet over the demo's faulty model (learning rate 50) prints the lines README shows."""
    (shown,) = [text for lang, text in blocks() if lang == "" and "a learning rate of 0.015" in text]
    assert cli(tmp_path, "tripwire init").returncode == 0
    out = run_snippet(LIGHTNING, tmp_path, dict(prelude="""
import lightning.pytorch as pl

from tripwire.demo import _digits, _Model

pl.seed_everything(0, verbose=False)
train_loader, val_loader = _digits()
model = _Model(lr=50.0, dead=False)
"""))
    printed = [line for line in (out.stdout + out.stderr).splitlines()
               if line.startswith(("tripwire: ", "diagnosis ", "    "))]
    assert_shows(shown, printed)
