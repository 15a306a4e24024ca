"""The zoo (benchmarks/zoo): realistic healthy and faulty setups in every framework, in their short runs.

Each case trains under the packaged default rules.yaml and with every built-in rule on (sampled every 10 steps).
No healthy case may get a verdict at warning or error, or be stopped, and each healthy model must still learn
with tripwire attached; with every rule on, each fault must be caught by a rule that names it; no rule may raise.
Lightning, plain PyTorch, XGBoost, Transformers and Keras on TensorFlow run here; Keras on torch and JAX in a
subprocess each (the backend is chosen before Keras is imported). `make zoo` runs the longer versions and writes
the table.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.zoo import cases
from benchmarks.zoo.harness import CONFIGS, run_case

ROOT = Path(__file__).parents[1]
IN_PROCESS = [c for f in ("lightning", "torch", "xgboost", "transformers") for c in cases(f)] + \
    [c for c in cases("keras") if "tensorflow" in c.backends]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("case", IN_PROCESS, ids=lambda c: c.id)
def test_zoo_case(case, config, tmp_path):
    result = run_case(case, config, root=str(tmp_path))
    assert not result.failures, "\n".join(result.failures)


def test_the_zoo_holds_what_the_issue_asks_for():
    """At least 12 Lightning and plain-torch setups, 10 Keras, 6 XGBoost, 2 Transformers, healthy; faults in every
    framework; at least 10 silent bugs, in Lightning, plain torch, Keras and XGBoost."""
    healthy = lambda fw: [c for c in cases(fw) if c.healthy]  # noqa: E731
    assert len(healthy("lightning") + healthy("torch")) >= 12 and len(healthy("keras")) >= 10
    assert len(healthy("xgboost")) >= 6 and len(healthy("transformers")) >= 2
    for framework in ("lightning", "torch", "keras", "xgboost", "transformers"):
        assert any(not c.healthy and c.catch for c in cases(framework)), framework
    assert {"torch", "jax"} <= {b for c in cases("keras") for b in c.backends}
    silent = [c for c in cases() if "silent" in c.tags]
    assert len(silent) >= 10 and {"lightning", "torch", "keras", "xgboost"} <= {c.framework for c in silent}


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_keras_zoo_on_another_backend(backend):
    pytest.importorskip(backend)
    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.zoo.run", "--framework", "keras", "--backend", backend,
                          "--short", "--check", "--no-write"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert out.stdout.count("\nok ") + out.stdout.startswith("ok ") >= 8  # every case of that backend ran
