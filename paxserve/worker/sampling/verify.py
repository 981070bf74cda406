"""Verification of proposed tokens, inside the step's sampler.

A verifying step has L = 1 + k logits rows per sequence: row j scores the position after the j-th
fed token (the sequence's last real token, then its proposals d_0 .. d_{k-1}). Each row is sampled
exactly as plain decoding samples that output position: the same processing, and for sampled
requests the same Gumbel draw keyed by (seed, output position). The sequence keeps x_0 .. x_m, where
m counts the leading positions whose sample equals the proposal.

That is rejection sampling for a proposer whose distribution q is one token (n-gram lookup):
accepting d with probability min(1, p(d) / q(d)) = p(d) is "the draw came out d", and a rejected
position's draw is distributed as p without d, normalised, which is the residual max(0, p - q)
normalised. So every kept token has exactly the target's distribution, and because the draws are
the ones plain decoding makes, a seeded request gives the same tokens with or without proposals
(greedy ones trivially).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from paxserve.worker.sampling.host_inputs import NO_DRAFT
from paxserve.worker.sampling.sampler import SamplerState, SamplingMetadata, sample_tokens

__all__ = ["NO_DRAFT", "accepted_counts", "verify"]


def accepted_counts(tokens: Int[Array, "S L"], drafts: Int[Array, "S L"]) -> Int[Array, " S"]:
    """How many leading positions' samples equal their proposals (`drafts[:, j]` is the proposal the
    sample at row j is compared with; NO_DRAFT never matches)."""
    return jnp.sum(jnp.cumprod(tokens == drafts, axis=1), axis=1).astype(jnp.int32)


def verify(logits: Float[Array, "N V"], md: SamplingMetadata, state: SamplerState,
           drafts: Int[Array, "S L"]) -> tuple[Float[Array, "N W"], SamplerState]:
    """`logits` and `md` hold N = S * L rows, sequence-major (row i * L + j: sequence i, position j;
    `md.step` already counts j in). Returns every row packed as `sample` does (the host applies the
    same acceptance rule to the tokens), and the state with the kept tokens counted and each
    sequence's last kept token remembered as its next input."""
    s, width = drafts.shape
    tokens, packed = sample_tokens(logits, md, state)
    grid = tokens.reshape(s, width)
    accepted = accepted_counts(grid, drafts)
    position = jnp.arange(width, dtype=jnp.int32)[None, :]
    keep = md.keep.reshape(s, width)[:, :1]
    kept = (keep & (position <= accepted[:, None])).reshape(-1)
    last = (keep & (position == accepted[:, None])).reshape(-1)
    rows = jnp.where((md.state_row > 0) & kept, md.state_row, state.num_rows)  # past the end: dropped
    batch_rows = jnp.where(last, md.batch_row, state.num_rows)
    state = state.replace(counts=state.counts.at[rows, tokens].add(1, mode="drop"),
                          last_token=state.last_token.at[batch_rows].set(tokens, mode="drop"))
    return packed, state
