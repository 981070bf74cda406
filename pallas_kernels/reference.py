"""Reference (pure `jnp`, XLA) ragged paged attention and the KV-cache write by slot mapping.

This is what CPU serving runs and what every Pallas kernel is tested against. The work is split
into *work items*: one query block (one decode token, or up to 64 consecutive prompt tokens of one
sequence) against one KV chunk (32 or 64 consecutive cache positions, whole pages) that the block
can see. Only the chunks a block needs are enumerated, so a short sequence in a batch with a long
one costs only its own context; a loop gathers a bounded group of items per iteration (small
enough to stay in cache between the gather and the two products) and merges each item's partial
softmax into its query block's running max, sum and output (flash-attention style).

Cache layout: `k_cache`, `v_cache` are `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`
and a step addresses one layer by index, so a `lax.scan` over layers updates the cache in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from paxserve.kernels.attention_args import (
    Window,
    check_alibi_slopes,
    check_sliding_window,
    slopes_operand,
    window_operand,
)
from paxserve.kernels.kv_cache import fp8_view, to_cache_dtype
from paxserve.kernels.metadata import NULL_BLOCK, AttentionMetadata

# Cache positions gathered (as K and V) per loop iteration, over all its work items together:
# 2048 x 3 KV heads x 64 dims x 2 x 4 bytes = 3 MiB for SmolLM2, which stays in cache.
_KEYS_PER_ITERATION = 2048
# KV chunk length in tokens for decode and for prompt blocks. Short chunks waste little past a
# sequence's last token; prompt blocks take longer ones so each product is a reasonable matmul.
_DECODE_CHUNK = 32
_PREFILL_CHUNK = 64


def write_kv_reference(
    k_cache: Float[Array, "L N P K D"],
    v_cache: Float[Array, "L N P K D"],
    layer: Int[Array, ""] | int,
    k: Float[Array, "T K D"],
    v: Float[Array, "T K D"],
    slot_mapping: Int[Array, " T"],
) -> tuple[Float[Array, "L N P K D"], Float[Array, "L N P K D"]]:
    """Scatter the new tokens' K/V into their cache slots (padding slots land in null block 0)."""
    block_size = k_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache = k_cache.at[layer, blocks, offsets].set(to_cache_dtype(k, k_cache.dtype))
    v_cache = v_cache.at[layer, blocks, offsets].set(to_cache_dtype(v, v_cache.dtype))
    return k_cache, v_cache


