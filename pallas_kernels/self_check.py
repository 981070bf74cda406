"""Start-up self-check: run an attention backend once on a small random paged batch and compare it
with the XLA reference, so a kernel that does not compile or gives wrong numbers on this machine is
found before the first step (and `resolve_attention_backend` can fall back to the reference).

The batch has the model's head counts, head_dim, block size and dtype, and covers what a real
step does: a prompt chunk from position 0, a chunk on top of cached context, decode tokens (one at
a block boundary, one whose context spans several key steps), a padding sequence and padding
tokens, pages in random order, and every unused page (and the null block) full of NaN. A model
with a sliding window or ALiBi has the batch checked on those variants too. A backend marked
`pure_decode` (the engine's decode programs) is checked on a pure-decode batch of the same kind:
one token per sequence, contexts at and across block and key-step boundaries, padding.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from paxserve.kernels.alibi import alibi_slopes
from paxserve.kernels.kv_cache import fp8_bits
from paxserve.kernels.metadata import NULL_BLOCK, AttentionMetadata
from paxserve.kernels.reference import ragged_paged_attention_reference

if TYPE_CHECKING:  # dispatch imports this module for its default self-check
    from paxserve.kernels.dispatch import AttentionBackend

__all__ = ["self_check_attention", "tolerance_for"]

_NUM_LAYERS = 2
_LAYER = 1  # the layer read; layer 0 holds finite garbage, so reading the wrong layer shows
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_MAX_REASON = 300
# One jit for every check, so that checks of the same shapes (several backends, repeated checks)
# compile the reference once.
_reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "fp8"))


def tolerance_for(dtype: jnp.dtype) -> float:
    """Largest accepted max|out - ref| / max|ref|: float32 1e-5 (IEEE: the kernels' float32 dots are
    HIGHEST precision and the reference runs at "highest"; TF32 would land near 3e-4), 16-bit
    floats 2e-2."""
    return 1e-5 if jnp.dtype(dtype) == jnp.dtype(jnp.float32) else 2e-2


def _describe(error: BaseException) -> str:
    """"ExceptionType: first non-empty line of the message", without memory addresses."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    first = _ADDRESS.sub("<address>", lines[0]) if lines else "(no message)"
    if len(first) > _MAX_REASON:
        first = first[: _MAX_REASON - 3] + "..."
    return f"{type(error).__name__}: {first}"


