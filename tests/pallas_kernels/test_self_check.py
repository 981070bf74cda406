"""Start-up self-check of the attention backend (`pallas_kernels/self_check.py`) and the fallback to
the XLA reference in `resolve_attention_backend` when the Pallas kernel fails it.

On this CPU machine the Pallas kernel runs in interpret mode (which must pass); the non-interpret
kernel cannot compile here, which is a real failing backend for the fallback; wrong numbers come
from a monkeypatched kernel entry.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest

import paxserve.kernels.dispatch as dispatch
from paxserve.kernels import REFERENCE, AttentionBackend, ragged_paged_attention_reference, resolve_attention_backend
from paxserve.kernels.self_check import self_check_attention

PALLAS = AttentionBackend("pallas")
PALLAS_INTERPRET = AttentionBackend("pallas", interpret=True)
TINY = dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, dtype=jnp.float32)
LOGGER = "paxserve.kernels.dispatch"


@pytest.mark.parametrize(
    ("backend", "num_heads", "num_kv_heads", "head_dim", "block_size", "dtype"),
    [
        (PALLAS_INTERPRET, 4, 2, 16, 8, jnp.float32),  # GQA 2
        (PALLAS_INTERPRET, 8, 1, 32, 16, jnp.bfloat16),  # GQA 8 (MQA)
        (PALLAS_INTERPRET, 2, 2, 16, 32, jnp.float16),  # MHA
        (REFERENCE, 6, 2, 16, 16, jnp.float32),  # GQA 3
        (REFERENCE, 4, 1, 16, 8, jnp.bfloat16),
    ],
    ids=["interp-g2-bs8-f32", "interp-g8-bs16-bf16", "interp-g1-bs32-f16", "ref-g3-bs16-f32", "ref-g4-bs8-bf16"],
)
def test_self_check_passes(backend: AttentionBackend, num_heads: int, num_kv_heads: int, head_dim: int,
                           block_size: int, dtype: jnp.dtype) -> None:
    assert self_check_attention(backend, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                block_size=block_size, dtype=dtype, seed=3) is None


def test_kernel_that_cannot_compile_falls_back_or_raises(caplog: pytest.LogCaptureFixture) -> None:
    """On this CPU machine platform "gpu" picks the non-interpret kernel, which cannot compile here."""
    reason = self_check_attention(PALLAS, **TINY)
    assert reason is not None and reason.startswith("compile/run failed: ")
    assert "\n" not in reason and "0x" not in reason

    caplog.set_level(logging.INFO, logger=LOGGER)
    assert resolve_attention_backend("auto", "gpu", **TINY) == REFERENCE
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert reason in warnings[0] and "Triton kernel failed its start-up self-check" in warnings[0]
    assert "using the XLA reference" in warnings[1]

    with pytest.raises(ValueError, match="failed its start-up self-check") as info:
        resolve_attention_backend("pallas", "cuda", **TINY)
    assert reason in str(info.value) and "0x" not in str(info.value)


def _scaled_reference(q, k_cache, v_cache, layer, metadata, *, sm_scale, sliding_window=None, soft_cap=None,
                      **_):  # noqa: ANN001, ANN202
    """A 'kernel' that is 1% off."""
    out = ragged_paged_attention_reference(q, k_cache, v_cache, layer, metadata, sm_scale=sm_scale,
                                           sliding_window=sliding_window, soft_cap=soft_cap)
    return out * 1.01


def _nan_kernel(q, *_, **__):  # noqa: ANN001, ANN202
    return jnp.full_like(q, jnp.nan)


def test_wrong_numbers_are_a_mismatch(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(dispatch, "ragged_paged_attention", _scaled_reference)
    reason = self_check_attention(PALLAS_INTERPRET, **TINY)
    assert reason is not None and reason.startswith("mismatch: max relative error ") and "> tol 1e-05" in reason
    # 1% off is within nothing for float32 but passes the 16-bit tolerance (2e-2).
    assert self_check_attention(PALLAS_INTERPRET, **{**TINY, "dtype": jnp.bfloat16}) is None

    monkeypatch.setattr(dispatch, "ragged_paged_attention", _nan_kernel)
    reason = self_check_attention(PALLAS_INTERPRET, **TINY)
    assert reason is not None and reason.startswith("mismatch: ") and "NaN or inf" in reason

    # The default self-check on a GPU platform runs the (patched) kernel entry and falls back.
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert resolve_attention_backend("auto", "gpu", **TINY) == REFERENCE
    assert any("NaN or inf" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_reasons_carry_no_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_, **__):  # noqa: ANN002, ANN003, ANN202
        raise jax.errors.JaxRuntimeError(
            "\nINTERNAL: cuLaunchKernel failed at 0x7f3a9c001000 (stream <Stream at 0xDEADBEEF>)\n  second line")

    monkeypatch.setattr(dispatch, "ragged_paged_attention", broken)
    reason = self_check_attention(PALLAS_INTERPRET, **TINY)
    assert reason == ("compile/run failed: JaxRuntimeError: INTERNAL: cuLaunchKernel failed at <address> "
                      "(stream <Stream at <address>>)")


def test_resolve_runs_the_check_once_only_for_the_gpu_kernel(caplog: pytest.LogCaptureFixture) -> None:
    """Once for the kernel and once for its decode-only kernel (on a pure-decode batch)."""
    calls = []

    def passing(backend: AttentionBackend, **shapes) -> None:  # noqa: ANN003
        calls.append((backend, shapes))

    caplog.set_level(logging.INFO, logger=LOGGER)
    for option in ("auto", "pallas"):
        assert resolve_attention_backend(option, "gpu", **TINY, self_check=passing) == PALLAS
    decode = replace(PALLAS, pure_decode=True)
    assert calls == [(PALLAS, TINY), (decode, TINY)] * 2
    assert sum("passed its start-up self-check" in r.getMessage() for r in caplog.records) == 4
    assert sum("Triton kernel's decode-only kernel passed its start-up self-check" in r.getMessage()
               for r in caplog.records) == 2
    # Not for the reference, a CPU, interpret mode or shapes the kernel does not serve.
    assert resolve_attention_backend("reference", "gpu", **TINY, self_check=passing) == REFERENCE
    assert resolve_attention_backend("auto", "cpu", **TINY, self_check=passing) == replace(REFERENCE, cpu_kernel=True)
    assert resolve_attention_backend("pallas", "cpu", **TINY, self_check=passing) == PALLAS_INTERPRET
    assert resolve_attention_backend("auto", "gpu", **{**TINY, "head_dim": 80}, self_check=passing) == REFERENCE
    assert len(calls) == 4
    # None skips it; a check that raises counts as failed.
    assert resolve_attention_backend("pallas", "gpu", **TINY, self_check=None) == PALLAS

    def raising(backend: AttentionBackend, **shapes) -> None:  # noqa: ANN003
        raise RuntimeError("boom")

    assert resolve_attention_backend("auto", "gpu", **TINY, self_check=raising) == REFERENCE
    with pytest.raises(ValueError, match="boom"):
        resolve_attention_backend("pallas", "gpu", **TINY, self_check=raising)


def test_self_check_covers_the_models_window_and_alibi(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreted kernel passes every variant; a kernel that ignores one fails on that one, named."""
    assert self_check_attention(PALLAS_INTERPRET, **TINY, sliding_window=4096, alibi=True, seed=5) is None

    def without(option: str):  # noqa: ANN202
        def kernel(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            for name in (option, "config", "interpret"):
                kwargs.pop(name, None)
            return ragged_paged_attention_reference(*args, **kwargs)
        return kernel

    monkeypatch.setattr(dispatch, "ragged_paged_attention", without("sliding_window"))
    reason = self_check_attention(PALLAS_INTERPRET, **TINY, sliding_window=4096)
    # The window is capped to block_size + 1 so that the small batch really skips keys.
    assert reason is not None and reason.startswith("mismatch: ") and reason.endswith("(with sliding_window=9)")
    monkeypatch.setattr(dispatch, "ragged_paged_attention", without("alibi_slopes"))
    reason = self_check_attention(PALLAS_INTERPRET, **TINY, sliding_window=2, alibi=True)
    # The plain and the window variants pass; ALiBi is checked with the window too.
    assert reason is not None and reason.startswith("mismatch: ") and reason.endswith("(with alibi, sliding_window=2)")


def test_resolve_passes_the_variants_to_the_check_only_when_given() -> None:
    calls = []

    def passing(backend: AttentionBackend, **kwargs) -> None:  # noqa: ANN003
        calls.append(kwargs)

    assert resolve_attention_backend("auto", "gpu", **TINY, self_check=passing) == PALLAS
    assert resolve_attention_backend("auto", "gpu", **TINY, self_check=passing, sliding_window=512) == PALLAS
    assert resolve_attention_backend("pallas", "gpu", **TINY, self_check=passing, alibi=True) == PALLAS
    # Each twice: the kernel, then its decode-only kernel.
    assert calls == [TINY, TINY, {**TINY, "sliding_window": 512}, {**TINY, "sliding_window": 512},
                     {**TINY, "alibi": True}, {**TINY, "alibi": True}]
