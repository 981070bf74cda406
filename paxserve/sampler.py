"""On-device sampling, run inside the jitted step right after the model's forward.

Order (vLLM's): logit bias, min_tokens suppression, repetition / frequency / presence penalties,
the structured-output token bitmask;
greedy rows take the argmax of those processed logits; sampled rows divide by temperature, apply
top-k, top-p and min-p, then draw with the Gumbel-max trick. The draw's key comes only from the
row's (seed, step), so a seeded request samples the same tokens whatever shares its batch.

Every optional stage leaves a row that does not use it bit-for-bit unchanged, so a row's result
does not depend on which compiled variant (see `sampling_metadata`) its batch mates select.
Logprobs are of the raw model logits, before any processing, as vLLM returns by default.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int, UInt32

from paxserve.sampling_metadata import SamplingInputs


@struct.dataclass
class SamplingMetadata:
    """Device copy of `SamplingInputs`: arrays are pytree leaves, flags are static (compile keys)."""

    temperature: Float[Array, " S"]
    top_k: Int[Array, " S"]
    top_p: Float[Array, " S"]
    min_p: Float[Array, " S"]
    seed: UInt32[Array, "S 2"]
    step: Int[Array, " S"]
    min_tokens: Int[Array, " S"]
    presence_penalty: Float[Array, " S"]
    frequency_penalty: Float[Array, " S"]
    repetition_penalty: Float[Array, " S"]
    output_token_ids: Int[Array, "S Lo"]
    prompt_token_ids: Int[Array, "S Lp"]
    logit_bias_ids: Int[Array, "S Lb"]
    logit_bias_values: Float[Array, "S Lb"]
    suppress_ids: Int[Array, "S Ls"]
    allowed_token_bitmask: Int[Array, "S W"]
    all_greedy: bool = struct.field(pytree_node=False)
    use_top_k_top_p: bool = struct.field(pytree_node=False)
    use_penalties: bool = struct.field(pytree_node=False)
    num_logprobs: int = struct.field(pytree_node=False)

    @classmethod
    def from_inputs(cls, inputs: SamplingInputs) -> "SamplingMetadata":
        values = {}
        for f in dataclasses.fields(cls):
            value = getattr(inputs, f.name)
            values[f.name] = jnp.asarray(value) if f.metadata.get("pytree_node", True) else value
        return cls(**values)


def _row_ids(ids: Int[Array, "S L"], vocab_size: int) -> tuple[Int[Array, "S 1"], Int[Array, "S L"]]:
    """Row and column indices for a scatter. Padding (-1) becomes out of range so `mode="drop"`
    skips it; left negative, JAX would wrap it round to the last token."""
    rows = jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None]
    return rows, jnp.where(ids >= 0, ids, vocab_size)


def _apply_penalties(logits: Float[Array, "S V"], md: SamplingMetadata) -> Float[Array, "S V"]:
    s, v = logits.shape
    rows, out_ids = _row_ids(md.output_token_ids, v)
    counts = jnp.zeros((s, v), jnp.int32).at[rows, out_ids].add(1, mode="drop")
    _, prompt_ids = _row_ids(md.prompt_token_ids, v)
    seen = jnp.zeros((s, v), bool).at[rows, prompt_ids].set(True, mode="drop") | (counts > 0)
    rep = md.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - md.frequency_penalty[:, None] * counts.astype(logits.dtype)
    return logits - md.presence_penalty[:, None] * (counts > 0).astype(logits.dtype)


def apply_penalties_and_bias(logits: Float[Array, "S V"], md: SamplingMetadata) -> Float[Array, "S V"]:
    """The argmax-changing processing every row gets: bias, min_tokens suppression, penalties."""
    v = logits.shape[1]
    rows, bias_ids = _row_ids(md.logit_bias_ids, v)
    logits = logits.at[rows, bias_ids].add(md.logit_bias_values, mode="drop")
    active = (md.step < md.min_tokens)[:, None] & (md.suppress_ids >= 0)
    _, suppress_ids = _row_ids(jnp.where(active, md.suppress_ids, -1), v)
    logits = logits.at[rows, suppress_ids].set(-jnp.inf, mode="drop")
    return _apply_penalties(logits, md) if md.use_penalties else logits


def apply_token_bitmask(processed: Float[Array, "S V"], logits: Float[Array, "S V"],
                        bitmask: Int[Array, "S W"]) -> Float[Array, "S V"]:
    """Structured outputs: tokens whose bit is clear become -inf. A free row's words are all ones,
    so it comes back unchanged. Should the grammar's tokens all be -inf already (min_tokens
    suppressing the EOS that a finished grammar allows), the grammar wins over the suppression."""
    v = processed.shape[1]
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :v].astype(bool)
    masked = jnp.where(allowed, processed, -jnp.inf)
    stuck = ~jnp.any(masked > -jnp.inf, axis=-1, keepdims=True)
    return jnp.where(stuck, jnp.where(allowed, logits, -jnp.inf), masked)


def apply_top_k_top_p_min_p(logits: Float[Array, "S V"], md: SamplingMetadata) -> Float[Array, "S V"]:
    """Mask (to -inf) what top-k, then top-p, then min-p drop. A row with all three off is returned
    unchanged: its cutoff is its own minimum, so `logits < cutoff` is false everywhere.

    Top-k and top-p cut at a logit value, so a token tied with the last kept one is kept too.
    """
    v = logits.shape[1]
    sorted_desc = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
    idx = jnp.arange(v, dtype=jnp.int32)[None, :]
    keep_k = idx < jnp.where(md.top_k > 0, md.top_k, v)[:, None]
    # Top-p sees the distribution renormalised over the top-k survivors, as vLLM does.
    probs = jax.nn.softmax(jnp.where(keep_k, sorted_desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p == 1 is tested explicitly: rounding can push the accumulated mass past 1.
    keep_p = (mass_before < md.top_p[:, None]) | (md.top_p[:, None] >= 1.0) | (idx == 0)
    num_keep = jnp.sum(keep_k & keep_p, axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(sorted_desc, num_keep - 1, axis=-1)
    # p_i < min_p * p_max  <=>  exp(x_i - x_max) < min_p; the ratio ignores what was masked above.
    below_min_p = (md.min_p[:, None] > 0) & (jnp.exp(logits - sorted_desc[:, :1]) < md.min_p[:, None])
    return jnp.where((logits < cutoff) | below_min_p, -jnp.inf, logits)


def _gumbel(md: SamplingMetadata, vocab_size: int) -> Float[Array, "S V"]:
    """Gumbel noise per row from its own key: threefry key data = the seed's two 32-bit words,
    folded with the step. Nothing about the batch (size, row index, mates) enters the key."""

    def row(seed: UInt32[Array, " 2"], step: Int[Array, ""]) -> Float[Array, " V"]:
        key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), step)
        return jax.random.gumbel(key, (vocab_size,), jnp.float32)

    return jax.vmap(row)(md.seed, md.step)


def _logprob_columns(
    logits: Float[Array, "S V"], tokens: Int[Array, " S"], k: int
) -> Float[Array, "S W"]:
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    sampled = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)
    top_values, top_ids = jax.lax.top_k(logprobs, k)
    return jnp.concatenate([sampled, top_ids.astype(jnp.float32), top_values], axis=-1)


def prompt_logprob_columns(logits: Float[Array, "T V"], targets: Int[Array, " T"], k: int) -> Float[Array, "T W"]:
    """Per flat position: the logprob of the token its logits score (`targets`, the next prompt
    token), that token's exact rank (1 + how many tokens have a strictly larger logprob), and the
    top `k` ids and logprobs, packed as float32 (ranks and ids are exact below 2**24)."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    actual = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)
    rank = 1 + jnp.sum(logprobs > actual, axis=-1, keepdims=True, dtype=jnp.int32)
    top_values, top_ids = jax.lax.top_k(logprobs, k)
    return jnp.concatenate([actual, rank.astype(jnp.float32), top_ids.astype(jnp.float32), top_values], axis=-1)


def sample(logits: Float[Array, "S V"], md: SamplingMetadata) -> Float[Array, "S W"]:
    """One packed float32 array per step, so the engine copies to the host once: column 0 the
    token id (exact below 2**24), then with `num_logprobs` k > 0 the token's logprob, k top ids
    and their k logprobs. Unpack with `sampling_metadata.unpack`."""
    logits = logits.astype(jnp.float32)
    processed = apply_token_bitmask(apply_penalties_and_bias(logits, md), logits, md.allowed_token_bitmask)
    tokens = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    if not md.all_greedy:
        sampled_rows = md.temperature > 0
        scaled = processed / jnp.where(sampled_rows, md.temperature, 1.0)[:, None]
        if md.use_top_k_top_p:
            scaled = apply_top_k_top_p_min_p(scaled, md)
        drawn = jnp.argmax(scaled + _gumbel(md, logits.shape[1]), axis=-1).astype(jnp.int32)
        tokens = jnp.where(sampled_rows, drawn, tokens)
    packed = tokens.astype(jnp.float32)[:, None]
    if md.num_logprobs == 0:
        return packed
    return jnp.concatenate([packed, _logprob_columns(logits, tokens, md.num_logprobs)], axis=-1)
