"""`paged_decode_attention` (Pallas, split-K) against its reference, in interpret mode and lowered for CUDA.

Cases come from `test_reference_attention.make_case` (random every run, shuffled pages, unused pages
and the null block full of NaN) with one decode token per sequence; splits that cover no keys,
padding sequences (context 0), sliding windows and soft caps are all exercised (ALiBi and traced
windows in interpret mode: `test_attention_variants.py`; lowered for CUDA here).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tests.pallas_kernels.test_reference_attention as ref_tests
from tests.helpers import lower_for_cuda
from paxserve.kernels.decode_attention import (
    PagedDecodeAttentionConfig,
    _launch_shape,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from tests.pallas_kernels.test_reference_attention import LAYER, Seq, make_case

print(f"test_decode_attention: PAXSERVE_TEST_SEED={ref_tests.BASE_SEED}")

BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
_reference = jax.jit(paged_decode_attention_reference, static_argnames=("sm_scale", "soft_cap"))


def decode_case(label: str, block_size: int, group: int, dtype: np.dtype, head_dim: int = 32, max_blocks: int = 4):
    """Contexts 1, one block exactly, one block + 1, a partial block, the longest the table allows,
    plus two padding sequences."""
    bs = block_size
    lens = (1, bs, bs + 1, 3 * bs - 5, max_blocks * bs, 7)
    return make_case(label, [Seq(n - 1, 1) for n in lens], block_size=bs, num_kv_heads=2, group=group,
                     head_dim=head_dim, dtype=dtype, pad_tokens=2, pad_seqs=2, pad_blocks_to=max_blocks)


def compare(case, *, sm_scale: float | None = None, sliding_window: int | None = None,  # noqa: ANN001
            soft_cap: float | None = None, config: PagedDecodeAttentionConfig = PagedDecodeAttentionConfig()):
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(case.head_dim)
    md = case.metadata()
    layer = jnp.asarray(LAYER, jnp.int32)
    k_cache, v_cache = ref_tests._write(jnp.asarray(case.k_cache), jnp.asarray(case.v_cache), layer,
                                        jnp.asarray(case.k_new), jnp.asarray(case.v_new), md.slot_mapping)
    q = jnp.asarray(case.q)
    out = paged_decode_attention(q, k_cache, v_cache, layer, md.block_tables, md.context_lens, sm_scale=sm_scale,
                                 sliding_window=sliding_window, soft_cap=soft_cap, config=config, interpret=True)
    ref = _reference(q, k_cache, v_cache, layer, md.block_tables, md.context_lens, sm_scale=sm_scale,
                     sliding_window=sliding_window, soft_cap=soft_cap)
    info = f"seed={case.seed} (PAXSERVE_TEST_SEED={ref_tests.BASE_SEED})"
    assert out.dtype == q.dtype and out.shape == q.shape, info
    out64, ref64 = np.asarray(out).astype(np.float64), np.asarray(ref).astype(np.float64)
    n = case.batch.num_tokens
    assert np.all(np.isfinite(out64)), f"NaN/inf in the output (an unused page leaked); {info}"
    rel = float(np.max(np.abs(out64[:n] - ref64[:n])) / np.max(np.abs(ref64[:n])))
    tol = 1e-5 if case.dtype == F32 else 1e-2
    assert rel < tol, f"relative error {rel:.3g} >= {tol}; {info}"
    assert np.array_equal(out64[n:], np.zeros_like(out64[n:])), f"padding sequences are not zero; {info}"
    return out64[:n], rel


@pytest.mark.parametrize(
    ("block_size", "group", "dtype", "num_splits"),
    [
        (8, 1, F32, 1),
        (16, 2, F32, 2),
        (32, 4, F32, 4),  # more splits than a short context fills
        (16, 8, BF16, None),
        (8, 4, F16, 3),
    ],
    ids=lambda p: getattr(p, "name", str(p)),
)
def test_decode_matches_reference(block_size: int, group: int, dtype: np.dtype, num_splits: int | None,
                                  report) -> None:
    case = decode_case(f"decode-{block_size}-{group}-{dtype.name}-{num_splits}", block_size, group, dtype)
    _, rel = compare(case, config=PagedDecodeAttentionConfig(num_splits=num_splits, kv_tokens=16))
    report(f"rel err {rel:.2e}")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sliding_window_and_soft_cap(num_splits: int) -> None:
    case = decode_case(f"decode-window-cap-{num_splits}", 8, 2, F32)
    config = PagedDecodeAttentionConfig(num_splits=num_splits, kv_tokens=16)
    compare(case, sliding_window=11, config=config)
    capped, _ = compare(case, sm_scale=1.0, soft_cap=5.0, config=config)
    uncapped, _ = compare(case, sm_scale=1.0, config=config)
    assert np.max(np.abs(capped - uncapped)) > 1e-2, "soft_cap had no effect"


def test_split_choice() -> None:
    """Splits fill ~512 programs, never exceed the table's inner steps, and never come out empty."""
    auto = PagedDecodeAttentionConfig()
    assert _launch_shape(64, 8, 128, 16, 64, auto) == (64, 1, 64)  # 512 programs already
    assert _launch_shape(4, 8, 128, 16, 256, auto) == (64, 16, 16)  # 32 programs -> 16 splits of 16 pages
    assert _launch_shape(1, 1, 128, 16, 8, auto) == (64, 2, 4)  # capped by the table width
    kv, splits, pages = _launch_shape(2, 2, 64, 8, 30, PagedDecodeAttentionConfig(num_splits=7))
    assert (splits - 1) * pages < 30 <= splits * pages  # every split covers some table entries