def ragged_paged_attention_reference(
    q: Float[Array, "T H D"],
    k_cache: Float[Array, "L N P K D"],
    v_cache: Float[Array, "L N P K D"],
    layer: Int[Array, ""] | int,
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: Window = None,
    soft_cap: float | None = None,
    alibi_slopes: Float[Array, " H"] | None = None,
    fp8: str | None = None,
) -> Float[Array, "T H D"]:
    """Causal attention of each new token to its own sequence's cached context.

    Token t of sequence s (query length n, context length c) sits at position
    `qp = c - n + (t - query_start_loc[s])` and attends to cache positions kp with `kp <= qp`
    (and, with a sliding window W, `kp > qp - W`). Query head h reads KV head
    `h // (num_heads // num_kv_heads)`. Its score is `(q.k + slope[h] * (kp - qp)) * sm_scale`
    (the ALiBi term only with `alibi_slopes`; added before the scale, as Hugging Face Falcon does),
    then `soft_cap * tanh(score / soft_cap)` if `soft_cap`, then the mask and the softmax.
    Padding tokens produce zeros. Masked cache entries are never mixed into the result, so garbage
    (even NaN) in unused pages cannot leak, and KV chunks wholly before a query block's window are
    never gathered.

    sliding_window: None (no window), a Python int >= 1 (checked here, ValueError otherwise), or an
      integer scalar array that may be traced, e.g. a per-layer window scanned over layers (not
      checked; clamped to [1, NO_WINDOW]). A global layer of a windowed model passes `NO_WINDOW`.
    alibi_slopes: None, or float32 [num_heads] (a dynamic array; see `alibi_slopes(num_heads)`).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    entry = "ragged_paged_attention_reference"
    window = window_operand(check_sliding_window(sliding_window, entry))
    check_alibi_slopes(alibi_slopes, num_heads, entry)
    slopes = slopes_operand(alibi_slopes)
    if slopes is not None:
        slopes = slopes.reshape(num_kv_heads, group)[None, :, None, :, None]  # [1, K, 1, G, 1] like the scores
    # Pure decode buckets (at most one token per sequence on average) take one token per block.
    block_q = min(64, 1 << max(0, (num_tokens // metadata.num_seqs).bit_length() - 1))
    qb_seq, qb_index, num_real_qb = metadata.query_blocks(num_tokens, block_q)
    num_qb = qb_seq.shape[0]
    qb_tokens = (metadata.query_start_loc[qb_seq] + qb_index * block_q)[:, None] + jnp.arange(block_q, dtype=jnp.int32)
    qb_ok = (jnp.arange(num_qb, dtype=jnp.int32) < num_real_qb)[:, None] & (qb_tokens < metadata.query_start_loc[qb_seq + 1][:, None])
    pos = metadata.context_lens[qb_seq][:, None] - (metadata.query_start_loc[qb_seq + 1][:, None] - qb_tokens)

    # KV chunks of whole pages; the block table is padded with the null block to whole chunks.
    chunk_pages = max(1, (_DECODE_CHUNK if block_q == 1 else _PREFILL_CHUNK) // block_size)
    chunk = chunk_pages * block_size
    num_chunks = -(-metadata.block_tables.shape[1] // chunk_pages)
    tables = metadata.block_tables
    tables = jnp.pad(tables, ((0, 0), (0, num_chunks * chunk_pages - tables.shape[1])), constant_values=NULL_BLOCK)

    # Work items: query block b needs chunks first[b] .. last[b], enumerated block after block.
    big = jnp.iinfo(jnp.int32).max
    last = jnp.max(jnp.where(qb_ok, pos, 0), axis=1) // chunk
    if window is None:
        first = jnp.zeros_like(last)
    else:  # `big - window` cannot overflow: window >= 1
        first = jnp.maximum(jnp.min(jnp.where(qb_ok, pos, big), axis=1) - window + 1, 0) // chunk
    items_per_qb = jnp.where(jnp.any(qb_ok, axis=1), last - first + 1, 0)
    item_end = jnp.cumsum(items_per_qb)
    num_items = item_end[-1]
    per_iter = max(1, min(_KEYS_PER_ITERATION // chunk, num_qb * num_chunks))

    q_blocks = q.astype(jnp.float32)[jnp.clip(qb_tokens, 0, num_tokens - 1)]  # [Q, bq, H, D]
    q_blocks = q_blocks.reshape(num_qb, block_q, num_kv_heads, group, head_dim)
    span = jnp.arange(chunk, dtype=jnp.int32)

    def merge(i: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        """Work items i * per_iter ... : partial softmax per item, merged into its query block's
        running max M, sum L and unnormalised output A."""
        run_max, run_sum, run_out = carry
        w = i * per_iter + jnp.arange(per_iter, dtype=jnp.int32)
        qb = jnp.minimum(jnp.searchsorted(item_end, w, side="right"), num_qb - 1).astype(jnp.int32)
        c = first[qb] + w - (item_end[qb] - items_per_qb[qb])
        cols = jnp.clip(c[:, None] * chunk_pages + jnp.arange(chunk_pages, dtype=jnp.int32), 0, tables.shape[1] - 1)
        pages = tables[qb_seq[qb][:, None], cols]
        # An fp8 cache's uint8 bits are viewed as values after the gather (pallas_kernels/kv_cache.py).
        k = fp8_view(k_cache[layer, pages], fp8).reshape(per_iter, chunk, num_kv_heads, head_dim)
        v = fp8_view(v_cache[layer, pages], fp8).reshape(per_iter, chunk, num_kv_heads, head_dim)
        key_pos = c[:, None] * chunk + span  # [I, chunk]
        qpos = pos[qb]  # [I, bq]
        mask = (key_pos[:, None, :] <= qpos[:, :, None]) & (qb_ok[qb] & (w < num_items)[:, None])[:, :, None]
        if window is not None:
            mask &= key_pos[:, None, :] > qpos[:, :, None] - window
        s = jnp.einsum("ibkgd,ilkd->ikbgl", q_blocks[qb], k.astype(jnp.float32),
                       preferred_element_type=jnp.float32)
        if slopes is not None:
            # Relative distance (<= 0 where visible): HF's slope * kp differs by a per-row constant,
            # which softmax ignores, and this stays small at long contexts.
            dist = (key_pos[:, None, :] - qpos[:, :, None]).astype(jnp.float32)  # [I, bq, chunk]
            s = s + slopes * dist[:, None, :, None, :]
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        m5 = mask[:, None, :, None, :]  # [I, 1, bq, 1, chunk]
        s = jnp.where(m5, s, -jnp.inf)
        m = jnp.max(s, axis=-1)
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.where(m5, jnp.exp(s - m_safe[..., None]), 0.0)
        # Keys no row may see are zeroed so that garbage (even NaN) in unused pages cannot leak.
        v = jnp.where(jnp.any(mask, axis=1)[:, :, None, None], v.astype(jnp.float32), 0.0)
        out = jnp.einsum("ikbgl,ilkd->ikbgd", p, v, preferred_element_type=jnp.float32)
        # Merge: a block's items may repeat within an iteration, so its old state is rescaled with
        # `set` (every duplicate writes the same value) before the items' shares are added.
        new_max = run_max.at[qb].max(m)
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)[qb]
        keep = jnp.where(jnp.isfinite(run_max[qb]), jnp.exp(run_max[qb] - safe_max), 0.0)
        share = jnp.where(jnp.isfinite(m), jnp.exp(m - safe_max), 0.0)
        run_sum = run_sum.at[qb].set(run_sum[qb] * keep).at[qb].add(jnp.sum(p, axis=-1) * share)
        run_out = run_out.at[qb].set(run_out[qb] * keep[..., None]).at[qb].add(out * share[..., None])
        return new_max, run_sum, run_out

    state = (jnp.full((num_qb, num_kv_heads, block_q, group), -jnp.inf, jnp.float32),
             jnp.zeros((num_qb, num_kv_heads, block_q, group), jnp.float32),
             jnp.zeros((num_qb, num_kv_heads, block_q, group, head_dim), jnp.float32))
    _, run_sum, run_out = jax.lax.fori_loop(0, (num_items + per_iter - 1) // per_iter, merge, state)
    out = run_out / jnp.where(run_sum > 0, run_sum, 1.0)[..., None]
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_qb, block_q, num_heads, head_dim).astype(q.dtype)
    if block_q == 1:
        return out.reshape(num_tokens, num_heads, head_dim)
    # Each real token belongs to exactly one block; padding rows index past the end and are dropped.
    rows = jnp.where(qb_ok, qb_tokens, num_tokens).reshape(-1)
    result = jnp.zeros((num_tokens, num_heads, head_dim), q.dtype)
    return result.at[rows].set(out.reshape(-1, num_heads, head_dim), mode="drop")
