"""What a user sees on the console without configuring logging: each finding once, on a line of its own beside
Lightning's progress bar, and one line at the end of a healthy run that says what was checked."""

import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

PROBE_RUN = """
import sys, torch
sys.path.insert(0, {tests!r})
import helpers
from tripwire.plugins.torch import TripwireProbe

torch.manual_seed(0)
(x, y), _ = helpers.digits()
net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
optimizer = torch.optim.SGD(net.parameters(), lr={lr})
{logging_setup}
with TripwireProbe(net, optimizer, out_dir={out!r}) as probe:
    for step in range(120):
        i = 32 * (step % 40)
        xb, yb = torch.tensor(x[i:i + 32]), torch.tensor(y[i:i + 32], dtype=torch.long)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(xb), yb)
        loss.backward()
        optimizer.step()
        probe.step(loss, labels=yb)
        if probe.should_stop:
            break
print("first loss", float(torch.nn.functional.cross_entropy(net(torch.tensor(x[:256])), torch.tensor(y[:256]))))
"""


def run_script(code: str, tmp_path, one_stream: bool = False) -> subprocess.CompletedProcess:
    """The script in a fresh process; with `one_stream`, stderr into stdout, unbuffered, as a terminal shows them."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "KERAS_HOME": str(tmp_path / "keras"), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, timeout=300, env=env,
                          stderr=subprocess.STDOUT if one_stream else subprocess.PIPE, cwd=tmp_path)


def probe_script(tmp_path, lr: float, logging_setup: str = "") -> str:
    return PROBE_RUN.format(tests=str(TESTS), lr=lr, out=str(tmp_path / "run"), logging_setup=logging_setup)


def test_a_healthy_run_ends_with_one_line_that_says_nothing_fired(tmp_path):
    done = run_script(probe_script(tmp_path, lr=0.1), tmp_path)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("tripwire:")]
    assert len(said) == 1, done.stderr
    assert re.match(r"tripwire: \d+ rule\(s\) checked .* up to step \d+; no warning or error", said[0]), said
    assert "has no data" not in done.stderr  # rules without data are named in that one line, not one line each


def test_a_fault_is_said_at_warning_without_configuring_logging(tmp_path):
    done = run_script(probe_script(tmp_path, lr=50.0), tmp_path)
    assert done.returncode == 0, done.stderr
    assert "tripwire: stopping training after step" in done.stderr
    assert "no warning or error" not in done.stderr


def test_logging_the_user_configured_is_left_alone(tmp_path):
    setup = "import logging; logging.basicConfig(level=logging.WARNING, format='USER %(name)s %(message)s')"
    done = run_script(probe_script(tmp_path, lr=50.0, logging_setup=setup), tmp_path)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "tripwire:" in line]
    assert lines and all(line.startswith("USER tripwire tripwire:") for line in lines), done.stderr
    assert not logging.getLogger("tripwire").handlers  # nor is this process's logging touched by the tests


LIGHTNING_RUN = """
import sys
sys.path.insert(0, {tests!r})
import helpers
from lightning.pytorch.callbacks import {bar}
from tripwire.plugins.lightning import TripwireCallback

module = helpers.mlp_module(lr=50.0)
callback = TripwireCallback(out_dir={out!r})
helpers.fit(callback, module, max_epochs=3, enable_progress_bar=True, callbacks=[{bar}()])
"""


@pytest.mark.parametrize("bar", ["TQDMProgressBar", "RichProgressBar"])
def test_lines_do_not_land_inside_lightnings_progress_bar(tmp_path, bar):
    code = LIGHTNING_RUN.format(tests=str(TESTS), out=str(tmp_path / "run"), bar=bar)
    done = run_script(code, tmp_path, one_stream=True)  # Lightning's bar on stdout, tripwire's lines on stderr
    output = done.stdout
    assert done.returncode == 0, output
    pieces = re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", output))  # cursor moves: not text
    ours = [p for p in pieces if "tripwire:" in p]
    assert ours, output
    assert all(p.startswith("tripwire:") for p in ours), [p for p in ours if not p.startswith("tripwire:")]
    assert "Epoch" in output  # the bar was drawn
    assert output.count("[exploding_tensor] error at step") >= 1
    # the validation Lightning runs as it stops finds the NaN too: it is said, and stops and checkpoints nothing again
    assert output.count("tripwire: stopping training") == 1 and output.count("checkpoint written") == 1, output


def test_check_lists_a_rule_without_data_once(tmp_path):
    done = run_script(probe_script(tmp_path, lr=0.1), tmp_path)
    assert done.returncode == 0, done.stderr
    config = tmp_path / "extra.yaml"
    config.write_text(textwrap.dedent("""\
        rules:
          - rule: overfit
    """))
    checked = subprocess.run([sys.executable, "-m", "tripwire", "check", str(tmp_path / "run"), "--config",
                              str(config)], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.count("[overfit] has no data") == 1, checked.stdout
