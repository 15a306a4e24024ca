"""Stored data is checked and reading stays inside the run: a flipped bit, a cut or missing file, a crafted name or
header is reported, naming the file, and never read back as data or followed out of its folder."""

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import tripwire
from tripwire.core.errors import TripwireError
from tripwire.core.recorder import Recorder
from tripwire.core.sample import Sample, shard_contents
from tripwire.core.shardfile import encode
from tripwire.core.store import Store, opened_json, sealed_json

pytestmark = pytest.mark.filterwarnings("ignore:tripwire. skipped")

CONFIG = {"collections": {"losses": {}, "weights": {"save": "tensors", "reductions": ["l2", "mean"]}},
          "sampling": {"every": 1}, "rules": [], "writer": {"flush_every_s": 60}}


def recorded(run_dir: Path, steps: int = 12, crashed: bool = False) -> Path:
    """A run of a loss and a weight (full values and two reductions) in shards of three steps each (one per
    session: the run resumed with append=True), and an index; `crashed`: no index, and a status whose writer
    process is gone."""
    rng = np.random.default_rng(0)
    for first in range(0, steps, 3):
        recorder = Recorder(CONFIG, run_url=str(run_dir), framework="test", append=first > 0)
        recorder.start()
        for step in range(first, min(first + 3, steps)):
            w = rng.normal(size=(4, 8)).astype(np.float32)
            recorder.record(step, "train", {"losses/train": {"value": 1.0 / (step + 1)},
                                            "weights/w": {"l2": float(np.linalg.norm(w)), "mean": float(w.mean())}},
                            {"weights/w": w})
        recorder.finish()
    if crashed:
        vanished(run_dir)
    return run_dir


def vanished(run_dir: Path) -> None:
    """Make a finished run look like one whose writer process died: no index, a `running` status of a dead pid."""
    for index in (run_dir / "index").iterdir():
        index.unlink()
    status_file = run_dir / "status" / "00000.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    status = {**opened_json(status_file.read_bytes()), "state": "running", "host": socket.gethostname(),
              "pid": dead.pid}
    status_file.write_bytes(sealed_json(status))


