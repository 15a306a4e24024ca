"""`make zoo`: every zoo case under the default config and with every rule on; one table.

    python -m benchmarks.zoo.run                          # every framework, the longer runs, Keras on 3 backends
    python -m benchmarks.zoo.run --framework keras --backend jax --short
    python -m benchmarks.zoo.run --framework torch --cases resnet_bn,mlp_bn --short --check

The table (case × config: rules fired at warning or error, false alarms,
faults caught, by the right rule, steps from onset to verdict) is printed
and, for a run of every framework, written to benchmarks/results/zoo.md with
each rule's record in benchmarks/results/zoo.json (docs/rules.md is made from
it: `python -m tripwire.core.rulesdoc --zoo benchmarks/results/zoo.json`).
Keras runs on TensorFlow in this process and on torch and JAX in a process of
their own each (a backend is chosen before Keras is imported). With --check
the exit status is 1 when any case fails (a false alarm, a healthy model that
did not learn, a fault missed by its rule, a rule that raised).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
FRAMEWORKS = ("lightning", "torch", "keras", "xgboost", "transformers")
OTHER_BACKENDS = ("torch", "jax")  # Keras backends run in a process of their own


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zoo.run", description=__doc__.split("\n")[0])
    parser.add_argument("--framework", choices=FRAMEWORKS, action="append")
    parser.add_argument("--backend", help="Keras backend (tensorflow, torch, jax) of this process")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--configs", default="default,all_rules", help="comma-separated: default, all_rules")
    parser.add_argument("--short", action="store_true", help="the short runs the test suite uses")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="where the PyTorch cases train (default cpu)")
    parser.add_argument("--check", action="store_true", help="exit 1 if any case fails")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--json-out", help=argparse.SUPPRESS)  # results as JSON, for the process that merges them
    args = parser.parse_args(argv)
    if args.backend:
        os.environ["KERAS_BACKEND"] = args.backend
    if args.device:
        os.environ["TRIPWIRE_ZOO_DEVICE"] = args.device
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    quiet_frameworks()

    from .table import by_rule, table

    frameworks = args.framework or list(FRAMEWORKS)
    results = run(frameworks, args.cases, args.configs.split(","), args.short)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([r.to_dict() for r in results]))
        return 0
    if "keras" in frameworks and not args.backend:
        for backend in OTHER_BACKENDS:
            results += in_another_process(backend, args)
    text = table(results)
    print("\n" + text)
    if not args.no_write and results and not args.framework and not args.cases:
        RESULTS.mkdir(exist_ok=True)
        name = "zoo-short" if args.short else "zoo"
        (RESULTS / f"{name}.md").write_text(text + "\n")
        (RESULTS / f"{name}.json").write_text(json.dumps(by_rule(results), indent=1, sort_keys=True) + "\n")
    return 1 if args.check and any(r.failures for r in results) else 0


def run(frameworks, names: str | None, configs: list[str], short: bool) -> list:
    """Every case of these frameworks (those named) under each config, in this process."""
    from . import cases
    from .harness import run_case

    wanted = set(names.split(",")) if names else None
    backend = os.environ["KERAS_BACKEND"]
    results = []
    for framework in frameworks:
        for case in cases(framework):
            if wanted is not None and case.name not in wanted:
                continue
            if framework == "keras" and backend not in case.backends and (short or backend != "tensorflow"):
                continue  # short runs take each backend's share; the long ones all on TensorFlow, a share elsewhere
            for config in configs:
                result = run_case(case, config, long=not short)
                results.append(result)
                mark = "FAIL" if result.failures else "ok"
                print(f"{mark:4} {case.id:40} {config:9} {result.seconds:5.1f}s  {result.score}  "
                      f"fired: {', '.join(result.rules) or '-'}", flush=True)
                for failure in result.failures:
                    print(f"       {failure}", flush=True)
    return results


def in_another_process(backend: str, args) -> list:
    """The Keras cases of another backend, run in a fresh interpreter (Keras picks its backend once)."""
    from . import cases
    from .harness import Result

    with tempfile.TemporaryDirectory(prefix="zoo-") as folder:
        out = Path(folder) / "results.json"
        command = [sys.executable, "-m", "benchmarks.zoo.run", "--framework", "keras", "--backend", backend,
                   "--configs", args.configs, "--json-out", str(out)] + (["--short"] if args.short else []) + \
                  (["--cases", args.cases] if args.cases else [])
        env = {**os.environ, "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
        subprocess.run(command, env=env, check=True)
        by_id = {c.id: c for c in cases("keras")}
        return [Result.from_dict(data, by_id[data["case"]]) for data in json.loads(out.read_text())]


def quiet_frameworks() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("tripwire").setLevel(logging.CRITICAL)  # the table says what fired
    for name in ("lightning", "pytorch_lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


if __name__ == "__main__":
    sys.exit(main())
