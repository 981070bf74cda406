"""Start-up self-check: run an attention backend once on a small random paged batch and compare it
with the XLA reference, so a kernel that does not compile or gives wrong numbers on this machine is
found before the first step (and `resolve_attention_backend` can fall back to the reference).

The batch has the model's head counts, head_dim, block size and dtype, and covers what a real
step does: a prompt chunk from position 0, a chunk on top of cached context, decode tokens (one at
a block boundary, one whose context spans several key steps), a padding sequence and padding
tokens, pages in random order, and every unused page (and the null block) full of NaN.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.metadata import NULL_BLOCK, AttentionMetadata
from pallas_kernels.paged_attention_reference import ragged_paged_attention_reference

if TYPE_CHECKING:  # dispatch imports this module for its default self-check
    from pallas_kernels.dispatch import AttentionBackend

__all__ = ["self_check_attention", "tolerance_for"]

_NUM_LAYERS = 2
_LAYER = 1  # the layer read; layer 0 holds finite garbage, so reading the wrong layer shows
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_MAX_REASON = 300


def tolerance_for(dtype: jnp.dtype) -> float:
    """Largest accepted max|out - ref| / max|ref|: float32 1e-5, 16-bit floats 2e-2."""
    return 1e-5 if jnp.dtype(dtype) == jnp.dtype(jnp.float32) else 2e-2


def _describe(error: BaseException) -> str:
    """"ExceptionType: first non-empty line of the message", without memory addresses."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    first = _ADDRESS.sub("<address>", lines[0]) if lines else "(no message)"
    if len(first) > _MAX_REASON:
        first = first[: _MAX_REASON - 3] + "..."
    return f"{type(error).__name__}: {first}"


def _problem(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, seed: int):
    """Numpy float32 q, K/V caches (NaN outside the sequences' contexts) and int32 metadata arrays,
    laid out as `paxserve.batch.build_batch` does (pallas_kernels does not import the engine)."""
    rng = np.random.default_rng(seed)
    bs = block_size
    # (tokens already cached, new tokens, allocated blocks beyond the context: NaN, never written)
    seqs = [
        (0, bs + 3, 0),  # a prompt chunk from position 0
        (2 * bs + 1, 6, 1),  # a chunk on top of cached context, with an empty allocated block
        (bs - 1, 1, 0),  # decode: context exactly one block
        (64 + bs + 2, 1, 0),  # decode: context longer than one key step of the kernel
        (0, 1, 0),  # a one-token prompt
    ]
    num_tokens = sum(n for _, n, _ in seqs)
    t_pad = -(-(num_tokens + 1) // 16) * 16  # at least one padding token, like the engine's buckets
    s_pad = 8  # three padding sequences
    blocks_needed = [-(-(c + n) // bs) + extra for c, n, extra in seqs]
    num_blocks = 1 + sum(blocks_needed) + 2  # null block, the tables, two spare (NaN) pages
    width = max(blocks_needed)
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)  # never the null block

    cache_shape = (_NUM_LAYERS, num_blocks, bs, num_kv_heads, head_dim)
    k_cache = np.full(cache_shape, np.nan, np.float32)
    v_cache = np.full(cache_shape, np.nan, np.float32)
    k_cache[0] = rng.standard_normal(cache_shape[1:])
    v_cache[0] = rng.standard_normal(cache_shape[1:])
    q = rng.standard_normal((t_pad, num_heads, head_dim)).astype(np.float32)

    slot_mapping = np.full(t_pad, NULL_BLOCK * bs, np.int32)
    block_tables = np.full((s_pad, width), NULL_BLOCK, np.int32)
    context_lens = np.zeros(s_pad, np.int32)
    query_start_loc = np.full(s_pad + 1, num_tokens, np.int32)
    logits_indices = np.zeros(s_pad, np.int32)
    start = first_block = 0
    for s, ((cached, n, _), needed) in enumerate(zip(seqs, blocks_needed)):
        table = ids[first_block : first_block + needed]
        first_block += needed
        pos = np.arange(cached + n)
        # Every context position is in the cache: the cached ones and this step's (already written).
        k_cache[_LAYER, table[pos // bs], pos % bs] = rng.standard_normal((cached + n, num_kv_heads, head_dim))
        v_cache[_LAYER, table[pos // bs], pos % bs] = rng.standard_normal((cached + n, num_kv_heads, head_dim))
        new = pos[cached:]
        slot_mapping[start : start + n] = table[new // bs] * bs + new % bs
        block_tables[s, :needed] = table
        context_lens[s] = cached + n
        query_start_loc[s] = start
        logits_indices[s] = start + n - 1
        start += n
    metadata = (slot_mapping, block_tables, context_lens, query_start_loc, logits_indices)
    return q, k_cache, v_cache, metadata, num_tokens


def self_check_attention(
    backend: AttentionBackend,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: jnp.dtype,
    seed: int = 0,
) -> str | None:
    """Run `attention(...)` on `backend` once on a small random paged batch with the model's shapes
    and compare it with `ragged_paged_attention_reference` on the same device.

    Returns None when the outputs of the real tokens agree (finite, and
    max|out - ref| / max|ref| below `tolerance_for(dtype)`), else a short reason:
    "compile/run failed: <ExceptionType>: <first line>" or "mismatch: ...". Never raises (an
    exception of any kind, XLA runtime errors included, becomes the reason).
    """
    from pallas_kernels.dispatch import attention  # here: dispatch imports this module

    try:
        q_np, k_np, v_np, md_np, n = _problem(num_heads, num_kv_heads, head_dim, block_size, seed)
        dt = jnp.dtype(dtype)
        q, k_cache, v_cache = (jnp.asarray(x, dtype=dt) for x in (q_np, k_np, v_np))
        metadata = AttentionMetadata(*(jnp.asarray(x) for x in md_np))
        layer = jnp.asarray(_LAYER, jnp.int32)
        sm_scale = float(head_dim) ** -0.5
        ref = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=sm_scale))(
            q, k_cache, v_cache, layer, metadata)
        ref = np.asarray(jax.block_until_ready(ref)).astype(np.float64)[:n]
    except Exception as error:  # noqa: BLE001 - the check must never raise
        return f"reference failed: {_describe(error)}"
    try:
        out = jax.jit(functools.partial(attention, sm_scale=sm_scale, backend=backend))(
            q, k_cache, v_cache, layer, metadata)
        out = jax.block_until_ready(out)
        if out.shape != q.shape or out.dtype != q.dtype:
            return f"mismatch: output is {out.dtype.name}{list(out.shape)}, expected {q.dtype.name}{list(q.shape)}"
        out = np.asarray(out).astype(np.float64)[:n]
    except Exception as error:  # noqa: BLE001
        return f"compile/run failed: {_describe(error)}"
    bad = int(np.count_nonzero(~np.isfinite(out)))
    if bad:
        return f"mismatch: {bad} of {out.size} output values are NaN or inf"
    scale = float(np.max(np.abs(ref)))
    rel = float(np.max(np.abs(out - ref))) / (scale if scale > 0 else 1.0)
    tol = tolerance_for(dt)
    if not rel < tol:
        return f"mismatch: max relative error {rel:.3g} > tol {tol:g}"
    return None
