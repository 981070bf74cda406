"""`benchmarks/gpu_check.py --smoke` runs end to end on CPU (tiny shapes, kernels interpreted), so the
GPU check script is known to work before a GPU run is spent on it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke_runs_and_passes() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--budget", "300"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    table = proc.stdout.split("gpu_check summary", 1)[1]
    for part in ("a", "b", "c", "d"):
        assert f"\n{part} " in table, f"part {part} missing from the summary:\n{table}"
    assert "FAIL" not in table and "ERROR" not in table and "skipped" not in table, table
    assert "offline 4 x 16 -> 4" in table
