"""The Mosaic GPU weight-only matmul (pallas_kernels/mosaic_matmul.py) in interpret mode against XLA's
dequantize-then-dot, lowered for sm90, and reached through `dense` when a weight carries it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxserve.kernels import matmul_dispatch
from paxserve.kernels.matmul_dispatch import MatmulKernel, self_check_matmul
from paxserve.kernels.mosaic_matmul import mosaic_weight_only_matmul, weight_only_matmul_reference
from paxserve.models.layers import dense
from paxserve.models.quant_weights import GroupQuantizedWeight, WeightQuantization, with_matmul_kernel
from tests.helpers import lower_for_cuda

# (label, rows of x, inputs, outputs, bits, group or None (per channel), code dtype, offset, bias, x dtype,
#  tile_n, num_splits). Split-K: 512 inputs (4 stages) in 2 pieces by default, 384 in 3 pieces as asked.
CASES = [
    ("int8-per-channel-2-row-tiles", 70, 256, 128, 8, None, np.int8, False, 0, jnp.bfloat16, None, None),
    ("fp8-per-channel", 3, 128, 192, 8, None, jnp.float8_e4m3fn, False, 0, jnp.bfloat16, 64, None),
    ("int8-groups-of-16-f16-3-splits", 9, 384, 64, 8, 16, np.int8, False, 0, jnp.float16, None, 3),
    ("uint8-groups-of-32-offsets", 1, 256, 128, 8, 32, np.uint8, True, 0, jnp.bfloat16, None, None),
    ("4bit-groups-of-32-offsets-2-splits", 5, 512, 128, 4, 32, np.uint8, True, 0, jnp.bfloat16, None, None),
    ("4bit-groups-of-128-bias-8", 64, 256, 256, 4, 128, np.uint8, False, 8, jnp.bfloat16, 64, None),
    ("4bit-groups-of-256-one-stage-each", 2, 512, 64, 4, 256, np.uint8, False, 8, jnp.float16, None, 1),
]


def _problem(rows: int, k: int, n: int, bits: int, group: int | None, code_dtype, offset: bool, x_dtype, seed=0):  # noqa: ANN001, ANN202
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, k)), x_dtype)
    if np.dtype(code_dtype) == np.dtype(jnp.float8_e4m3fn):
        codes = (rng.standard_normal((k, n)) * 40).astype(code_dtype)
    else:
        info = np.iinfo(code_dtype)
        codes = rng.integers(info.min, info.max + 1, (k * bits // 8, n)).astype(code_dtype)
    scale = None if group is None else jnp.asarray((rng.random((k // group, n)) * 0.02).astype(np.float16))
    shift = jnp.asarray(rng.standard_normal((k // group, n)).astype(np.float32) * 0.1) if offset else None
    return x, jnp.asarray(codes), scale, shift


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_equals_xla_dequantize_then_dot_and_lowers_for_sm90(case) -> None:  # noqa: ANN001
    _, rows, k, n, bits, group, code_dtype, offset, bias, x_dtype, tile_n, splits = case
    x, codes, scale, shift = _problem(rows, k, n, bits, group, code_dtype, offset, x_dtype)
    got = mosaic_weight_only_matmul(x, codes, scale, shift, bits=bits, bias=bias, tile_n=tile_n, num_splits=splits,
                                    interpret=True)
    want = weight_only_matmul_reference(x, codes, scale, shift, bits=bits, bias=bias)
    assert got.shape == (rows, n) and got.dtype == jnp.float32
    # The same bf16 / f16 weights summed in float32 in another order: a few float32 ulps apart.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))
    text = lower_for_cuda(lambda *a: mosaic_weight_only_matmul(*a, bits=bits, bias=bias, tile_n=tile_n,
                                                               num_splits=splits), x, codes, scale, shift)
    assert "mosaic_gpu" in text


def test_llama_3_8b_shapes_lower_for_sm90() -> None:
    """Every linear layer of Llama-3-8B, int8 and 4-bit, for a decode batch (split-K on)."""
    sds = jax.ShapeDtypeStruct
    for k, n in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
        for tokens in (16,):  # a prefill chunk differs only in its grid
            x = sds((tokens, k), jnp.bfloat16)
            int8 = lambda x, c: mosaic_weight_only_matmul(x, c)  # noqa: E731
            assert "mosaic_gpu" in lower_for_cuda(int8, x, sds((k, n), jnp.int8))
            four = lambda x, c, s, o: mosaic_weight_only_matmul(x, c, s, o, bits=4)  # noqa: E731
            assert "mosaic_gpu" in lower_for_cuda(four, x, sds((k // 2, n), jnp.uint8), sds((k // 32, n), jnp.float32),
                                                  sds((k // 32, n), jnp.float32))


def test_split_k_fills_the_gpu_for_decode_and_never_makes_an_empty_piece() -> None:
    from paxserve.kernels.mosaic_matmul import _num_splits

    # Llama-3-8B's o projection at decode: 32 output tiles, 32 stages -> 8 pieces of 4 (256 programs).
    assert _num_splits(None, 32, 32, 132) == 8
    assert _num_splits(None, 300, 32, 132) == 1  # a prefill chunk fills the GPU by itself
    assert _num_splits(None, 1, 5, 132) == 2  # at least 2 stages a piece
    assert _num_splits(4, 1, 5, 132) == 3  # 4 asked of 5 stages: pieces of 2, 2, 1


def test_unserved_shapes_are_named() -> None:
    x = jnp.zeros((4, 576), jnp.bfloat16)
    with pytest.raises(ValueError, match="576 inputs, not a multiple of 128"):
        mosaic_weight_only_matmul(x, jnp.zeros((576, 128), jnp.int8), interpret=True)
    with pytest.raises(ValueError, match="float32"):
        mosaic_weight_only_matmul(jnp.zeros((4, 128), jnp.float32), jnp.zeros((128, 128), jnp.int8), interpret=True)


def test_self_check_passes_and_a_wrong_kernel_fails_it(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = MatmulKernel(interpret=True)
    assert self_check_matmul(kernel, jnp.bfloat16) is None
    real = matmul_dispatch.run_kernel
    # A kernel that ignores the offsets (GGUF Q4_1/Q4_K's minimums) must not pass.
    monkeypatch.setattr(matmul_dispatch, "run_kernel", lambda k, x, c, s, o, bits, bias: real(k, x, c, s, None, bits, bias))
    reason = self_check_matmul(kernel, jnp.bfloat16)
    assert reason is not None and reason.startswith("4-bit groups of 32 with offsets: mismatch"), reason


def test_dense_runs_the_kernel_a_weight_carries_and_keeps_xla_where_it_cannot() -> None:
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((6, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 128)) * 0.05, jnp.float32)
    kernel = MatmulKernel(interpret=True)
    group = GroupQuantizedWeight(codes=jnp.asarray(rng.integers(0, 256, (128, 128)), jnp.uint8),
                                 scale=jnp.asarray(rng.random((8, 128)) * 0.01, jnp.float16), bits=4, bias=8)
    for plain in (WeightQuantization("int8").quantize(w), group):
        served = with_matmul_kernel({"w": plain}, kernel)["w"]
        assert served.kernel == kernel
        assert "wgmma" in str(jax.make_jaxpr(dense)(x, served)) and "wgmma" not in str(jax.make_jaxpr(dense)(x, plain))
        np.testing.assert_allclose(np.asarray(dense(x, served), np.float32), np.asarray(dense(x, plain), np.float32),
                                   rtol=2e-2, atol=2e-2)
    # 576 inputs (SmolLM2's width) are not a multiple of the kernel's stage: XLA's path, same result.
    narrow = with_matmul_kernel(WeightQuantization("int8").quantize(jnp.ones((576, 64), jnp.float32)), kernel)
    xs = jnp.ones((2, 576), jnp.bfloat16)
    assert jnp.array_equal(dense(xs, narrow), dense(xs, narrow.replace(kernel=None)))
