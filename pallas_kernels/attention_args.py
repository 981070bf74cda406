"""Checks and normalisation of the options every attention entry point shares.

`sliding_window` is None (no window: no window code is traced), a Python int >= 1, or an integer
scalar array whose value may be traced (a per-layer window scanned over layers). Only a Python int
can be validated; every window reaches the computation as an int32 scalar clamped to
`[1, NO_WINDOW]`, so `position - window` cannot overflow int32 whatever a traced value holds.

`alibi_slopes` is None (no ALiBi code traced) or one float slope per query head.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from paxserve.kernels.metadata import NO_WINDOW

__all__ = ["check_alibi_slopes", "check_scale_and_cap", "check_sliding_window", "slopes_operand", "window_operand"]

Window = int | Int[Array, ""] | None


def check_sliding_window(sliding_window: Window, entry: str) -> Window:
    """Validate what can be validated before tracing: a Python int must be >= 1 (it is clamped to
    `NO_WINDOW`, which already hides nothing, so that it fits int32); an array must be an integer
    scalar. Returns the window to hand on (None, an int, or the array untouched)."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool):  # bool is an int subclass; a flag here is a caller's slip
        raise ValueError(f"{entry}: sliding_window must be None, an int >= 1 or an int32 scalar, got a bool")
    if isinstance(sliding_window, (int, np.integer)):
        if sliding_window < 1:
            raise ValueError(f"{entry}: sliding_window must be >= 1 or None, got {int(sliding_window)}")
        return min(int(sliding_window), NO_WINDOW)
    if isinstance(sliding_window, (jax.Array, np.ndarray)):
        if sliding_window.shape != () or not jnp.issubdtype(sliding_window.dtype, jnp.integer):
            raise ValueError(f"{entry}: sliding_window must be an integer scalar, got "
                             f"{sliding_window.dtype}{list(sliding_window.shape)}")
        return sliding_window
    raise ValueError(f"{entry}: sliding_window must be None, an int >= 1 or an int32 scalar, got "
                     f"{type(sliding_window).__name__}")


def window_operand(sliding_window: Window) -> Int[Array, ""] | None:
    """The window as the int32 scalar the computation uses (call after `check_sliding_window`)."""
    if sliding_window is None:
        return None
    return jnp.clip(jnp.asarray(sliding_window).astype(jnp.int32), 1, NO_WINDOW)


def check_alibi_slopes(alibi_slopes: Float[Array, " H"] | None, num_heads: int, entry: str) -> None:
    """One real slope per query head (its values may be traced)."""
    if alibi_slopes is None:
        return
    if not hasattr(alibi_slopes, "dtype"):  # a list or tuple; arrays (traced ones too) keep theirs
        alibi_slopes = np.asarray(alibi_slopes)
    shape, dtype = tuple(alibi_slopes.shape), alibi_slopes.dtype
    if shape != (num_heads,) or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise ValueError(f"{entry}: alibi_slopes must be [num_heads={num_heads}] floats, got "
                         f"{jnp.dtype(dtype).name}{list(shape)}")


def slopes_operand(alibi_slopes: Float[Array, " H"] | None) -> Float[Array, " H"] | None:
    return None if alibi_slopes is None else jnp.asarray(alibi_slopes).astype(jnp.float32)


def check_scale_and_cap(sm_scale: float, soft_cap: float | None, entry: str) -> None:
    if not math.isfinite(float(sm_scale)):
        raise ValueError(f"{entry}: sm_scale must be finite, got {sm_scale!r}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"{entry}: soft_cap must be > 0 or None, got {soft_cap!r}")
