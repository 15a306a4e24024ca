"""What a zoo case is: a realistic training setup, healthy or with one real fault, that tripwire is attached to.

A case trains one model on packaged or synthetic data and says whether it
learned. The harness (`harness.py`) hands it an `Attach`, through which the
case puts tripwire on its training exactly as a user would (a callback in
`Trainer(callbacks=…)` or `model.fit(callbacks=…)`, a probe around a plain
loop), with the config and folder the harness chose. `attach` is None when the
harness trains the case without tripwire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


SILENT = ("silent",)  # the tag of a silent bug: the run trains, the loss goes down a little, no number goes bad


@dataclass(frozen=True)
class Outcome:
    """What a training run achieved. `learned`: the case's own target was reached (asserted on healthy cases)."""

    learned: bool
    score: str  # e.g. "val_accuracy 0.97 (target 0.90)"
    steps: int  # optimizer steps (boosting rounds for XGBoost) that ran


@dataclass(frozen=True)
class Case:
    """One zoo setup.

    train(attach, long) trains it, with tripwire attached through `attach` (or without, for attach None), and
    returns its Outcome; `long` asks for the longer version `make zoo` runs.
    fault: what is wrong, in a few words; "" for a healthy case.
    catch: the rules that name this fault; a verdict of any of them at warning or error is a detection.
    cause: the rules whose verdict, as the primary cause of the first diagnosis (tripwire.core.diagnosis), names
        this fault; `catch` where not given.
    onset: the first step at which the fault is present (0: from the start).
    backends: Keras backends the test suite runs the case on (TensorFlow in process, the others in a subprocess).
    tags: SILENT for a silent bug (the table counts those caught within one step of their onset).
    """

    framework: str  # lightning | torch | keras | xgboost | transformers
    name: str
    train: Callable
    fault: str = ""
    catch: tuple = ()
    cause: tuple = ()
    onset: int = 0
    backends: tuple = ("tensorflow",)
    tags: tuple = field(default=())

    @property
    def healthy(self) -> bool:
        return not self.fault

    @property
    def causes(self) -> tuple:
        return self.cause or self.catch

    @property
    def id(self) -> str:
        return f"{self.framework}/{self.name}"


class Attach:
    """How a case puts tripwire on its training: one of these methods, called once, as a user would."""

    def __init__(self, config, out_dir: str):
        self.config, self.out_dir = config, out_dir
        self.run_url: str | None = None
        self.callback = None

    def lightning(self, pl=None):
        """A TripwireCallback for `pl.Trainer(callbacks=[...])` (either Lightning distribution)."""
        from tripwire.plugins.lightning import TripwireCallback

        return self._keep(TripwireCallback(self.config, out_dir=self.out_dir))

    def keras(self):
        """A TripwireCallback for `model.fit(callbacks=[...])`."""
        from tripwire.plugins.keras import TripwireCallback

        return self._keep(TripwireCallback(self.config, out_dir=self.out_dir))

    def xgboost(self, **kwargs):
        """A TripwireCallback for `xgb.train(callbacks=[...])` or an sklearn estimator's `callbacks=`."""
        from tripwire.plugins.xgboost import TripwireCallback

        return self._keep(TripwireCallback(self.config, out_dir=self.out_dir, **kwargs))

    def transformers(self):
        """A TripwireCallback for `transformers.Trainer(callbacks=[...])`."""
        from tripwire.plugins.transformers import TripwireCallback

        return self._keep(TripwireCallback(self.config, out_dir=self.out_dir))

    def probe(self, model, optimizer):
        """A TripwireProbe for a plain PyTorch loop: use it as a context manager, call `probe.step(loss)`."""
        from tripwire.plugins.torch import TripwireProbe

        return self._keep(TripwireProbe(model, optimizer, self.config, out_dir=self.out_dir))

    def _keep(self, callback):
        self.callback = callback
        self.run_url = callback.run_url or self.out_dir
        return callback


def should_stop(attach: Attach | None, probe) -> bool:
    """In a plain loop: whether the probe asks the loop to stop (False without tripwire)."""
    return attach is not None and probe is not None and probe.should_stop


Train = Callable[[Attach | None, bool], Outcome]
