"""On-device sampling, run inside the jitted step right after the model's forward.

Order (vLLM's): logit bias, min_tokens suppression, repetition / frequency / presence penalties,
the structured-output token bitmask; greedy rows take the argmax of those processed logits; sampled
rows divide by temperature, apply top-k, top-p and min-p, then draw with the Gumbel-max trick. The
draw's key comes only from the row's (seed, step), so a seeded request samples the same tokens
whatever shares its batch.

Every feature is runtime data (see `sampling.host_inputs`): one program serves every mix of requests.
The costly stages (the per-request state, the random draw, the vocabulary sort behind the filters,
the top logprobs) run under `lax.cond` on whether any row of the step uses them, so a step of plain
greedy rows pays for none of them, and a row that does not use a stage leaves it bit-for-bit
unchanged, so its result does not depend on what its batch mates use. Logprobs are of the raw model
logits, before any processing, as vLLM returns by default.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int, UInt32

from paxserve.sampling_params import MAX_LOGPROBS
from paxserve.worker.sampling.host_inputs import SamplingInputs, StateWrites, bitmask_width


@struct.dataclass
class SamplingMetadata:
    """Device copy of `SamplingInputs` (every field an array: nothing here is a compile key)."""

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
    logprobs: Bool[Array, " S"]
    state_row: Int[Array, " S"]
    batch_row: Int[Array, " S"]
    keep: Bool[Array, " S"]
    allowed_token_bitmask: Int[Array, "S W"]
    logprob_ids: Int[Array, "S K"]  # chosen tokens whose logprobs a row reports (-1: none, the top ones)

    @classmethod
    def from_inputs(cls, inputs: SamplingInputs, all_allowed: jax.Array | None = None,
                    no_logprob_ids: jax.Array | None = None, on_host: bool = False) -> "SamplingMetadata":
        """Copy to the device. A step without constrained rows has no bitmask: `all_allowed`, an
        all-ones [S, W] device array the caller keeps, stands in (made here when not given); one
        without logprob_token_ids likewise takes `no_logprob_ids`, all -1 [S, MAX_LOGPROBS].
        `on_host`: the host's fields stay numpy arrays, for a caller that hands them straight to a
        compiled step program, which copies them in one go (a jnp.asarray each costs ~20-30 us of
        Python per field, ~0.5 ms of every step)."""
        values = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(cls)}
        s = inputs.temperature.shape[0]
        if values["allowed_token_bitmask"] is None:
            shape = (s, bitmask_width(inputs.vocab_size))
            values["allowed_token_bitmask"] = jnp.full(shape, -1, jnp.int32) if all_allowed is None else all_allowed
        if values["logprob_ids"] is None:
            values["logprob_ids"] = jnp.full((s, MAX_LOGPROBS), -1, jnp.int32) if no_logprob_ids is None \
                else no_logprob_ids
        if on_host:
            return cls(**{name: value if isinstance(value, jax.Array) else np.asarray(value)
                          for name, value in values.items()})
        return cls(**{name: jnp.asarray(value) for name, value in values.items()})


@struct.dataclass
class SamplerState:
    """Per-request sampling state that outlives a step, one row per running request that needs it
    (row 0 stays all zeros: the row of every request that needs none). Passed to and returned by
    every step, donated like the KV cache."""

    counts: Int[Array, "R V"]  # how often each token is in the request's output
    prompt_mask: Int[Array, "R W"]  # packed bits: the prompt's tokens (repetition penalty)
    bias: Float[Array, "R V"]  # logit_bias, dense
    suppress_mask: Int[Array, "R W"]  # packed bits: held back while step < min_tokens
    # The last token each persistent-batch row kept: the next step's input for that row, read on the
    # device, so the host can build that step before this one's results are back.
    last_token: Int[Array, " R"]

    @classmethod
    def zeros(cls, num_rows: int, vocab_size: int) -> "SamplerState":
        w = bitmask_width(vocab_size)
        return cls(counts=jnp.zeros((num_rows, vocab_size), jnp.int32), prompt_mask=jnp.zeros((num_rows, w), jnp.int32),
                   bias=jnp.zeros((num_rows, vocab_size), jnp.float32),
                   suppress_mask=jnp.zeros((num_rows, w), jnp.int32), last_token=jnp.zeros((num_rows,), jnp.int32))

    @staticmethod
    def num_bytes(num_rows: int, vocab_size: int) -> int:
        return num_rows * 4 * (2 * vocab_size + 2 * bitmask_width(vocab_size) + 1)

    @property
    def num_rows(self) -> int:
        return self.counts.shape[0]


def write_state_rows(state: SamplerState, rows: Int[Array, " K"], counts: Int[Array, "K V"],
                     prompt_mask: Int[Array, "K W"], bias: Float[Array, "K V"],
                     suppress_mask: Int[Array, "K W"]) -> SamplerState:
    """Overwrite whole rows of the state (rows past its end are padding and dropped)."""
    return state.replace(counts=state.counts.at[rows].set(counts, mode="drop"),
                         prompt_mask=state.prompt_mask.at[rows].set(prompt_mask, mode="drop"),
                         bias=state.bias.at[rows].set(bias, mode="drop"),
                         suppress_mask=state.suppress_mask.at[rows].set(suppress_mask, mode="drop"))


def state_writes_args(writes: StateWrites) -> tuple[jax.Array, ...]:
    return tuple(jnp.asarray(a) for a in (writes.rows, writes.counts, writes.prompt_mask, writes.bias,
                                          writes.suppress_mask))


def unpack_bits(words: Int[Array, "S W"], vocab_size: int) -> Bool[Array, "S V"]:
    """Packed int32 words -> one bool per token (bit t of word t//32)."""
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].astype(bool)


