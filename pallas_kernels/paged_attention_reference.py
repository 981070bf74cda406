"""Reference (pure `jnp`, XLA) ragged paged attention and the KV-cache write by slot mapping.

This is what CPU serving runs and what every Pallas kernel is tested against. It gathers each
sequence's K/V through its block table (once per decode token, or once per block of up to 64 prompt
tokens), so it is exact but materialises the gathered context; the work is batched so that memory
stays bounded for long prompts.

Cache layout: `k_cache`, `v_cache` are `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`
and a step addresses one layer by index, so a `lax.scan` over layers updates the cache in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.metadata import AttentionMetadata

# Elements of gathered K per token chunk: bounds the reference's temporary memory (~64 MiB f32).
_GATHER_BUDGET = 1 << 24


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
    k_cache = k_cache.at[layer, blocks, offsets].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[layer, blocks, offsets].set(v.astype(v_cache.dtype))
    return k_cache, v_cache


def ragged_paged_attention_reference(
    q: Float[Array, "T H D"],
    k_cache: Float[Array, "L N P K D"],
    v_cache: Float[Array, "L N P K D"],
    layer: Int[Array, ""] | int,
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> Float[Array, "T H D"]:
    """Causal attention of each new token to its own sequence's cached context.

    Token t of sequence s (query length n, context length c) sits at position
    `c - n + (t - query_start_loc[s])` and attends to cache positions `<=` that (and, with a
    sliding window W, `> position - W`). Padding tokens produce zeros. Masked cache entries are
    never mixed into the result, so garbage (even NaN) in unused pages cannot leak.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_seqs = metadata.num_seqs
    max_len = metadata.block_tables.shape[1] * block_size
    qsl, context_lens = metadata.query_start_loc, metadata.context_lens
    key_pos = jnp.arange(max_len, dtype=jnp.int32)

    def attend(seq: Array, tokens: Array, ok: Array, q_rows: Array) -> Array:
        """Query rows `q_rows` [..., H, D] at flat `tokens` [...] (all of sequence `seq`; `ok` marks
        real ones) against the sequence's context. `...` is empty for one token, (C,) for a block."""
        ctx = context_lens[seq]
        pos = ctx - (qsl[seq + 1] - tokens)
        blocks = metadata.block_tables[seq]
        k = k_cache[layer, blocks].reshape(max_len, num_kv_heads, head_dim)
        v = v_cache[layer, blocks].reshape(max_len, num_kv_heads, head_dim)
        mask = (key_pos <= pos[..., None]) & (key_pos < ctx) & ok[..., None]
        if sliding_window is not None:
            mask &= key_pos > pos[..., None] - sliding_window
        qg = q_rows.reshape(*tokens.shape, num_kv_heads, group, head_dim)
        scores = jnp.einsum("...kgd,lkd->...kgl", qg, k, preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        m = mask[..., None, None, :]
        scores = jnp.where(m, scores, -jnp.inf)
        row_max = jnp.max(scores, axis=-1, keepdims=True)
        probs = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
        probs = jnp.where(m, probs, 0.0)
        denom = jnp.sum(probs, axis=-1, keepdims=True)
        probs = probs / jnp.where(denom > 0, denom, 1.0)
        # Keys no row may see are zeroed so that garbage (even NaN) in unused pages cannot leak.
        seen = mask if mask.ndim == 1 else jnp.any(mask, axis=0)
        v = jnp.where(seen[:, None, None], v, jnp.zeros((), v.dtype))
        out = jnp.einsum("...kgl,lkd->...kgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return out.reshape(*tokens.shape, num_heads, head_dim).astype(q.dtype)

    def run(xs: tuple[Array, Array, Array, Array], count: int, per_item: int) -> Array:
        """`attend` over the leading axis of `xs`, in batches that keep the gathers within budget."""
        batch = max(1, _GATHER_BUDGET // per_item)
        fn = lambda a: attend(*a)  # noqa: E731
        return jax.vmap(fn)(xs) if count <= batch else jax.lax.map(fn, xs, batch_size=batch)

    # Pure decode buckets (at most one token per sequence on average): one row per token, in place.
    block_q = min(64, 1 << max(0, (num_tokens // num_seqs).bit_length() - 1))
    if block_q == 1:
        t = jnp.arange(num_tokens, dtype=jnp.int32)
        xs = (metadata.token_seq_ids(num_tokens), t, metadata.token_is_valid(num_tokens), q)
        return run(xs, num_tokens, max_len * (2 * num_kv_heads * head_dim + num_heads))

    # Prompt chunks: work items of `block_q` consecutive tokens of one sequence gather the context
    # once per item instead of once per token. The item count is a static upper bound.
    num_items = min(num_tokens, num_tokens // block_q + num_seqs)
    q_lens = qsl[1:] - qsl[:-1]
    items_per_seq = (q_lens + block_q - 1) // block_q
    item_end = jnp.cumsum(items_per_seq)
    w = jnp.arange(num_items, dtype=jnp.int32)
    item_seq = jnp.minimum(jnp.searchsorted(item_end, w, side="right"), num_seqs - 1).astype(jnp.int32)
    item_tokens = qsl[item_seq] + (w - (item_end[item_seq] - items_per_seq[item_seq])) * block_q
    item_tokens = item_tokens[:, None] + jnp.arange(block_q, dtype=jnp.int32)[None, :]
    item_ok = (w < item_end[-1])[:, None] & (item_tokens < qsl[item_seq + 1][:, None])
    item_q = q[jnp.clip(item_tokens, 0, num_tokens - 1)]
    outs = run((item_seq, item_tokens, item_ok, item_q), num_items,
               max_len * (2 * num_kv_heads * head_dim + block_q * num_heads))
    # Each real token belongs to exactly one item; padding rows index past the end and are dropped.
    rows = jnp.where(item_ok, item_tokens, num_tokens).reshape(-1)
    out = jnp.zeros((num_tokens, num_heads, head_dim), q.dtype)
    return out.at[rows].set(outs.reshape(-1, num_heads, head_dim), mode="drop")
