"""Rule documentation, written from the rule classes themselves: `tripwire rules NAME` and docs/rules.md.

One source: a rule's docstring (what it detects), `condition`, parameters,
`requires()`, `hint` and `source`, and each rule's record on the zoo
(`make zoo` writes it to benchmarks/results/zoo.json). Regenerate the docs with
`python -m tripwire.core.rulesdoc --zoo benchmarks/results/zoo.json > docs/rules.md`;
a test keeps them in step.
"""

from __future__ import annotations

import inspect

INTRO = """\
# Rules

Generated from the rule classes by `python -m tripwire.core.rulesdoc`; `tripwire rules NAME` prints the same.

A rule reads captured data and returns a verdict when its condition holds. Each rule declares what it
requires; enabling it in the config turns that capture on (collections, reductions, full tensors, extra
steps). Rules are evaluated at the sampled steps of the modes they look at, in the training process
(`evaluation: {where: in_process}`) or by `tripwire watch` (`side_process`), through the same engine. A rule
reports each of its findings (a tensor, a side of a threshold, a severity) once per worker, at the first step
it holds, and at most 20 findings. Every verdict has a severity: `error` (the run is broken), `warning`
(likely a problem) or `info` (worth a look); `stop` and `raise` act on errors unless the config says
`{stop: warning}`. A rule that never saw the data it requires, or found it is not the kind it judges (a
regressor's targets for a classifier's rule), reports `no_data` when the run ends; a rule that raises reports
`error` once and is disabled, while training goes on.

Rules judge a parameter by its role in the model's structure, which every plugin records when training starts
(`run.info["model"]`): weight rules judge kernels (dense, convolution, recurrent and attention weights), not
normalisation scales, embedding tables, biases or frozen layers. Each rule below ends with its record on the
zoo (benchmarks/zoo: realistic healthy and faulty setups in Lightning, plain PyTorch, Keras on three backends
and XGBoost), with every rule on: the healthy runs it fired on at warning or error, and the faults it caught.

Configure a rule in the `rules:` list of the config:

```yaml
rules:
  - rule: vanishing_gradient
    params: {threshold: 1.0e-7}
    actions: [log, stop]          # log, stop, checkpoint, report, raise, {call: module:function}
  - rule: my_project.rules:LargeGradient     # a rule of your own (see the end of this page)
    params: {threshold: 20}
```

Each numeric parameter has a range of valid values, shown beside its default below; loading a config refuses a
value outside it (or a `.inf` / `.nan`), and reports every mistake of the config at once, each with its line.
"""

CUSTOM = """\
## Rules of your own

A rule is a subclass of `tripwire.Rule`; a dataclass is the shortest way to give it parameters, which the
config's `params:` are checked against. `requires()` declares the data (and so turns its capture on);
`check(run, step)` reads the run as of `step` through the same API as `tripwire.open_run` and returns
`self.fire(step, message, **evidence)` (or a list of them, one per finding) or None. A verdict is a warning
unless the class says `severity = "error"` (or `fire(..., severity=...)` does): set it to `error` where your
rule's `stop` should act. A config's value for a numeric parameter must be at least 0 where the default is; a
class attribute `limits` gives a parameter another range (a `Range`, or `PERCENT`, `SHARE`, `COUNT`, `POSITIVE`,
from `tripwire.core.ranges`).

```python
from dataclasses import dataclass

from tripwire import Requirement, Rule
from tripwire.core.ranges import POSITIVE


@dataclass
class LargeGradient(Rule):
    \"\"\"A gradient whose largest element is too large.\"\"\"

    threshold: float = 10.0

    name = "large_gradient"
    limits = {"threshold": POSITIVE}
    condition = "abs_max of any gradient above `threshold`"
    hint = "Clip gradients or lower the learning rate."

    def requires(self):
        return [Requirement("gradients", ("abs_max",))]

    def check(self, run, step):
        for name in run.tensor_names("gradients"):
            value = run.tensor(name).reduction(step, "abs_max")
            if value > self.threshold:
                return self.fire(step, f"{name} reached {value:.3g}", tensor=name, value=value)
        return None
```

Name it in the config as `rule: my_project.rules:LargeGradient`. The module is imported only because your
own config names it; nothing stored in a run is imported or executed (`tripwire check` and `watch` leave
out the custom rules a run's stored config names, unless you pass `--trust-run` for a run of your own).
"""


def requirement_lines(rule) -> list[str]:
    from .naming import SCALAR_COLLECTIONS

    lines = []
    for req in rule.requires():
        what = "every tensor collection captured" if req.collection == "*" else f"`{req.collection}`"
        parts = [f"reductions {', '.join(req.reductions)}" if req.reductions else "",
                 "full tensors" if req.save_tensors else "",
                 f"layers matching {', '.join(req.include)}" if req.include else "",
                 "" if not req.steps else f"at steps {req.steps[0]}..{req.steps[-1]} too (sampled for it)"
                 if req.collection in SCALAR_COLLECTIONS else f"at steps {req.steps[0]}..{req.steps[-1]} only "
                 "(sampled for it)",
                 "where the framework has it" if req.optional else ""]
        lines.append(what + "".join(f"; {p}" for p in parts if p))
    return lines


def _nothing(cls) -> str:
    """What a rule that requires nothing at its defaults reads: what its required parameters name, or nothing."""
    return "what its required parameters name" if cls.required_parameters() else "nothing captured"


def _evaluated(cls) -> str:
    if cls.idle:
        return "by the clock (tripwire watch, and the training process's writer thread)"
    return "at sampled " + " and ".join(cls.modes) + " steps"


