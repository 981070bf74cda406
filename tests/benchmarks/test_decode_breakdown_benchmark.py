"""`benchmarks/decode_breakdown.py`: a real (tiny) batch-1 step taken apart, and its plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import load_benchmark

breakdown = load_benchmark("decode_breakdown")


def test_a_tiny_models_decode_step_is_split_into_parts_that_add_up(tmp_path: Path) -> None:
    breakdown.write_llama(tmp_path, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, bf16=False)
    parts = breakdown.engine_run(str(tmp_path), prompt_tokens=8, tokens=8, async_scheduling=False, dtype="float32")
    assert set(breakdown.PARTS) | {"wall"} == set(parts)
    assert all(v >= 0 for v in parts.values()) and parts["device wait"] > 0 and parts["inputs+dispatch"] > 0
    # The medians of the parts add up to about the median wall time (each step's parts add up to its wall).
    assert sum(parts[p] for p in breakdown.PARTS) == pytest.approx(parts["wall"], rel=0.5)
    device = breakdown.device_parts(str(tmp_path), prompt_tokens=8, tokens=8, dtype="float32")
    assert device["forward"] > 0 and device["sampler"] > 0 and device["weight_bytes"] > 49152 * 32 * 4


def test_the_plot_is_drawn(tmp_path: Path) -> None:
    step = {p: 1e-3 for p in breakdown.PARTS} | {"wall": 6e-3}
    result = {"model": "m", "sync": step, "async": step,
              "device": {"forward": 4e-3, "sampler": 1e-4, "weight read bound": 1e-3}}
    breakdown.plot(result, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_the_profile_names_the_decode_steps_costliest_device_ops(tmp_path: Path) -> None:
    breakdown.write_llama(tmp_path, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, bf16=False)
    rows = breakdown.profile_ops(str(tmp_path), prompt_tokens=8, tokens=6, dtype="float32", top=5)
    assert 0 < len(rows) <= 5 and all(r["ms_per_step"] >= 0 and r["runs_per_step"] > 0 for r in rows)
    assert rows == sorted(rows, key=lambda r: -r["ms_per_step"])