def abstract_args(num_seqs: int, width: int, block_size: int, num_kv_heads: int, group: int, head_dim: int,
                  dtype: jnp.dtype):
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    q = jax.ShapeDtypeStruct((num_seqs, num_kv_heads * group, head_dim), dtype)
    cache = jax.ShapeDtypeStruct((2, 97, block_size, num_kv_heads, head_dim), dtype)
    return q, cache, cache, i32(), i32(num_seqs, width), i32(num_seqs)


def assert_lowers(*shape, **kwargs) -> None:  # noqa: ANN002
    fn = lambda q, k, v, layer, tables, lens: paged_decode_attention(q, k, v, layer, tables, lens, **kwargs)  # noqa: E731
    text = lower_for_cuda(fn, *abstract_args(*shape))
    assert "__gpu$xla.gpu.triton" in text, "no Triton kernel in the CUDA lowering"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_lowers_for_cuda(block_size: int, head_dim: int, dtype: jnp.dtype) -> None:
    group = {8: 1, 16: 4, 32: 8}[block_size]
    assert_lowers(64, 64, block_size, 8 // group if group < 8 else 1, group, head_dim, dtype, sm_scale=0.125)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(sliding_window=4096, soft_cap=30.0),
        dict(config=PagedDecodeAttentionConfig(num_splits=16, kv_tokens=16, num_warps=2, num_stages=1)),
        dict(config=PagedDecodeAttentionConfig(num_splits=1, kv_tokens=128, num_warps=8, num_stages=3)),
    ],
    ids=["window-softcap", "many-splits", "one-split-big-tiles"],
)
def test_lowers_for_cuda_variants(kwargs: dict) -> None:
    assert_lowers(256, 64, 16, 8, 4, 128, jnp.bfloat16, sm_scale=0.0883, **kwargs)
    assert_lowers(3, 7, 16, 2, 3, 64, jnp.float16, sm_scale=0.125, **kwargs)  # odd sizes, group of 3


@pytest.mark.parametrize(
    ("traced_window", "alibi", "soft_cap"),
    [(True, False, None), (False, True, None), (True, True, 30.0)],
    ids=["traced-window", "alibi", "traced-window-alibi-softcap"],
)
def test_lowers_for_cuda_traced_window_and_alibi(traced_window: bool, alibi: bool, soft_cap: float | None) -> None:
    """The window as a traced int32 scalar and the ALiBi slopes as an [H] input, at a large and an
    odd shape (group of 3)."""
    for shape, scale in (((256, 64, 16, 8, 4, 128, jnp.bfloat16), 0.0883), ((3, 7, 16, 2, 3, 64, jnp.float16), 0.125)):
        num_heads = shape[3] * shape[4]
        extra = ([jax.ShapeDtypeStruct((), jnp.int32)] if traced_window else []) + (
            [jax.ShapeDtypeStruct((num_heads,), jnp.float32)] if alibi else [])

        def fn(q, k, v, layer, tables, lens, *extra):  # noqa: ANN001, ANN002, ANN202
            extra = list(extra)
            window = extra.pop(0) if traced_window else None
            slopes = extra.pop(0) if alibi else None
            return paged_decode_attention(q, k, v, layer, tables, lens, sm_scale=scale, sliding_window=window,
                                          soft_cap=soft_cap, alibi_slopes=slopes)

        text = lower_for_cuda(fn, *abstract_args(*shape), *extra)
        assert "__gpu$xla.gpu.triton" in text, "no Triton kernel in the CUDA lowering"
