"""Installing tripwire as README says: the wheel this repository builds (`make dist`) holds the packaged configs and
runs from a plain install, every `pip install` in the docs names this distribution and extras it has, and
`tripwire init` writes a packaged config into the user's repo."""

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import tripwire
from tripwire.core.cli import EXTRAS
from tripwire.core.config import PACKAGED
from tripwire.core.errors import DISTRIBUTION, install

ROOT = Path(__file__).parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `make dist` builds, built from a copy of the sources (the build writes into the tree it builds)."""
    tmp = tmp_path_factory.mktemp("dist")
    src = tmp / "src"
    shutil.copytree(ROOT / "tripwire", src / "tripwire", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "rules.yaml"):
        shutil.copy(ROOT / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "--disable-pip-version-check", "-w", str(tmp / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (found,) = (tmp / "dist").glob("*.whl")
    return found


def test_the_wheel_is_tripwire_training_and_holds_the_packaged_configs(wheel):
    assert wheel.name.startswith("tripwire_training-")
    with zipfile.ZipFile(wheel) as z:
        for name in PACKAGED:  # the real text, not a symbolic link (rules.yaml is one in the repository)
            assert z.read(f"tripwire/{name}").decode() == (ROOT / "tripwire" / name).read_text(), name
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert f"Name: {DISTRIBUTION}" in metadata
    extras = set(re.findall(r"^Provides-Extra: (\S+)", metadata, re.M))
    assert {"lightning", "keras", "xgboost", "xgboost-cpu", "dask", "tensorboard", "all"} <= extras


def test_init_runs_from_the_installed_wheel(wheel, tmp_path):
    """`python -m tripwire init` from a plain (non-editable) install of the wheel writes the packaged config."""
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                          "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    work = tmp_path / "repo"
    work.mkdir()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import tripwire; print(tripwire.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=120)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr  # the wheel's, not this checkout's

    init = [sys.executable, "-m", "tripwire", "init", "--framework", "xgboost"]
    out = subprocess.run(init, cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "wrote xgboost.yaml" in out.stdout, out.stdout + out.stderr
    assert (work / "xgboost.yaml").read_text() == (ROOT / "tripwire" / "xgboost.yaml").read_text()
    again = subprocess.run(init, cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "--force" in again.stderr


def pip_install_lines() -> list[tuple[str, str]]:
    """(file name, line) of every `pip install` command in README.md and docs/."""
    return [(doc.name, line.strip()) for doc in DOCS for line in doc.read_text().splitlines()
            if re.search(r"\bpip install\b", line)]


def test_every_pip_install_in_the_docs_names_this_distribution_and_extras_it_has():
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    lines = pip_install_lines()
    assert DISTRIBUTION in (ROOT / "README.md").read_text() and "make dist" in (ROOT / "README.md").read_text()
    for doc, line in lines:
        command = line.split("#", 1)[0]
        assert not re.search(r"\btripwire(\[|\s|'|$)", command), f"{doc}: {line}: not a distribution of ours"
        for target, wanted in re.findall(r"([\w./*-]+)\[([\w,-]+)\]", line):  # comments name extras too
            if target.startswith(("jax", "dask")):  # other packages' own extras
                continue
            assert target in (DISTRIBUTION, ".") or target.endswith(".whl"), f"{doc}: {line}"
            assert set(wanted.split(",")) <= extras, f"{doc}: {line}: no extra {set(wanted.split(',')) - extras}"


def test_the_hints_about_missing_packages_name_extras_that_exist():
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    assert set(EXTRAS.values()) <= extras
    assert install("xgboost-cpu,dask") == f"pip install '{DISTRIBUTION}[xgboost-cpu,dask]'"
    (everything,) = PYPROJECT["project"]["optional-dependencies"]["all"]
    assert everything.startswith(f"{DISTRIBUTION}[")
    assert set(everything.split("[")[1].rstrip("]").split(",")) <= extras


@pytest.mark.parametrize("framework, name", [("lightning", "rules.yaml"), ("torch", "rules.yaml"),
                                             ("xgboost", "xgboost.yaml")])
def test_init_writes_the_framework_s_config_into_a_folder_and_replaces_it_only_with_force(tmp_path, framework,
                                                                                         name, capsys):
    from tripwire.core.cli import main

    folder = tmp_path / "configs"
    assert main(["init", "--framework", framework, "-o", f"{folder}/"]) == 0
    written = folder / name
    assert written.read_text() == (ROOT / "tripwire" / name).read_text()  # comments and all
    assert tripwire.load_config(written).rules
    written.write_text("mine")
    assert main(["init", "--framework", framework, "-o", str(written)]) == 2
    assert written.read_text() == "mine" and "--force" in capsys.readouterr().err
    assert main(["init", "--framework", framework, "-o", str(written), "--force"]) == 0
    assert written.read_text() == (ROOT / "tripwire" / name).read_text()


def test_init_help_names_the_frameworks_and_the_files():
    out = subprocess.run([sys.executable, "-m", "tripwire", "init", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0
    assert "lightning,keras,xgboost,transformers,torch" in out.stdout and "xgboost.yaml" in out.stdout


def test_a_missing_config_named_like_a_packaged_one_says_tripwire_init(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(tripwire.ConfigError, match=r"tripwire init --framework xgboost -o conf/xgboost.yaml"):
        tripwire.load_config("conf/xgboost.yaml")
    with pytest.raises(tripwire.ConfigError) as other:
        tripwire.load_config("nope.yaml")
    assert "tripwire init" not in str(other.value)
    assert tripwire.load_config("xgboost.yaml").source == "xgboost.yaml (packaged)"  # none here: the packaged one
    (tmp_path / "xgboost.yaml").write_text("version: 1\nrules: [tree_depth]\n")
    assert [spec.rule for spec in tripwire.load_config("xgboost.yaml").rules] == ["tree_depth"]  # the user's own
