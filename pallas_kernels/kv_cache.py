"""The paged KV cache as an explicit pytree: passed into every jitted step and returned (donated).

An fp8 cache (vLLM's --kv-cache-dtype fp8) holds K / k_scale and V / v_scale, one float32 scale per
layer for each. Attention never dequantizes a page: with q·(s·k) = s·(q·k) and Σ p·(s·v) = s·Σ p·v,
the model scales q by k_scale before the kernel and the output by v_scale after it, and the kernels
only widen the fp8 values they load to q's dtype.

Its pages are stored as the fp8 values' bits in uint8 arrays (`fp8` names the format) and read
through a free bitcast view: XLA's CPU backend has no fp8 scatter, and emulates one by converting
the whole cache to float32 and back for every write (0.55 s per layer for a 1.4 GiB cache, against
0.2 ms for the same scatter on uint8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jaxtyping import Array, Float

from paxserve.kernels.pytree import pytree_dataclass, static_field

# vLLM's --kv-cache-dtype names; "fp8" is e4m3 (more mantissa: the better choice for K and V).
KV_CACHE_DTYPES = {
    "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
    "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
_FP8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


def is_fp8(dtype: object) -> bool:
    return np.dtype(dtype) in _FP8


def to_cache_dtype(x: Array, dtype: object) -> Array:
    """`x` in `dtype`; into fp8 with saturation (a value past the format's largest would become
    NaN in e4m3fn, or inf in e5m2)."""
    if is_fp8(dtype):
        limit = float(ml_dtypes.finfo(np.dtype(dtype)).max)
        x = jnp.clip(x.astype(jnp.float32), -limit, limit)
    return x.astype(dtype)


def fp8_bits(x: Array, fp8: str) -> Array:
    """`x` rounded to the fp8 format `fp8` (saturating), as the uint8 bits the cache stores."""
    return jax.lax.bitcast_convert_type(to_cache_dtype(x, np.dtype(fp8)), jnp.uint8)


def fp8_view(pages: Array, fp8: str | None) -> Array:
    """The cache's pages as values: an fp8 cache's uint8 bits seen as `fp8` (a bitcast, no copy)."""
    return pages if fp8 is None else jax.lax.bitcast_convert_type(pages, np.dtype(fp8))


@pytree_dataclass
class KVCache:
    """K and V pages for all layers: `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`.

    Block 0 is the null block: padding tokens write there and padded block-table entries point
    there, so it never holds a real token.
    """

    k: Float[Array, "L N P K D"]  # the model's dtype, or uint8 bits of `fp8` values
    v: Float[Array, "L N P K D"]
    k_scale: Float[Array, " L"] | None = None  # an fp8 cache's per-layer scales (None otherwise)
    v_scale: Float[Array, " L"] | None = None
    fp8: str | None = static_field()  # "float8_e4m3fn" / "float8_e5m2" for an fp8 cache

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @staticmethod
    def array_shape(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
              head_dim: int) -> tuple[int, int, int, int, int]:
        """The shape of K (and of V); ValueError when there is no block besides the null block."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        return (num_layers, num_blocks, block_size, num_kv_heads, head_dim)

    @classmethod
    def zeros(
        cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: jnp.dtype
    ) -> "KVCache":
        """A zeroed cache of values of `dtype` (an fp8 dtype: uint8 storage, scales 1.0)."""
        shape = cls.array_shape(num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        stored = cls.storage_dtype(dtype)
        return cls.of_pages(jnp.zeros(shape, stored), jnp.zeros(shape, stored), dtype)

    @classmethod
    def of_pages(cls, k: Array, v: Array, dtype: object) -> "KVCache":
        """A cache of values of `dtype` around zeroed K and V pages in `storage_dtype(dtype)` (an fp8
        cache gets its scales, 1.0)."""
        if not is_fp8(dtype):
            return cls(k=k, v=v)
        # Two arrays, not one twice: the step donates the cache, and a buffer cannot be donated twice.
        k_scale, v_scale = (jnp.ones((k.shape[0],), jnp.float32) for _ in range(2))
        return cls(k=k, v=v, k_scale=k_scale, v_scale=v_scale, fp8=np.dtype(dtype).name)

    @staticmethod
    def storage_dtype(dtype: object) -> np.dtype:
        """What the K and V arrays of a cache of `dtype` values hold."""
        return np.dtype(np.uint8) if is_fp8(dtype) else np.dtype(dtype)
