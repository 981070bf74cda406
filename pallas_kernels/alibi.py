"""ALiBi slopes (Press et al.), as Falcon-RW / falcon-7b (`alibi=True`) use them in Hugging Face."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["alibi_slopes"]


def alibi_slopes(num_heads: int) -> np.ndarray:
    """float32 [num_heads]: the slopes of `build_alibi_tensor` in transformers'
    `models/falcon/modeling_falcon.py`, before it rounds them to bfloat16 (HF's bias is
    `bfloat16(bfloat16(slope) * key_position)`; a model that must track HF's logits closely can round
    these slopes to bfloat16 before passing them to the attention entries).

    The closest power of two n <= num_heads gets slopes base**1 .. base**n with
    base = 2**(-(2**-(log2(n) - 3))) (= 2**(-8/n)); the remaining heads take the odd powers
    1, 3, 5, ... of the base for 2n heads.
    """
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    closest = 2 ** math.floor(math.log2(num_heads))
    # torch holds each base as a float32 scalar; the powers are taken in float64 and rounded once,
    # which is within one float32 ulp of torch's vectorised float32 pow (and equal once rounded to
    # bfloat16, the precision Hugging Face applies the bias in).
    base = float(np.float32(2 ** (-(2 ** -(math.log2(closest) - 3)))))
    slopes = np.power(base, np.arange(1, 1 + closest, dtype=np.float64))
    if closest != num_heads:
        extra_base = float(np.float32(2 ** (-(2 ** -(math.log2(2 * closest) - 3)))))
        remaining = min(closest, num_heads - closest)
        slopes = np.concatenate([slopes, np.power(extra_base, np.arange(1, 1 + 2 * remaining, 2, dtype=np.float64))])
    return slopes.astype(np.float32)
