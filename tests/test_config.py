"""Config loading and validation: every mistake names file, line, key, what is allowed."""

import itertools
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tripwire
from tripwire import ConfigError


def write(tmp_path, text, name="rules.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_packaged_default_loads_and_plans_rule_requirements():
    cfg = tripwire.load_config(None)
    assert cfg.source.startswith("rules.yaml")
    ids = [r.id for r in cfg.rules]
    assert "exploding_tensor" in ids and "vanishing_gradient" in ids
    plan = cfg.plan()
    # rules turn on what they need: gradients with abs_mean for vanishing_gradient, relu activations for dead_relu
    assert "abs_mean" in plan.collections["gradients"].reductions
    assert "dead_fraction" in plan.collections["activations"].reductions
    assert plan.collections["activations"].include == ("relu", "tanh", "sigmoid")  # dead_relu + saturation
    # every tensor collection gets nonfinite_count from exploding_tensor; losses are scalars
    assert "nonfinite_count" in plan.collections["gradients"].reductions
    assert plan.collections["losses"].reductions == ("value",)


def test_reductions_a_rule_reads_in_a_window_of_steps_are_taken_only_there():
    # poor_weight_initialization reads the weights' std and variance in the first steps only
    plan = tripwire.load_config({"rules": [{"rule": "poor_weight_initialization", "params": {"steps": 3}},
                                           {"rule": "all_zero", "params": {"collections": ["gradients"]}},
                                           "exploding_tensor"]}).plan()
    at = lambda step: {c.name: c.reductions for c in plan.at("train", step)}  # noqa: E731
    # a step sampled only for the window takes the window's reductions, and the NaN count every sampled step
    # needs (without it exploding_tensor would have nothing but the window's reductions to judge)
    assert at(2) == {"weights": ("std", "var", "nonfinite_count")}
    assert at(0)["weights"] == ("std", "var", "nonfinite_count")
    assert at(0)["gradients"] == ("zero_fraction", "nonfinite_count")
    assert at(3) == {}  # past the window, and not a step of the schedule
    assert at(100) == {"losses": ("value",), "gradients": ("zero_fraction", "nonfinite_count")}
    assert plan.at("train", 1)[0] is plan.at("train", 2)[0]  # the step's plan is made once, not per step


def test_default_rules_yaml_is_the_packaged_file():
    from importlib import resources
    from pathlib import Path

    packaged = resources.files("tripwire").joinpath("rules.yaml").read_text()
    assert packaged == (Path(__file__).parents[1] / "rules.yaml").read_text()


def test_unknown_key_names_file_line_key_and_suggestion(tmp_path):
    path = write(tmp_path, """\
        version: 1
        sampling:
          evry: 10
        rules: [exploding_tensor]
        """)
    with pytest.raises(ConfigError) as err:
        tripwire.load_config(path)
    message = str(err.value)
    assert f"{path}:3" in message
    assert "sampling.evry" in message
    assert "Allowed here: every, start, end, steps, modes" in message
    assert "Did you mean 'every'?" in message
    assert err.value.line == 3 and err.value.key == "sampling.evry"


def test_wrong_type(tmp_path):
    path = write(tmp_path, """\
        rules: [exploding_tensor]
        writer:
          flush_every_s: soon
        """)
    with pytest.raises(ConfigError, match=r"rules.yaml:3: writer.flush_every_s: expected a number; got str 'soon'"):
        tripwire.load_config(path)


def test_unknown_rule_suggests_the_closest(tmp_path):
    path = write(tmp_path, """\
        rules:
          - rule: exploding_tensors
        """)
    with pytest.raises(ConfigError) as err:
        tripwire.load_config(path)
    assert "rules[0].rule" in str(err.value) and ":2:" in str(err.value)
    assert "Did you mean 'exploding_tensor'?" in str(err.value)


@pytest.mark.parametrize("ref", [":", "custom_rules:", ":LargeGradient", ".relative:Rule", "no_such_module:Rule"])
def test_custom_rule_that_names_nothing_importable(ref):
    with pytest.raises(ConfigError, match=r"rules\[0\]\.rule") as err:
        tripwire.load_config({"rules": [{"rule": ref}]})
    assert "module:ClassName" in str(err.value) or "cannot import" in str(err.value)


def test_unknown_rule_parameter(tmp_path):
    path = write(tmp_path, """\
        rules:
          - rule: vanishing_gradient
            params: {treshold: 1.0e-5}
        """)
    with pytest.raises(ConfigError, match=r":3: rules\[0\].params.treshold: unknown key 'treshold'.*threshold"):
        tripwire.load_config(path)


def test_rule_parameter_of_wrong_type(tmp_path):
    path = write(tmp_path, "rules:\n  - rule: dead_relu\n    params: {threshold_layer: lots}\n")
    with pytest.raises(ConfigError, match=r"threshold_layer: expected a number like the default 70.0"):
        tripwire.load_config(path)


def test_malformed_yaml_gives_line(tmp_path):
    path = write(tmp_path, "rules: [exploding_tensor\nsampling: {every: 3}\n")
    with pytest.raises(ConfigError, match=r"rules.yaml:2: malformed YAML"):
        tripwire.load_config(path)


def test_unknown_collection_and_reduction(tmp_path):
    with pytest.raises(ConfigError, match=r"collections.gradient: unknown key 'gradient'.*Did you mean 'gradients'"):
        tripwire.load_config({"collections": {"gradient": {}}})
    with pytest.raises(ConfigError, match=r"collections.weights.reductions\[1\]: 'median' is not allowed"):
        tripwire.load_config({"collections": {"weights": {"reductions": ["mean", "median"]}}})


def test_config_that_captures_nothing_is_refused():
    with pytest.raises(ConfigError, match="captures nothing"):
        tripwire.load_config({"version": 1})


def test_missing_file():
    with pytest.raises(ConfigError, match="no config file at 'nope.yaml'"):
        tripwire.load_config("nope.yaml")


def test_invalid_regex_and_bad_action():
    with pytest.raises(ConfigError, match=r"include\[0\]: '\(' is not a valid regular expression"):
        tripwire.load_config({"collections": {"weights": {"include": ["("]}}})
    with pytest.raises(ConfigError, match=r"actions\[0\]: 'halt' is not allowed.*stop"):
        tripwire.load_config({"rules": [{"rule": "exploding_tensor", "actions": ["halt"]}]})


def test_duplicate_rule_needs_a_name():
    with pytest.raises(ConfigError, match="listed twice"):
        tripwire.load_config({"rules": ["dead_relu", "dead_relu"]})
    cfg = tripwire.load_config({"rules": ["dead_relu", {"rule": "dead_relu", "name": "dead_relu_strict",
                                                        "params": {"threshold_layer": 10}}]})
    assert [r.id for r in cfg.rules] == ["dead_relu", "dead_relu_strict"]


def test_to_dict_round_trips():
    cfg = tripwire.load_config(None)
    again = tripwire.load_config(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()
    assert [r.actions for r in again.rules] == [r.actions for r in cfg.rules]


def test_sampling_resolution_per_mode_and_collection():
    cfg = tripwire.load_config({
        "sampling": {"every": 100, "modes": {"eval": {"every": 5}}},
        "collections": {"losses": {"every": 10}, "weights": {"steps": [7], "modes": {"train": {"start": 50}}}},
    })
    plan = cfg.plan()
    losses, weights = plan.collections["losses"], plan.collections["weights"]
    assert losses.sampled("train", 30) and not losses.sampled("train", 35)
    assert losses.sampled("eval", 20) and not losses.sampled("eval", 25)  # collection every wins over mode
    assert weights.sampled("train", 7) and weights.sampled("train", 150) and not weights.sampled("train", 100)
    assert weights.sampled("eval", 15)  # eval falls back to sampling.modes.eval


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 400), min_size=1, max_size=60), st.booleans())
def test_the_plan_asked_step_by_step_answers_as_each_collection_would(jumps, monotonic):
    """plan.at keeps each collection's next sampled step between calls; whatever steps the loop asks for
    (one by one, skipping ahead, repeating a step as gradient accumulation does, or starting again), it
    answers what each collection's schedule and windows say."""
    plan = tripwire.load_config({
        "sampling": {"every": 7, "start": 3},
        "collections": {"losses": {"every": 2}, "weights": {"steps": [5, 6, 90], "every": 50, "end": 300}},
        "rules": [{"rule": "poor_weight_initialization", "params": {"steps": 4}}],
    }).plan()
    steps = [*itertools.accumulate(j % 9 for j in jumps)] if monotonic else jumps
    for step in steps:
        expected = {c.name for c in plan.collections.values() if c.sampled("train", step)}
        assert {c.name for c in plan.at("train", step)} == expected, step


