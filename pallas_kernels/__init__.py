"""Attention kernels over the paged KV cache, each with a pure-`jnp` reference beside it."""

from pallas_kernels.alibi import alibi_slopes
from pallas_kernels.kv_cache import KVCache
from pallas_kernels.metadata import NO_WINDOW, NULL_BLOCK, AttentionMetadata
from pallas_kernels.paged_attention_reference import ragged_paged_attention_reference, write_kv_reference
from pallas_kernels.ragged_paged_attention import RaggedPagedAttentionConfig, ragged_paged_attention
from pallas_kernels.paged_attention import PagedDecodeAttentionConfig, paged_decode_attention
from pallas_kernels.mosaic_attention import (
    MosaicAttentionConfig,
    mosaic_paged_decode_attention,
    mosaic_ragged_paged_attention,
)
from pallas_kernels.dispatch import (  # noqa: I001 (after the kernels it dispatches to)
    ATTENTION_BACKEND_OPTIONS,
    REFERENCE,
    AttentionBackend,
    attention,
    resolve_attention_backend,
)
from pallas_kernels.self_check import self_check_attention

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
