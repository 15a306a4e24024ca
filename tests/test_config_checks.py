"""Config mistakes found when the config is loaded, before any training: a `call:` action that names nothing
callable, a rule without a required parameter. And the default rules.yaml, which names every built-in rule."""

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import tripwire
from tripwire import ConfigError, Requirement, Rule
from tripwire.core.ranges import SHARE, Range
from tripwire.plugins.lightning import TripwireCallback

ROOT = Path(__file__).parents[1]


def write(tmp_path, text):
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    return str(path)


def test_call_action_whose_module_does_not_import_fails_at_load(tmp_path):
    path = write(tmp_path, "rules:\n  - rule: dead_relu\n    actions:\n      - log\n      - call: no_mod:f\n")
    with pytest.raises(ConfigError, match=r"rules.yaml:5: rules\[0\]\.actions\[1\]\.call: cannot import module "
                                          r"'no_mod' for action call 'no_mod:f': ModuleNotFoundError"):
        tripwire.load_config(path)
    with pytest.raises(ConfigError, match="cannot import module 'no_mod'"):  # the callback: before training
        TripwireCallback(path, out_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("target, error", [
    ("custom_rules:recrod", r"module 'custom_rules' has no 'recrod' for action call 'custom_rules:recrod'\..*"
                            r"Did you mean 'record'"),
    ("custom_rules:json", r"'custom_rules:json' is a module, not a function"),
    ("custom_rules:", r"'custom_rules:' must be 'module:function'"),
    ("no_colon", r"'no_colon' must be 'module:function'"),
])
def test_call_action_must_name_a_function(tmp_path, target, error):
    path = write(tmp_path, f"rules:\n  - rule: dead_relu\n    actions: [{{call: '{target}'}}]\n")
    with pytest.raises(ConfigError, match=r"rules.yaml:3: rules\[0\]\.actions\[0\]\.call: " + error):
        tripwire.load_config(path)


def test_call_action_to_a_function_loads(tmp_path):
    config = tripwire.load_config({"rules": [{"rule": "dead_relu", "actions": [{"call": "custom_rules:record"}]}]})
    assert config.rules[0].actions[0].target == "custom_rules:record"


def test_a_config_read_back_from_a_run_is_not_imported_for_its_call_actions():
    """`tripwire check`/`watch` never run actions: a run's stored config loads where its modules are missing."""
    stored = {"rules": [{"rule": "dead_relu", "actions": [{"call": "no_mod:f"}]}]}
    config = tripwire.load_config(stored, imports=False)
    assert config.rules[0].actions[0].target == "no_mod:f" and "no_mod" not in sys.modules


def test_similar_across_runs_without_reference_fails_at_load(tmp_path):
    path = write(tmp_path, "version: 1\nrules:\n  - rule: similar_across_runs\n    params: {atol: 0.001}\n")
    with pytest.raises(ConfigError, match=r"rules.yaml:4: rules\[0\]\.params\.reference: rule similar_across_runs "
                                          r"needs `reference` in its params: it has no default"):
        tripwire.load_config(path)
    with pytest.raises(ConfigError, match=r"rules\[0\]\.params\.reference: rule similar_across_runs needs"):
        TripwireCallback({"rules": [{"rule": "similar_across_runs", "params": {"reference": ""}}]})
    config = tripwire.load_config({"rules": [{"rule": "similar_across_runs", "params": {"reference": "runs/a"}}]})
    assert config.rules[0].params == {"reference": "runs/a"}


@dataclass
class NeedsLimit(Rule):
    """A user's rule with a parameter that has no default."""

    limit: float
    window: int = 3

    name = "needs_limit"

    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        return None


def test_custom_rule_parameter_without_default_is_required_at_load():
    ref = f"{__name__}:NeedsLimit"
    assert NeedsLimit.required_parameters() == ["limit"]
    with pytest.raises(ConfigError, match=rf"rules\[0\]\.params\.limit: rule {ref} needs `limit` in its params: it "
                                          "has no default"):
        tripwire.load_config({"rules": [{"rule": ref, "params": {"window": 5}}]})
    assert tripwire.load_config({"rules": [{"rule": ref, "params": {"limit": 1.0}}]}).rules[0].params == {"limit": 1.0}


def test_required_parameters_are_marked_in_the_docs():
    out = subprocess.run([sys.executable, "-m", "tripwire", "rules", "similar_across_runs"], capture_output=True,
                         text=True, timeout=60)
    assert "  reference = '' (required)" in out.stdout
    assert "| `reference` | required |" in (ROOT / "docs" / "rules.md").read_text()


def test_rules_lists_every_rule_with_its_parameters_defaults_condition_and_hint():
    from tripwire.core.rules.registry import builtin_rules

    out = subprocess.run([sys.executable, "-m", "tripwire", "rules"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    flat = " ".join(out.stdout.split())  # the listing wraps long lines
    sections = [re.sub(r"^\[[^]]*\] ", "", s) for s in re.split(r"\n\n(?=\S)", out.stdout.strip())]
    assert [s.split(" — ")[0] for s in sections[:-1]] == list(builtin_rules())
    for name, cls in builtin_rules().items():
        (section,) = [" ".join(s.split()) for s in sections if s.startswith(f"{name} — ")]
        assert f"condition: {' '.join(cls.condition.split())}" in section, name
        assert f"hint: {' '.join(cls.hint.split())}" in section, name
        for param, default in cls.parameters().items():
            assert f"{param} = {default!r}" in section, (name, param)
    assert "threshold = 1e-07" in flat and "ratio_threshold = 70.0, max_norm = 1000.0" in flat


def test_default_rules_yaml_names_every_rule_and_its_commented_rules_load():
    """README says rules.yaml enables some rules and documents the others, commented out: every built-in rule is
    there, and uncommenting an entry gives a config that loads."""
    from tripwire.core.rules.registry import rule_names

    text = (ROOT / "rules.yaml").read_text()
    enabled = [r.rule for r in tripwire.load_config(None).rules]
    commented = re.findall(r"^  # - rule: (\w+)", text, re.M)
    assert sorted(enabled + commented) == sorted(rule_names())
    assert {"tree_depth", "feature_importance_overweight", "confusion", "overtraining"} <= set(commented)
    entries = re.findall(r"^  # (- rule: \w+.*\n(?:  #   .*\n)*)", text, re.M)
    assert len(entries) == len(commented)
    for entry in entries:
        body = re.sub(r"^  #   ", "    ", entry, flags=re.M)
        config = tripwire.load_config("rules:\n  " + body)
        assert config.rules[0].rule in commented
    readme = (ROOT / "README.md").read_text()
    for name in commented:
        assert f"`{name}`" in readme.split("documents the others")[1].split("\n\n")[0], name


@pytest.mark.parametrize("rule, param, value, valid", [
    ("exploding_gradient", "ratio_threshold", -1, "greater than 0"),
    ("dead_relu", "threshold_layer", 150, "between 0 and 100 (a percentage)"),
    ("all_zero", "threshold", -0.5, "between 0 and 100 (a percentage)"),
    ("feature_importance_overweight", "threshold", 1.5, "between 0 and 1 (a share)"),
    ("vanishing_gradient", "patience", 0, "at least 1"),
    ("unchanged_tensor", "num_steps", 1, "at least 2 (samples: one has nothing to compare with)"),
    ("tensor_variance", "min_threshold", -0.001, "at least 0"),  # no declared range: at least 0, as its default
    ("stalled_training", "threshold_s", 0, "greater than 0"),
])
def test_rule_parameters_out_of_range_are_refused_with_the_range(tmp_path, rule, param, value, valid):
    path = write(tmp_path, f"rules:\n  - rule: {rule}\n    params:\n      {param}: {value}\n")
    with pytest.raises(ConfigError) as err:
        tripwire.load_config(path)
    assert str(err.value) == f"{path}:4: rules[0].params.{param}: `{param}` must be {valid}; found {value}."


def test_rule_parameters_at_the_ends_of_their_ranges_load():
    rules = [{"rule": "dead_relu", "params": {"threshold_layer": 100, "patience": 1}},
             {"rule": "all_zero", "params": {"threshold": 0}},
             {"rule": "feature_importance_overweight", "params": {"threshold": 1.0, "leak_share": 0}},
             {"rule": "class_imbalance", "params": {"binary_threshold": -2.5}}]  # logits: any number
    assert [r.params for r in tripwire.load_config({"rules": rules}).rules] == [r["params"] for r in rules]


def test_every_numeric_parameter_of_every_rule_has_a_range_that_holds_its_default():
    from tripwire.core.rules.registry import builtin_rules

    for name, cls in builtin_rules().items():
        numeric = {k for k, v in cls.parameters().items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        assert set(cls.ranges()) == numeric, name
        for param, valid in cls.ranges().items():
            assert cls.parameters()[param] in valid, (name, param)


@dataclass
class Share(Rule):
    """A user's rule whose parameters take the default ranges, one declared range, and one inherited."""

    share: float = 0.5
    offset: float = -1.0
    count: int = 2

    name = "share"
    limits = {"share": SHARE}

    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        return None


@dataclass
class StrictShare(Share):
    limits = {"count": Range(2, 10, what="samples")}


def test_a_rule_of_ones_own_declares_ranges_and_its_subclasses_add_to_them():
    assert {k: str(v) for k, v in StrictShare.ranges().items()} == {
        "share": "between 0 and 1 (a share)", "offset": "any finite number", "count": "between 2 and 10 (samples)"}
    assert str(Share.ranges()["count"]) == "at least 0"
    ref = f"{__name__}:StrictShare"
    with pytest.raises(ConfigError) as err:
        tripwire.load_config({"rules": [{"rule": ref, "params": {"share": 2, "offset": -50.0, "count": 11}}]})
    assert [p.key for p in err.value.problems] == ["rules[0].params.share", "rules[0].params.count"]
    assert tripwire.load_config({"rules": [{"rule": ref, "params": {"offset": -50.0}}]}).rules[0].params == \
        {"offset": -50.0}


def test_rules_name_shows_each_parameter_range():
    out = subprocess.run([sys.executable, "-m", "tripwire", "rules", "dead_relu"], capture_output=True, text=True,
                         timeout=60)
    assert "  threshold_layer = 70.0; between 0 and 100 (a percentage)\n  patience = 3; at least 1\n" in out.stdout
    docs = (ROOT / "docs" / "rules.md").read_text()
    assert "| `threshold_layer` | `70.0` | between 0 and 100 (a percentage) |" in docs
    assert "| `reference` | required |  |" in docs