def apply_penalties_and_bias(logits: Float[Array, "S V"], md: SamplingMetadata, state: SamplerState,
                             earlier: Int[Array, "S K"] | None = None) -> Float[Array, "S V"]:
    """The argmax-changing processing of rows with sampler state: bias, min_tokens suppression,
    penalties. Skipped when no row of the step has state; a row without state reads the all-zero
    row 0 and neutral penalties, which change nothing. `earlier`: output tokens each row follows
    that its state has not counted yet (a verifying step's proposals before the row; -1: none)."""
    v = logits.shape[1]

    def process(x: Float[Array, "S V"]) -> Float[Array, "S V"]:
        rows = md.state_row
        x = x + state.bias[rows]
        held = unpack_bits(state.suppress_mask[rows], v) & (md.step < md.min_tokens)[:, None]
        x = jnp.where(held, -jnp.inf, x)
        counts = state.counts[rows]
        if earlier is not None:
            at = jnp.arange(x.shape[0])[:, None]
            counts = counts.at[at, jnp.where(earlier >= 0, earlier, v)].add(1, mode="drop")
        seen = unpack_bits(state.prompt_mask[rows], v) | (counts > 0)
        rep = md.repetition_penalty[:, None]
        x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
        x = x - md.frequency_penalty[:, None] * counts.astype(x.dtype)
        return x - md.presence_penalty[:, None] * (counts > 0).astype(x.dtype)

    return jax.lax.cond(jnp.any(md.state_row > 0), process, lambda x: x, logits)


def count_kept_tokens(state: SamplerState, md: SamplingMetadata, tokens: Int[Array, " S"]) -> SamplerState:
    """Add each kept token to its row's counts, so the next step's penalties see it, and remember it
    as its batch row's last token."""
    rows = jnp.where((md.state_row > 0) & md.keep, md.state_row, state.num_rows)  # past the end: dropped
    last = jnp.where(md.keep, md.batch_row, state.num_rows)
    return state.replace(counts=state.counts.at[rows, tokens].add(1, mode="drop"),
                         last_token=state.last_token.at[last].set(tokens, mode="drop"))


def apply_token_bitmask(processed: Float[Array, "S V"], logits: Float[Array, "S V"],
                        bitmask: Int[Array, "S W"]) -> Float[Array, "S V"]:
    """Structured outputs: tokens whose bit is clear become -inf. A free row's words are all ones,
    so it comes back unchanged. Should the grammar's tokens all be -inf already (min_tokens
    suppressing the EOS that a finished grammar allows), the grammar wins over the suppression."""
    allowed = unpack_bits(bitmask, processed.shape[1])
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


