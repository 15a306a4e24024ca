"""Actions: what happens when a rule fires, the same in every framework.

`log`, `report` and `call` are done here. `stop` and `checkpoint` need the
framework, so they come back to the plugin in a `Decision` (which it may
first agree on across ranks); `raise` is raised by the plugin after them.
`stop` and `raise` act on `error` verdicts unless the config lowers their
severity (`{stop: warning}`): only a broken run is stopped by default.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field

log = logging.getLogger("tripwire")


@dataclass
class Decision:
    """What the plugin must do after a step: stop, write checkpoints for these verdicts, raise for this one."""

    stop: bool = False
    checkpoint: list = field(default_factory=list)
    raise_for: object = None
    verdicts: list = field(default_factory=list)

    def merge(self, other: "Decision") -> "Decision":
        self.stop |= other.stop
        self.checkpoint += other.checkpoint
        self.raise_for = self.raise_for or other.raise_for
        self.verdicts += other.verdicts
        return self

    def raise_if_asked(self) -> None:
        if self.raise_for is not None:
            from .errors import RuleFired

            raise RuleFired(self.raise_for)


LOG_LEVELS = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO}


def apply(verdict, actions, write_report, cause=None) -> Decision:
    """Run a fired verdict's actions that act on its severity; `write_report()` writes the run's report.

    cause: the earlier verdict whose diagnosis this one joins (tripwire.core.diagnosis), if any: the log names it
    instead of repeating a hint."""
    decision = Decision(verdicts=[verdict])
    for action in actions:
        if not action.acts_on(verdict):
            continue
        if action.name == "log":
            text = verdict.describe(with_hint=cause is None)
            if cause is not None:
                text += f" (follows from {cause.rule} at step {cause.step})"
            log.log(LOG_LEVELS[verdict.severity], "tripwire: %s", text)
        elif action.name == "stop" and verdict.mode == "predict":  # predict is outside training and over by now
            log.warning("tripwire: rule %s fired on predictions (step %s); nothing to stop", verdict.rule, verdict.step)
        elif action.name == "stop":
            decision.stop = True
            log.warning("tripwire: stopping training after step %s: rule %s fired (%s)", verdict.step, verdict.rule,
                        verdict.message)
        elif action.name == "checkpoint":
            decision.checkpoint.append(verdict)
        elif action.name == "report":
            write_report()
        elif action.name == "raise":
            decision.raise_for = decision.raise_for or verdict
        elif action.name == "call":
            call(action.target, verdict)
    return decision


def call(target: str, verdict) -> None:
    """Call the user's `module:function` with the verdict; a failure is logged, never raised into training."""
    module_name, _, attr = target.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attr)
        function(verdict)
    except Exception as exc:  # noqa: BLE001 - user code must not take training down
        log.error("tripwire: action call %s failed for rule %s: %s: %s", target, verdict.rule, type(exc).__name__, exc)
