"""A user's own rules and action target, as a project would keep them (imported by name from configs)."""

import json
import os
from dataclasses import dataclass

from tripwire import Requirement, Rule


@dataclass
class LossAbove(Rule):
    """The training loss above a level."""

    threshold: float = 1.0

    name = "loss_above"
    condition = "losses/train above `threshold`"
    hint = "Train longer or fix the model."

    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        value = run.tensor("losses/train").reduction(step)
        if value > self.threshold:
            return self.fire(step, f"loss {value:.3f} > {self.threshold}", loss=value)
        return None


class Broken(Rule):
    """A rule with a bug: it raises at its second evaluation and would at every later one.
    `Broken.evaluations` counts the evaluations in this process."""

    name = "broken"
    evaluations = 0

    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        Broken.evaluations += 1
        if Broken.evaluations >= 2:
            raise ZeroDivisionError("bug in a user rule")
        return None


def record(verdict):
    """An action target: appends the verdict to the file named by TRIPWIRE_TEST_CALLS."""
    with open(os.environ["TRIPWIRE_TEST_CALLS"], "a") as f:
        f.write(json.dumps(verdict.to_dict()) + "\n")


@dataclass
class OnRank(Rule):
    """Fires from round `start` on, and only in the process of XGBoost collective rank `rank`: a decision that
    one worker of a distributed training makes alone (every other worker's data looks fine to its rules)."""

    rank: int = 1
    start: int = 2

    name = "on_rank"
    severity = "error"  # a decision to stop: `stop` acts on errors
    condition = "the evaluating process is collective rank `rank` and the step is at least `start`"
    hint = "A test rule."

    def requires(self):
        return [Requirement("metrics")]

    def check(self, run, step):
        from xgboost import collective

        rank = collective.get_rank()
        if rank == self.rank and step >= self.start:
            return self.fire(step, f"rank {rank} decided at step {step}", rank=rank)
        return None


@dataclass
class LossSteps(Rule):
    """Fires once, at step `at`, saying the steps of losses/train it was handed: what a rule reads in-process."""

    at: int = 0

    name = "loss_steps"
    history = 64  # samples kept for it in memory
    condition = "the step is `at`"
    hint = "A test rule."

    def requires(self):
        return [Requirement("losses")]

    def check(self, run, step):
        if step == self.at:
            return self.fire(step, "steps " + " ".join(map(str, run.tensor("losses/train").steps())))
        return None


class FailingLossStream(Rule):
    """A rule of one's own that judges every step's loss, and whose look at it fails from the 5th loss on."""

    name = "failing_loss_stream"
    condition = "never fires"
    hint = "-"

    def requires(self):
        return [Requirement("losses")]

    def stream(self):
        class Stream:
            seen = 0

            def see(self, step, value):
                self.seen += 1
                if self.seen >= 5:
                    raise RuntimeError("this rule's stream broke")
                return None

        return Stream()

    def check(self, run, step):
        return None
