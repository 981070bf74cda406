"""Build the padded, flattened ragged batch (numpy) that one model step consumes.

Host side only (no JAX): each sequence contributes a chunk of new tokens (a prompt chunk or one
decode token) on top of the tokens already in its cache, through its block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pallas_kernels.metadata import NULL_BLOCK


@dataclass(slots=True)
class SeqChunk:
    """One sequence's share of a step."""

    token_ids: list[int]  # new tokens fed this step
    num_computed_tokens: int  # tokens of this sequence already in the KV cache
    block_table: list[int]  # physical block ids, in logical order

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("SeqChunk.token_ids must hold at least one token")
        if self.num_computed_tokens < 0:
            raise ValueError(f"SeqChunk.num_computed_tokens must be >= 0, got {self.num_computed_tokens}")
        if NULL_BLOCK in self.block_table:
            raise ValueError(f"SeqChunk.block_table must not use the reserved null block {NULL_BLOCK}")

    @property
    def context_len(self) -> int:
        return self.num_computed_tokens + len(self.token_ids)


@dataclass(slots=True)
class Batch:
    """Numpy arrays for one step; fields mirror `AttentionMetadata` plus token ids and positions."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    block_tables: np.ndarray  # [S, B]
    context_lens: np.ndarray  # [S]
    query_start_loc: np.ndarray  # [S + 1]
    logits_indices: np.ndarray  # [S]
    num_seqs: int  # real (unpadded) sequences
    num_tokens: int  # real (unpadded) tokens


def next_power_of_2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


def build_batch(
    chunks: list[SeqChunk],
    block_size: int,
    *,
    pad_tokens_to: int | None = None,
    pad_seqs_to: int | None = None,
    pad_blocks_to: int | None = None,
) -> Batch:
    """Flatten `chunks` into one padded batch. Padding tokens write to the null block's slots and
    padding sequences have no tokens and no context, so they change nothing."""
    if not chunks:
        raise ValueError("build_batch needs at least one sequence")
    num_tokens = sum(len(c.token_ids) for c in chunks)
    max_blocks = max(len(c.block_table) for c in chunks)
    t_pad = pad_tokens_to or num_tokens
    s_pad = pad_seqs_to or len(chunks)
    b_pad = pad_blocks_to or max_blocks
    if t_pad < num_tokens or s_pad < len(chunks) or b_pad < max_blocks:
        raise ValueError(
            f"padding ({t_pad} tokens, {s_pad} seqs, {b_pad} blocks) is smaller than the batch "
            f"({num_tokens} tokens, {len(chunks)} seqs, {max_blocks} blocks)"
        )
    input_ids = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slot_mapping = np.full(t_pad, NULL_BLOCK * block_size, np.int32)
    block_tables = np.full((s_pad, b_pad), NULL_BLOCK, np.int32)
    context_lens = np.zeros(s_pad, np.int32)
    query_start_loc = np.full(s_pad + 1, num_tokens, np.int32)
    logits_indices = np.zeros(s_pad, np.int32)
    start = 0
    for s, c in enumerate(chunks):
        n = len(c.token_ids)
        if c.context_len > len(c.block_table) * block_size:
            raise ValueError(
                f"sequence {s} needs {c.context_len} cache slots but its block table holds "
                f"{len(c.block_table)} blocks of {block_size}"
            )
        pos = np.arange(c.num_computed_tokens, c.context_len, dtype=np.int32)
        table = np.asarray(c.block_table, np.int32)
        input_ids[start : start + n] = c.token_ids
        positions[start : start + n] = pos
        slot_mapping[start : start + n] = table[pos // block_size] * block_size + pos % block_size
        block_tables[s, : len(table)] = table
        context_lens[s] = c.context_len
        query_start_loc[s] = start
        logits_indices[s] = start + n - 1
        start += n
    return Batch(
        input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, block_tables=block_tables,
        context_lens=context_lens, query_start_loc=query_start_loc, logits_indices=logits_indices,
        num_seqs=len(chunks), num_tokens=num_tokens,
    )