def test_eval_is_sampled_every_time_by_default():
    plan = tripwire.load_config({"collections": {"metrics": {}}}).plan()
    assert all(plan.collections["metrics"].sampled("eval", s) for s in (3, 47, 101))


def test_yaml_bomb_and_huge_file_are_refused(tmp_path):
    bomb = "a: &a [x,x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdef", "bcdefg"))
    with pytest.raises(ConfigError, match="expands to more than"):
        tripwire.load_config(write(tmp_path, bomb))
    with pytest.raises(ConfigError, match="a config may hold at most"):
        tripwire.load_config(write(tmp_path, "# " + "x" * 2_000_000 + "\n", "big.yaml"))


def test_python_tags_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="unsupported YAML tag"):
        tripwire.load_config(write(tmp_path, "output: !!python/object/apply:os.system ['true']\n"))


@pytest.mark.parametrize("depth", [2_000, 100_000])
@pytest.mark.parametrize("style", ["flow", "mapping", "block"])
def test_deep_nesting_is_refused_before_anything_is_built(tmp_path, depth, style):
    # PyYAML recurses once per level: 2,000 raised RecursionError and 100,000 overflowed the C stack
    text = {"flow": "collections:\n  a: " + "[" * depth + "]" * depth + "\n",
            "mapping": "collections:\n  a: " + "{a: " * depth + "1" + "}" * depth + "\n",
            "block": "collections:\n  a:\n    " + "- " * depth + "x\n"}[style]
    with pytest.raises(ConfigError, match=r"rules\.yaml:\d+: .*nested more than 64 levels.*at most 64"):
        tripwire.load_config(write(tmp_path, text))


