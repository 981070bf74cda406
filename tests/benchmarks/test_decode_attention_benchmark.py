"""`benchmarks/decode_attention.py`: every attention variant it times computes the reference's answer."""

from __future__ import annotations

import pytest

from tests.helpers import load_benchmark

decode_attention = load_benchmark("decode_attention")


def test_every_variant_matches_the_reference_and_is_timed(capsys: pytest.CaptureFixture[str]) -> None:
    assert decode_attention.main(["--seqs", "5", "--context", "40", "--runs", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "variant" not in line]
    assert len(rows) == len(decode_attention.VARIANTS)
    for row in rows:
        name, ms, _, diff = (cell.strip() for cell in row.strip("|").split("|"))
        assert float(ms) > 0, row
        if "only" not in name:  # the two half-variants say where time goes; they are not attention
            assert float(diff) < 1e-4, row
