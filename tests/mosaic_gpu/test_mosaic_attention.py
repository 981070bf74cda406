"""The Mosaic GPU kernels in GPU interpret mode (JAX 0.11.2 on a CPU) against the XLA reference.

Cases come from `tests/pallas_kernels/test_reference_attention.make_case`: random every run,
shuffled block tables, every unused page, the unwritten tail of each last page, blocks allocated
past a context and the null block full of NaN. Interpret mode starts shared memory as NaN too, so a
row the kernel forgets to initialise or mask shows. Ragged batches mix fresh prompts longer than
one unit, chunks on cached context, decode tokens, padding tokens and padding sequences.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import tests.pallas_kernels.test_reference_attention as ref_tests
from paxserve.kernels.mosaic_attention import (
    MosaicAttentionConfig,
    mosaic_paged_decode_attention,
    mosaic_ragged_paged_attention,
)
from paxserve.kernels.decode_attention import paged_decode_attention_reference
from tests.pallas_kernels.test_attention_variants import assert_close, dense_attention, random_slopes, written
from tests.helpers import lower_for_cuda
from tests.pallas_kernels.test_reference_attention import LAYER, Seq, make_case

BF16, F16 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)
LAYER_ARRAY = jnp.asarray(LAYER, jnp.int32)
_reference = jax.jit(ref_tests.ragged_paged_attention_reference, static_argnames=("sm_scale", "soft_cap"))
_decode_reference = jax.jit(paged_decode_attention_reference, static_argnames=("sm_scale", "soft_cap"))


def ragged_case(label: str, *, block_size: int, group: int, head_dim: int, dtype: np.dtype, num_kv_heads: int = 2):
    """A fresh 70-token prompt (two units when a unit holds 64 tokens), a 9-token chunk on 40 cached
    tokens with spare NaN blocks in its table, two decode tokens (one on a context ending mid-page),
    a prompt of 3, and padding."""
    seqs = [Seq(0, 70), Seq(40, 9, extra_blocks=2), Seq(block_size * 3 - 1, 1), Seq(57, 1, extra_blocks=1),
            Seq(0, 3)]
    return make_case(label, seqs, block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                     head_dim=head_dim, dtype=dtype, pad_tokens=3, pad_seqs=2)


# (block size, GQA group, head dim, dtype): every block size, groups 1-8 (3 pads to 4), every head dim.
SHAPES = [(8, 1, 64, BF16), (16, 3, 128, F16), (32, 8, 64, BF16), (16, 2, 256, BF16), (32, 4, 128, F16)]


@pytest.mark.parametrize("block_size,group,head_dim,dtype", SHAPES,
                         ids=[f"bs{b}-g{g}-d{d}-{np.dtype(t).name}" for b, g, d, t in SHAPES])
def test_ragged_step_matches_reference(block_size: int, group: int, head_dim: int, dtype: np.dtype) -> None:
    case = ragged_case(f"ragged-{block_size}-{group}-{head_dim}", block_size=block_size, group=group,
                       head_dim=head_dim, dtype=dtype, num_kv_heads=1 if group == 8 else 2)
    k_cache, v_cache = written(case)
    q, md, scale = jnp.asarray(case.q), case.metadata(), 1 / math.sqrt(head_dim)
    out = mosaic_ragged_paged_attention(q, k_cache, v_cache, LAYER_ARRAY, md, sm_scale=scale, interpret=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, _reference(q, k_cache, v_cache, LAYER_ARRAY, md, sm_scale=scale), case, "mosaic vs reference")
    assert_close(out, dense_attention(case, sm_scale=scale), case, "mosaic vs dense float64")


def test_ragged_window_soft_cap_alibi_with_traced_window() -> None:
    """All three score options together; the window is a traced scalar (one compile, any window)."""
    case = ragged_case("ragged-options", block_size=16, group=2, head_dim=64, dtype=BF16)
    k_cache, v_cache = written(case)
    q, md, slopes = jnp.asarray(case.q), case.metadata(), random_slopes(case)
    run = jax.jit(lambda w: mosaic_ragged_paged_attention(q, k_cache, v_cache, LAYER_ARRAY, md, sm_scale=0.125,
                                                          sliding_window=w, soft_cap=5.0,
                                                          alibi_slopes=jnp.asarray(slopes), interpret=True))
    for window in (1, 24):
        out = run(jnp.asarray(window, jnp.int32))
        assert_close(out, dense_attention(case, sm_scale=0.125, window=window, slopes=slopes, soft_cap=5.0), case,
                     f"window {window}, soft cap, ALiBi")


def test_decode_split_k_matches_reference_and_never_reads_outside_the_window() -> None:
    """Split-K forced to 3 pieces (some empty), fp16, contexts from 1 to 200 and two padding
    sequences; then with a window, every page no query can see is NaN."""
    lens = (1, 16, 17, 93, 200, 64)
    case = make_case("decode", [Seq(n - 1, 1) for n in lens], block_size=16, num_kv_heads=2, group=4,
                     head_dim=128, dtype=F16, pad_tokens=2, pad_seqs=2, pad_blocks_to=14)
    k_cache, v_cache = written(case)
    q, md = jnp.asarray(case.q), case.metadata()
    args = (q, k_cache, v_cache, LAYER_ARRAY, md.block_tables, md.context_lens)
    for splits in (1, 3):
        out = mosaic_paged_decode_attention(*args, sm_scale=0.1, config=MosaicAttentionConfig(num_splits=splits),
                                            interpret=True)
        assert_close(out, _decode_reference(*args, sm_scale=0.1), case, f"decode, {splits} splits")
    window = 40
    k_np, v_np = np.asarray(k_cache).copy(), np.asarray(v_cache).copy()
    hidden = 0
    for s, table in zip(case.seqs, case.block_tables):
        for i, block in enumerate(table):
            if (i + 1) * 16 <= s.context_len - window:  # wholly before the window
                k_np[LAYER, block] = np.nan
                v_np[LAYER, block] = np.nan
                hidden += 1
    assert hidden >= 8
    args = (q, jnp.asarray(k_np), jnp.asarray(v_np), LAYER_ARRAY, md.block_tables, md.context_lens)
    out = mosaic_paged_decode_attention(*args, sm_scale=0.1, sliding_window=window,
                                        config=MosaicAttentionConfig(num_splits=2), interpret=True)
    assert_close(out, dense_attention(case, sm_scale=0.1, window=window), case, "decode, window, NaN before it")


def test_no_data_races_in_the_pipeline() -> None:
    """The interpreter's happens-before race detector over the TMA ring, the P staging buffer and the
    zeroing of V's tail (two buffers, so every slot is refilled while the other is computed)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    case = make_case("races", [Seq(150, 1), Seq(0, 20)], block_size=8, num_kv_heads=1, group=2, head_dim=64,
                     dtype=BF16)
    k_cache, v_cache = written(case)
    q, md = jnp.asarray(case.q), case.metadata()
    out = mosaic_ragged_paged_attention(q, k_cache, v_cache, LAYER_ARRAY, md, sm_scale=0.125,
                                        config=MosaicAttentionConfig(num_buffers=2),
                                        interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert_close(out, _reference(q, k_cache, v_cache, LAYER_ARRAY, md, sm_scale=0.125), case, "race-checked run")
    assert not gpu_callbacks.get_races().races_found, "the race detector found a data race in the kernel"


VARIANTS = [dict(), dict(sliding_window=32), dict(soft_cap=30.0), dict(alibi=True),
            dict(sliding_window=8, soft_cap=10.0, alibi=True)]


@pytest.mark.parametrize("block_size,group,head_dim,dtype", SHAPES,
                         ids=[f"bs{b}-g{g}-d{d}-{np.dtype(t).name}" for b, g, d, t in SHAPES])
def test_every_variant_lowers_for_sm90(block_size: int, group: int, head_dim: int, dtype: np.dtype) -> None:
    """Both entries and the score options, lowered for CUDA as for an H200: the whole Mosaic GPU
    lowering (layouts, wgmma shapes, TMA transforms, shared-memory budget) runs without a GPU."""
    num_kv_heads, num_tokens, num_seqs, width = 2, 40, 6, 12
    q = jax.ShapeDtypeStruct((num_tokens, num_kv_heads * group, head_dim), dtype)
    cache = jax.ShapeDtypeStruct((2, 50, block_size, num_kv_heads, head_dim), dtype)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    md = ref_tests.AttentionMetadata(slot_mapping=i32(num_tokens), block_tables=i32(num_seqs, width),
                                     context_lens=i32(num_seqs), query_start_loc=i32(num_seqs + 1),
                                     logits_indices=i32(num_seqs))
    # Every option set on the first shape; on the others the plain one and all options together
    # (each variant's lowering is the same code at every shape; the shapes change tiles and budgets).
    for options in VARIANTS if (block_size, group, head_dim, dtype) == SHAPES[0] else (VARIANTS[0], VARIANTS[-1]):
        kw = {k: v for k, v in options.items() if k != "alibi"}
        slopes = jax.ShapeDtypeStruct((num_kv_heads * group,), jnp.float32) if options.get("alibi") else None
        ragged = lambda q, k, v, md, s: mosaic_ragged_paged_attention(q, k, v, 1, md, sm_scale=0.1,  # noqa: E731
                                                                       alibi_slopes=s, **kw)
        text = lower_for_cuda(ragged, q, cache, cache, md, slopes)
        assert "mosaic_gpu" in text, f"no Mosaic GPU kernel in the lowering for {options}"
        decode = lambda q, k, v, bt, cl, s: mosaic_paged_decode_attention(q, k, v, 1, bt, cl, sm_scale=0.1,  # noqa: E731
                                                                           alibi_slopes=s, **kw)
        dq = jax.ShapeDtypeStruct((num_seqs, num_kv_heads * group, head_dim), dtype)
        assert "mosaic_gpu" in lower_for_cuda(decode, dq, cache, cache, i32(num_seqs, width), i32(num_seqs), slopes)


@pytest.mark.parametrize("block_size,group,head_dim,dtype,fp8", [
    (8, 1, 64, BF16, "float8_e4m3fn"), (16, 3, 128, F16, "float8_e5m2"), (32, 2, 256, BF16, "float8_e4m3fn")],
    ids=["bs8-g1-d64-e4m3", "bs16-g3-d128-f16-e5m2", "bs32-g2-d256-e4m3"])
def test_fp8_pages_lower_for_sm90(block_size: int, group: int, head_dim: int, dtype: np.dtype, fp8: str) -> None:
    """An fp8 cache (uint8 bits) through both entries, with a window and ALiBi: its ring of one-byte
    pages, the widened tiles and the larger shared-memory footprint all lower for an H200."""
    num_kv_heads, num_tokens, num_seqs, width = 2, 40, 6, 12
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    cache = jax.ShapeDtypeStruct((2, 50, block_size, num_kv_heads, head_dim), jnp.uint8)
    slopes = jax.ShapeDtypeStruct((num_kv_heads * group,), jnp.float32)
    md = ref_tests.AttentionMetadata(slot_mapping=i32(num_tokens), block_tables=i32(num_seqs, width),
                                     context_lens=i32(num_seqs), query_start_loc=i32(num_seqs + 1),
                                     logits_indices=i32(num_seqs))
    q = jax.ShapeDtypeStruct((num_tokens, num_kv_heads * group, head_dim), dtype)
    ragged = lambda q, k, v, md, s: mosaic_ragged_paged_attention(  # noqa: E731
        q, k, v, 1, md, sm_scale=0.1, alibi_slopes=s, sliding_window=64, fp8=fp8)
    assert "mosaic_gpu" in lower_for_cuda(ragged, q, cache, cache, md, slopes)
    dq = jax.ShapeDtypeStruct((num_seqs, num_kv_heads * group, head_dim), dtype)
    decode = lambda q, k, v, bt, cl, s: mosaic_paged_decode_attention(  # noqa: E731
        q, k, v, 1, bt, cl, sm_scale=0.1, alibi_slopes=s, sliding_window=64, fp8=fp8)
    assert "mosaic_gpu" in lower_for_cuda(decode, dq, cache, cache, i32(num_seqs, width), i32(num_seqs), slopes)
