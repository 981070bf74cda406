"""`benchmarks/layer_matmuls.py`: every layout variant computes and is timed (tiny shapes)."""

from __future__ import annotations

from tests.helpers import load_benchmark

layer_matmuls = load_benchmark("layer_matmuls")


def test_every_variant_is_timed_on_the_same_weights() -> None:
    result = layer_matmuls.measure(hidden=16, inter=32, kv=8, layers=3, runs=2)
    assert result["weight_bytes"] == 4 * 3 * (16 * 16 * 2 + 8 * 16 * 2 + 32 * 16 * 3)
    timed = [v for k, v in result.items() if not k.endswith("bytes")]
    assert len(timed) == 6 and all(v > 0 for v in timed)
