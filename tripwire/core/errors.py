"""The exceptions tripwire raises. Each message says what was asked, what exists, and what to do."""

from __future__ import annotations

import difflib
from typing import Iterable

# The name tripwire is installed under (`import tripwire` is unchanged): "Tripwire" names an existing security
# product.
DISTRIBUTION = "tripwire-training"


def install(extras: str) -> str:
    """The pip command that installs tripwire with the given extras ("lightning,demo"): every hint about a missing
    package names it, so the name is written once."""
    return f"pip install '{DISTRIBUTION}[{extras}]'"


class TripwireError(Exception):
    """Base class of every error tripwire raises on purpose."""


class ConfigError(TripwireError, ValueError):
    """A config that cannot be used. Carries the file, line and key when they are known.

    A config is checked whole: `problems` holds every mistake found, each a ConfigError of its own, in line order,
    so one run shows them all. `source`, `line` and `key` are those of the first."""

    def __init__(self, message: str, *, source: str | None = None, line: int | None = None, key: str | None = None):
        self.source, self.line, self.key = source, line, key
        self.problems: tuple = (self,)
        where = source or "<config>"
        if line is not None:
            where += f":{line}"
        prefix = f"{where}: " + (f"{key}: " if key else "")
        super().__init__(prefix + message)

    @classmethod
    def of(cls, problems: list) -> ConfigError:
        """One error for every mistake of a config (ConfigErrors, in the order to show them)."""
        if len(problems) == 1:
            return problems[0]
        first = problems[0]
        error = cls(f"{len(problems)} mistakes; fix them all before loading it again:\n"
                    + "\n".join(f"  {p}" for p in problems), source=first.source)
        error.line, error.key, error.problems = first.line, first.key, tuple(problems)
        return error


class RunNotFound(TripwireError, FileNotFoundError):
    """No run at the URL given."""


class RunDamaged(TripwireError, ValueError):
    """A file of the run that was changed after it was written (its checksum does not match), cut short or
    removed. The message names the file; `run.skipped` lists every such file found so far."""


class OutsideRun(TripwireError):
    """A path of a run that leads out of the run's folder (a symbolic link): tripwire reads and writes a run's own
    folder only, and says which link it did not follow."""


class TensorUnavailable(TripwireError, LookupError):
    """A tensor (or one of its reductions, modes or workers) that the run does not hold."""


class StepUnavailable(TripwireError, LookupError):
    """A step that a tensor's series does not hold."""


class StorageError(TripwireError, OSError):
    """The run store could not be written (raised in training only under `writer.on_error: raise`)."""


class StoreUnavailable(TripwireError):
    """The run store could not be read or written for longer than the reader retries (`tripwire watch`).

    Deliberately not an OSError: code that skips a file it cannot parse must not mistake an outage of the
    store for a bad file, and a rule must not be disabled because the store did not answer."""


class RuleFired(TripwireError):
    """Raised out of training by the `raise` action; `.verdict` is the verdict that fired.

    Under distributed training every rank raises at the same step: `.rank` is the rank whose rule fired
    (None in a single process)."""

    def __init__(self, verdict, rank: int | None = None):
        self.verdict, self.rank = verdict, rank
        where = f" on rank {rank}" if rank is not None else ""
        super().__init__(f"rule {verdict.rule} fired{where} at step {verdict.step}: {verdict.message}")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' Did you mean 'x'?' for the closest choice, or ''."""
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def listing(items: Iterable[str], limit: int = 12) -> str:
    """A short comma-separated listing of names, with a count of the rest."""
    items = sorted(items)
    if not items:
        return "(none)"
    shown = ", ".join(items[:limit])
    return shown + (f", … ({len(items) - limit} more)" if len(items) > limit else "")
