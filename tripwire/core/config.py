"""The rule config: YAML or dict in, a validated `Config` out.

Every key is checked, and every number against its range. The whole config
is checked before anything is reported: one `ConfigError` lists every
mistake, each naming the file, the line, the key, what is allowed, and the
closest allowed name. The packaged
default is `rules.yaml` at the root of the repository, shipped inside the
package as `tripwire/rules.yaml`; `tripwire/xgboost.yaml` is the one for
boosted trees. A bare name of a packaged config ("xgboost.yaml") that is not
a file in the working directory reads the packaged one.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any, Mapping

from .configcheck import Checker, shown
from .errors import ConfigError, did_you_mean
from .naming import COLLECTIONS, MODES, SCALAR_COLLECTIONS, VALUE
from .plan import plan_collections
from .ranges import ANY, Range
from .reductions import REDUCTIONS
from .sampling import SCHEDULE_KEYS, CapturePlan
from .verdict import SEVERITIES

ACTIONS = ("stop", "checkpoint", "log", "report", "raise", "call")

# The configs shipped inside the package, and the frameworks each is the starting point for (`tripwire init`).
PACKAGED = {"rules.yaml": ("lightning", "keras", "transformers", "torch"), "xgboost.yaml": ("xgboost",)}


def packaged_config(name: str) -> str:
    """The text of a config shipped inside the package (a key of PACKAGED), comments and all."""
    return resources.files("tripwire").joinpath(name).read_text(encoding="utf-8")


# Actions that end training act on verdicts of at least this severity, unless the config names another
# (`{stop: warning}`): only a broken run is stopped by default.
ENDING_ACTIONS = ("stop", "raise")


@dataclass(frozen=True)
class ActionSpec:
    name: str  # one of ACTIONS
    target: str | None = None  # 'module:function' for `call`
    severity: str | None = None  # `stop` and `raise`: the least severity they act on, if not the default

    @property
    def least_severity(self) -> str:
        """The least severe verdict this action acts on: `error` for stop and raise unless set, else `info`."""
        return self.severity or ("error" if self.name in ENDING_ACTIONS else "info")

    def acts_on(self, verdict) -> bool:
        return SEVERITIES.index(verdict.severity) <= SEVERITIES.index(self.least_severity)

    def to_yaml(self):
        if self.name == "call":
            return {"call": self.target}
        return {self.name: self.severity} if self.severity else self.name


@dataclass(frozen=True)
class RuleSpec:
    """One entry of `rules:`. `id` names it in verdicts (defaults to the rule name)."""

    rule: str
    id: str
    params: dict
    actions: tuple
    line: int | None = None

    def create(self):
        """A fresh instance of the rule with its params, told its id."""
        from .rules.registry import rule_class

        rule = rule_class(self.rule)(**self.params)
        rule.id = self.id
        return rule


@dataclass(frozen=True)
class WriterConfig:
    flush_every_s: float = 1.0
    max_queue_mb: float = 256.0
    on_error: str = "warn"  # warn | raise | ignore
    on_full: str = "drop"  # drop | block
    close_timeout_s: float = 30.0  # the longest the end of training waits for storage to take what is left


@dataclass(frozen=True)
class EvaluationConfig:
    where: str = "in_process"  # in_process | side_process
    spawn: bool = False
    poll_s: float = 0.25
    watcher_timeout_s: float = 60.0  # side_process: warn if no watcher attached (or its heartbeat stops) this long
    rule_budget: float = 0.1  # in_process: the share of training time one rule may take before it is disabled


@dataclass(frozen=True)
class Config:
    """A validated config. Build it with `load_config`; `to_dict()` gives back a dict that loads to the same."""

    version: int = 1
    output: str = "runs/{run_id}"
    storage_options: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)  # every/start/end/steps/modes, as written
    collections: dict = field(default_factory=dict)  # name -> {include, exclude, reductions, save, every, ...}
    rules: tuple = ()
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    writer: WriterConfig = field(default_factory=WriterConfig)
    workers: str = "zero"
    tensorboard: dict = field(default_factory=dict)
    loggers: bool = True  # verdicts also go to the framework's loggers and an active MLflow run (core.sinks)
    source: str = "<dict>"
    left_out: tuple = ()  # custom rules named but not imported: a config read back from a run
    output_set: bool = False  # the user's config names `output` (the packaged default's is not the user's choice)

    def to_dict(self) -> dict:
        """The config as plain data (storage options left out: they may hold credentials)."""
        return {
            "version": self.version,
            "output": self.output,
            "sampling": copy.deepcopy(self.sampling),
            "collections": copy.deepcopy(self.collections),
            "rules": [
                {"rule": r.rule, **({"name": r.id} if r.id != r.rule else {}), "params": dict(r.params),
                 "actions": [a.to_yaml() for a in r.actions]}
                for r in self.rules
            ],
            "evaluation": vars(self.evaluation).copy(),
            "writer": vars(self.writer).copy(),
            "workers": self.workers,
            **({"tensorboard": dict(self.tensorboard)} if self.tensorboard else {}),
            "loggers": self.loggers,
        }

    def create_rules(self) -> list:
        return [spec.create() for spec in self.rules]

    def plan(self) -> CapturePlan:
        """What to capture: the configured collections plus what the rules require."""
        return CapturePlan(plan_collections(self))


def load_config(config: Any = None, *, imports: bool = True) -> Config:
    """A path, a YAML string, a dict, a Config, or None (the packaged default) -> a validated Config.

    imports: the user's own config imports what it names: custom rules (`module:Class`), and the module of each
    `call: module:function` action, checked now rather than when a rule fires. Pass False for a config read back
    from a run (`tripwire check`/`watch`): nothing a run names is imported; its custom rules are left out (listed
    in `Config.left_out`) and its actions, which those commands never run, are not checked."""
    if isinstance(config, Config):
        return config
    if config is None:
        return _from_text(packaged_config("rules.yaml"), "rules.yaml (packaged default)")
    if isinstance(config, Mapping):
        return _build(copy.deepcopy(dict(config)), Checker("<dict>", {}, imports))
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if isinstance(config, str) and "\n" in config:
            return _from_text(config, "<string>", imports)
        if not os.path.exists(path):
            name = os.path.basename(path)
            if path == name and name in PACKAGED:  # "xgboost.yaml": the packaged one, unless the user has their own
                return _from_text(packaged_config(name), f"{name} (packaged)", imports)
            start = (f" `tripwire init{' --framework xgboost' if name == 'xgboost.yaml' else ''} -o {path}` writes the "
                     f"packaged {name} there, commented, to start from." if name in PACKAGED else "")
            raise ConfigError(
                f"no config file at '{path}' (working directory {os.getcwd()}). Pass a path to a YAML file, a dict, "
                f"or None for the packaged default (`tripwire rules` lists the rules).{start}", source=path)
        size = os.path.getsize(path)
        from .yamlsource import MAX_BYTES

        if size > MAX_BYTES:
            raise ConfigError(f"the file is {size:,} bytes; a config may hold at most {MAX_BYTES:,}.", source=path)
        with open(path, encoding="utf-8", errors="replace") as f:
            return _from_text(f.read(), path, imports)
    raise ConfigError(f"config must be a path, a dict, a tripwire.Config or None, not {type(config).__name__}.")


def _from_text(text: str, source: str, imports: bool = True) -> Config:
    from .yamlsource import load_yaml

    data, lines = load_yaml(text, source)
    return _build(data, Checker(source, lines, imports))


# The settings of `writer:` and `evaluation:` that are numbers, and their ranges. The caps keep a value from
# overflowing where it is used (a queue counted in bytes, a timeout passed to a wait) long before it reaches
# what a machine holds or what anyone waits for.
SETTING_RANGES = {
    ("writer", "flush_every_s"): Range(0, 3600, low_open=True, what="seconds"),
    ("writer", "max_queue_mb"): Range(0, 1 << 20, low_open=True, what="MiB"),
    ("writer", "close_timeout_s"): Range(0, 86400, low_open=True, what="seconds"),
    ("evaluation", "poll_s"): Range(0, 3600, low_open=True, what="seconds"),
    ("evaluation", "watcher_timeout_s"): Range(0, 86400, low_open=True, what="seconds"),
    ("evaluation", "rule_budget"): Range(0, 1, low_open=True, what="a share of training time"),
}
SETTING_CHOICES = {
    ("writer", "on_error"): ("warn", "raise", "ignore"),
    ("writer", "on_full"): ("drop", "block"),
    ("evaluation", "where"): ("in_process", "side_process"),
}


TOP_KEYS = ("version", "output", "storage_options", "sampling", "collections", "rules", "evaluation", "writer",
            "workers", "tensorboard", "loggers")
COLLECTION_KEYS = ("include", "exclude", "reductions", "save") + SCHEDULE_KEYS + ("modes",)
RULE_KEYS = ("rule", "name", "params", "actions")


def _build(data: Any, c: Checker) -> Config:
    """Check the whole config, noting every mistake, then raise them all at once or build the Config. A value
    with a mistake is left out and its default stands in while the rest is checked."""
    data = c.section(data, (), TOP_KEYS)
    top: dict = {}
    with c.part():
        top["version"] = c.integer(data.get("version", 1), ("version",))
        if top["version"] != 1:
            c.fail(("version",), f"this tripwire reads config version 1; got {top['version']}.")
    with c.part():
        top["output"] = c.string(data.get("output", "runs/{run_id}"), ("output",))
    top["storage_options"] = dict(c.section(data.get("storage_options"), ("storage_options",),
                                            list(data.get("storage_options") or {})))
    top["sampling"] = _sampling(data.get("sampling"), ("sampling",), c, allow_modes=True)
    raw_collections = c.section(data.get("collections"), ("collections",), list(COLLECTIONS))
    top["collections"] = {name: _collection(name, body, ("collections", name), c)
                          for name, body in raw_collections.items()}
    rules: list = []
    with c.part():
        rules = [spec for spec in c.listing(data.get("rules"), ("rules",), lambda v, p: _rule(v, p, c)) if spec]
    ids = [r.id for r in rules]
    for i, rid in enumerate(ids):
        if rid in ids[:i]:
            c.report(("rules", i), f"rule '{rid}' is listed twice; give one of them its own `name:`.")
    top["rules"] = tuple(rules)
    top["evaluation"] = _settings(EvaluationConfig, data.get("evaluation"), "evaluation", c)
    top["writer"] = _settings(WriterConfig, data.get("writer"), "writer", c)
    with c.part():
        top["workers"] = c.choice(data.get("workers", "zero"), ("workers",), ("zero", "all"))
    top["tensorboard"] = dict(c.section(data.get("tensorboard"), ("tensorboard",), ("dir",)))
    if top["tensorboard"]:
        with c.part():
            c.string(top["tensorboard"].get("dir"), ("tensorboard", "dir"))
    with c.part():
        top["loggers"] = c.boolean(data.get("loggers", True), ("loggers",))
    c.done()
    config = Config(**top, source=c.source, left_out=tuple(c.left_out),
                    output_set="output" in data and not c.source.endswith("(packaged default)"))
    clock = any(spec.create().idle for spec in rules)  # judged by the clock: needs no capture
    if not plan_collections(config) and not c.left_out and not clock:
        raise c.error((), "this config captures nothing: it has no collections and no rules. Add a rule (e.g. "
                          "`rules: [{rule: exploding_tensor}]`) or a collection (e.g. `collections: {losses: {}}`).")
    return config


def _settings(cls, value, section: str, c: Checker):
    """`writer:` or `evaluation:` as its dataclass: each key checked as SETTING_RANGES or SETTING_CHOICES say
    (the others are true/false); a key with a mistake keeps its default."""
    raw = c.section(value, (section,), [f.name for f in fields(cls)])
    out = {}
    for key, given in raw.items():
        path = (section, key)
        with c.part():
            out[key] = (c.number(given, path, SETTING_RANGES[path]) if path in SETTING_RANGES else
                        c.choice(given, path, SETTING_CHOICES[path]) if path in SETTING_CHOICES else
                        c.boolean(given, path))
    return cls(**out)


def _sampling(value, path, c: Checker, allow_modes: bool) -> dict:
    keys = SCHEDULE_KEYS + (("modes",) if allow_modes else ())
    raw = c.section(value, path, keys)
    out: dict = {}
    for key in ("every", "start", "end"):
        if key in raw:
            with c.part():
                out[key] = c.integer(raw[key], path + (key,), minimum=0, optional=key == "end")
    if "steps" in raw:
        with c.part():
            out["steps"] = sorted(set(c.listing(raw["steps"], path + ("steps",),
                                                lambda v, p: c.integer(v, p, minimum=0))))
    if "start" in out and out.get("end") is not None and out["end"] <= out["start"]:
        c.report(path + ("end",), f"end ({out['end']}) must be after start ({out['start']}); end is exclusive.")
    if allow_modes and "modes" in raw:
        modes = c.section(raw["modes"], path + ("modes",), MODES)
        out["modes"] = {m: _sampling(v, path + ("modes", m), c, allow_modes=False) for m, v in modes.items()}
    return out


def _collection(name: str, body: Any, path: tuple, c: Checker) -> dict:
    raw = c.section(body, path, COLLECTION_KEYS)
    out = _sampling({k: raw[k] for k in raw if k in SCHEDULE_KEYS + ("modes",)}, path, c, allow_modes=True)
    for key in ("include", "exclude"):
        if key in raw:
            with c.part():
                out[key] = c.listing(raw[key], path + (key,), c.regex)
    if "reductions" in raw:
        with c.part():
            if name in SCALAR_COLLECTIONS:
                c.fail(path + ("reductions",), f"'{name}' holds scalars, stored as '{VALUE}'; reductions do not "
                                               "apply. Remove this key.")
            out["reductions"] = c.listing(raw["reductions"], path + ("reductions",),
                                          lambda v, p: c.choice(v, p, tuple(REDUCTIONS)))
    if "save" in raw:
        with c.part():
            out["save"] = c.choice(raw["save"], path + ("save",), ("reductions", "tensors"))
    return out


def _rule(value: Any, path: tuple, c: Checker) -> RuleSpec | None:
    """One entry of `rules:`; its parameters are checked against the rule's defaults (their kind) and ranges."""
    from .rules.base import ParamError
    from .rules.registry import RuleLoadError, rule_class, rule_names

    if isinstance(value, str):
        value = {"rule": value}
    raw = c.mapping(value, path, RULE_KEYS)
    c.needs(raw, value, "rule", path, "each entry of `rules:` needs `rule:` (a built-in name or module:Class).")
    ref = c.string(raw["rule"], path + ("rule",))
    if ":" in ref and not c.imports:
        c.left_out.append(ref)
        return None
    try:
        cls = rule_class(ref)
    except RuleLoadError as exc:
        c.fail(path + ("rule",), str(exc) + ("" if ":" in ref else did_you_mean(ref, rule_names())))
    rule_id = ref
    with c.part():
        rule_id = c.string(raw.get("name", ref), path + ("name",))
    defaults, ranges = cls.parameters(), cls.ranges()
    given_params, params = c.section(raw.get("params"), path + ("params",), list(defaults)), {}
    for key, given in given_params.items():
        with c.part():
            default = defaults[key]
            if default is not None and not _same_kind(given, default):
                c.fail(path + ("params", key), f"expected {_kind(default)} like the default {default!r}; "
                                               f"got {shown(given)}.")
            if isinstance(given, (int, float)) and not isinstance(given, bool):
                c.within(given, path + ("params", key), ranges.get(key, ANY))
            params[key] = given
    missing = [key for key in cls.required_parameters() if given_params.get(key) in (None, "")]
    for key in missing:
        c.report(path + ("params", key), f"rule {ref} needs `{key}` in its params: it has no default"
                 + (f" (e.g. `params: {{{key}: ...}}`; `tripwire rules {ref}` describes it)." if ":" not in ref
                    else "."))
    if not missing and len(params) == len(given_params):
        try:
            cls(**params)
        except ParamError as exc:  # each problem at its own key and line
            for key, message in exc.problems:
                c.report(path + ("params",) + tuple(key), message)
        except (TypeError, ValueError) as exc:
            c.report(path + ("params",), f"rule {ref} does not accept these params: {exc}")
    actions = ()
    with c.part():
        actions = tuple(c.listing(raw.get("actions", ["log"]), path + ("actions",), lambda v, p: _action(v, p, c)))
    return RuleSpec(rule=ref, id=rule_id, params=params, actions=actions, line=c.lines.get(path))


