"""The `tripwire` command line. Exit codes: 0 nothing fired, 1 a rule fired (or runs differ), 2 an error.

An unexpected exception is an error too (exit 2, never 1): one line on stderr, and the traceback only when
the environment variable TRIPWIRE_DEBUG is set to a non-empty value other than 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from .errors import TripwireError, install


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "verb", None):
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        return args.func(args) or 0
    except TripwireError as exc:
        print(f"tripwire {args.verb}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `tripwire … | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ModuleNotFoundError as exc:
        package = (exc.name or "").split(".")[0]
        if package not in EXTRAS:
            return _unexpected(args, exc)
        print(f"tripwire {args.verb}: this needs {package}, which is not installed: {install(EXTRAS[package])} "
              f"(or pip install {package}).", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - exit 1 means "a rule fired"; a crash must not read as that
        return _unexpected(args, exc)


def _unexpected(args, exc: Exception) -> int:
    """Exit 2 with one line (the traceback with TRIPWIRE_DEBUG=1): a crash must not read as "a rule fired"."""
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        import traceback

        traceback.print_exception(exc)
    message = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line
    print(f"tripwire {args.verb}: unexpected error: {message} (at {_origin(exc)}). This is a bug in tripwire or "
          f"input it could not handle; set {DEBUG_ENV}=1 for the traceback.", file=sys.stderr)
    return 2


DEBUG_ENV = "TRIPWIRE_DEBUG"
# An optional package a verb imports, and the extra that has it.
EXTRAS = {"tensorboard": "tensorboard", "tensorboardX": "tensorboard", "matplotlib": "report", "s3fs": "s3",
          "lightning": "lightning", "sklearn": "demo", "yaml": "lightning"}
EXIT_CODES = ("exit codes: 0 nothing fired (compare: equivalent), 1 a verdict at warning or error (compare: the "
              "runs differ), 2 an error (a damaged run, a bad config, a rule that failed, a missing path).")
TRUST_HELP = ("import the custom rules the run's stored config names (without it they are left out: code a run "
              "names is not imported); only for a run you wrote yourself")


def _origin(exc: BaseException) -> str:
    """file:line where the exception was raised, for the one-line message."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}" if tb is not None else "?"


