"""An fp8 KV cache through the kernels: writes saturate instead of overflowing to NaN, the Triton
ragged and decode-only kernels (interpret mode, and lowered for CUDA) read the fp8 pages (stored as
uint8 bits) as the XLA reference does, and dispatch passes over the Mosaic GPU kernels, which do not
read fp8 pages."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from paxserve.kernels import (
    AttentionBackend,
    self_check_attention,
    paged_decode_attention,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    resolve_attention_backend,
)
from paxserve.kernels.decode_attention import paged_decode_attention_reference
from paxserve.kernels.kv_cache import KV_CACHE_DTYPES, KVCache, fp8_bits, to_cache_dtype
from tests.helpers import lower_for_cuda
from tests.pallas_kernels.test_decode_attention import decode_case
from tests.pallas_kernels.test_reference_attention import LAYER, Seq, _write, make_case

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3, E5M2 = KV_CACHE_DTYPES["fp8_e4m3"], KV_CACHE_DTYPES["fp8_e5m2"]


def test_fp8_writes_saturate_and_a_new_cache_has_unit_scales() -> None:
    x = jnp.asarray([1000.0, -1000.0, 3.0, 0.0], jnp.float32)
    assert np.asarray(to_cache_dtype(x, E4M3), np.float32).tolist() == [448.0, -448.0, 3.0, 0.0]
    assert np.asarray(to_cache_dtype(x * 64, E5M2), np.float32).tolist() == [57344.0, -57344.0, 192.0, 0.0]
    cache = KVCache.zeros(3, 2, 8, 1, 4, E4M3)
    assert cache.k.dtype == np.uint8 and cache.fp8 == "float8_e4m3fn"
    assert np.asarray(cache.k_scale).tolist() == [1.0, 1.0, 1.0]
    assert KVCache.zeros(3, 2, 8, 1, 4, jnp.bfloat16).k_scale is None


def _fp8_pages(case, dtype: np.dtype):  # noqa: ANN001, ANN202
    """The case's cache after its write, as an fp8 cache stores it (uint8 bits)."""
    md = case.metadata()
    layer = jnp.asarray(LAYER, jnp.int32)
    k, v = _write(jnp.asarray(case.k_cache), jnp.asarray(case.v_cache), layer, jnp.asarray(case.k_new),
                  jnp.asarray(case.v_new), md.slot_mapping)
    return fp8_bits(k, dtype.name), fp8_bits(v, dtype.name), md, layer


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_triton_ragged_kernel_reads_fp8_pages_as_the_reference_does(dtype: np.dtype) -> None:
    bs = 16
    case = make_case("fp8-ragged", [Seq(0, 21), Seq(3 * bs - 2, 1), Seq(bs, bs + 3)], block_size=bs, num_kv_heads=2,
                     group=2, head_dim=32, dtype=BF16, pad_tokens=3, pad_seqs=1, pad_blocks_to=8)
    k, v, md, layer = _fp8_pages(case, dtype)
    q, scale = jnp.asarray(case.q), 1.0 / math.sqrt(case.head_dim)
    out = ragged_paged_attention(q, k, v, layer, md, sm_scale=scale, interpret=True, fp8=dtype.name)
    ref = ragged_paged_attention_reference(q, k, v, layer, md, sm_scale=scale, fp8=dtype.name)
    n = case.batch.num_tokens
    out64, ref64 = (np.asarray(a, np.float64)[:n] for a in (out, ref))
    assert out.dtype == q.dtype and np.all(np.isfinite(out64))
    assert float(np.max(np.abs(out64 - ref64)) / np.max(np.abs(ref64))) < 1e-2


def test_triton_decode_kernel_reads_fp8_pages_as_the_reference_does() -> None:
    case = decode_case("fp8-decode", 16, 4, BF16)
    k, v, md, layer = _fp8_pages(case, E4M3)
    q, scale = jnp.asarray(case.q), 1.0 / math.sqrt(case.head_dim)
    out = paged_decode_attention(q, k, v, layer, md.block_tables, md.context_lens, sm_scale=scale, interpret=True,
                                 fp8=E4M3.name)
    ref = paged_decode_attention_reference(q, k, v, layer, md.block_tables, md.context_lens, sm_scale=scale,
                                           fp8=E4M3.name)
    n = case.batch.num_tokens
    out64, ref64 = (np.asarray(a, np.float64)[:n] for a in (out, ref))
    assert np.all(np.isfinite(out64))
    assert float(np.max(np.abs(out64 - ref64)) / np.max(np.abs(ref64))) < 1e-2


def test_triton_kernels_with_fp8_pages_lower_for_cuda() -> None:
    tokens, seqs, blocks, heads, d, bs = 64, 8, 4, 2, 64, 16
    q = jax.ShapeDtypeStruct((tokens, heads * 4, d), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((2, 32, bs, heads, d), jnp.uint8)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    decode = lambda q, k, v, layer, tables, lens: paged_decode_attention(  # noqa: E731
        q, k, v, layer, tables, lens, sm_scale=0.125, fp8=E4M3.name)
    q_decode = jax.ShapeDtypeStruct((seqs, heads * 4, d), jnp.bfloat16)
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(decode, q_decode, cache, cache, i32(), i32(seqs, blocks), i32(seqs))
    from paxserve.kernels import AttentionMetadata

    md = AttentionMetadata(i32(tokens), i32(seqs, blocks), i32(seqs), i32(seqs + 1), i32(seqs))
    ragged = lambda q, k, v, layer, md: ragged_paged_attention(q, k, v, layer, md, sm_scale=0.125,  # noqa: E731
                                                               fp8=E4M3.name)
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(ragged, q, cache, cache, i32(), md)


def test_dispatch_checks_each_kernel_on_fp8_pages_and_hands_over_to_mosaic() -> None:
    shapes = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.bfloat16)
    checked = []

    def self_check(backend, **kwargs):  # noqa: ANN001, ANN003, ANN202
        checked.append((backend.name, backend.pure_decode, kwargs.get("kv_dtype")))
        return "forced failure" if backend.name == "triton" and not backend.pure_decode else None

    # Triton fails here on purpose: on Hopper the next candidate, Mosaic GPU, reads fp8 pages too.
    backend = resolve_attention_backend("auto", "gpu", **shapes, kv_dtype=E4M3, self_check=self_check,
                                        compute_capability="9.0")
    assert backend.name == "mosaic" and backend.decode_kernel
    assert checked == [("triton", False, E4M3), ("mosaic", False, E4M3), ("mosaic", True, E4M3)]


def test_the_triton_kernels_pass_their_self_check_on_fp8_pages() -> None:
    """The start-up check of an fp8 cache on a GPU: it once passed the format to the jitted kernel as
    an argument (a string), failed on every machine, and put fp8 caches on the XLA reference."""
    shapes = dict(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=jnp.bfloat16, kv_dtype=E4M3)
    for pure_decode in (False, True):
        assert self_check_attention(AttentionBackend("triton", interpret=True, pure_decode=pure_decode), **shapes) is None