def test_nesting_stacked_through_aliases_is_refused(tmp_path):
    # each anchor nests the previous one 40 levels deeper: the text is shallow, the document is not
    text = "".join(f"x{i}: &x{i} " + "[" * 40 + (f"*x{i - 1}" if i else "1") + "]" * 40 + "\n" for i in range(30))
    with pytest.raises(ConfigError, match=r"rules\.yaml:\d+: .*nested more than 64 levels"):
        tripwire.load_config(write(tmp_path, text))


def test_nesting_up_to_the_limit_is_read(tmp_path):
    from tripwire.core.yamlsource import MAX_DEPTH, load_yaml

    data, _ = load_yaml("a: " + "[" * (MAX_DEPTH - 1) + "1" + "]" * (MAX_DEPTH - 1) + "\n", "x.yaml")
    for _ in range(MAX_DEPTH):  # the mapping, then 63 lists
        (data,) = data if isinstance(data, list) else data.values()
    assert data == 1


def test_every_mistake_is_reported_at_once_in_line_order(tmp_path):
    """Four mistakes in four places: one error lists them all, each with its line and key; checking goes on past
    an unknown key (dropped), a value of the wrong type, an unknown rule and a number out of range."""
    path = write(tmp_path, """\
        version: 1
        writer:
          max_queue_mb: .inf
        sampling:
          evry: 10
        rules:
          - rule: exploding_tensors
          - rule: exploding_gradient
            params: {ratio_threshold: -1}
        loggers: sometimes
        """)
    with pytest.raises(ConfigError) as err:
        tripwire.load_config(path)
    error = err.value
    assert [(p.line, p.key) for p in error.problems] == [
        (3, "writer.max_queue_mb"), (5, "sampling.evry"), (7, "rules[0].rule"),
        (9, "rules[1].params.ratio_threshold"), (10, "loggers")]
    lines = str(error).splitlines()
    assert lines[0] == f"{path}: 5 mistakes; fix them all before loading it again:"
    assert lines[1:] == [f"  {p}" for p in error.problems]
    assert "Did you mean 'every'?" in lines[2] and "Did you mean 'exploding_tensor'?" in lines[3]
    assert lines[4].endswith("`ratio_threshold` must be greater than 0; found -1.")
    assert (error.line, error.key, error.source) == (3, "writer.max_queue_mb", str(path))  # the first mistake's


def test_one_mistake_is_one_problem(tmp_path):
    with pytest.raises(ConfigError) as err:
        tripwire.load_config({"rules": ["exploding_tensor"], "writer": {"on_full": "wait"}})
    assert err.value.problems == (err.value,) and err.value.key == "writer.on_full"
    assert str(err.value).startswith("<dict>: writer.on_full: 'wait' is not allowed")


