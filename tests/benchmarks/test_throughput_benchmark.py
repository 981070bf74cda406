"""`benchmarks/throughput.py`: the seeded workload, the static-batching accounting, the report, and a
whole run on a tiny random Llama (paxserve, max_num_seqs=1, a sweep, transformers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import load_benchmark, make_tiny_llama


throughput = load_benchmark("throughput")
workload = sys.modules["workload"]  # benchmarks/workload.py, imported by the script


def test_sharegpt_workload_is_seeded_and_fits_max_model_len() -> None:
    a = throughput.make_workload("sharegpt", 200, max_model_len=512, seed=3)
    assert a == throughput.make_workload("sharegpt", 200, max_model_len=512, seed=3)
    assert a["output_lens"] != throughput.make_workload("sharegpt", 200, max_model_len=512, seed=4)["output_lens"]
    assert [len(p) for p in a["prompts"]] == a["input_lens"]
    assert all(3 <= t < throughput.BUNDLED_VOCAB for p in a["prompts"] for t in p)
    assert all(i >= 1 and o >= 1 and i + o <= 512 for i, o in zip(a["input_lens"], a["output_lens"]))
    assert max(i + o for i, o in zip(a["input_lens"], a["output_lens"])) == 512  # the tail was clipped


def test_sharegpt_lengths_are_long_tailed_with_sharegpt_means() -> None:
    pairs = workload.sharegpt_lengths(20000, max_model_len=10**6, seed=0)  # effectively unclipped
    for values, mean in (([i for i, _ in pairs], 160), ([o for _, o in pairs], 340)):
        a = np.array(values)
        assert a.mean() == pytest.approx(mean, rel=0.05)
        assert np.median(a) < 0.7 * a.mean()  # lognormal, sigma 1: median = mean / e^0.5
        assert np.percentile(a, 99) > 4 * np.median(a)
        assert a.min() >= 1
    clipped = workload.sharegpt_lengths(20000, max_model_len=1024, seed=0)
    assert all(i + o <= 1024 for i, o in clipped)
    assert np.mean([o for _, o in clipped]) < np.mean([o for _, o in pairs])


def test_sharegpt_lengths_match_memory_benchmark_trace() -> None:
    memory = load_benchmark("memory", "paxserve_bench_memory_t")
    trace = memory.make_trace(300, max_model_len=1024, seed=5)
    assert [(t.input_len, t.output_len) for t in trace] == workload.sharegpt_lengths(300, max_model_len=1024, seed=5)


def test_fixed_workload_keeps_the_flags() -> None:
    w = throughput.make_workload("fixed", 20, max_model_len=1024, seed=0, min_input_len=16, max_input_len=32,
                                 output_len=7)
    assert w["output_lens"] == [7] * 20
    assert all(16 <= n <= 32 for n in w["input_lens"])
    assert w["prompts"] == throughput.make_fixed_prompts(20, 16, 32, throughput.BUNDLED_VOCAB, 0)
    with pytest.raises(ValueError, match="exceeds --max-model-len"):
        throughput.make_workload("fixed", 2, max_model_len=100, seed=0, max_input_len=64, output_len=64)
    with pytest.raises(ValueError, match="unknown dataset"):
        throughput.make_workload("alpaca", 2, max_model_len=100, seed=0)


def test_short_workload_has_the_held_out_shape() -> None:
    w = throughput.make_workload("short", 400, max_model_len=1024, seed=1)
    assert w == throughput.make_workload("short", 400, max_model_len=1024, seed=1)
    assert [len(p) for p in w["prompts"]] == w["input_lens"]
    assert min(w["input_lens"]) >= 27 and max(w["input_lens"]) <= 400 and max(w["input_lens"]) > 350
    assert min(w["output_lens"]) >= 16 and max(w["output_lens"]) <= 192 and max(w["output_lens"]) > 170
    with pytest.raises(ValueError, match="max-model-len 512"):
        throughput.make_workload("short", 2, max_model_len=512, seed=0)


def test_static_batching_accounting() -> None:
    lens = [5, 1, 3, 7, 2]
    assert throughput.static_batches(lens, 2) == [(0, 2, 5), (2, 4, 7), (4, 5, 2)]
    assert throughput.static_batching_tokens(lens, 2) == (2 * 5 + 2 * 7 + 1 * 2, 18)
    assert throughput.static_batching_tokens(lens, 1) == (18, 18)  # batch 1 wastes nothing
    assert throughput.static_batching_tokens(lens, 5) == (5 * 7, 18)
    assert throughput.static_batching_tokens(lens, 64) == (5 * 7, 18)  # a short last batch
    table = throughput.static_batching_table(lens, [1, 2])
    assert "| 2 | 3 | 26 | 18 | 69.2% |" in table and "| 1 | 5 | 18 | 18 | 100.0% |" in table
    with pytest.raises(ValueError):
        throughput.static_batches(lens, 0)


def _fake(engine: str, n: int, out_per_s: float, **extra) -> dict:
    r = {"engine": engine, "num_prompts": n, "requests_per_s": n / 10, "output_tokens_per_s": out_per_s,
         "total_tokens_per_s": 2 * out_per_s, "seconds": 10.0, "all_seconds": [10.0, 11.0], "output_tokens": 100,
         **extra}
    if engine == "paxserve":
        r.update(kv_blocks=100, block_size=16, peak_kv_usage=0.5, preemptions=0, buckets=3, padding_share=0.25)
    else:
        r.update(best_batch_size=8, generated_tokens=400, sweep_seconds={8: 10.0, 16: 12.0})
    return r


def test_report_tables_and_ratio_lines() -> None:
    pax = _fake("paxserve", 64, 300.0, max_num_seqs=256)
    single = _fake("paxserve", 16, 50.0, max_num_seqs=1)
    hf = _fake("transformers", 64, 120.0)
    table = throughput.main_table([pax, single, hf], 64)
    assert "| paxserve (max_num_seqs=256) | 64 | 6.40 | 300.0 |" in table
    assert "| paxserve (max_num_seqs=1) | first 16 of 64 |" in table
    assert "3 compiled buckets, 25.0% of token slots padding" in table
    assert "transformers (static batching, batch size 8)" in table and "(25.0% useful)" in table
    lines = throughput.ratio_lines(pax, single, hf)
    assert lines[0] == "paxserve / transformers output throughput: 2.50x"
    assert lines[1].startswith("paxserve (max_num_seqs=256) / paxserve (max_num_seqs=1): 6.00x (max_num_seqs=1 ran "
                               "the first 16 of 64 prompts")
    assert throughput.ratio_lines(pax, None, None) == []
    sweep = throughput.concurrency_table({1: 50.0, 4: 150.0}, {4: 90.0, 8: 100.0}, {1: " (first 16 prompts)"})
    assert "| 1 | 50.0 (first 16 prompts) |  |" in sweep and "| 4 | 150.0 | 90.0 |" in sweep
    assert "| 8 |  | 100.0 |" in sweep


def test_concurrency_plot_is_written(tmp_path: Path) -> None:
    path = throughput.plot_concurrency({1: 50.0, 4: 150.0, 16: 280.0}, {4: 90.0, 16: 120.0}, tmp_path / "t.png")
    assert path == str(tmp_path / "t.png") and (tmp_path / "t.png").stat().st_size > 0


def test_whole_run_on_a_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both engines on a tiny random Llama (vocab 256, no tokenizer: token-id prompts), per-request
    output lengths, the max_num_seqs=1 subset, a sweep, the JSON and the plot."""
    model_dir = tmp_path / "tiny"
    make_tiny_llama(model_dir, seed=5, num_attention_heads=4, num_key_value_heads=2)
    out_json = tmp_path / "r.json"
    rc = throughput.main(["--model", str(model_dir), "--dataset", "sharegpt", "--num-prompts", "4",
                          "--max-model-len", "48", "--vocab-size", "256", "--kv-cache-memory-bytes", str(2**20),
                          "--runs", "1", "--hf-batch-sizes", "1,4", "--single-num-prompts", "2",
                          "--concurrency-sweep", "1,2", "--log-stats-interval", "0", "--out-dir", str(tmp_path),
                          "--other-scheduling", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads(out_json.read_text())
    lens = report["workload"]["output_lens"]
    assert report["paxserve"]["output_tokens"] == sum(lens) and report["paxserve"]["max_num_seqs"] == 256
    assert report["paxserve_single"]["num_prompts"] == 2 and report["paxserve_single"]["max_num_seqs"] == 1
    assert report["paxserve_single"]["output_tokens"] == sum(lens[:2])
    # CPU: synchronous by default, so the other run is the async one.
    assert report["paxserve"]["async_scheduling"] is False
    assert report["paxserve_other_scheduling"]["async_scheduling"] is True
    assert report["paxserve_other_scheduling"]["output_tokens"] == sum(lens)
    assert 0 <= report["paxserve"]["padding_share"] < 1
    assert "| paxserve (max_num_seqs=256, synchronous scheduling) | 4 |" in out
    assert "| paxserve (max_num_seqs=256, async scheduling) | 4 |" in out
    assert "paxserve async / synchronous scheduling output throughput: " in out
    hf = report["transformers"]
    assert hf["output_tokens"] == sum(lens)
    assert hf["sweep_generated_tokens"] == {"1": sum(lens), "4": 4 * max(lens)}
    assert set(report["concurrency_sweep"]["paxserve"]) == {"1", "2"}
    assert "paxserve / transformers output throughput: " in out
    assert "paxserve (max_num_seqs=256) / paxserve (max_num_seqs=1): " in out
    assert "| paxserve (max_num_seqs=1) | first 2 of 4 |" in out
    assert (tmp_path / "throughput_vs_concurrency.png").stat().st_size > 0  # matplotlib is a test dependency
