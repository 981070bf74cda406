"""Attention kernels over the paged KV cache, each with a pure-`jnp` reference beside it, and the
weight-only quantized matmul on Mosaic GPU with XLA's dequantize-then-dot beside it."""

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
from paxserve.kernels.mosaic_matmul import mosaic_weight_only_matmul, weight_only_matmul_reference
from paxserve.kernels.matmul_dispatch import MatmulKernel, resolve_matmul_kernel, self_check_matmul

__all__ = [
    "ATTENTION_BACKEND_OPTIONS",
    "NO_WINDOW",
    "NULL_BLOCK",
    "REFERENCE",
    "AttentionBackend",
    "AttentionMetadata",
    "KVCache",
    "MatmulKernel",
    "MosaicAttentionConfig",
    "PagedDecodeAttentionConfig",
    "RaggedPagedAttentionConfig",
    "alibi_slopes",
    "attention",
    "mosaic_paged_decode_attention",
    "mosaic_ragged_paged_attention",
    "mosaic_weight_only_matmul",
    "paged_decode_attention",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "resolve_attention_backend",
    "resolve_matmul_kernel",
    "self_check_attention",
    "self_check_matmul",
    "weight_only_matmul_reference",
    "write_kv_reference",
]
