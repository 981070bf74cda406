"""The paged KV cache as an explicit pytree: passed into every jitted step and returned (donated)."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from paxserve.kernels.pytree import pytree_dataclass


@pytree_dataclass
class KVCache:
    """K and V pages for all layers: `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`.

    Block 0 is the null block: padding tokens write there and padded block-table entries point
    there, so it never holds a real token.
    """

    k: Float[Array, "L N P K D"]
    v: Float[Array, "L N P K D"]

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
        shape = cls.array_shape(num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
