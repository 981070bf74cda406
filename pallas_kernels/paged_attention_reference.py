"""Reference (pure `jnp`, XLA) ragged paged attention and the KV-cache write by slot mapping.

This is what CPU serving runs and what every Pallas kernel is tested against. It gathers each
token's K/V through its sequence's block table, so it is exact but materialises the gathered
context; the work is split into token chunks so that memory stays bounded for long prompts.

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
    max_len = metadata.block_tables.shape[1] * block_size

    seq_ids = metadata.token_seq_ids(num_tokens)
    valid = metadata.token_is_valid(num_tokens)
    ends = metadata.query_start_loc[1:][seq_ids]
    q_pos = metadata.context_lens[seq_ids] - (ends - jnp.arange(num_tokens, dtype=jnp.int32))
    key_pos = jnp.arange(max_len, dtype=jnp.int32)

    def one_token(args: tuple[Array, Array, Array, Array]) -> Array:
        q_t, seq, pos, ok = args
        blocks = metadata.block_tables[seq]
        k = k_cache[layer, blocks].reshape(max_len, num_kv_heads, head_dim)
        v = v_cache[layer, blocks].reshape(max_len, num_kv_heads, head_dim)
        mask = (key_pos <= pos) & (key_pos < metadata.context_lens[seq]) & ok
        if sliding_window is not None:
            mask &= key_pos > pos - sliding_window
        qg = q_t.reshape(num_kv_heads, group, head_dim)
        scores = jnp.einsum("kgd,lkd->kgl", qg, k, preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        scores = jnp.where(mask, scores, -jnp.inf)
        row_max = jnp.max(scores, axis=-1, keepdims=True)
        probs = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
        probs = jnp.where(mask, probs, 0.0)
        denom = jnp.sum(probs, axis=-1, keepdims=True)
        probs = probs / jnp.where(denom > 0, denom, 1.0)
        v = jnp.where(mask[:, None, None], v, jnp.zeros((), v.dtype))
        out = jnp.einsum("kgl,lkd->kgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return out.reshape(num_heads, head_dim).astype(q.dtype)

    chunk = max(1, _GATHER_BUDGET // (max_len * num_kv_heads * head_dim))
    xs = (q, seq_ids, q_pos, valid)
    if num_tokens <= chunk:
        return jax.vmap(one_token)(xs)
    return jax.lax.map(one_token, xs, batch_size=chunk)
