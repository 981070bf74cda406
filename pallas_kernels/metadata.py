"""Attention metadata: how a flattened ragged batch of new tokens maps onto the paged KV cache.

The batch holds `T` new tokens (padded) from `S` sequences (padded). Sequence `s` owns the tokens
`query_start_loc[s] : query_start_loc[s + 1]`: a prompt chunk or one decode token. After this
step's writes it has `context_lens[s]` tokens in the cache, so its new tokens sit at positions
`context_lens[s] - query_len .. context_lens[s] - 1`. Padding sequences have query length 0 and
context length 0; padding tokens write to the reserved null block 0, which nothing reads.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Int

from paxserve.kernels.pytree import pytree_dataclass

NULL_BLOCK = 0
# A sliding window that hides nothing, for the global layers of a windowed model whose per-layer
# window is a scanned (traced) int32 value and so cannot be None. 2**30 is past any context this
# engine serves and keeps `position - window` and `position + window` inside int32.
NO_WINDOW = 2**30


@pytree_dataclass
class AttentionMetadata:
    """Explicit pytree of int32 arrays passed to every jitted step (never a global)."""

    slot_mapping: Int[Array, " T"]  # flat cache slot (block_id * block_size + offset) of each new token
    block_tables: Int[Array, "S B"]  # block ids of each sequence, padded with the null block
    context_lens: Int[Array, " S"]  # tokens in the cache per sequence, including this step's
    query_start_loc: Int[Array, " S1"]  # S + 1 cumulative offsets of each sequence's new tokens
    logits_indices: Int[Array, " S"]  # flat token index whose logits each sequence wants

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    def token_seq_ids(self, num_tokens: int) -> Int[Array, " T"]:
        """Which sequence each flat token belongs to (padding tokens map to the last sequence and are
        recognised by `token_is_valid`)."""
        t = jnp.arange(num_tokens, dtype=jnp.int32)
        ids = jnp.searchsorted(self.query_start_loc[1:], t, side="right").astype(jnp.int32)
        return jnp.minimum(ids, self.num_seqs - 1)

    def token_is_valid(self, num_tokens: int) -> Array:
        return jnp.arange(num_tokens, dtype=jnp.int32) < self.query_start_loc[-1]

    def query_blocks(self, num_tokens: int, block_q: int) -> tuple[Array, Array, Array]:
        """Each sequence's new tokens cut into blocks of `block_q` consecutive tokens: per block its
        sequence and its index within that sequence, padded to a static count (each sequence wastes
        at most one partial block; extra blocks map to the last sequence), and the real count."""
        q_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
        blocks = (q_lens + block_q - 1) // block_q
        ends = jnp.cumsum(blocks).astype(jnp.int32)
        w = jnp.arange(max(1, min(num_tokens, num_tokens // block_q + self.num_seqs)), dtype=jnp.int32)
        seq = jnp.minimum(jnp.searchsorted(ends, w, side="right"), self.num_seqs - 1).astype(jnp.int32)
        return seq, (w - (ends[seq] - blocks[seq])).astype(jnp.int32), ends[-1]
