"""Attention kernels over the paged KV cache, each with a pure-`jnp` reference beside it."""

from pallas_kernels.kv_cache import KVCache
from pallas_kernels.metadata import NULL_BLOCK, AttentionMetadata
from pallas_kernels.paged_attention_reference import ragged_paged_attention_reference, write_kv_reference

__all__ = [
    "NULL_BLOCK",
    "AttentionMetadata",
    "KVCache",
    "ragged_paged_attention_reference",
    "write_kv_reference",
]
