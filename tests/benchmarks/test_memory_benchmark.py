"""`benchmarks/memory.py` on a tiny trace: the claims its tables make hold, and nothing leaks."""

from __future__ import annotations


import pytest
from tests.helpers import load_benchmark


memory = load_benchmark("memory")
MAX_LEN = 2048
SLOTS = 16384  # 8 contiguous max_model_len sequences


@pytest.fixture(scope="module")
def trace():
    return memory.make_trace(50, max_model_len=MAX_LEN, seed=0, request_rate=0.35)


def _assert_clean(result, n: int) -> None:
    assert result.finished == n
    assert result.final_free_blocks == result.usable_blocks, "blocks still held after every request finished"
    assert result.final_held_refs == 0


def test_trace_is_seeded_and_fits_max_model_len(trace) -> None:
    assert trace == memory.make_trace(50, max_model_len=MAX_LEN, seed=0, request_rate=0.35)
    assert all(t.input_len >= 1 and t.output_len >= 1 and t.input_len + t.output_len <= MAX_LEN for t in trace)
    fixed = memory.make_trace(5, max_model_len=600, seed=1, input_len=100, output_len=200, prefix_len=512)
    assert {(t.input_len, t.output_len) for t in fixed} == {(87, 1)}  # clipped to 512 + 87 + 1 = 600


def test_paged_keeps_kv_slots_full_of_real_tokens(trace) -> None:
    result = memory.simulate(trace, block_size=16, kv_slots=SLOTS, max_model_len=MAX_LEN)
    _assert_clean(result, len(trace))
    assert result.paged_utilization >= 0.9
    assert result.paged_utilization > 3 * result.contiguous_utilization
    assert result.fragmentation == pytest.approx(1 - result.paged_utilization)  # all waste is in last blocks
    assert result.waste_per_seq < 16
    assert result.peak_allocated_slots <= SLOTS


def test_paged_admits_more_sequences_than_contiguous_on_the_same_budget(trace) -> None:
    contiguous = memory.contiguous_capacity(SLOTS, MAX_LEN)
    assert contiguous == 8
    result = memory.simulate(trace, block_size=16, kv_slots=SLOTS, max_model_len=MAX_LEN, all_at_once=True)
    _assert_clean(result, len(trace))
    assert result.peak_running > 2 * contiguous
    assert result.mean_running_saturated > contiguous


def test_prefix_caching_serves_more_logical_tokens_than_physical_slots() -> None:
    trace = memory.make_trace(50, max_model_len=MAX_LEN, seed=0, request_rate=0.35, prefix_len=512)
    off, on = (memory.simulate(trace, block_size=16, kv_slots=SLOTS, max_model_len=MAX_LEN, prefix_len=512,
                               enable_caching=c) for c in (False, True))
    for r in (off, on):
        _assert_clean(r, len(trace))
    assert off.logical_per_physical <= 1.0
    assert on.logical_per_physical > 1.2
    assert on.prefix_hit_rate > 0.5


def test_main_prints_tables_and_writes_the_plot(tmp_path, capsys) -> None:
    rc = memory.main(["--num-requests", "30", "--kv-slots", str(SLOTS), "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| paged, block 16 |" in out and "| contiguous, 2048 slots per sequence |" in out
    assert "every block free at the end: True" in out
    assert (tmp_path / "memory_kv_usage.png").stat().st_size > 0  # matplotlib is a test dependency
