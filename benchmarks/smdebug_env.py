"""smdebug's own virtualenv (benchmarks/.smdebug-venv): smdebug needs numpy<2, tripwire's venv has numpy 2.

Created on first use: torch==2.13.0 first (the CPU build the main venv has;
a bare `torch` would pull a CUDA build), then smdebug with numpy 1.26.4.
smdebug 1.0.34 imports `requests` without declaring it, so it is installed too.
"""

from __future__ import annotations

import subprocess
import sys

from .common import ROOT, BenchError

VENV = ROOT / "benchmarks" / ".smdebug-venv"
PYTHON = VENV / "bin" / "python"
READY = VENV / ".ready"
TORCH = "torch==2.13.0"
PACKAGES = ["smdebug", "numpy==1.26.4", "pandas", "psutil", "requests", TORCH]


def python() -> str:
    """The venv's interpreter, creating the venv if needed; BenchError says why smdebug cannot run."""
    if not READY.exists():
        steps = [[sys.executable, "-m", "venv", str(VENV)],
                 [str(PYTHON), "-m", "pip", "install", "-q", TORCH],
                 [str(PYTHON), "-m", "pip", "install", "-q", *PACKAGES],
                 [str(PYTHON), "-c", "import smdebug.pytorch, smdebug.trials"]]
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                lines = [l for l in (done.stderr or done.stdout).splitlines() if "is ignored" not in l]
                raise BenchError(f"smdebug venv: `{' '.join(cmd[-3:])}` failed: " + " | ".join(lines[-4:]))
        READY.write_text(" ".join(PACKAGES) + "\n")
    return str(PYTHON)
