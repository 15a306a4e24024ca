"""The read API with several workers: `worker=` everywhere, and following a live run cheaply."""

import threading

import pytest

import helpers
import tripwire
from tripwire.core.recorder import Recorder

CONFIG = {"collections": {"losses": {}}, "writer": {"flush_every_s": 0.05},
          "rules": [{"rule": "exploding_tensor", "params": {"collections": ["losses"]}}]}


@pytest.fixture
def two_workers(tmp_path):
    """A live run written by two real Recorders (ranks 0 and 1), as under DDP with `workers: all`."""
    url = str(tmp_path / "run")
    recorders = [Recorder(CONFIG, run_url=url, framework="test", worker=w, world_size=2) for w in (0, 1)]
    for r in recorders:
        r.start()
    yield url, recorders
    for r in recorders:
        r.finish()


def loss(value):
    return {"losses/train": {"value": value}}


class Counting:
    """Counts the calls the run makes on its store, per method and folder."""

    def __init__(self, store):
        self._store, self.calls = store, {}
        self._lock = threading.Lock()

    def __getattr__(self, name):
        method = getattr(self._store, name)
        if name not in ("list", "get", "get_json", "exists"):
            return method

        def counted(rel, *args, **kwargs):
            with self._lock:
                key = (name.removesuffix("_json"), rel.split("/")[0])  # a JSON object is one GET too
                self.calls[key] = self.calls.get(key, 0) + 1
            return method(rel, *args, **kwargs)

        return counted


def test_worker_is_accepted_everywhere(two_workers):
    url, (rank0, rank1) = two_workers
    for step in range(4):
        rank0.record(step, "train", loss(1.0))
        rank1.record(step, "train", {**loss(float("nan") if step == 3 else 1.0), "custom/probe": {"value": 2.0}})
    rank0.record(3, "eval", {"metrics/val_loss": {"value": 0.5}})
    run = tripwire.open_run(url)
    assert run.wait_for_step(3, worker=0, timeout=60) and run.wait_for_step(3, worker=1, timeout=60)
    helpers.wait_until(lambda: run.refresh() or "eval" in run.modes(worker=0))
    assert run.workers() == [0, 1]
    assert run.modes(worker=0) == ["eval", "train"] and run.modes(worker=1) == ["train"] and \
        run.modes() == ["eval", "train"]
    assert run.collections(worker=0) == ["losses", "metrics"] and run.collections(worker=1) == ["custom", "losses"]
    assert run.collections() == ["custom", "losses", "metrics"]
    helpers.wait_until(lambda: run.verdicts(worker=1))
    assert [(v.rule, v.step) for v in run.verdicts(worker=1)] == [("exploding_tensor", 3)]
    assert run.verdicts(worker=0) == [] and [v.worker for v in run.verdicts()] == [1]
    assert run.at(3, worker=1).verdicts(worker=1)[0].step == 3 and run.at(2, worker=1).verdicts(worker=1) == []
    assert run.tensor("custom/probe").series(worker=1)[0].tolist() == [0, 1, 2, 3]


def test_wait_for_step_of_one_worker(two_workers):
    url, (rank0, rank1) = two_workers
    for step in range(6):
        rank0.record(step, "train", loss(1.0))
    for step in range(3):
        rank1.record(step, "train", loss(1.0))
    run = tripwire.open_run(url)
    assert run.wait_for_step(5, timeout=60)  # any worker: rank 0 has it
    assert run.wait_for_step(2, worker=1, timeout=60)
    assert not run.wait_for_step(5, worker=1, timeout=0.3)  # rank 1 has not got there
    rank1.record(5, "train", loss(1.0))
    assert run.wait_for_step(5, worker=1, timeout=60)
    assert run.steps(worker=1) == [0, 1, 2, 5]


def test_wait_for_step_is_cheap_while_nothing_arrives(two_workers):
    url, (rank0, rank1) = two_workers
    rank0.record(0, "train", loss(1.0))
    run = tripwire.open_run(url)
    assert run.wait_for_step(0, timeout=60)
    run.store = counting = Counting(run.store)
    assert not run.wait_for_step(99, timeout=1.5)
    calls = counting.calls
    # the status (a listing of status/ and one GET per worker) is read once in 1.5 s, not every round
    assert calls.get(("list", "status"), 0) == 1 and calls.get(("get", "status"), 0) == 2, calls
    # one listing of shards/ per round, the rounds backing off from 0.05 s: a handful, not dozens
    assert 1 <= calls.get(("list", "shards"), 0) <= 12, calls
    assert not calls.get(("list", "index")) and not calls.get(("get", "shards")), calls


def test_wait_for_step_returns_once_the_run_ended_without_it(tmp_path):
    url = str(tmp_path / "run")
    recorder = Recorder(CONFIG, run_url=url, framework="test")
    recorder.start()
    recorder.record(0, "train", loss(1.0))
    run = tripwire.open_run(url)
    recorder.finish()
    assert run.wait_for_step(0, timeout=None)  # the data written before the end is seen
    assert not run.wait_for_step(99, timeout=None)  # ended: no wait for ever

