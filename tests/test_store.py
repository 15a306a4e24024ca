"""The store: writer thread -> shards -> read API, on a local folder and on memory://."""

import json
import threading
import time

import numpy as np
import pytest

import tripwire
from tripwire.core.config import WriterConfig
from tripwire.core.index import write_index
from tripwire.core.recorder import Recorder
from tripwire.core.store import Store, opened_json
from tripwire.core.sample import Sample
from tripwire.core.writer import Writer

CONFIG = {"collections": {"weights": {"save": "tensors", "reductions": ["mean", "l2"]}, "losses": {}},
          "sampling": {"every": 1}, "writer": {"flush_every_s": 0.05}}


@pytest.fixture(params=["local", "memory"])
def url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return f"memory://tripwire-tests/{request.node.name}-{time.monotonic_ns()}"


def record_steps(recorder, steps, mode="train"):
    for step in steps:
        recorder.record(step, mode, {"losses/train": {"value": 1.0 / (step + 1)},
                                     "weights/w": {"mean": float(step), "l2": 2.0 * step}},
                        {"weights/w": np.full((2, 3), step, dtype=np.float32)})


def test_round_trip(url):
    rec = Recorder(CONFIG, run_url=url, framework="test")
    rec.start()
    record_steps(rec, range(0, 50, 5))
    rec.record(40, "eval", {"losses/train": {"value": 9.0}})
    rec.finish()
    run = tripwire.open_run(url)
    assert run.info["status"] == "finished" and run.info["framework"] == "test"
    assert run.steps() == list(range(0, 50, 5)) and run.steps(mode="eval") == [40]
    assert run.modes() == ["eval", "train"] and run.workers() == [0]
    assert run.collections() == ["losses", "weights"]
    assert run.tensor_names(collection="weights") == ["weights/w"]
    assert run.tensor_names(regex="loss") == ["losses/train"]
    steps, values = run.tensor("weights/w").series("l2")
    assert steps.dtype == np.int64 and values.dtype == np.float64
    np.testing.assert_array_equal(steps, np.arange(0, 50, 5))
    np.testing.assert_allclose(values, 2.0 * steps)
    assert run.tensor("losses/train").reduction(10) == pytest.approx(1 / 11)
    assert run.tensor("losses/train").reduction(40, mode="eval") == 9.0
    np.testing.assert_array_equal(run.tensor("weights/w").value(25), np.full((2, 3), 25, dtype=np.float32))


def test_names_at_a_step_in_a_stored_run_and_in_the_history(url):
    from tripwire.core.history import History

    history = History()
    rec = Recorder(CONFIG, run_url=url, framework="test")
    rec.start()
    for step in range(6):
        values = {"losses/train": {"value": 1.0}}
        tensors = {"weights/w": np.zeros(3, dtype=np.float32)} if step % 3 == 0 else {}
        if step % 2 == 0:
            values["weights/w"] = {"mean": 0.0}
        rec.record(step, "train", values, tensors)
        history.add(0, "train", step, values, tensors)
    rec.finish()
    for view in (tripwire.open_run(url), history):
        assert view.tensor_names(step=4) == ["losses/train", "weights/w"]  # a reduction at 4
        assert view.tensor_names(step=3) == ["losses/train", "weights/w"]  # only the full tensor at 3
        assert view.tensor_names(step=5) == ["losses/train"]
        assert view.tensor_names("weights", step=1) == [] and view.tensor_names(step=9) == []
        assert view.at(5).tensor_names(step=5) == ["losses/train"] and view.at(3).tensor_names(step=4) == []


def test_errors_say_what_exists(url):
    rec = Recorder(CONFIG, run_url=url, framework="test")
    rec.start()
    record_steps(rec, [0, 10, 20])
    rec.finish()
    run = tripwire.open_run(url)
    with pytest.raises(tripwire.TensorUnavailable, match="no tensor 'weights/v'.*Did you mean 'weights/w'"):
        run.tensor("weights/v")
    with pytest.raises(tripwire.TensorUnavailable, match="no reduction 'std'.*Captured: l2, mean"):
        run.tensor("weights/w").series("std")
    with pytest.raises(tripwire.StepUnavailable, match="no a value at step 15|no value at step 15|nearest 10, 20"):
        run.tensor("weights/w").reduction(15, "l2")
    with pytest.raises(tripwire.TensorUnavailable, match="no data in mode 'eval'"):
        run.tensor("weights/w").series("l2", mode="eval")
    with pytest.raises(tripwire.RunNotFound, match="no tripwire run at"):
        tripwire.open_run(url + "-missing")


