"""`benchmarks/host_overhead.py`: a real (tiny) measurement through the stubbed device, and the
before/after comparison table and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import load_benchmark

host_overhead = load_benchmark("host_overhead")


def test_a_stubbed_step_is_measured_with_the_engine_running_its_requests(tmp_path: Path) -> None:
    host_overhead.write_tiny_checkpoint(tmp_path)
    seconds = host_overhead.measure(tmp_path, batch=2, context=40, steps=3)
    assert 0 < seconds < 5.0  # host work only: no program ran


def test_idle_fractions() -> None:
    assert host_overhead.idle_fractions(1.0, 3.0) == (0.25, 0.0)  # overlapped: the device never waits
    serial, overlapped = host_overhead.idle_fractions(4.0, 1.0)
    assert serial == pytest.approx(0.8) and overlapped == pytest.approx(0.75)


def test_compare_prints_runs_side_by_side_and_plots_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run(label: str, scale: float) -> Path:
        rows = [dict(batch=b, context=c, host_s=scale * b * 1e-4, device_model_s=3e-3) for b in (1, 64)
                for c in (128, 2048)]
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps({"label": label, "rows": rows}))
        return path

    plot = tmp_path / "plot.png"
    host_overhead.compare([run("before", 4.0), run("after", 1.0)], plot)
    out = capsys.readouterr().out
    assert "host ms/step, before | host ms/step, after" in out
    assert "| 64 | 2048 | 25.60 | 6.40 | 4.0x | 3.00 | 90% / 53% |" in out
    assert plot.stat().st_size > 0
