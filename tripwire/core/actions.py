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


def agree(decision: Decision | None, rank: int, reduce_max, broadcast) -> tuple:
    """What every rank of a distributed training does after a step, from each rank's own decision: (stop,
    checkpoint, raise_for, fired_rank). Every rank calls this at the same steps, with the framework's
    collectives: `reduce_max(ints)` (MAX over ranks, element-wise) and `broadcast(obj, src)`.

    One reduction over [stop, checkpoint, raising rank + 1]: a stop on any rank stops all; a checkpoint asked on
    any rank is made by all (the frameworks' checkpoints are themselves collective); a `raise` on any rank raises
    on every rank, with the verdict broadcast from the rank that fired (fired_rank says which; a rank that fired
    too raises its own verdict), so no rank waits for the others."""
    raise_for = decision.raise_for if decision is not None else None
    flags = reduce_max([int(bool(decision and decision.stop)), int(bool(decision and decision.checkpoint)),
                        0 if raise_for is None else rank + 1])
    fired_rank = None
    if flags[2]:
        fired_rank = int(flags[2]) - 1
        shared = broadcast(raise_for.to_dict() if raise_for is not None and rank == fired_rank else None, fired_rank)
        if raise_for is not None:
            fired_rank = rank
        else:
            from .verdict import Verdict

            raise_for = Verdict.from_dict(shared)
    return bool(flags[0]), bool(flags[1]), raise_for, fired_rank


LOG_LEVELS = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO}


def apply(verdict, actions, write_report, cause=None, stopping: bool = False) -> Decision:
    """Run a fired verdict's actions that act on its severity; `write_report()` writes the run's report.

    cause: the earlier verdict whose diagnosis this one joins (tripwire.core.diagnosis), if any: the log names it
    instead of repeating a hint.
    stopping: training is already stopping (an earlier verdict's stop, whose checkpoint is written): a verdict that
    fires while the framework winds down (its last validation) is logged, and stops or checkpoints nothing again."""
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
        elif action.name in ("stop", "checkpoint") and stopping:
            continue
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