def _parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = argparse.ArgumentParser(prog="tripwire", description="A debugger for machine-learning training.",
                                epilog=EXIT_CODES)
    p.add_argument("--version", action="version", version=f"tripwire {__version__}")
    sub = p.add_subparsers(dest="verb", metavar="VERB")

    c = sub.add_parser("check", help="evaluate rules over a stored run; exit 1 if any fired", epilog=EXIT_CODES)
    c.add_argument("run", help="run URL (a folder, memory://…, s3://…)")
    c.add_argument("--config", help="rule config to use instead of the one stored with the run")
    c.add_argument("--trust-run", action="store_true", help=TRUST_HELP)
    c.set_defaults(func=_check)

    w = sub.add_parser("watch", help="follow a live run, evaluate its rules, store verdicts in it", epilog=EXIT_CODES)
    w.add_argument("run", help="run URL to follow (it may not exist yet: see --wait)")
    w.add_argument("--config", help="rule config to use instead of the one stored with the run")
    w.add_argument("--trust-run", action="store_true", help=TRUST_HELP)
    w.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the run to appear (default 60)")
    w.add_argument("--idle-timeout", type=float, default=None, help="give up after this long with nothing new")
    w.add_argument("--give-up-after", type=float, default=300.0,
                   help="seconds of storage errors in a row (retried with backoff) before exiting 2 (default 300)")
    w.add_argument("--ended-after", type=float, default=30.0,
                   help="a run whose writers are gone without closing it (status crashed or unknown) counts as "
                        "ended after this many seconds with nothing new (default 30)")
    w.add_argument("--quiet", action="store_true", help="print nothing but errors (exit codes unchanged)")
    w.set_defaults(func=_watch)

    s = sub.add_parser("show", help="what a run holds", epilog=EXIT_CODES)
    s.add_argument("run", help="run URL (a folder, memory://…, s3://…)")
    s.add_argument("--json", action="store_true", help="print it as JSON")
    s.set_defaults(func=_show)

    ls = sub.add_parser("ls", help="the runs under a folder, with status and verdicts", epilog=EXIT_CODES)
    ls.add_argument("root", help="a folder (or fsspec URL) holding runs at any depth")
    ls.add_argument("--json", action="store_true", help="print them as JSON")
    ls.set_defaults(func=_ls)

    rep = sub.add_parser("report", help="a self-contained HTML report of a run (or an index of the runs under a root)")
    rep.add_argument("run", help="a run URL, or a folder of runs")
    rep.add_argument("-o", "--output", help="where to write the HTML (default: report.html in the run)")
    rep.add_argument("--steps", type=_report_steps, metavar="N,M,…",
                     help="steps of the weight and gradient histograms, 1 to 8 (each tensor at its saved step "
                          "nearest to each; default: its first, middle and last saved steps)")
    rep.set_defaults(func=lambda args: _delegate("report", args))

    cmp_ = sub.add_parser("compare", help="first step and tensor where two runs diverge; exit 1 if they do",
                          epilog=EXIT_CODES)
    cmp_.add_argument("a", help="the first run's URL")
    cmp_.add_argument("b", help="the second run's URL")
    cmp_.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance up to --switch-step")
    cmp_.add_argument("--rtol", type=float, default=0.05, help="relative tolerance after --switch-step")
    cmp_.add_argument("--switch-step", type=int, default=10,
                      help="the step from which --rtol applies instead of --atol (default 10)")
    cmp_.add_argument("--tensors", help="compare only tensors whose names match this regex")
    cmp_.add_argument("--map", help="YAML name map: renames and transposes between the two runs")
    cmp_.set_defaults(func=lambda args: _delegate("compare", args))

    exp = sub.add_parser("export", help="export a run to another tool's format")
    exp.add_argument("format", choices=["tensorboard"], help="the format to write: tensorboard event files")
    exp.add_argument("run", help="run URL")
    exp.add_argument("logdir", help="where to write the event files (a folder or fsspec URL)")
    exp.set_defaults(func=lambda args: _delegate("export", args))

    le = sub.add_parser("learn", help="learn the ranges healthy runs held; write them as a rule file",
                        description="Learn, from healthy runs of one pipeline, the range of every captured reduction "
                                    "per kind of tensor (collection, layer class and role: the gradients of Linear "
                                    "kernels, the loss, the learning rate), per mode and per band of steps (0, 1-9, "
                                    "10-99, ...), widened by a margin; write them as a config of one rule, "
                                    "learned_invariants, that warns where a later run leaves them. docs/learn.md "
                                    "has the details.",
                        epilog="exit codes: 0 written, 2 an error (a run missing or damaged, nothing learned, the "
                               "file cannot be written).")
    le.add_argument("runs", nargs="+", metavar="RUN",
                    help="healthy runs of the pipeline (folders, memory://…, s3://…)")
    le.add_argument("-o", "--output", required=True, metavar="FILE",
                    help="the rule file to write; check a run with `tripwire check RUN --config FILE`")
    le.set_defaults(func=lambda args: _delegate("learn", args))

    r = sub.add_parser("rules", help="every built-in rule, or one in full")
    r.add_argument("name", nargs="?", help="a rule's name: print it in full")
    r.set_defaults(func=_rules)

    frameworks = ("lightning", "keras", "xgboost", "transformers", "torch")
    i = sub.add_parser("init", help="write a starting rule config, commented, into your repo",
                       description="Write the rule config tripwire ships for a framework into your repo, comments "
                                   "and all, to edit: rules.yaml (Lightning, Keras, Transformers, plain PyTorch) or "
                                   "xgboost.yaml (XGBoost). Pass it to the callback: TripwireCallback(\"rules.yaml\").",
                       epilog="exit codes: 0 written, 2 the file is there already (see --force) or cannot be written.")
    i.add_argument("--framework", choices=frameworks, default="lightning",
                   help="the framework you train with (default lightning: rules.yaml)")
    i.add_argument("-o", "--output", metavar="PATH",
                   help="the file to write, or a folder to write it into (default: rules.yaml, for xgboost "
                        "xgboost.yaml, in the working directory)")
    i.add_argument("--force", action="store_true", help="overwrite the file if it is there")
    i.set_defaults(func=_init)

    d = sub.add_parser("demo", help="train a small model healthy and with faults; show detection and early stop")
    d.add_argument("--out", default="runs/demo", help="where the demo runs are stored (default runs/demo)")
    d.set_defaults(func=_demo)
    return p


def _report_steps(text: str) -> list[int]:
    """`report --steps 0,50,100`: a comma-separated list of 1 to 8 steps."""
    try:
        steps = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of steps, e.g. 0,50,100") from None
    if not 1 <= len(steps) <= 8:
        raise argparse.ArgumentTypeError(f"give 1 to 8 steps, not {len(steps)}")
    return steps


