"""The GPU check's orchestrator keeps going whatever a part does: a part that hangs is killed at its
limit, one that crashes gets an error row with its last words, rows land in the output folder as
they are measured, and a part that would not fit the budget is skipped, never started.

No JAX here: the parts are tiny Python programs. The whole check, smoke-sized, under the GPU image's
package set runs in the Mosaic lane (tests/mosaic_gpu/test_gpu_check_image.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.helpers import load_benchmark

gpu_check = load_benchmark("gpu_check")

ROW = ("import json, os, sys; from pathlib import Path; path = Path(sys.argv[sys.argv.index('--rows') + 1]);\n"
       "def row(check, result, status='info'):\n"
       "    r = dict(part='a', check=check, result=result, note='', status=status, value=None, key=None,\n"
       "             pid=os.getpid(), time=0.0)\n"
       "    print('@@row ' + json.dumps(r), flush=True); open(path, 'a').write(json.dumps(r) + '\\n')\n")


def job(name: str, body: str, part: str = "a") -> object:
    return gpu_check.Job(name, part, ["-c", ROW + body])


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


def test_a_hang_and_a_crash_cost_their_own_rows_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(gpu_check.LIMIT_S, "a", 3)
    check = gpu_check.Check(tmp_path, smoke=False, budget=300, jobs=2)
    start = time.monotonic()
    status = check.run([
        job("hangs", "row('before the hang', '1'); import time; time.sleep(600)"),
        job("crashes", "row('before the crash', '2'); raise RuntimeError('illegal memory access (simulated)')"),
        job("fine", "row('after both', 'PASS', 'pass')"),
    ], concurrency=2)
    assert time.monotonic() - start < 30
    assert status == {"hangs": None, "crashes": 1, "fine": 0}
    found = {(r["check"], r["result"]) for r in rows(tmp_path)}
    assert {("before the hang", "1"), ("before the crash", "2"), ("after both", "PASS")} <= found
    assert ("hangs", "TIMEOUT") in found
    error = next(r for r in rows(tmp_path) if r["check"] == "crashes")
    assert error["result"] == "ERROR exit 1" and "illegal memory access (simulated)" in error["note"]
    log = (tmp_path / "gpu_check.log").read_text()
    assert "Traceback" in log and "--- fine: exit 0" in log
    assert check.summary() == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "TIMEOUT" in summary and "ERROR exit 1" in summary and "after both" in summary


def test_a_failing_row_needs_no_second_error_row(tmp_path: Path) -> None:
    check = gpu_check.Check(tmp_path, smoke=False, budget=300, jobs=1)
    check.run([job("wrong", "row('kernel vs reference', 'FAIL rel err 1', 'fail'); sys.exit(1)")], 1)
    assert [r["check"] for r in rows(tmp_path)] == ["kernel vs reference"]
    assert check.summary() == 1


def test_parts_that_would_not_fit_the_budget_are_skipped(tmp_path: Path) -> None:
    check = gpu_check.Check(tmp_path, smoke=False, budget=1, jobs=1)
    assert not check.fits("c")
    skipped = rows(tmp_path)[-1]
    assert skipped["part"] == "c" and skipped["result"] == "skipped"
    assert check.summary() == 0  # a skip is reported, not a failure


def test_no_gpu_stops_the_check_after_the_toolchain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started = []
    monkeypatch.setattr(gpu_check.Check, "toolchain", lambda self: False)
    monkeypatch.setattr(gpu_check.Check, "run", lambda self, jobs, concurrency: started.extend(jobs) or {})
    check = gpu_check.Check(tmp_path, smoke=False, budget=300, jobs=1)
    check.all_parts(gpu_check.PARTS)
    assert started == []
    assert check.summary() == 3


def test_the_expected_times_fit_the_default_budget() -> None:
    assert sum(gpu_check.EXPECTED_S[p] for p in gpu_check.DEFAULT_PARTS) <= gpu_check.DEFAULT_BUDGET_S
    assert set(gpu_check.EXPECTED_S) == set(gpu_check.PARTS) == set(gpu_check.LIMIT_S)
