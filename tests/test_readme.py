"""Every command and snippet in README.md works as written (issue 23): each ```python block runs in a fresh process,
in a folder of its own, after a prelude that makes what the reader brings (`model`, `train_loader`, `params`, …) as
a real small model on sklearn's data; each `tripwire …` command in a shell block runs against runs those snippets
wrote, with the exit status README gives; each `make` target exists. The `pip install` lines are checked by
tests/test_install.py (distribution and extras)."""

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


def blocks(path: Path) -> list[tuple[str, str]]:
    """(language, text) of every fenced block of a Markdown file, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), re.M | re.S)


def python_blocks() -> list[str]:
    return [text for lang, text in blocks(README) if lang == "python"]


def shell_lines() -> list[str]:
    """Every command of README's shell blocks, without its comment; continuation comments dropped."""
    lines = []
    for lang, text in blocks(README):
        if lang in ("sh", "bash", "console"):
            lines += [c for c in (line.split("#", 1)[0].strip() for line in text.splitlines()) if c]
    return lines


def readme_config() -> str:
    (config,) = [text for lang, text in blocks(README) if lang == "yaml"]
    return config


def snippet(marker: str) -> str:
    """The one python block of README that holds `marker`."""
    (found,) = [text for text in python_blocks() if marker in text]
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

# What each snippet needs from the reader, keyed by a line of the snippet; `check` runs after it and asserts what
# README says the snippet does. `folder`: "shared" runs it in the folder of the Lightning run (runs/exp1), which
# the later snippets and commands read.
CASES = {
    "from tripwire.plugins.lightning import TripwireCallback": dict(folder="shared", prelude=TORCH_DIGITS + """
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
    "from tripwire.plugins.keras import TripwireCallback": dict(prelude=DIGITS + """
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
    "from tripwire.plugins.transformers import TripwireCallback": dict(prelude=DIGITS + """
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
    "from tripwire.plugins.xgboost import TripwireCallback": dict(setup="tripwire init --framework xgboost", prelude="""
import xgboost as xgb
from sklearn.datasets import load_breast_cancer

X, y = load_breast_cancer(return_X_y=True)
dtrain = xgb.DMatrix(X[:400], label=y[:400])
X_val, y_val = X[400:], y[400:]
dval = xgb.DMatrix(X_val, label=y_val)
params = {"objective": "binary:logistic", "eval_metric": "logloss", "max_depth": 3, "eta": 0.1}
""", check="""
import tripwire

assert callback.run_url.endswith("runs/exp1"), callback.run_url
run = tripwire.open_run(callback.run_url)
assert "metrics/validation/logloss" in run.tensor_names() and "trees/depth" in run.tensor_names()
assert "tree_depth" in [rule["rule"] for rule in run.info["config"]["rules"]]  # xgboost.yaml's rules
"""),
    "from tripwire.plugins.torch import TripwireProbe": dict(prelude=TORCH_DIGITS + """
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = torch.nn.CrossEntropyLoss()
loader = torch.utils.data.DataLoader(dataset(0, 1200), batch_size=32, shuffle=True)
""", check="""
import tripwire

assert probe.run_url.endswith("runs/exp1") and not probe.should_stop
assert tripwire.open_run(probe.run_url).steps(mode="train") == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], probe.run_url
"""),
}


def env(tmp: Path) -> dict:
    """A reader's environment: this checkout's tripwire, Keras on TensorFlow with its home in tmp, no warnings."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "KERAS_HOME": str(tmp / "keras-home"), "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3",
            "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}  # one thread: XGBoost's crawl on shared cores


def run_snippet(marker: str, folder: Path) -> subprocess.CompletedProcess:
    """Prelude, the snippet as README has it, check: one script in `folder`, run as a reader runs theirs."""
    case = CASES[marker]
    script = folder / "snippet.py"
    script.write_text("\n".join([textwrap.dedent(case.get("prelude", "")), snippet(marker),
                                 textwrap.dedent(case.get("check", ""))]))
    out = subprocess.run([sys.executable, str(script)], cwd=folder, env=env(folder), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, f"README snippet '{marker}':\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
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
    (folder / "my_project" / "rules.py").write_text(snippet("class LargeGradient(Rule):"))
    run_snippet("from tripwire.plugins.lightning import TripwireCallback", folder)
    return folder


def test_lightning(shared):
    assert tripwire.open_run(shared / "runs" / "exp1").info["status"] == "finished"


@pytest.mark.parametrize("marker", [m for m, case in CASES.items() if case.get("folder") != "shared"])
def test_snippet(marker, tmp_path):
    setup = CASES[marker].get("setup", "tripwire init")  # README: a copy of rules.yaml in the reader's repo
    assert setup in shell_lines() + re.findall(r"`(tripwire [^`]*)`", README.read_text())
    init = cli(tmp_path, setup)
    assert init.returncode == 0 and "wrote" in init.stdout, init.stdout + init.stderr
    run_snippet(marker, tmp_path)