def _draw(processed: Float[Array, "S V"], greedy: Int[Array, " S"], md: SamplingMetadata) -> Int[Array, " S"]:
    """Sampled rows: temperature, the filters (only when some row uses one), a Gumbel-max draw."""
    sampled_rows = md.temperature > 0
    scaled = processed / jnp.where(sampled_rows, md.temperature, 1.0)[:, None]
    filtered = (md.top_k > 0) | (md.top_p < 1.0) | (md.min_p > 0)
    scaled = jax.lax.cond(jnp.any(filtered), lambda x: apply_top_k_top_p_min_p(x, md), lambda x: x, scaled)
    drawn = jnp.argmax(scaled + _gumbel(md, processed.shape[1]), axis=-1).astype(jnp.int32)
    return jnp.where(sampled_rows, drawn, greedy)


def _top_k(logprobs: Float[Array, "N V"], k: int) -> tuple[Float[Array, "N k"], Float[Array, "N k"]]:
    """Top-k logprobs and their ids as float32, zero-padded to k columns for a vocabulary smaller
    than k (test models)."""
    values, ids = jax.lax.top_k(logprobs, min(k, logprobs.shape[1]))
    pad = ((0, 0), (0, k - values.shape[1]))
    return jnp.pad(ids.astype(jnp.float32), pad), jnp.pad(values, pad)


def _logprob_columns(logits: Float[Array, "S V"], tokens: Int[Array, " S"], k: int,
                     chosen: Int[Array, "S K"]) -> Float[Array, "S W"]:
    """The sampled token's logprob, then k ids and their logprobs: the top k, or for a row with
    `chosen` tokens (logprob_token_ids) those, in the order asked."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    sampled = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)
    top_ids, top_values = _top_k(logprobs, k)
    own = chosen[:, :1] >= 0
    chosen_values = jnp.where(chosen >= 0, jnp.take_along_axis(logprobs, jnp.maximum(chosen, 0), axis=-1), 0.0)
    ids = jnp.where(own, chosen.astype(jnp.float32), top_ids)
    values = jnp.where(own, chosen_values, top_values)
    return jnp.concatenate([sampled, ids, values], axis=-1)


def prompt_logprob_columns(logits: Float[Array, "T V"], targets: Int[Array, " T"], k: int) -> Float[Array, "T W"]:
    """Per flat position: the logprob of the token its logits score (`targets`, the next prompt
    token), that token's exact rank (1 + how many tokens have a strictly larger logprob), and the
    top `k` ids and logprobs, packed as float32 (ranks and ids are exact below 2**24)."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    actual = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)
    rank = 1 + jnp.sum(logprobs > actual, axis=-1, keepdims=True, dtype=jnp.int32)
    top_ids, top_values = _top_k(logprobs, k)
    return jnp.concatenate([actual, rank.astype(jnp.float32), top_ids, top_values], axis=-1)


def sample_tokens(logits: Float[Array, "S V"], md: SamplingMetadata, state: SamplerState,
                  earlier: Int[Array, "S K"] | None = None) -> tuple[Int[Array, " S"], Float[Array, "S W"]]:
    """Every row's token, and the packed float32 rows `sample` returns (the state is read, not
    changed: the caller counts what it keeps). `earlier`: see `apply_penalties_and_bias`."""
    logits = logits.astype(jnp.float32)
    processed = apply_token_bitmask(apply_penalties_and_bias(logits, md, state, earlier), logits,
                                    md.allowed_token_bitmask)
    greedy = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    tokens = jax.lax.cond(jnp.any(md.temperature > 0), lambda p, g: _draw(p, g, md), lambda p, g: g,
                          processed, greedy)
    width = 1 + 2 * MAX_LOGPROBS
    columns = jax.lax.cond(jnp.any(md.logprobs), lambda: _logprob_columns(logits, tokens, MAX_LOGPROBS,
                                                                          md.logprob_ids),
                           lambda: jnp.zeros((logits.shape[0], width), jnp.float32))
    return tokens, jnp.concatenate([tokens.astype(jnp.float32)[:, None], columns], axis=-1)


def sample(logits: Float[Array, "S V"], md: SamplingMetadata,
           state: SamplerState) -> tuple[Float[Array, "S W"], SamplerState]:
    """One packed float32 array per step, so the engine copies to the host once: column 0 the token
    id (exact below 2**24), then its logprob, MAX_LOGPROBS top ids and their logprobs (zeros when no
    row asked; unpack with `host_inputs.unpack`). The state comes back with the kept tokens
    counted."""
    tokens, packed = sample_tokens(logits, md, state)
    return packed, count_kept_tokens(state, md, tokens)
