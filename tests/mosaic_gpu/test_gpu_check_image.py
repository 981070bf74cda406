"""`benchmarks/gpu_check.sh --smoke` under the GPU image's package set, as the first GPU call will run it.

This lane's interpreter has the image's versions (Python 3.12, JAX 0.11.2); `tests/support/gpu_image`
makes every installed package the image lacks unimportable (gguf and llguidance among them), in the
check and in every part process it starts. So an import of a package outside the image anywhere on
the check's path fails here, not in the first minute of a GPU lease.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGE = ROOT / "tests" / "support" / "gpu_image"


def image_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "OUT")}
    return {**env, "PYTHONPATH": str(IMAGE), "PYTHON": sys.executable}


def test_the_image_package_set_hides_what_the_image_lacks() -> None:
    code = "import sitecustomize, importlib.util as u; print(sorted(sitecustomize.BLOCKED)); " \
           "print(u.find_spec('gguf'), u.find_spec('llguidance'), u.find_spec('jax') is not None)"
    out = subprocess.run([sys.executable, "-c", code], env=image_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    blocked, found = out.stdout.splitlines()
    assert "'gguf'" in blocked and "'llguidance'" in blocked
    assert found == "None None True"


def test_gpu_check_smoke_runs_every_part_under_the_image_package_set(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--smoke", "--out", str(tmp_path)],
                          env=image_env(), capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert {r["part"] for r in rows} >= set("tpacbd"), sorted({r["part"] for r in rows})
    assert not [r for r in rows if r["status"] in ("fail", "error", "skipped")], output[-6000:]
    checks = {r["check"]: r for r in rows}
    assert checks["first computation"]["result"] == "PASS"
    # Every kernel case ran (none n/a: this JAX interprets Mosaic GPU kernels) and passed.
    kernel_rows = [r for r in rows if r["part"] == "a"]
    assert len(kernel_rows) == 3 and all(r["result"].startswith("PASS") for r in kernel_rows), kernel_rows
    # The engine ran end to end on each smoke backend, both phases; the kernel in both scheduling
    # modes, the reference (the yardstick, timed after the kernels) asynchronously only.
    for backend, modes in (("triton", ("async", "sync")), ("reference", ("async",))):
        for mode in modes:
            assert checks[f"{backend} {mode}: prefill 4x32"]["value"] > 0
            assert checks[f"{backend} {mode}: decode 4 seqs x 3 steps"]["value"] > 0
    assert "reference sync: prefill 4x32" not in checks
    assert checks["triton: timing turn"]["time"] < checks["reference: timing turn"]["time"]
    assert any(r["check"].startswith("decode 4x64 mosaic ragged") for r in rows)
    summary = (tmp_path / "summary.md").read_text()
    assert "nothing failed" in summary and proc.stdout.rstrip().endswith("nothing failed")
    assert (tmp_path / "gpu_check.log").stat().st_size > 0
