"""Helpers for users' own test suites: assert that two runs compute the same thing.

A migration or refactor keeps a reference run and checks each new run
against it in CI; the failure message is `tripwire compare`'s report, so it
names the first diverging step and the earliest tensor that differs.
"""

from __future__ import annotations


def assert_runs_equivalent(run_a, run_b, **options):
    """Fail (AssertionError with the comparison's report) unless the runs agree within tolerance at every common
    step and something was compared. `options` are `tripwire.compare`'s: atol, rtol, switch_step, tensors,
    name_map, modes, steps, workers, storage_options. Returns the Comparison."""
    __tracebackhide__ = True  # pytest shows the caller's line, not this one
    from .core.compare import compare

    result = compare(run_a, run_b, **options)
    if not result.equivalent:
        raise AssertionError("the runs are not equivalent\n" + result.report())
    return result