def test_live_refresh_reads_only_new_shards(url):
    rec = Recorder(CONFIG, run_url=url, framework="test")
    rec.start()
    record_steps(rec, range(10))
    time.sleep(0.3)
    run = tripwire.open_run(url)
    assert run.info["status"] == "running"
    first = run.steps()
    assert first and first == list(range(len(first)))
    loaded = set(run._files)
    record_steps(rec, range(10, 20))
    time.sleep(0.3)
    assert run.refresh() >= 10 - (len(first) - 10 if len(first) > 10 else 0)
    assert set(run._files) > loaded
    assert run.steps() == list(range(20))
    assert run.wait_for_step(19, timeout=1)
    assert not run.wait_for_step(25, timeout=0.3)
    rec.finish()
    assert run.info["status"] == "finished"


def test_index_written_at_close_serves_reads(url):
    rec = Recorder(CONFIG, run_url=url, framework="test")
    rec.start()
    for chunk in range(3):
        record_steps(rec, range(chunk * 10, chunk * 10 + 10))
        time.sleep(0.15)
    rec.finish()
    store = Store(url)
    assert len(store.list("shards")) >= 2 and len(store.list("index")) == 1
    run = tripwire.open_run(url)
    assert not run._files.keys() - {f"index/{n}" for n in store.list("index")}  # only the index was read
    np.testing.assert_array_equal(run.tensor("weights/w").series("mean")[0], np.arange(30))
    np.testing.assert_array_equal(run.tensor("weights/w").value(17), np.full((2, 3), 17, dtype=np.float32))


def test_the_index_kept_in_memory_is_the_index_read_back_from_the_shards(url):
    """The writer writes the index at close from what it kept of its shards; the same index built by reading
    every shard back is the same bytes (a step recorded again in a later shard keeps its last values)."""
    rec = Recorder(CONFIG, run_url=url, framework="test")
    rec.start()
    for steps in (range(0, 6), range(4, 9), range(9, 12)):  # steps 4 and 5 twice, in two shards
        record_steps(rec, steps)
        rec.record(steps[-1], "eval", {"metrics/val_loss": {"value": float(steps[-1])}})
        time.sleep(0.15)
    rec.finish()
    store = Store(url)
    (kept,) = store.list("index")
    upto = int(kept.split("-")[1].split(".")[0])
    assert upto >= 2
    from_memory = store.get(f"index/{kept}")
    store.fs.rm_file(store.path(f"index/{kept}"))
    assert not store.list("index")
    write_index(store, 0, upto, final="finished")
    assert store.get(f"index/{kept}") == from_memory


def test_resumed_run_appends(url):
    for steps in (range(0, 10), range(10, 20)):
        rec = Recorder(CONFIG, run_url=url, framework="test", append=steps[0] > 0)
        rec.start()
        record_steps(rec, steps)
        time.sleep(0.1)
        record_steps(rec, [steps[-1]])
        rec.finish()
    run = tripwire.open_run(url)
    assert run.steps() == list(range(20))
    # the second writer's index covers the first writer's shards too: it read them back
    last = sorted(Store(url).list("index"))[-1]
    assert not tripwire.open_run(url)._files.keys() - {f"index/{last}"}


