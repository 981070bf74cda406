"""What the Pallas kernels serve and the checks their entry points share (shapes, dtypes, options)."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from jaxtyping import Array, Float

from paxserve.kernels.attention_args import Window, check_alibi_slopes, check_scale_and_cap, check_sliding_window

__all__ = ["MIN_DOT", "SUPPORTED_DTYPES", "check_decode_tables", "check_options", "is_pow2", "next_pow2", "supports_ragged_paged_attention",
           "validate_q_and_cache"]

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MIN_DOT = 16  # smallest M, N and K a Triton tensor-core dot accepts


def is_pow2(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def supports_ragged_paged_attention(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: jnp.dtype
) -> str | None:
    """None if the kernel serves these shapes, else the reason it does not."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
    if not is_pow2(head_dim) or head_dim < MIN_DOT:
        return f"head_dim={head_dim} must be a power of two >= {MIN_DOT}"
    if not is_pow2(block_size):
        return f"block_size={block_size} must be a power of two"
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return f"dtype {jnp.dtype(dtype).name} is not one of {', '.join(d.name for d in SUPPORTED_DTYPES)}"
    return None


def validate_q_and_cache(q: Array, k_cache: Array, v_cache: Array, kernel: str,
                         supports: Callable[..., str | None] = supports_ragged_paged_attention,
                         fp8: str | None = None) -> None:
    """Checks shared by the kernels' entry points: q [rows, H, D], caches [L, N, P, K, D] alike, one
    dtype (an fp8 cache: uint8 bits of `fp8` values), and shapes the kernel supports (`supports(num_heads, num_kv_heads, head_dim, block_size,
    dtype)`: None or the reason; the Triton kernels' by default)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [rows, num_heads, head_dim], got shape {q.shape}")
    if k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_layers, num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got {k_cache.shape} and {v_cache.shape}")
    if fp8 is not None:
        if k_cache.dtype != jnp.uint8 or v_cache.dtype != jnp.uint8:
            raise ValueError(f"an fp8 ({fp8}) cache is stored as uint8 bits, got {k_cache.dtype}, {v_cache.dtype}")
    elif k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"head_dim of q ({q.shape[-1]}) and of the cache ({k_cache.shape[-1]}) differ")
    reason = supports(q.shape[1], k_cache.shape[3], q.shape[2], k_cache.shape[2], q.dtype)
    if reason:
        raise ValueError(f"{kernel}: {reason}")


def check_decode_tables(q: Array, block_tables: Array, context_lens: Array, kernel: str) -> None:
    """A decode batch's block_tables [S, B] and context_lens [S] match q's S."""
    if block_tables.ndim != 2 or block_tables.shape[0] != q.shape[0] or context_lens.shape != (q.shape[0],):
        raise ValueError(f"{kernel}: block_tables [S, B] and context_lens [S] must match q's S={q.shape[0]}; got "
                         f"{block_tables.shape}, {context_lens.shape}")


def check_options(q: Array, sm_scale: float, sliding_window: Window, soft_cap: float | None,
                  alibi_slopes: Float[Array, " H"] | None, kernel: str) -> Window:
    """Eager checks of the score options (before the jit, so a Python int window is still an int);
    returns the window to pass on."""
    check_scale_and_cap(sm_scale, soft_cap, kernel)
    check_alibi_slopes(alibi_slopes, q.shape[1], kernel)
    return check_sliding_window(sliding_window, kernel)