def _delegate(verb: str, args) -> int:
    """Verbs whose code lives in its own module, imported only when used."""
    import importlib

    modules = {"report": ".report_html", "compare": ".compare", "export": ".export", "learn": ".learn"}
    module = importlib.import_module(modules[verb], __package__)
    return module.cli(args, _storage_options())


def _storage_options() -> dict:
    from .watcher import STORAGE_OPTIONS_ENV

    return json.loads(os.environ.get(STORAGE_OPTIONS_ENV, "{}"))


def _open(url):
    from .run import open_run

    return open_run(url, _storage_options())


def _config(path):
    if path is None:
        return None
    from .config import load_config

    return load_config(path)


def _check(args) -> int:
    from .evaluate import check

    from .diagnosis import summary

    run = _open(args.run)
    # Findings as they come; the rules that failed or had no data are listed once, in the summary.
    verdicts = check(run, _config(args.config),
                     on_verdict=lambda v: v.fired and print(v.describe(with_hint=False)), trust_run=args.trust_run)
    if verdicts:
        print("\n" + summary(verdicts))
    code = _verdict_exit(verdicts)
    return _damaged_exit(run, "check") or code


def _damaged_exit(run, verb: str) -> int:
    """2, saying which files, where the run holds damaged, cut short or missing files; else 0."""
    return 2 if say_damage(run, verb) else 0


def say_damage(run, verb: str) -> bool:
    """Print which of the run's files are damaged (to stderr), if any: every verb says so."""
    note = run.damage_note()
    if note:
        print(f"tripwire {verb}: {note}", file=sys.stderr)
    return bool(note)


def _verdict_exit(verdicts, quiet: bool = False) -> int:
    """1 if a verdict of severity warning or error fired (info verdicts are only worth a look), else 2 if a rule
    failed, else 0."""
    counted = [v for v in verdicts if v.counts]
    info = sum(v.fired and not v.counts for v in verdicts)
    failed = [v for v in verdicts if v.status == "error"]
    if not quiet:
        print(f"{len(counted)} finding(s) at warning or error" + (f", {info} at info" if info else "")
              + (f", {len(failed)} rule(s) failed" if failed else "") + ".")
    return 1 if counted else (2 if failed else 0)


def _watch(args) -> int:
    from .errors import RunNotFound, StoreUnavailable
    from .evaluate import watch

    deadline = time.monotonic() + args.wait
    while True:
        try:
            run = _open(args.run)
            break
        except (RunNotFound, OSError, StoreUnavailable) as exc:  # not there yet, or the store hiccups
            if time.monotonic() > deadline:
                if isinstance(exc, RunNotFound):
                    raise
                raise StoreUnavailable(f"could not open {args.run} within {args.wait:g}s: {type(exc).__name__}: "
                                       f"{exc}") from exc
            time.sleep(0.2)
    say = (lambda v: None) if args.quiet else (lambda v: print(v.describe(), flush=True))
    verdicts = watch(run, _config(args.config), on_verdict=say, idle_timeout_s=args.idle_timeout,
                     give_up_s=args.give_up_after, ended_after_s=args.ended_after, trust_run=args.trust_run)
    return _verdict_exit(verdicts, args.quiet)


def _show(args) -> int:
    from .diagnosis import summary
    from .naming import collection_of

    run = _open(args.run)
    info = run.info
    modes = {m: run.steps(mode=m) for m in run.modes()}
    names = run.tensor_names()
    verdicts = run.verdicts()
    if args.json:
        print(json.dumps({"url": run.url, "info": info, "steps": {m: len(s) for m, s in modes.items()},
                          "tensors": names, "verdicts": [v.to_dict() for v in verdicts],
                          "skipped": run.skipped, "damaged": run.damaged}, indent=1, default=str))
        return _damaged_exit(run, "show")
    print(f"run        {run.url}")
    framework, version = str(info.get("framework")), str(info.get("framework_version", ""))
    print(f"framework  {version if version.startswith(framework) else f'{framework} {version}'}   tripwire "
          f"{info.get('tripwire_version')}")
    print(f"status     {info['status']}   created {_when(info.get('created'))}   world size "
          f"{info.get('world_size', 1)}   workers with data {run.workers()}")
    if info["lost_steps"] or info["dropped_steps"] or info["partial_steps"]:
        print(f"lost       {info['lost_steps']} steps lost to storage errors, {info['dropped_steps']} dropped "
              f"(writer queue full), {info['partial_steps']} stored without their full tensors (they did not fit "
              "in writer.max_queue_mb)")
    for mode, steps in modes.items():
        span = f"{steps[0]}..{steps[-1]}" if steps else "-"
        print(f"steps      {mode}: {len(steps)} sampled ({span})")
    by_collection: dict = {}
    for name in names:
        by_collection.setdefault(collection_of(name), []).append(name)
    for collection, members in sorted(by_collection.items()):
        reductions = sorted(set().union(*(run.tensor(n).reductions(mode=m) for n in members[:1]
                                          for m in run.modes() if n in run.tensor_names(mode=m))))
        print(f"collection {collection}: {len(members)} tensors ({', '.join(reductions) or 'full values'}), "
              f"e.g. {members[0]}")
    print(f"verdicts   {len(verdicts)}" + (", by root cause:" if verdicts else ""))
    if verdicts:
        print("  " + summary(verdicts, with_hint=False).replace("\n", "\n  "))
    for rel, reason in run.skipped.items():
        print(f"{'damaged' if rel in run.damaged else 'skipped':10} {rel}: {reason}")
    return _damaged_exit(run, "show")


