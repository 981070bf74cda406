"""Attention kernels over the paged KV cache, each with a pure-`jnp` reference beside it."""

from paxserve.kernels.alibi import alibi_slopes
from paxserve.kernels.kv_cache import KVCache
from paxserve.kernels.metadata import NO_WINDOW, NULL_BLOCK, AttentionMetadata
from paxserve.kernels.reference import ragged_paged_attention_reference, write_kv_reference
from paxserve.kernels.ragged_paged_attention import RaggedPagedAttentionConfig, ragged_paged_attention
from paxserve.kernels.decode_attention import PagedDecodeAttentionConfig, paged_decode_attention
from paxserve.kernels.mosaic_attention import (
    MosaicAttentionConfig,
    mosaic_paged_decode_attention,
    mosaic_ragged_paged_attention,
)
from paxserve.kernels.dispatch import (  # noqa: I001 (after the kernels it dispatches to)
    ATTENTION_BACKEND_OPTIONS,
    REFERENCE,
    AttentionBackend,
    attention,
    resolve_attention_backend,
)
from paxserve.kernels.self_check import self_check_attention

__all__ = [
    "ATTENTION_BACKEND_OPTIONS",
    "NO_WINDOW",
    "NULL_BLOCK",
    "REFERENCE",
    "AttentionBackend",
    "AttentionMetadata",
    "KVCache",
    "MosaicAttentionConfig",
    "PagedDecodeAttentionConfig",
    "RaggedPagedAttentionConfig",
    "alibi_slopes",
    "attention",
    "mosaic_paged_decode_attention",
    "mosaic_ragged_paged_attention",
    "paged_decode_attention",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "resolve_attention_backend",
    "self_check_attention",
    "write_kv_reference",
]
