"""`make zoo`: every zoo case under the default config and with every rule on; one table.

    python -m benchmarks.zoo.run                          # every framework, the longer runs
    python -m benchmarks.zoo.run --framework keras --backend jax --short
    python -m benchmarks.zoo.run --framework torch --cases resnet_bn,mlp_bn --short --check

The table (case × config: rules fired at warning or error, false alarms,
faults caught, by the right rule, steps from onset to verdict) is printed and
written to benchmarks/results/zoo-<framework>[-<backend>].md. With --check the
exit status is 1 when any case fails (a false alarm, a healthy model that did
not learn, a fault missed by its rule, a rule that raised).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zoo.run", description=__doc__.split("\n")[0])
    parser.add_argument("--framework", choices=["lightning", "torch", "keras", "xgboost"], action="append")
    parser.add_argument("--backend", help="Keras backend (tensorflow, torch, jax); set before Keras is imported")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--configs", default="default,all_rules", help="comma-separated: default, all_rules")
    parser.add_argument("--short", action="store_true", help="the short runs the test suite uses")
    parser.add_argument("--check", action="store_true", help="exit 1 if any case fails")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    if args.backend:
        os.environ["KERAS_BACKEND"] = args.backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    quiet_frameworks()

    from . import cases
    from .harness import run_case
    from .table import table

    frameworks = args.framework or ["lightning", "torch", "keras", "xgboost"]
    wanted = set(args.cases.split(",")) if args.cases else None
    results = []
    for framework in frameworks:
        backend = args.backend or "tensorflow"
        for case in cases(framework):
            if wanted is not None and case.name not in wanted:
                continue
            if framework == "keras" and args.short and backend not in case.backends:
                continue
            for config in args.configs.split(","):
                result = run_case(case, config, long=not args.short)
                results.append(result)
                mark = "FAIL" if result.failures else "ok"
                print(f"{mark:4} {case.id:40} {config:9} {result.seconds:5.1f}s  {result.score}  "
                      f"fired: {', '.join(result.rules) or '-'}", flush=True)
                for failure in result.failures:
                    print(f"       {failure}", flush=True)
    text = table(results, args.backend)
    print("\n" + text)
    if not args.no_write and results:
        suffix = "-".join(frameworks) + (f"-{args.backend}" if args.backend else "") + ("-short" if args.short else "")
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"zoo-{suffix}.md").write_text(text + "\n")
    return 1 if args.check and any(r.failures for r in results) else 0


def quiet_frameworks() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("tripwire").setLevel(logging.ERROR)
    for name in ("lightning", "pytorch_lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


if __name__ == "__main__":
    sys.exit(main())
