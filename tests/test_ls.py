"""`tripwire ls` (and `tripwire report ROOT`): the runs under a root, on a local folder and on a real S3 server on
loopback."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tripwire.core.listing import list_runs
from tripwire.core.recorder import Recorder

CONFIG = {"rules": [{"rule": "exploding_tensor", "actions": ["stop"]}, "overfit"], "collections": {"losses": {}},
          "sampling": {"every": 1}, "writer": {"flush_every_s": 0.05}}


def make_run(url, last_step, nan_at=None, storage_options=None, every=1, pause=0.0, finish=True):
    """A short run of steps 0, every, 2*every, … last_step; a NaN loss at `nan_at` fires exploding_tensor; overfit
    never gets its data (no_data). `pause` seconds between steps makes one shard per step or so."""
    rec = Recorder(CONFIG, run_url=url, framework="test", storage_options=storage_options)
    rec.start()
    for step in range(0, last_step + 1, every):
        rec.record(step, "train", {"losses/train": {"value": float("nan") if step == nan_at else 1 / (step + 1)}})
        time.sleep(pause)
    if not finish:
        return rec
    rec.finish("stopped" if nan_at is not None else "finished")
    return url


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tripwire", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def check_rows(rows):
    assert [r["name"] for r in rows] == ["healthy", "group/faulty"]  # oldest first; found two levels down
    healthy, faulty = rows
    assert healthy["framework"] == "test" and healthy["status"] == "finished" and healthy["last_step"] == 7
    assert healthy["steps"] == 8 and healthy["steps_by_mode"] == {"train": 8} and faulty["steps"] == 4
    assert healthy["verdicts"] == 0 and healthy["no_data"] == 1 and healthy["error"] is None
    assert faulty["status"] == "stopped" and faulty["last_step"] == 3 and faulty["verdicts"] == 1
    assert healthy["created"] < faulty["created"] and healthy["run_id"] == "healthy"


def test_ls_local_folder(tmp_path):
    make_run(str(tmp_path / "healthy"), 7)
    make_run(str(tmp_path / "group" / "faulty"), 3, nan_at=3)
    (tmp_path / "not-a-run" / "deeper").mkdir(parents=True)
    rows = list_runs(str(tmp_path))
    check_rows(rows)
    assert rows[0]["url"] == str(tmp_path / "healthy")

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "run.json").write_text("{not json")
    out = cli("ls", str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:6] == ["run", "framework", "steps", "last", "step", "status"]
    assert any(line.split()[:5] == ["healthy", "test", "8", "7", "finished"] for line in lines)
    assert any(line.startswith("group/faulty") and "stopped" in line and line.endswith(" 1 (+1 no data)")
               for line in lines)
    assert any(line.startswith("healthy") and "(+1 no data)" in line for line in lines)
    assert any(line.split()[:4] == ["broken", "?", "-", "-"] and "unreadable" in line for line in lines)
    as_json = json.loads(cli("ls", str(tmp_path), "--json").stdout)
    assert {r["name"] for r in as_json} == {"healthy", "group/faulty", "broken"}
    missing = cli("ls", str(tmp_path / "nothing"))  # a path that is not there is an error, as in `ls`
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    (tmp_path / "empty").mkdir()
    assert cli("ls", str(tmp_path / "empty")).stdout.startswith("no runs under")


def test_a_run_itself_is_listed_as_one_row(tmp_path):
    make_run(str(tmp_path / "only"), 2)
    (row,) = list_runs(str(tmp_path / "only"))
    assert row["name"] == "." and row["last_step"] == 2 and row["steps"] == 3


def test_runs_at_any_depth_with_their_step_counts(tmp_path):
    deep = tmp_path / "a" / "b" / "c" / "d" / "e"
    make_run(str(deep / "sparse"), 20, every=5)  # steps 0, 5, 10, 15, 20: 5 steps, the last 20
    many = make_run(str(tmp_path / "x" / "many"), 5, pause=0.12)  # a shard per step or so, and an index
    assert len(list(Path(many, "shards").iterdir())) > 1 and list(Path(many, "index").iterdir())
    rec = Recorder(CONFIG, run_url=str(tmp_path / "x" / "modes"), framework="test")
    rec.start()
    for step in range(6):
        rec.record(step, "train", {"losses/train": {"value": 1.0}})
        if step % 3 == 2:
            rec.record(step, "eval", {"losses/eval": {"value": 1.0}})
    rec.finish()
    # a run inside a run's folder is not searched for: the search stops at the outer run
    make_run(str(tmp_path / "x" / "many" / "checkpoints" / "inner"), 1)
    (tmp_path / "a" / "loop").symlink_to(tmp_path / "a", target_is_directory=True)  # searched once

    rows = {r["name"]: r for r in list_runs(str(tmp_path))}
    assert set(rows) == {"a/b/c/d/e/sparse", "x/many", "x/modes"}
    assert (rows["a/b/c/d/e/sparse"]["steps"], rows["a/b/c/d/e/sparse"]["last_step"]) == (5, 20)
    assert (rows["x/many"]["steps"], rows["x/many"]["last_step"]) == (6, 5)
    assert rows["x/modes"]["steps"] == 6 and rows["x/modes"]["steps_by_mode"] == {"eval": 2, "train": 6}

    out = cli("ls", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert any(line.split()[:4] == ["a/b/c/d/e/sparse", "test", "5", "20"] for line in out.stdout.splitlines())


def test_a_live_run_counts_the_steps_of_its_shards(tmp_path):
    rec = make_run(str(tmp_path / "live"), 4, pause=0.12, finish=False)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            (row,) = list_runs(str(tmp_path))
            if row["steps"] == 5:
                break
            time.sleep(0.1)
        assert row["status"] == "running" and row["steps"] == 5 and not (tmp_path / "live" / "index").exists()
        assert len(list((tmp_path / "live" / "shards").iterdir())) > 1
    finally:
        rec.finish()
    (row,) = list_runs(str(tmp_path))
    assert row["status"] == "finished" and row["steps"] == 5


def test_ls_on_s3(s3_server):
    import s3fs

    root = s3_server.bucket() + "/runs"
    options = s3_server.storage_options
    make_run(f"{root}/healthy", 7, storage_options=options)
    make_run(f"{root}/group/faulty", 3, nan_at=3, storage_options=options)

    calls = []
    original = s3fs.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        calls.append((method, kwargs.get("Prefix", kwargs.get("Key", "")), kwargs.get("Range")))
        return await original(self, method, *args, **kwargs)

    def listed(url):
        calls.clear()
        s3fs.S3FileSystem._call_s3 = counting
        try:
            return list_runs(url, options)
        finally:
            s3fs.S3FileSystem._call_s3 = original

    rows = listed(root)
    check_rows(rows)
    assert rows[1]["url"] == f"{root}/group/faulty"
    # one listing per folder visited (root, healthy, group, group/faulty) and per run's status, verdicts and
    # index folders; one GET per small JSON object; the final index's header by one ranged GET each: no shard
    # is read or listed and nothing is listed recursively
    assert sum(c[0] == "list_objects_v2" for c in calls) == 4 + 3 * 2 and "head_object" not in {c[0] for c in calls}
    gets = [c for c in calls if c[0] == "get_object"]
    assert sum(c[1].endswith(".json") and c[2] is None for c in gets) == 2 + 2 + 3  # manifests, statuses, verdicts
    headers = [c for c in gets if "/index/" in c[1]]
    assert len(headers) == 2 and all(c[2] == "bytes=0-65535" for c in headers)
    assert len(gets) == 7 + 2

    # a finished run of several shards: its index's header alone counts its steps; shards/ is not even listed
    indexed = make_run(f"{root}-more/indexed", 5, pause=0.12, storage_options=options)
    (row,) = listed(indexed)
    assert row["steps"] == 6 and row["last_step"] == 5
    assert sorted(c[1].rsplit("/", 2)[-2] for c in calls if c[0] == "list_objects_v2") == \
        ["index", "indexed", "status", "verdicts"]
    assert [c[2] for c in calls if c[0] == "get_object" and "/index/" in c[1]] == ["bytes=0-65535"]
    assert not [c for c in calls if "/shards/" in c[1]]

    out = cli("ls", root, "--json", env=s3_server.env)
    assert out.returncode == 0, out.stderr
    assert [r["verdicts"] for r in json.loads(out.stdout)] == [0, 1]

    # `tripwire report ROOT` on S3: each run's report.html in the run, an index linking them by relative paths
    out = cli("report", root, env=s3_server.env)
    assert out.returncode == 0, out.stderr
    fs = s3fs.S3FileSystem(**options)
    fs.invalidate_cache()  # the cached instance listed the folder before the CLI wrote into it
    index = fs.cat_file(f"{root}/index.html").decode()
    assert 'href="healthy/report.html"' in index and 'href="group/faulty/report.html"' in index
    assert fs.cat_file(f"{root}/group/faulty/report.html").startswith(b"<!DOCTYPE html>")


@pytest.mark.parametrize("tty", [False, True])
def test_progress_bar_only_on_a_terminal(tty):
    import io

    from tripwire.core.progress import Progress

    stream = io.StringIO()
    stream.isatty = lambda: tty
    with Progress(3, "work", stream=stream) as bar:
        for _ in range(3):
            bar.update()
    assert ("work [" in stream.getvalue()) == tty
    assert stream.getvalue().endswith("\r") or not tty
