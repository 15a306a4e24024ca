"""The command line as a user meets it: --version, help with exit codes, a folder of runs or a file where a run was
expected, a path that does not exist, an optional package that is not installed, output piped into `head`."""

import subprocess
import sys

import pytest
import torch

import helpers
import tripwire
from tripwire.plugins.torch import TripwireProbe


def cli(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "tripwire", *map(str, args)], capture_output=True, text=True,
                          timeout=120, **kwargs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A folder of two small runs."""
    root = tmp_path_factory.mktemp("runs")
    for name in ("a", "b"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 10))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        (x, y), _ = helpers.digits(n_train=64)
        with TripwireProbe(net, optimizer, {"collections": {"losses": {}}, "sampling": {"every": 1}},
                           out_dir=root / name) as probe:
            for _ in range(3):
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(net(torch.tensor(x)), torch.tensor(y))
                loss.backward()
                optimizer.step()
                probe.step(loss)
    return root


def test_version_and_help_with_the_exit_codes():
    assert cli("--version").stdout.strip() == f"tripwire {tripwire.__version__}"
    for args in ([], ["check"], ["compare"]):
        out = cli(*args, "--help")
        assert out.returncode == 0 and "exit codes: 0" in " ".join(out.stdout.split()), args
    assert "the first run's URL" in cli("compare", "--help").stdout


def test_a_folder_of_runs_a_file_or_nothing_where_a_run_was_expected(runs, tmp_path):
    for verb in ("show", "check"):
        out = cli(verb, runs)
        assert out.returncode == 2 and "is a folder of 2 run(s), not a run: a, b" in out.stderr, out.stderr
        assert "bug in tripwire" not in out.stderr
    out = cli("show", runs / "a" / "run.json")
    assert out.returncode == 2 and "is a file, not a run" in out.stderr
    out = cli("ls", tmp_path / "nothing")
    assert out.returncode == 2 and "does not exist" in out.stderr
    assert cli("ls", runs).returncode == 0


def test_show_names_the_framework_once(runs):
    line = next(line for line in cli("show", runs / "a").stdout.splitlines() if line.startswith("framework"))
    assert line.split()[1:3] == ["torch", torch.__version__]


def test_output_piped_into_head_ends_quietly(runs):
    piped = subprocess.run(f"{sys.executable} -m tripwire rules | head -1", shell=True, capture_output=True,
                           text=True, timeout=120)
    assert piped.stderr == "" and piped.stdout.startswith("[in the default rules.yaml]")


def test_rules_says_which_rules_the_default_config_turns_on():
    out = cli("rules").stdout
    default = {spec.rule for spec in tripwire.load_config(None).rules}
    assert f"{len(default)} of" in out and "[off by default] class_imbalance" in out
    assert "[in the default rules.yaml] exploding_tensor" in out


def test_a_missing_optional_package_names_the_extra(runs, tmp_path):
    code = ("import sys; sys.modules['tensorboard'] = sys.modules['tensorboardX'] = None; "
            "from tripwire.core.cli import main; "
            f"sys.exit(main(['export', 'tensorboard', {str(runs / 'a')!r}, {str(tmp_path / 'tb')!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "pip install 'tripwire-training[tensorboard]'" in out.stderr
    assert "bug in tripwire" not in out.stderr