def test_corrupt_and_foreign_files_are_skipped_with_a_warning(tmp_path):
    url = str(tmp_path / "run")
    rec = Recorder(CONFIG, run_url=url, framework="test")
    rec.start()
    record_steps(rec, range(5))
    rec.finish()
    (tmp_path / "run" / "shards" / "00000-00000099.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    (tmp_path / "run" / "shards" / "notes.txt").write_text("hello")
    good = (tmp_path / "run" / "shards" / "00000-00000000.safetensors").read_bytes()
    (tmp_path / "run" / "shards" / "00000-00000098.safetensors").write_bytes(good[: len(good) // 2])
    (tmp_path / "run" / "verdicts").mkdir(exist_ok=True)
    (tmp_path / "run" / "verdicts" / "bad.json").write_text("{not json")
    with pytest.warns(UserWarning, match="skipped"):
        run = tripwire.open_run(url)
        run.verdicts()
    assert run.steps() == list(range(5))
    assert set(run.skipped) == {"shards/00000-00000099.safetensors", "shards/notes.txt",
                                "shards/00000-00000098.safetensors", "verdicts/bad.json"}


def test_shards_are_safetensors_files(tmp_path):
    from safetensors.numpy import load_file

    url = str(tmp_path / "run")
    rec = Recorder(CONFIG, run_url=url, framework="test")
    rec.start()
    record_steps(rec, range(3))
    rec.finish()
    loaded = load_file(str(tmp_path / "run" / "shards" / "00000-00000000.safetensors"))
    assert any(v.shape == (2, 3) for v in loaded.values())


def test_writer_leaves_out_full_tensors_that_do_not_fit_keeps_the_scalars_and_counts_it(tmp_path):
    store = Store(str(tmp_path / "run"))
    gate = threading.Event()
    real_put = store.put

    def slow_put(rel, data):
        gate.wait(5)
        real_put(rel, data)

    store.put = slow_put
    writer = Writer(store, 0, WriterConfig(flush_every_s=0.01, max_queue_mb=1.0))
    big = np.zeros(100_000, dtype=np.float32)  # 400 kB
    kept = [writer.put(Sample(s, "train", {"losses/train": {"value": 1.0 / (s + 1)}}, {"weights/w": big}))
            for s in range(10)]
    assert writer.pending_bytes <= 1 << 20
    assert all(kept) and writer.dropped_steps == 0 and writer.partial_steps >= 7
    # past the bound and its slack even samples of scalars alone are dropped, and counted
    many = {f"metrics/m{i}": {"value": 1.0} for i in range(60_000)}  # ~1 MB each
    dropped = [writer.put(Sample(s, "train", dict(many))) for s in range(10, 16)]
    assert dropped.count(False) >= 1 and writer.dropped_steps == dropped.count(False)
    gate.set()
    assert writer.close()
    status = opened_json((tmp_path / "run" / "status" / "00000.json").read_bytes())
    assert status["state"] == "finished"
    assert (status["partial_steps"], status["dropped_steps"]) == (writer.partial_steps, writer.dropped_steps)
    store.put_json("run.json", {"format_version": 2, "run_id": "run", "framework": "test", "world_size": 1})
    run = tripwire.open_run(str(tmp_path / "run"))
    assert run.tensor("losses/train").steps() == [*range(10)]  # the loss of every step, tensors or not


def test_series_of_10000_steps_reads_fast(tmp_path):
    url = str(tmp_path / "run")
    rec = Recorder({"collections": {"gradients": {"reductions": ["l2"]}}, "sampling": {"every": 1}},
                   run_url=url, framework="test")
    rec.start()
    for step in range(10_000):
        rec.record(step, "train", {f"gradients/layer{i}": {"l2": step * 0.5 + i} for i in range(4)})
    rec.finish()
    start = time.perf_counter()
    steps, values = tripwire.open_run(url).tensor("gradients/layer2").series("l2")
    assert len(steps) == 10_000 and values[-1] == 9999 * 0.5 + 2
    assert time.perf_counter() - start < 2.0  # loose here; `make bench` measures it (target 0.1 s)


# -- reading corrupt, crafted and foreign files: every check happens before anything of a file is visible ------------

def three_shard_run(path):
    """A finished run with shards 0, 1, 2 (steps 0-9, 10-19, 20-29) and an index over them."""
    import helpers

    rec = Recorder(CONFIG, run_url=str(path), framework="test")
    rec.start()
    for chunk in range(3):
        record_steps(rec, range(chunk * 10, chunk * 10 + 10))
        helpers.wait_until(lambda: rec.writer.shards_written == chunk + 1)
    rec.finish()
    assert sorted(p.name for p in (path / "index").iterdir()) == ["00000-00000002.safetensors"]
    return path


def rewrite_header(path, change):
    """Rewrite a shard's (or index's) JSON header in place: change(header, meta) edits both; the data is kept."""
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    meta = json.loads(header["__metadata__"]["tripwire"])
    change(header, meta)
    header["__metadata__"]["tripwire"] = json.dumps(meta)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + blob[8 + n:])


@pytest.mark.parametrize("where", ["../../../outside.safetensors", "/etc/passwd", "shards/../../run.json",
                                   "shards/00000-00000001.safetensors/../../../x", "s3://bucket/x.safetensors",
                                   "shards/00001-00000001.safetensors", "shards/00000-00000007.safetensors"])
def test_an_index_pointing_outside_its_shards_is_skipped_and_the_shards_serve(tmp_path, where):
    run_dir = three_shard_run(tmp_path / "run")
    (tmp_path / "outside.safetensors").write_bytes((run_dir / "shards" / "00000-00000000.safetensors").read_bytes())

    def point_elsewhere(header, meta):
        meta["tensors"][3][3] = where

    rewrite_header(run_dir / "index" / "00000-00000002.safetensors", point_elsewhere)
    with pytest.warns(UserWarning, match="skipped .*index/00000-00000002.safetensors.*points to"):
        run = tripwire.open_run(str(run_dir))
    assert list(run.skipped) == ["index/00000-00000002.safetensors"]
    assert set(run._files) == {f"shards/00000-0000000{i}.safetensors" for i in range(3)}  # read from the shards
    assert run.steps() == list(range(30))
    np.testing.assert_array_equal(run.tensor("weights/w").value(3), np.full((2, 3), 3, dtype=np.float32))


def corrupt(name):
    """Ways a shard's header can lie, each as change(header, meta)."""
    def steps_as_list(header, meta):
        meta["steps"] = ["m0"]

    def rows_as_list(header, meta):
        meta["rows"] = [10]

    def shape_does_not_match_offsets(header, meta):
        header["m0"]["shape"] = [11]  # the steps entry: 10 int64s on disk

    def series_of_a_missing_entry(header, meta):
        meta["series"][-1][3] = "v999"  # the last series: steps of the file were fine, this is not

    def values_and_steps_differ_in_length(header, meta):
        meta["series"][0][4] = "m0"  # 10 steps
        header["v0"]["shape"], header["v0"]["data_offsets"][1] = [5], header["v0"]["data_offsets"][0] + 40

    def worker_of_another_file(header, meta):
        meta["worker"] = 3

    def step_as_text(header, meta):
        meta["tensors"][0][2] = "7"

    def steps_entry_of_floats(header, meta):
        header["m0"]["dtype"] = "F64"

    return locals()[name]


@pytest.mark.parametrize("how", ["steps_as_list", "rows_as_list", "shape_does_not_match_offsets",
                                 "series_of_a_missing_entry", "values_and_steps_differ_in_length",
                                 "worker_of_another_file", "step_as_text", "steps_entry_of_floats"])
def test_a_shard_that_fails_any_check_is_skipped_whole(tmp_path, how):
    run_dir = three_shard_run(tmp_path / "run")
    for index in (run_dir / "index").iterdir():
        index.unlink()  # read the shards themselves
    rewrite_header(run_dir / "shards" / "00000-00000001.safetensors", corrupt(how))
    with pytest.warns(UserWarning, match="skipped .*shards/00000-00000001.safetensors"):
        run = tripwire.open_run(str(run_dir))
    assert list(run.skipped) == ["shards/00000-00000001.safetensors"]
    expected = [*range(10), *range(20, 30)]  # none of the bad shard's steps leak into any answer
    assert run.steps() == expected
    assert run.tensor("weights/w").series("mean")[0].tolist() == expected
    assert run.tensor("weights/w").steps(tensors=True) == expected
    assert run.tensor("losses/train").series()[0].tolist() == expected


def test_foreign_status_verdicts_and_manifest_are_skipped_or_refused(tmp_path):
    run_dir = three_shard_run(tmp_path / "run")
    (run_dir / "status" / "00001.json").write_text("[1, 2, 3]")
    (run_dir / "status" / "00002.json").write_text(json.dumps({"state": ["running"], "heartbeat": "soon"}))
    (run_dir / "status" / "00003.json").write_text(json.dumps({"state": "running", "lost_steps": "many"}))
    (run_dir / "status" / "notes.json").write_text("{}")
    (run_dir / "verdicts").mkdir(exist_ok=True)
    (run_dir / "verdicts" / "00000-000000000001-x-1.json").write_text("[]")
    (run_dir / "verdicts" / "00000-000000000002-x-2.json").write_text(json.dumps(
        {"rule": "x", "step": "2", "message": "m"}))
    (run_dir / "verdicts" / "00000-000000000003-x-3.json").write_text(json.dumps(
        {"rule": "x", "step": 3, "message": "m", "status": "exploded"}))
    with pytest.warns(UserWarning, match="skipped"):
        run = tripwire.open_run(str(run_dir))
        info = run.info
        assert run.verdicts() == []
    assert info["status"] == "finished" and list(info["workers"]) == [0] and info["lost_steps"] == 0
    assert set(run.skipped) == {"status/00001.json", "status/00002.json", "status/00003.json", "status/notes.json",
                                "verdicts/00000-000000000001-x-1.json", "verdicts/00000-000000000002-x-2.json",
                                "verdicts/00000-000000000003-x-3.json"}
    assert run.steps() == list(range(30))
    for manifest in ("[1, 2]", '"run"', json.dumps({"format_version": "1"})):
        (run_dir / "run.json").write_text(manifest)
        with pytest.raises(tripwire.RunNotFound, match="is not a tripwire manifest"):
            tripwire.open_run(str(run_dir))


def test_show_names_corrupt_truncated_and_foreign_files_and_exits_2_on_damage(tmp_path):
    import subprocess
    import sys

    run_dir = three_shard_run(tmp_path / "run")
    (run_dir / "index" / "00000-00000002.safetensors").unlink()
    (run_dir / "index" / "00000-00000009.safetensors").write_bytes(b"\xff" * 64)  # corrupt
    shard = run_dir / "shards" / "00000-00000002.safetensors"
    shard.write_bytes(shard.read_bytes()[:300])  # truncated
    rewrite_header(run_dir / "shards" / "00000-00000001.safetensors", corrupt("rows_as_list"))  # lies
    (run_dir / "shards" / "README.md").write_text("foreign")
    (run_dir / "shards" / ".tmp-0123abcd").write_bytes(b"half a shard")  # a write in progress: not a shard at all
    (run_dir / "status" / "00001.json").write_text("[1]")
    (run_dir / "verdicts").mkdir(exist_ok=True)
    (run_dir / "verdicts" / "00000-000000000001-x-1.json").write_text("{")
    out = subprocess.run([sys.executable, "-m", "tripwire", "show", str(run_dir)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr  # everything readable is shown, and the run is damaged
    for rel in ("index/00000-00000009.safetensors", "shards/00000-00000002.safetensors",
                "shards/00000-00000001.safetensors", "status/00001.json", "verdicts/00000-000000000001-x-1.json"):
        assert f"damaged    {rel}: " in out.stdout
        assert rel in out.stderr or "…" in out.stderr
    assert "skipped    shards/README.md: not a tripwire file" in out.stdout  # foreign, not damage
    assert "is damaged: 5 file(s)" in out.stderr
    assert ".tmp-" not in out.stdout + out.stderr
    assert "status     finished" in out.stdout and "train: 10 sampled (0..9)" in out.stdout
    healthy = three_shard_run(tmp_path / "healthy")
    out = subprocess.run([sys.executable, "-m", "tripwire", "show", str(healthy)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "damaged" not in out.stdout + out.stderr, out.stderr


def test_put_writes_every_chunk_in_order_through_partial_writes(tmp_path, monkeypatch):
    """A shard is handed to the store as thousands of chunks, written with writev in batches; a system call
    that writes only part of what it was given (allowed by POSIX) is resumed where it stopped."""
    import os

    rng = np.random.default_rng(0)
    chunks = [rng.bytes(int(n)) for n in rng.integers(0, 3000, size=2500)]
    store = Store(str(tmp_path / "run"))
    store.put("whole.bin", chunks)
    real_writev, calls = os.writev, []

    def partial_writev(fd, buffers):
        calls.append(len(buffers))
        return real_writev(fd, [b"".join(bytes(b) for b in buffers)[:1000]])

    monkeypatch.setattr(os, "writev", partial_writev)
    store.put("partial.bin", chunks)
    assert (tmp_path / "run" / "whole.bin").read_bytes() == b"".join(chunks)
    assert (tmp_path / "run" / "partial.bin").read_bytes() == b"".join(chunks)
    assert max(calls) == 1024 and len(calls) > len(b"".join(chunks)) // 1000