def _same_kind(given, default) -> bool:
    if isinstance(default, bool):
        return isinstance(given, bool)
    if isinstance(default, (int, float)):
        return isinstance(given, (int, float)) and not isinstance(given, bool) and (
            isinstance(default, float) or isinstance(given, int))
    if isinstance(default, (list, tuple)):
        return isinstance(given, (list, tuple))
    return isinstance(given, type(default))


def _kind(default) -> str:
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string", list: "a list",
            tuple: "a list", dict: "a mapping"}.get(type(default), type(default).__name__)


def _action(value: Any, path: tuple, c: Checker) -> ActionSpec:
    if isinstance(value, dict) and len(value) == 1 and next(iter(value)) in ENDING_ACTIONS:
        name, severity = next(iter(value.items()))
        c.choice(severity, path + (name,), SEVERITIES)
        return ActionSpec(name, severity=severity)
    if isinstance(value, dict):
        raw = c.mapping(value, path, ("call", *ENDING_ACTIONS))
        c.needs(raw, value, "call", path, "an action written as a mapping is `{call: module:function}`, or "
                                          "`{stop: SEVERITY}` or `{raise: SEVERITY}` alone.")
        target = c.string(raw.get("call"), path + ("call",))
        module_name, _, attr = target.partition(":")
        if not module_name.strip() or not attr.strip():
            c.fail(path + ("call",), f"'{target}' must be 'module:function'.")
        if c.imports:
            _check_call(target, path + ("call",), c)
        return ActionSpec("call", target)
    name = c.choice(value, path, tuple(a for a in ACTIONS if a != "call"))
    return ActionSpec(name)


def _check_call(target: str, path: tuple, c: Checker) -> None:
    """The module a `call:` action names imports and holds a callable of that name: found now, not when the rule
    fires hours into training. Only the module the user's own config names is imported."""
    import importlib

    module_name, _, attr = target.partition(":")
    try:
        module, failure = importlib.import_module(module_name), None
    except Exception as exc:  # noqa: BLE001 - any failure to import is the config's problem to report
        module, failure = None, f"{type(exc).__name__}: {exc}"
    if module is None:
        c.fail(path, f"cannot import module '{module_name}' for action call '{target}': {failure}. Is it on the "
                     "Python path of the training process?")
    function = getattr(module, attr, None)
    if function is None:
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n]))
        c.fail(path, f"module '{module_name}' has no '{attr}' for action call '{target}'."
               + did_you_mean(attr, public))
    if not callable(function):
        c.fail(path, f"'{target}' is a {type(function).__name__}, not a function: a `call:` action calls it with "
                     "the verdict.")
