"""`tripwire demo`, as a user runs it: the faulty run stops early with its verdict, the healthy run fires nothing."""

import re
import subprocess
import sys

import tripwire


def test_demo_stops_the_faulty_run_early_and_leaves_the_healthy_one_alone(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tripwire", "demo", "--out", str(tmp_path / "demo")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    rows = {m[0]: m for m in re.findall(r"^(\w+)\s+(.+?)\s+(\d+)\s+(\d+)/(\d+)\s+(\d+ steps|-)\s+(\S+)$", text,
                                        re.M)}
    assert set(rows) == {"healthy", "exploding", "dead_relu"}, text

    _, first, causes, steps, planned, saved, url = rows["healthy"]
    assert (first, causes, saved) == ("nothing", "0", "-") and steps == planned
    healthy = tripwire.open_run(url)
    assert healthy.info["status"] == "finished" and not [v for v in healthy.verdicts() if v.counts]
    assert "nothing fired: no warning or error." in text.split("── healthy:")[1].split("── exploding:")[0]

    # one diagnosis per faulty run, whose cause is the fault injected, with a fix that names the value
    _, first, causes, steps, planned, saved, url = rows["exploding"]
    exploding = tripwire.open_run(url)
    stop = next(v for v in exploding.verdicts() if v.rule == "exploding_tensor")  # the first NaN found stops
    assert exploding.info["status"] == "stopped" and int(steps) == stop.step + 1 < int(planned)
    assert saved == f"{int(planned) - int(steps)} steps"
    assert (first, causes) == ("learning rate too high @0", "1")
    section = text.split("── exploding:")[1].split("── dead_relu:")[0]
    assert f"[exploding_tensor] error at step {stop.step}" in section and section.count("hint:") == 1
    assert "diagnosis 1 (error): learning rate too high, from step 0" in section
    assert "learning rate 50 with SGD" in section and "fix: The learning rate is too high" in section

    _, first, causes, *_ = rows["dead_relu"]
    assert (first, causes) == ("dead ReLU units @0", "1")
    section = text.split("── dead_relu:")[1]
    assert "fix: Every bias of Linear net.0 is negative (at most -20" in section
    assert f"tripwire show {url}" in text
