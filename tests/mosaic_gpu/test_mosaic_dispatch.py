"""The Mosaic GPU backend through `attention()`, its start-up self-check, and the fallback when the
kernel cannot run (the non-interpret kernel cannot on this CPU, which is a real failing backend)."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import pytest

from paxserve.kernels import REFERENCE, AttentionBackend, resolve_attention_backend, self_check_attention

MOSAIC_INTERPRET = AttentionBackend("mosaic", interpret=True)


@pytest.mark.parametrize("shapes", [
    dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.bfloat16, alibi=True),
    dict(num_heads=6, num_kv_heads=1, head_dim=128, block_size=8, dtype=jnp.float16),
    dict(num_heads=2, num_kv_heads=2, head_dim=64, block_size=32, dtype=jnp.bfloat16, sliding_window=100),
], ids=["g4-bs16-alibi", "g6-bs8-f16", "mha-bs32-window"])
def test_interpreted_kernel_passes_the_self_check(shapes: dict) -> None:
    assert self_check_attention(MOSAIC_INTERPRET, **shapes, seed=7) is None


@pytest.mark.parametrize("fp8,pure_decode,shapes", [
    ("float8_e4m3fn", False, dict(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.bfloat16)),
    ("float8_e5m2", True, dict(num_heads=6, num_kv_heads=1, head_dim=128, block_size=8, dtype=jnp.float16)),
], ids=["ragged-e4m3-g2-bs16", "decode-e5m2-g6-bs8-f16"])
def test_fp8_pages_pass_the_self_check(fp8: str, pure_decode: bool, shapes: dict) -> None:
    """fp8 pages (every unused one NaN bits) widened in the kernel: the reference reads the same
    pages. The ragged kernel on e4m3, the decode-only one on e5m2 (the engine test runs both on e4m3)."""
    backend = AttentionBackend("mosaic", interpret=True, pure_decode=pure_decode)
    assert self_check_attention(backend, **shapes, kv_dtype=jnp.dtype(fp8), seed=3) is None


def test_option_mosaic_on_cpu_is_interpret_mode() -> None:
    shapes = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.bfloat16)
    assert resolve_attention_backend("mosaic", "cpu", **shapes) == MOSAIC_INTERPRET


def test_a_kernel_that_cannot_run_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    shapes = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.bfloat16)
    reason = self_check_attention(AttentionBackend("mosaic"), **shapes)
    assert reason is not None and reason.startswith("compile/run failed: ")
    caplog.set_level(logging.INFO, logger="paxserve.kernels.dispatch")
    assert resolve_attention_backend("auto", "gpu", **shapes, compute_capability="9.0") == REFERENCE
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("Mosaic GPU kernel failed its start-up self-check" in w and reason in w for w in warnings), warnings
    assert "using the XLA reference" in warnings[-1]
    with pytest.raises(ValueError, match="failed its start-up self-check"):
        resolve_attention_backend("mosaic", "gpu", **shapes)