def test_a_dict_config_reports_its_mistakes_in_the_order_written():
    with pytest.raises(ConfigError) as err:
        tripwire.load_config({"rules": [{"rule": "dead_relu", "params": {"patience": 0, "threshold_layer": -5}}],
                              "sampling": {"every": "often"}, "workers": "some"})
    assert [p.key for p in err.value.problems] == ["sampling.every", "rules[0].params.patience",
                                                   "rules[0].params.threshold_layer", "workers"]


@pytest.mark.parametrize("text, value", [(".inf", "inf"), ("-.inf", "-inf"), (".nan", "nan"), (".NaN", "nan")])
@pytest.mark.parametrize("key", ["writer:\n  max_queue_mb", "evaluation:\n  watcher_timeout_s",
                                 "rules:\n  - rule: dead_relu\n    params:\n      threshold_layer",
                                 "rules:\n  - rule: custom_rules:LossAbove\n    params:\n      threshold"],
                         ids=["writer", "evaluation", "built-in rule", "custom rule"])
def test_infinite_and_nan_numbers_are_refused(tmp_path, key, text, value):
    """`.inf` passed validation and raised OverflowError in the writer's constructor; NaN compares false with
    every bound."""
    body = ("rules: [exploding_tensor]\n" if not key.startswith("rules") else "") + f"{key}: {text}\n"
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as err:
        tripwire.load_config(path)
    assert f"must be a finite number; got {value} ({text.lower()} in YAML)" in str(err.value)
    assert err.value.line == body.count("\n") and len(err.value.problems) == 1


@pytest.mark.parametrize("section, key, value, valid", [
    ("writer", "max_queue_mb", 0, "greater than 0 and at most 1,048,576 (MiB)"),
    ("writer", "max_queue_mb", 2_000_000, "greater than 0 and at most 1,048,576 (MiB)"),
    ("writer", "max_queue_mb", 10**400, "greater than 0 and at most 1,048,576 (MiB)"),  # beyond any float
    ("writer", "flush_every_s", -1, "greater than 0 and at most 3,600 (seconds)"),
    ("writer", "close_timeout_s", 1e12, "greater than 0 and at most 86,400 (seconds)"),
    ("evaluation", "poll_s", 0.0, "greater than 0 and at most 3,600 (seconds)"),
    ("evaluation", "watcher_timeout_s", 100_000, "greater than 0 and at most 86,400 (seconds)"),
    ("evaluation", "rule_budget", 1.5, "greater than 0 and at most 1 (a share of training time)"),
])
def test_writer_and_evaluation_settings_are_range_checked(section, key, value, valid):
    with pytest.raises(ConfigError) as err:
        tripwire.load_config({"rules": ["exploding_tensor"], section: {key: value}})
    assert str(err.value) == f"<dict>: {section}.{key}: `{key}` must be {valid}; found {value}."


def test_settings_at_the_ends_of_their_ranges_load():
    config = tripwire.load_config({"rules": ["exploding_tensor"], "evaluation": {"rule_budget": 1},
                                   "writer": {"max_queue_mb": 1 << 20, "close_timeout_s": 86400}})
    assert config.evaluation.rule_budget == 1.0 and config.writer.max_queue_mb == 1 << 20


def test_readme_lists_the_settings_ranges():
    from pathlib import Path

    from tripwire.core.config import SETTING_RANGES

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for (section, key), valid in SETTING_RANGES.items():
        assert f"| `{section}.{key}` | {valid} |" in readme


@pytest.mark.parametrize("text, line, column", [
    ("rules: [exploding_tensor]\nsampling:\n\tevery: 3\n", 3, 1),
    ("rules: [exploding_tensor]\nsampling:\n  every: 3\n\tstart: 2\n", 4, 1),
    ("rules:\n  - rule: dead_relu\n  \tparams: {patience: 2}\n", 3, 3),
    ("rules:\n\t- exploding_tensor\n", 2, 1),
], ids=["mapping", "after spaces", "within spaces", "list"])
def test_a_tab_used_to_indent_is_named(tmp_path, text, line, column):
    with pytest.raises(ConfigError) as err:
        tripwire.load_config(write(tmp_path, text))
    assert f"a tab at line {line}, column {column}: YAML indents with spaces, not tabs" in str(err.value)
    assert err.value.line == line and "cannot start any token" not in str(err.value)


def test_tabs_where_yaml_allows_them_load(tmp_path):
    config = tripwire.load_config(write(tmp_path, "rules:\t[exploding_tensor,\n\tdead_relu]\noutput:\truns/x\n"))
    assert [r.rule for r in config.rules] == ["exploding_tensor", "dead_relu"] and config.output == "runs/x"
