"""Which matmul quantized weights run (`resolve_matmul_kernel`), decided without running a kernel: the
kernel itself is proven in the Mosaic GPU lane (tests/mosaic_gpu/test_mosaic_matmul.py)."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import pytest

from paxserve.kernels.matmul_dispatch import MatmulKernel, resolve_matmul_kernel


def test_a_cpu_keeps_xla_unless_the_mosaic_family_is_named() -> None:
    assert resolve_matmul_kernel("auto", "cpu", dtype=jnp.bfloat16) is None
    assert resolve_matmul_kernel("reference", "cpu", dtype=jnp.bfloat16) is None


def test_a_gpu_before_hopper_or_float32_activations_keep_xla(caplog: pytest.LogCaptureFixture) -> None:
    never = lambda *a, **k: pytest.fail("no self-check where the kernel cannot run")  # noqa: E731
    with caplog.at_level(logging.INFO):
        assert resolve_matmul_kernel("auto", "gpu", dtype=jnp.bfloat16, compute_capability="8.0",
                                     self_check=never) is None
        assert resolve_matmul_kernel("auto", "gpu", dtype=jnp.float32, compute_capability="9.0",
                                     self_check=never) is None
    assert "compute capability 9.0+, this GPU has 8.0" in caplog.text
    assert "bfloat16 / float16 activations, the model runs in float32" in caplog.text


def test_hopper_takes_the_kernel_only_when_its_self_check_passes(caplog: pytest.LogCaptureFixture) -> None:
    seen = []

    def passing(kernel: MatmulKernel, dtype: object) -> None:
        seen.append((kernel, jnp.dtype(dtype)))

    assert resolve_matmul_kernel("auto", "gpu", dtype=jnp.bfloat16, compute_capability="9.0",
                                 self_check=passing) == MatmulKernel()
    assert seen == [(MatmulKernel(), jnp.dtype(jnp.bfloat16))]
    with caplog.at_level(logging.INFO):
        assert resolve_matmul_kernel("triton", "gpu", dtype=jnp.float16, compute_capability="9.0",
                                     self_check=lambda *a: "fp8 per channel: mismatch") is None
    assert "failed its start-up self-check (fp8 per channel: mismatch)" in caplog.text


def test_kernel_names_are_checked() -> None:
    with pytest.raises(ValueError, match="'mosaic'"):
        MatmulKernel("triton")
