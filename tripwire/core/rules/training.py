"""Rules over the training process itself."""

from __future__ import annotations

from dataclasses import dataclass

from ..ranges import POSITIVE
from .base import Rule


@dataclass
class StalledTraining(Rule):
    """A training process that stopped producing steps (hung data loader, deadlock, a stuck collective)."""

    threshold_s: float = 1800.0

    name = "stalled_training"
    limits = {"threshold_s": POSITIVE}
    modes = ()  # judged by the clock, not at steps: see `idle`
    idle = True
    condition = ("no training step (sampled or not) and no evaluation batch for `threshold_s` seconds while the "
                 "run is running (a long validation is progress); judged by the clock, in tripwire watch (from the "
                 "samples stored) and in the training process's writer thread")
    hint = ("Training stopped making progress: a hung data loader or worker, a deadlock, a stuck distributed "
            "collective (one rank died), or a step far slower than expected. Try: py-spy dump --pid on the "
            "training process, check data-loader workers and every rank's logs, set timeouts on collectives.")
    source = "smdebug StalledTrainingRule: threshold 1800 s."

    def check_idle(self, now: float, last_data: float, step: int):
        if now - last_data > self.threshold_s:
            return self.fire(step, f"no new step for {now - last_data:.0f} s (limit {self.threshold_s:g} s); the "
                                   f"last one captured was step {step}.", seconds=now - last_data)
        return None
