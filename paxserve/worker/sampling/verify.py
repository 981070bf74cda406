"""Verification of proposed tokens, inside the step's sampler.

A verifying step's logits rows are its sequences' rows one after another: a sequence with d
proposals has 1 + d of them, row j scoring the position after its j-th fed token (its last real
token, then its proposals). Rows after the last sequence's are padding. Each row is sampled exactly
as plain decoding samples that output position: the same processing, and for sampled requests the
same Gumbel draw keyed by (seed, output position). The sequence keeps x_0 .. x_m, where m counts the
leading rows whose sample equals the proposal.

That is rejection sampling for a proposer whose distribution q is one token (n-gram lookup):
accepting d with probability min(1, p(d) / q(d)) = p(d) is "the draw came out d", and a rejected
position's draw is distributed as p without d, normalised, which is the residual max(0, p - q)
normalised. So every kept token has exactly the target's distribution, and because the draws are
the ones plain decoding makes, a seeded request gives the same tokens with or without proposals
(greedy ones trivially).

Only the rows that exist are computed (the logits head and the sampler run over them), not 1 + k
per sequence: on a compute-bound device a row costs what a token does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from paxserve.worker.sampling.host_inputs import NO_DRAFT
from paxserve.worker.sampling.sampler import SamplerState, SamplingMetadata, sample_tokens

__all__ = ["NO_DRAFT", "kept_rows", "verify"]


def kept_rows(tokens: Int[Array, " N"], drafts: Int[Array, " N"], batch_row: Int[Array, " N"]
              ) -> tuple[Bool[Array, " N"], Bool[Array, " N"]]:
    """Which rows' samples a sequence keeps (every row up to and including its first whose sample
    differs from the proposal `drafts` holds for it; NO_DRAFT never matches, so a sequence's last
    row always ends it), and which of them is its last. A sequence's rows are the consecutive ones
    with the same `batch_row`."""
    miss = (tokens != drafts).astype(jnp.int32)
    before = jnp.cumsum(miss) - miss  # misses in earlier rows, over the whole step
    start = jnp.concatenate([jnp.ones((1,), bool), batch_row[1:] != batch_row[:-1]])
    # `before` never decreases, so its value at the latest sequence start is a running maximum.
    kept = before == jax.lax.cummax(jnp.where(start, before, 0))
    return kept, kept & (miss == 1)


def verify(logits: Float[Array, "N V"], md: SamplingMetadata, state: SamplerState, drafts: Int[Array, " N"],
           earlier: Int[Array, "N K"]) -> tuple[Float[Array, "N W"], SamplerState]:
    """`logits` and `md` hold the step's N rows (`md.step` already counts each row's position in its
    sequence in; `drafts[i]` is the proposal row i's sample is compared with; `earlier[i]` the
    proposals before row i in its sequence, -1 after them, which penalties count: a row's sample
    is kept only if they were). Returns every row packed as `sample` does (the host applies the
    same acceptance rule to the tokens), and the state with the kept tokens counted and each
    sequence's last kept token remembered as its next input."""
    tokens, packed = sample_tokens(logits, md, state, earlier)
    kept, last = kept_rows(tokens, drafts, md.batch_row)
    kept, last = kept & md.keep, last & md.keep
    rows = jnp.where((md.state_row > 0) & kept, md.state_row, state.num_rows)  # past the end: dropped
    batch_rows = jnp.where(last, md.batch_row, state.num_rows)
    state = state.replace(counts=state.counts.at[rows, tokens].add(1, mode="drop"),
                          last_token=state.last_token.at[batch_rows].set(tokens, mode="drop"))
    return packed, state