def _when(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "?"


def _ls(args) -> int:
    from .listing import list_runs

    import fsspec

    options = _storage_options()
    fs, path = fsspec.core.url_to_fs(args.root, **options)
    if not fs.exists(path):
        print(f"tripwire ls: {args.root} does not exist.", file=sys.stderr)
        return 2
    rows = list_runs(args.root, options)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no runs under {args.root} (a run is a folder holding run.json).")
        return 0
    width = max(12, *(len(r["name"]) for r in rows))
    print(f"{'run':{width}} {'framework':10} {'steps':>7} {'last step':>9} {'status':9} {'created':19} verdicts")
    for r in rows:
        steps = ("-" if r["error"] else "?") if r["steps"] is None else r["steps"]
        step = "-" if r["last_step"] is None else r["last_step"]
        status = r["status"] if not r["error"] else f"unreadable: {r['error']}"
        more = "".join(f" (+{r[key]} {label})" for key, label in (("info", "info"), ("no_data", "no data"))
                       if r[key])
        print(f"{r['name']:{width}} {r['framework'] or '?':10} {steps:>7} {step:>9} {status:9} "
              f"{_when(r['created']):19} {r['verdicts']}{more}")
    return 0


def _rules(args) -> int:
    from .rules.registry import rule_class, rule_names

    if not args.name:
        from .config import load_config
        from .rulesdoc import summary

        default = {spec.rule for spec in load_config(None).rules}
        print("\n\n".join(("[in the default rules.yaml] " if name in default else "[off by default] ")
                           + summary(rule_class(name)) for name in rule_names()))
        print(f"\n{len(default)} of {len(rule_names())} rules are on in the default rules.yaml. `tripwire rules NAME` "
              "shows one rule in full: also what it requires and where its defaults come from (docs/rules.md has "
              "them all).")
        return 0
    try:
        cls = rule_class(args.name)
    except TripwireError as exc:
        from .errors import did_you_mean

        print(f"{exc}{did_you_mean(args.name, rule_names())}", file=sys.stderr)
        return 2
    from .rulesdoc import describe

    print(describe(cls))
    return 0


def _init(args) -> int:
    """`tripwire init`: the packaged config of the framework, copied out for the user to edit."""
    from .config import PACKAGED, packaged_config

    name = next(name for name, frameworks in PACKAGED.items() if args.framework in frameworks)
    path = args.output or name
    if os.path.isdir(path) or path.endswith(("/", os.sep)):  # a folder, there or to make
        path = os.path.join(path, name)
    if os.path.exists(path) and not args.force:
        print(f"tripwire init: {path} is there already; it was left as it is. Pass --force to replace it with the "
              f"packaged {name}, or -o to write elsewhere.", file=sys.stderr)
        return 2
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(packaged_config(name))
    except OSError as exc:
        print(f"tripwire init: could not write {path}: {exc.strerror or exc}.", file=sys.stderr)
        return 2
    print(f"wrote {path}, tripwire's {name} for {args.framework}: edit it, then pass it to the callback, "
          f"TripwireCallback({path!r}, ...). `tripwire rules` lists every rule.")
    return 0


def _demo(args) -> int:
    try:
        from ..demo import run_demo
    except ImportError as exc:
        print(f"tripwire demo needs Lightning and scikit-learn ({exc}). Install them with "
              f"`{install('lightning,demo')}` or run `make demo`.", file=sys.stderr)
        return 2
    return run_demo(args.out)
