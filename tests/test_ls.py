"""`tripwire ls` (and `tripwire report ROOT`): the runs under a root, on a local folder and on a real S3 server on
loopback."""

import json
import subprocess
import sys

import pytest

from tripwire.core.listing import list_runs
from tripwire.core.recorder import Recorder

CONFIG = {"rules": [{"rule": "exploding_tensor", "actions": ["stop"]}, "overfit"], "collections": {"losses": {}},
          "sampling": {"every": 1}, "writer": {"flush_every_s": 0.05}}


def make_run(url, last_step, nan_at=None, storage_options=None):
    """A short run; a NaN loss at `nan_at` fires exploding_tensor; overfit never gets its data (no_data)."""
    rec = Recorder(CONFIG, run_url=url, framework="test", storage_options=storage_options)
    rec.start()
    for step in range(last_step + 1):
        rec.record(step, "train", {"losses/train": {"value": float("nan") if step == nan_at else 1 / (step + 1)}})
    rec.finish("stopped" if nan_at is not None else "finished")
    return url


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tripwire", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def check_rows(rows):
    assert [r["name"] for r in rows] == ["healthy", "group/faulty"]  # oldest first; found two levels down
    healthy, faulty = rows
    assert healthy["framework"] == "test" and healthy["status"] == "finished" and healthy["last_step"] == 7
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
    assert lines[0].split()[:3] == ["run", "framework", "last"]
    assert any(line.startswith("group/faulty") and "stopped" in line and line.endswith(" 1 (+1 no data)")
               for line in lines)
    assert any(line.startswith("healthy") and "(+1 no data)" in line for line in lines)
    assert any(line.startswith("broken") and "unreadable" in line for line in lines)
    as_json = json.loads(cli("ls", str(tmp_path), "--json").stdout)
    assert {r["name"] for r in as_json} == {"healthy", "group/faulty", "broken"}
    assert cli("ls", str(tmp_path / "nothing")).stdout.startswith("no runs under")


def test_a_run_itself_is_listed_as_one_row(tmp_path):
    make_run(str(tmp_path / "only"), 2)
    (row,) = list_runs(str(tmp_path / "only"))
    assert row["name"] == "." and row["last_step"] == 2


def test_ls_on_s3(s3_server):
    import s3fs

    root = s3_server.bucket() + "/runs"
    options = s3_server.storage_options
    make_run(f"{root}/healthy", 7, storage_options=options)
    make_run(f"{root}/group/faulty", 3, nan_at=3, storage_options=options)

    calls = []
    original = s3fs.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        calls.append(method)
        return await original(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = counting
    try:
        rows = list_runs(root, options)
    finally:
        s3fs.S3FileSystem._call_s3 = original
    check_rows(rows)
    assert rows[1]["url"] == f"{root}/group/faulty"
    # one listing per folder visited, the status and verdict folders, and one GET per small JSON object:
    # no shard is read and nothing is listed recursively
    assert calls.count("list_objects_v2") <= 9 and "head_object" not in calls
    assert calls.count("get_object") == 2 + 2 + 3  # manifests, statuses, verdicts (no_data, fired + no_data)

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