def _problem(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, seed: int, decode: bool = False):
    """Numpy float32 q, K/V caches (NaN outside the sequences' contexts) and int32 metadata arrays,
    laid out as `paxserve.worker.step_inputs.build_batch` does (pallas_kernels does not import the engine)."""
    rng = np.random.default_rng(seed)
    bs = block_size
    # (tokens already cached, new tokens, allocated blocks beyond the context: NaN, never written)
    seqs = [
        (0, bs + 3, 0),  # a prompt chunk from position 0
        (2 * bs + 1, 6, 1),  # a chunk on top of cached context, with an empty allocated block
        (bs - 1, 1, 0),  # decode: context exactly one block
        (64 + bs + 2, 1, 0),  # decode: context longer than one key step of the kernel
        (0, 1, 0),  # a one-token prompt
    ]
    if decode:  # one token each: the first S query rows are the sequences' (the rest padding)
        seqs = [(2 * bs, 1, 1), (bs - 1, 1, 0), (64 + bs + 2, 1, 0), (0, 1, 0), (3 * 64 + 5, 1, 0)]
    num_tokens = sum(n for _, n, _ in seqs)
    t_pad = -(-(num_tokens + 1) // 16) * 16  # at least one padding token, like the engine's buckets
    s_pad = 8  # three padding sequences
    blocks_needed = [-(-(c + n) // bs) + extra for c, n, extra in seqs]
    num_blocks = 1 + sum(blocks_needed) + 2  # null block, the tables, two spare (NaN) pages
    width = max(blocks_needed)
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)  # never the null block

    cache_shape = (_NUM_LAYERS, num_blocks, bs, num_kv_heads, head_dim)
    k_cache = np.full(cache_shape, np.nan, np.float32)
    v_cache = np.full(cache_shape, np.nan, np.float32)
    k_cache[0] = rng.standard_normal(cache_shape[1:])
    v_cache[0] = rng.standard_normal(cache_shape[1:])
    q = rng.standard_normal((t_pad, num_heads, head_dim)).astype(np.float32)

    slot_mapping = np.full(t_pad, NULL_BLOCK * bs, np.int32)
    block_tables = np.full((s_pad, width), NULL_BLOCK, np.int32)
    context_lens = np.zeros(s_pad, np.int32)
    query_start_loc = np.full(s_pad + 1, num_tokens, np.int32)
    logits_indices = np.zeros(s_pad, np.int32)
    start = first_block = 0
    for s, ((cached, n, _), needed) in enumerate(zip(seqs, blocks_needed)):
        table = ids[first_block : first_block + needed]
        first_block += needed
        pos = np.arange(cached + n)
        # Every context position is in the cache: the cached ones and this step's (already written).
        k_cache[_LAYER, table[pos // bs], pos % bs] = rng.standard_normal((cached + n, num_kv_heads, head_dim))
        v_cache[_LAYER, table[pos // bs], pos % bs] = rng.standard_normal((cached + n, num_kv_heads, head_dim))
        new = pos[cached:]
        slot_mapping[start : start + n] = table[new // bs] * bs + new % bs
        block_tables[s, :needed] = table
        context_lens[s] = cached + n
        query_start_loc[s] = start
        logits_indices[s] = start + n - 1
        start += n
    metadata = (slot_mapping, block_tables, context_lens, query_start_loc, logits_indices)
    return q, k_cache, v_cache, metadata, num_tokens


def _variants(num_heads: int, block_size: int, sliding_window: int | None, alibi: bool) -> list[tuple[str, dict]]:
    """(label, extra attention kwargs) per variant to check; the plain one has no label."""
    variants: list[tuple[str, dict]] = [("", {})]
    window = None
    if sliding_window is not None:
        # The problem's longest context is 64 + block_size + 3: a window this short skips whole key
        # steps and pages there, which a model's real window (512, 4096) would not. Passed as an
        # array, so it is traced as the model's scanned per-layer window is.
        window = jnp.asarray(max(1, min(int(sliding_window), block_size + 1)), jnp.int32)
        variants.append((f"sliding_window={int(window)}", {"sliding_window": window}))
    if alibi:
        kwargs = {"alibi_slopes": jnp.asarray(alibi_slopes(num_heads))}
        if window is not None:
            kwargs["sliding_window"] = window
        variants.append(("alibi" + (f", sliding_window={int(window)}" if window is not None else ""), kwargs))
    return variants


def self_check_attention(
    backend: AttentionBackend,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: jnp.dtype,
    seed: int = 0,
    sliding_window: int | None = None,
    alibi: bool = False,
    kv_dtype: jnp.dtype | None = None,
) -> str | None:
    """Run `attention(...)` on `backend` once on a small random paged batch with the model's shapes
    and compare it with `ragged_paged_attention_reference` on the same device.

    sliding_window: the model's window, if it has one: the batch is checked once more with a
      traced window (capped to block_size + 1, so that the small batch really skips keys).
    alibi: the model uses ALiBi: checked once more with `alibi_slopes(num_heads)` (and the window,
      if given).
    kv_dtype: the cache's dtype when it is not `dtype` (an fp8 cache): the kernel and the reference
      read the same quantized pages.

    Returns None when the outputs of the real tokens agree in every variant (finite, and
    max|out - ref| / max|ref| below `tolerance_for(dtype)`), else a short reason for the first
    variant that does not: "compile/run failed: <ExceptionType>: <first line>" or "mismatch: ...",
    followed by " (with <variant>)" for a variant other than the plain one. Never raises (an
    exception of any kind, XLA runtime errors included, becomes the reason).
    """
    try:
        q_np, k_np, v_np, md_np, n = _problem(num_heads, num_kv_heads, head_dim, block_size, seed,
                                              decode=backend.pure_decode)
        dt = jnp.dtype(dtype)
        q, k_cache, v_cache = (jnp.asarray(x, dtype=dt) for x in (q_np, k_np, v_np))
        fp8 = None if kv_dtype is None else jnp.dtype(kv_dtype).name
        if fp8 is not None:
            k_cache, v_cache = (fp8_bits(c, fp8) for c in (k_cache, v_cache))
        metadata = AttentionMetadata(*(jnp.asarray(x) for x in md_np))
        variants = _variants(num_heads, block_size, sliding_window, alibi)
    except Exception as error:  # noqa: BLE001 - the check must never raise
        return f"reference failed: {_describe(error)}"
    for label, kwargs in variants:
        reason = _check_one(backend, q, k_cache, v_cache, metadata, n, head_dim, kwargs | {"fp8": fp8})
        if reason is not None:
            return f"{reason} (with {label})" if label else reason
    return None


def _check_one(backend: AttentionBackend, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
               metadata: AttentionMetadata, n: int, head_dim: int, kwargs: dict) -> str | None:
    from paxserve.kernels.dispatch import attention  # here: dispatch imports this module

    layer = jnp.asarray(_LAYER, jnp.int32)
    sm_scale = float(head_dim) ** -0.5
    try:
        # IEEE float32 on GPUs too (XLA's default float32 dot there is TF32): the kernels' dots are
        # HIGHEST, and the float32 tolerance is IEEE's, as in benchmarks/gpu_check.py.
        with jax.default_matmul_precision("highest"):
            ref = _reference(q, k_cache, v_cache, layer, metadata, sm_scale=sm_scale, **kwargs)
        ref = np.asarray(jax.block_until_ready(ref)).astype(np.float64)[:n]
    except Exception as error:  # noqa: BLE001 - the check must never raise
        return f"reference failed: {_describe(error)}"
    try:
        # The fp8 format is static (a string is no jit argument); the window and slopes are arrays.
        static = {name: kwargs[name] for name in ("fp8",) if name in kwargs}
        traced = {name: value for name, value in kwargs.items() if name not in static}
        out = jax.jit(functools.partial(attention, sm_scale=sm_scale, backend=backend, **static))(
            q, k_cache, v_cache, layer, metadata, **traced)
        out = jax.block_until_ready(out)
        if out.shape != q.shape or out.dtype != q.dtype:
            return f"mismatch: output is {out.dtype.name}{list(out.shape)}, expected {q.dtype.name}{list(q.shape)}"
        out = np.asarray(out).astype(np.float64)[:n]
    except Exception as error:  # noqa: BLE001
        return f"compile/run failed: {_describe(error)}"
    bad = int(np.count_nonzero(~np.isfinite(out)))
    if bad:
        return f"mismatch: {bad} of {out.size} output values are NaN or inf"
    scale = float(np.max(np.abs(ref)))
    rel = float(np.max(np.abs(out - ref))) / (scale if scale > 0 else 1.0)
    tol = tolerance_for(q.dtype)
    if not rel < tol:
        return f"mismatch: max relative error {rel:.3g} > tol {tol:g}"
    return None
