"""The Mosaic GPU kernels on the main suite's JAX (0.10.2): they trace and lower for CUDA here too.

Running them needs a Hopper GPU or JAX >= 0.11.2's GPU interpret mode, which the Python 3.12 lane
(`tests/mosaic_gpu/`) has; this file checks what this JAX can: the whole Mosaic GPU lowering of
both entries with every score option, and a clear error, not a crash, when interpret mode is asked
of a JAX without it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from paxserve.kernels import AttentionMetadata, mosaic_paged_decode_attention, mosaic_ragged_paged_attention
from tests.helpers import lower_for_cuda


def i32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.int32)


@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,dtype", [
    (16, 8, 2, 128, jnp.bfloat16), (8, 2, 2, 64, jnp.float16), (32, 8, 1, 256, jnp.bfloat16)])
def test_both_entries_lower_for_cuda_with_every_option(block_size: int, heads: int, kv_heads: int, head_dim: int,
                                                        dtype: jnp.dtype) -> None:
    tokens, seqs = 40, 6
    q = jax.ShapeDtypeStruct((tokens, heads, head_dim), dtype)
    cache = jax.ShapeDtypeStruct((2, 50, block_size, kv_heads, head_dim), dtype)
    md = AttentionMetadata(i32(tokens), i32(seqs, 12), i32(seqs), i32(seqs + 1), i32(seqs))
    options = dict(sm_scale=0.1, soft_cap=20.0)
    ragged = lambda q, k, v, md, w, s: mosaic_ragged_paged_attention(  # noqa: E731
        q, k, v, 1, md, sliding_window=w, alibi_slopes=s, **options)
    slopes = jax.ShapeDtypeStruct((heads,), jnp.float32)
    assert "mosaic_gpu" in lower_for_cuda(ragged, q, cache, cache, md, i32(), slopes)
    decode = lambda q, k, v, bt, cl: mosaic_paged_decode_attention(q, k, v, 1, bt, cl, sm_scale=0.1)  # noqa: E731
    dq = jax.ShapeDtypeStruct((seqs, heads, head_dim), dtype)
    assert "mosaic_gpu" in lower_for_cuda(decode, dq, cache, cache, i32(seqs, 12), i32(seqs))


def test_interpret_mode_needs_jax_0_11_2_and_says_so() -> None:
    if hasattr(plgpu, "InterpretGPUParams"):
        pytest.fail("this JAX has Mosaic GPU interpret mode: the lane's tests cover it, update this test")
    q = jnp.zeros((4, 2, 64), jnp.bfloat16)
    cache = jnp.zeros((1, 4, 16, 2, 64), jnp.bfloat16)
    md = AttentionMetadata(jnp.zeros(4, jnp.int32), jnp.ones((2, 1), jnp.int32), jnp.array([2, 2], jnp.int32),
                           jnp.array([0, 2, 4], jnp.int32), jnp.array([1, 3], jnp.int32))
    with pytest.raises(RuntimeError, match=f"needs JAX >= 0.11.2 \\(this is JAX {jax.__version__}\\)"):
        mosaic_ragged_paged_attention(q, cache, cache, 0, md, sm_scale=0.1, interpret=True)