def describe(cls) -> str:
    """A rule as plain text, for `tripwire rules NAME`."""
    rule = cls()
    out = [cls.rule_name(), "", inspect.getdoc(cls) or "", "", f"condition: {cls.condition}", "", "parameters:"]
    required, ranges = cls.required_parameters(), cls.ranges()
    out += [f"  {k} = {v!r}" + (" (required)" if k in required else "") + (f"; {ranges[k]}" if k in ranges else "")
            for k, v in cls.parameters().items()] or ["  (none)"]
    out += ["", "requires:"] + [f"  {line}" for line in requirement_lines(rule) or [_nothing(cls)]] + \
        [f"  evaluated {_evaluated(cls)}"]
    out += ["", f"hint: {cls.hint}", "", f"source: {cls.source}"]
    return "\n".join(out)


def summary(cls, width: int = 100) -> str:
    """A rule in a few lines, for the `tripwire rules` listing: what it detects, its condition, its parameters
    with their defaults, and its hint."""
    import textwrap

    def block(label: str, text: str) -> str:
        return textwrap.fill(text, width, initial_indent=f"  {label}: ", subsequent_indent="    ",
                             break_on_hyphens=False, break_long_words=False)

    required = cls.required_parameters()
    params = ", ".join(f"{k} = {v!r}" + (" (required)" if k in required else "")
                       for k, v in cls.parameters().items()) or "(none)"
    first = (inspect.getdoc(cls) or "").splitlines()[0] if inspect.getdoc(cls) else ""
    return "\n".join([f"{cls.rule_name()} — {first}", block("condition", cls.condition),
                      block("parameters", params), block("hint", cls.hint)])


def zoo_record(rule: str, zoo: dict | None) -> str:
    """A rule's record on the zoo, as a sentence, from `make zoo`'s benchmarks/results/zoo.json."""
    entry = (zoo or {}).get("rules", {}).get(rule)
    if entry is None:
        return "Not measured on the zoo (it needs parameters of your own)." if zoo else "Not measured yet."
    alarms = entry["false_alarms"]
    text = (f"False alarms: {len(alarms)} of {entry['healthy_runs']} healthy runs" +
            (f" ({', '.join(alarms)})" if alarms else "") + ".")
    if entry["named"]:
        others = len(entry["named"]) - len(entry["fired"]) - len(entry["missed"])
        text += (f" Fired on {len(entry['fired'])} of the {len(entry['named'])} faults it is named for" +
                 (f"; {others} of the others were caught by another rule named for them" if others else "") +
                 (f"; missed by every rule: {', '.join(entry['missed'])}" if entry["missed"] else "") + ".")
    if entry["also_fired_on"]:
        text += f" Also fired on faults other rules are named for: {', '.join(entry['also_fired_on'])}."
    return text


def markdown(zoo: dict | None = None) -> str:
    """docs/rules.md; `zoo`: each rule's record on the zoo (benchmarks/results/zoo.json)."""
    from .rules.registry import builtin_rules

    sections = [INTRO]
    for name, cls in builtin_rules().items():
        rule = cls()
        required, ranges = cls.required_parameters(), cls.ranges()
        params = "\n".join(f"| `{k}` | " + ("required" if k in required else f"`{v!r}`") + f" | {ranges.get(k, '')} |"
                           for k, v in cls.parameters().items())
        sections.append("\n".join([
            f"## {name}", "", inspect.getdoc(cls) or "", "",
            f"**Condition.** {cls.condition}.".replace("..", "."), "",
            "**Parameters.**", "",
            "| parameter | default | valid values |\n|---|---|---|\n" + params if params else "None.", "",
            "**Requires.** " + "; ".join(requirement_lines(rule) or [_nothing(cls)]) +
            f". Evaluated {_evaluated(cls)}.", "",
            f"**Hint.** {cls.hint}", "",
            f"**Source.** {cls.source}", "",
            f"**On the zoo.** {zoo_record(name, zoo)}", ""]))
    sections.append(causal_links())
    sections.append(CUSTOM)
    return "\n".join(sections)


def causal_links() -> str:
    """The diagnosis's causal links (tripwire.core.diagnosis.CAUSES) as a table."""
    from .diagnosis import CAUSES

    rows = "\n".join(f"| `{kind}` | {cause.title} | {', '.join(f'`{s}`' for s in cause.explains) or '-'} |"
                     for kind, cause in CAUSES.items())
    return "\n".join([
        "## Diagnosis: one root cause per fault", "",
        "A fault shows as several verdicts; `tripwire check`, `show`, the report, the demo and the end of a training "
        "print one diagnosis per root cause: the verdict that explains the others (the primary cause, with a fix "
        "that names the layer and the value), the step it began, and the verdicts it explains. A verdict of a kind "
        "below explains verdicts of the kinds listed beside it that began no earlier (a rule that waits for several "
        "samples dates its finding from the first of them); at the same step, the kind listed first leads. A kind "
        "is a rule, or `rule:side` where its findings differ in meaning. The verdicts stay available underneath "
        "(`run.verdicts()`).", "",
        "| verdict | cause | explains |", "|---|---|---|", rows, ""])


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m tripwire.core.rulesdoc", description="docs/rules.md")
    parser.add_argument("--zoo", help="each rule's record on the zoo: benchmarks/results/zoo.json")
    args = parser.parse_args()
    print(markdown(json.loads(open(args.zoo).read()) if args.zoo else None), end="")
