"""Paged attention on the CPU for any step (cpu_attention.cc), as an XLA FFI call, with the XLA
reference it is checked against beside it.

The reference (`ragged_paged_attention_reference`) serves any step as a loop of gathers, scatters
and small einsums; at one token per sequence its op dispatch alone costs a small model about 0.1 ms
per layer, and a 2048-token prefill step spent ~1.2 s of its ~4.3 s in it (SmolLM2, 30 layers). The
kernel takes every step, decode and prefill, on float32 caches without the attention variants
(sliding windows, ALiBi, soft caps, fp8 pages), which stay on the reference. Built and registered
with the other CPU kernels by `cpu_library.load_cpu_kernels`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from paxserve.kernels.cpu_library import TARGETS
from paxserve.kernels.metadata import AttentionMetadata
from paxserve.kernels.reference import ragged_paged_attention_reference

__all__ = ["cpu_decode_attention", "self_check_cpu_attention", "serves"]

TARGET = TARGETS["PaxserveDecodeAttention"]
_MAX_GROUP = 16  # query heads per KV head (cpu_attention.cc's kMaxGroup)
_TOLERANCE = 1e-5  # max|out - ref|: both softmax the same float32 scores


def serves(q: Array, k_cache: Array, metadata: AttentionMetadata, *, sliding_window: object, soft_cap: object,
           alibi_slopes: object, fp8: object) -> bool:
    """Whether the kernel takes this step (static: shapes, dtypes and the attention's variants)."""
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k_cache.shape[3]
    return (sliding_window is None and soft_cap is None and alibi_slopes is None and fp8 is None
            and q.dtype == jnp.float32 and k_cache.dtype == jnp.float32
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= _MAX_GROUP)


@jax.named_call
def cpu_decode_attention(q: Float[Array, "T H D"], k_cache: Float[Array, "L N P K D"],
                         v_cache: Float[Array, "L N P K D"], layer: Int[Array, ""] | int, metadata: AttentionMetadata,
                         *, sm_scale: float) -> Float[Array, "T H D"]:
    """Causal paged attention of each token to its own sequence's cached keys (the reference's
    semantics): token t of sequence s sits at `context_lens[s] - (query_start_loc[s + 1] - t)` and
    sees keys up to there; padding tokens get zeros. The kernel must be loaded (`load_cpu_kernels`)."""
    num_tokens = q.shape[0]
    seq = metadata.token_seq_ids(num_tokens)
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    pos = metadata.context_lens[seq] - (metadata.query_start_loc[seq + 1] - token)
    pos = jnp.where(metadata.token_is_valid(num_tokens), pos, -1).astype(jnp.int32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, k_cache, v_cache, jnp.asarray(layer, jnp.int32).reshape(1), metadata.block_tables.astype(jnp.int32),
                seq, pos, sm_scale=np.float32(sm_scale))


def _problem(rng: np.random.Generator, num_seqs: int, num_tokens: int, heads: int, kv_heads: int,
             head_dim: int, queries: int = 1) -> tuple:
    """A paged step: `num_seqs` sequences of random lengths over shuffled blocks (block 0 is the null
    block), `queries` query tokens each (a decode step at 1, a prefill chunk above: the sequences'
    last positions), padded to `num_tokens` tokens and with one padding sequence."""
    layers, block_size, width = 2, 8, 6
    lens = rng.integers(queries, block_size * width + 1, num_seqs)
    num_blocks = 1 + num_seqs * width
    tables = np.zeros((num_seqs + 1, width), np.int32)
    tables[:num_seqs] = 1 + rng.permutation(num_seqs * width).reshape(num_seqs, width)
    k = rng.standard_normal((layers, num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((layers, num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    q = rng.standard_normal((num_tokens, heads, head_dim)).astype(np.float32)
    starts = np.minimum(np.arange(num_seqs + 2), num_seqs).astype(np.int32) * queries  # padding sequence: none
    metadata = AttentionMetadata(
        slot_mapping=jnp.zeros(num_tokens, jnp.int32), block_tables=jnp.asarray(tables),
        context_lens=jnp.asarray(np.append(lens, 0).astype(np.int32)), query_start_loc=jnp.asarray(starts),
        logits_indices=jnp.zeros(num_seqs + 1, jnp.int32))
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), metadata


def self_check_cpu_attention(seed: int = 0) -> str | None:
    """Decode steps and a prefill chunk against the reference (grouped heads, more than one register
    block of them, a partial last block, padding tokens and sequences, two layers, head sizes of
    whole vectors and not), in one program (one compile: every engine start runs it): None when
    every output is within 1e-5, else the first failure."""
    rng = np.random.default_rng(seed)
    shapes = ((1, 1, 2, 1, 16), (3, 5, 9, 3, 64), (2, 3, 16, 2, 128), (4, 4, 4, 4, 20), (3, 14, 9, 3, 64, 4))
    cases = [(shape, layer, _problem(rng, *shape)) for shape in shapes for layer in (0, 1)]

    def run(problems: list) -> list:
        outputs = []
        for (shape, layer, _), (q, k, v, metadata) in zip(cases, problems):
            scale = shape[4] ** -0.5
            outputs.append((cpu_decode_attention(q, k, v, layer, metadata, sm_scale=scale),
                            ragged_paged_attention_reference(q, k, v, layer, metadata, sm_scale=scale)))
        return outputs

    try:
        outputs = jax.jit(run)([problem for _, _, problem in cases])
    except Exception as error:  # noqa: BLE001 - a kernel that fails to run has failed
        return f"decode attention: {type(error).__name__}: {str(error).strip()[:300]}"
    for (shape, layer, _), (got, want) in zip(cases, outputs):
        err = float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
        if got.shape != want.shape or not err < _TOLERANCE:
            return f"decode attention, {shape[0]} sequences, layer {layer}: max error {err:.3g}"
    return None