def everything(run_dir: Path):
    """What the read API returns for every series, step and full tensor of the run, plus what it skipped."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = tripwire.open_run(str(run_dir))
        seen = {"steps": run.steps(), "names": run.tensor_names()}
        for name in seen["names"]:
            tensor = run.tensor(name)
            for reduction in tensor.reductions():
                if reduction == run.TENSOR:
                    seen[name] = [(s, tensor.value(s).tolist()) for s in tensor.steps()]
                else:
                    steps, values = tensor.series(reduction)
                    seen[f"{name}:{reduction}"] = (steps.tolist(), values.tolist())
    return seen, run.damaged


@pytest.mark.parametrize("crashed", [False, True], ids=["finished", "crashed"])
def test_no_flipped_bit_reads_back_as_data(tmp_path, crashed):
    """One bit flipped at random in a shard or index, 150 times: every read returns the true values, or the
    file is reported damaged (and left out), or reading says which file is damaged; none is silently wrong."""
    pristine = recorded(tmp_path / "pristine", crashed=crashed)
    truth, damaged = everything(pristine)
    assert not damaged and len(truth["steps"]) == 12
    files = sorted(p.relative_to(pristine) for p in pristine.rglob("*.safetensors"))
    assert any(f.parts[0] == "index" for f in files) != crashed
    rng = random.Random(22)
    silently_wrong, reported = [], 0
    for trial in range(150):
        copy = tmp_path / f"c{trial}"
        shutil.copytree(pristine, copy)
        target = copy / rng.choice(files)
        data = bytearray(target.read_bytes())
        bit = rng.randrange(len(data) * 8)
        data[bit // 8] ^= 1 << (bit % 8)
        target.write_bytes(bytes(data))
        try:
            seen, damaged = everything(copy)
        except TripwireError as exc:  # a damaged file met while reading: said so, naming it
            assert str(target.relative_to(copy)) in str(exc), exc
            reported += 1
        else:
            if seen != truth and str(target.relative_to(copy)) not in damaged:
                silently_wrong.append((str(target.relative_to(copy)), bit))
            reported += bool(damaged)
        shutil.rmtree(copy)
    assert silently_wrong == []
    # the rest flipped a bit nothing reads: the padding of a header, or (finished) a shard's copy of what its
    # index holds, read only for full tensors
    assert reported >= 15


def test_a_flipped_bit_in_a_json_object_is_not_read(tmp_path):
    run_dir = recorded(tmp_path / "run")
    Store(str(run_dir)).put_json("verdicts/00000-000000000003-x-0123456789ab.json", {
        "rule": "x", "step": 3, "message": "m", "status": "fired", "severity": "error"})
    assert [v.rule for v in tripwire.open_run(str(run_dir)).verdicts()] == ["x"]
    for rel in ("verdicts/00000-000000000003-x-0123456789ab.json", "status/00000.json"):
        path = run_dir / rel
        path.write_bytes(path.read_bytes().replace(b'"step": 3', b'"step": 7').replace(b'"finished"', b'"stopped"'))
    with pytest.warns(UserWarning, match="checksum"):
        run = tripwire.open_run(str(run_dir))
        assert run.verdicts() == [] and run.info["status"] != "stopped"


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "tripwire", *args], capture_output=True, text=True, cwd=cwd)


def test_a_cut_or_emptied_shard_is_reported_by_every_verb(tmp_path):
    run_dir = recorded(tmp_path / "run")
    healthy = recorded(tmp_path / "healthy")
    shard = run_dir / "shards" / "00000-00000001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    (run_dir / "shards" / "00000-00000002.safetensors").write_bytes(b"")
    for verb in ("show", "check"):
        out = cli(verb, str(run_dir))
        assert out.returncode == 2, out
        assert "is damaged" in out.stderr and "shards/00000-00000001.safetensors" in out.stderr + out.stdout
        assert "shards/00000-00000002.safetensors" in out.stderr + out.stdout
    for args in (["compare", str(healthy), str(run_dir)], ["export", "tensorboard", str(run_dir), str(tmp_path / "tb")],
                 ["report", str(run_dir), "-o", str(tmp_path / "report.html")]):
        out = cli(*args)
        assert "bug in tripwire" not in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert "shards/00000-00000001.safetensors" in out.stderr, (args, out.stderr)
    run = tripwire.open_run(str(run_dir))
    assert set(run.damaged) == {"shards/00000-00000001.safetensors", "shards/00000-00000002.safetensors"}
    # the index holds a checked copy of every step's reductions; the full tensors of the damaged shards are gone,
    # and reading one says which file is damaged
    assert run.steps() == [*range(12)] and run.tensor("weights/w").series("l2")[0].tolist() == [*range(12)]
    assert run.tensor("weights/w").value(2).shape == (4, 8)
    with pytest.raises(tripwire.RunDamaged, match="shards/00000-00000001.safetensors"):
        run.tensor("weights/w").value(3)  # its bytes are intact, but the file is not


def test_a_deleted_shard_of_a_crashed_run_is_a_reported_gap(tmp_path):
    run_dir = recorded(tmp_path / "run", crashed=True)
    (run_dir / "shards" / "00000-00000001.safetensors").unlink()
    run = tripwire.open_run(str(run_dir))
    assert "missing" in run.damaged["shards/00000-00000001.safetensors"]
    assert cli("show", str(run_dir)).returncode == 2
    # the last shard gone: the status says how many the writer wrote
    (run_dir / "shards" / "00000-00000003.safetensors").unlink()
    assert "shards/00000-00000003.safetensors" in tripwire.open_run(str(run_dir)).damaged


def crafted_shard(path: Path, mode: str) -> None:
    """A shard as an adversary writes it: well formed, checksums right, with a mode of its choosing."""
    entries, meta = shard_contents([Sample(0, mode, {"losses/train": {"value": 1.0}})], 0, int(path.stem[6:]))
    path.write_bytes(b"".join(bytes(c) for c in encode(entries, meta)))


def test_names_taken_from_a_run_never_leave_the_target_folder(tmp_path):
    run_dir = recorded(tmp_path / "run")
    crafted_shard(run_dir / "shards" / "00000-00000099.safetensors", "../../../escaped")
    Store(str(run_dir)).put_json("verdicts/00000-000000000001-x-0123456789ab.json", {
        "rule": "x", "step": 1, "message": "m", "status": "fired", "mode": "../../../escaped2", "worker": 0})
    out = tmp_path / "deep" / "er" / "tb"
    result = cli("export", "tensorboard", str(run_dir), str(out))
    assert "bug in tripwire" not in result.stderr, result.stderr
    written = {p.resolve() for p in tmp_path.rglob("*") if "tfevents" in p.name}
    assert written and all(out.resolve() in p.parents for p in written), written
    assert not list(tmp_path.rglob("escaped*"))


def test_the_watcher_does_not_follow_a_symlinked_folder_out_of_the_run(tmp_path):
    run_dir = recorded(tmp_path / "run")
    shutil.copytree(run_dir, tmp_path / "plain")
    assert cli("watch", str(tmp_path / "plain"), "--ended-after", "1").returncode == 0
    assert (tmp_path / "plain" / "watcher" / "heartbeat.json").exists()  # where the watcher writes, unlinked
    outside = tmp_path / "outside"
    outside.mkdir()
    (run_dir / "watcher").symlink_to(outside, target_is_directory=True)
    result = cli("watch", str(run_dir), "--ended-after", "1")
    assert result.returncode == 0 and list(outside.iterdir()) == [], result.stdout + result.stderr


def test_a_header_over_the_cap_is_refused_unread(tmp_path):
    """Four shards with real 20 MB headers (380,000 entries each; parsed, ~7x their size) and four claiming 200 MiB
    they do not hold: opening the run and listing it stay small, each file named as damaged."""
    run_dir = recorded(tmp_path / "run")
    entry = {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}
    head = json.dumps({"__metadata__": {"tripwire": "{}"}, **{f"e{i}": entry for i in range(380_000)}}).encode()
    head += b" " * (-len(head) % 8)
    assert len(head) > 20_000_000
    for i in range(4):
        (run_dir / "shards" / f"00000-{50 + i:08d}.safetensors").write_bytes(len(head).to_bytes(8, "little") + head)
        (run_dir / "shards" / f"00000-{60 + i:08d}.safetensors").write_bytes((200 << 20).to_bytes(8, "little") + b"{")
    code = ("import sys, warnings, tripwire; warnings.simplefilter('ignore'); "
            "run = tripwire.open_run(sys.argv[1]); from tripwire.core.listing import list_runs; "
            "rows = list_runs(sys.argv[2]); "  # VmHWM: this process's peak (ru_maxrss may hold its parent's)
            "peak = [line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')][0]; "
            "print(len(run.damaged), rows[0]['steps'], peak)")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code, str(run_dir), str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    damaged, steps, peak_kib = result.stdout.split()
    assert damaged == "8" and steps == "12" and int(peak_kib) < 200 * 1024, result.stdout
    assert time.perf_counter() - start < 20


def test_a_final_status_that_could_not_be_written_is_derived_from_the_index(tmp_path):
    run_dir = recorded(tmp_path / "run")
    status_file = run_dir / "status" / "00000.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # the final status never landed: the last one written still says running, from a process now gone
    status = {**opened_json(status_file.read_bytes()), "state": "running", "host": socket.gethostname(),
              "pid": dead.pid}
    status_file.write_bytes(sealed_json(status))
    run = tripwire.open_run(str(run_dir))
    assert run.info["status"] == "finished" and run.steps() == [*range(12)]
    from tripwire.core.listing import list_runs

    (row,) = list_runs(str(tmp_path))
    assert row["status"] == "finished" and row["steps"] == 12
    vanished(run_dir)  # without the index's final marker it is what it looks like: crashed
    assert tripwire.open_run(str(run_dir)).info["status"] == "crashed"


def test_the_final_status_is_retried(tmp_path, monkeypatch):
    from tripwire.core import writer as writer_module

    monkeypatch.setattr(writer_module, "RETRY_DELAYS_S", (0.01,))
    real_put = Store.put_json
    failures = []

    def flaky_status(self, rel, obj):
        if rel.startswith("status/") and obj.get("state") == "finished" and not failures:
            failures.append(rel)
            raise OSError(5, "Input/output error (injected)")
        return real_put(self, rel, obj)

    monkeypatch.setattr(Store, "put_json", flaky_status)
    run_dir = recorded(tmp_path / "run", steps=4)
    assert failures and json.loads((run_dir / "status" / "00000.json").read_text())["state"] == "finished"


def as_format_1(run_dir: Path) -> None:
    """Rewrite a run as tripwire wrote it before checksums: no crc32 in JSON objects, headers or index locations."""
    for path in run_dir.rglob("*.json"):
        obj = json.loads(path.read_text())
        obj.pop("crc32", None)
        if path.name == "run.json":
            obj["format_version"] = 1
        path.write_text(json.dumps(obj))
    for path in run_dir.rglob("*.safetensors"):
        blob = path.read_bytes()
        n = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8:8 + n])
        outer = header["__metadata__"]
        outer.pop("tripwire_crc32")
        meta = json.loads(outer["tripwire"])
        for key in ("crc32", "shards", "final"):  # an index of format 1 had no shard sizes or final state
            meta.pop(key, None)
        meta["format_version"] = 1
        meta["tensors"] = [item[:8] for item in meta["tensors"]]
        outer["tripwire"] = json.dumps(meta)
        head = json.dumps(header).encode()
        head += b" " * (-len(head) % 8)
        path.write_bytes(len(head).to_bytes(8, "little") + head + blob[8 + n:])


@pytest.mark.parametrize("crashed", [False, True], ids=["finished", "crashed"])
def test_a_run_written_before_checksums_still_opens(tmp_path, crashed):
    truth, _ = everything(recorded(tmp_path / "new", crashed=crashed))
    old = recorded(tmp_path / "old", crashed=crashed)
    as_format_1(old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped, nothing said
        run = tripwire.open_run(str(old))
        assert run.info["format_version"] == 1 and run.info["status"] == ("crashed" if crashed else "finished")
    assert everything(old) == (truth, {})

