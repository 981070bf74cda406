"""Build the padded, flattened ragged batch (numpy) that one model step consumes.

Host side only (no JAX): each sequence contributes a chunk of new tokens (a prompt chunk or one
decode token) on top of the tokens already in its cache, through its block table. The engine feeds
`assemble_batch` from its persistent rows (`input_batch`); `build_batch` takes a list of chunks
(tests, warm-up, tools, and through `bucketed_batch` a drafter's passes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from paxserve.kernels.metadata import NULL_BLOCK


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
    # [T]: the persistent-batch row whose last kept token (on the device) is this input token, or -1
    # where `input_ids` holds it: a step built before the previous one's results are back.
    token_source: np.ndarray | None = None
    # The program kind that runs it: "forward", or "decode" for a pure-decode step (one token per
    # sequence) when the attention backend has a decode-only kernel (the model runner decides).
    program: str = "forward"
    # [T]: each token's LoRA slot (-1: the base model alone), when the engine serves adapters.
    lora_slots: np.ndarray | None = None


def verify_rows(num_tokens: int, num_seqs: int, width: int) -> int:
    """A verifying step's padded logits rows for its token and sequence buckets: every fed token may
    be a row, and no sequence has more than `width` (1 + k)."""
    return min(num_tokens, num_seqs * width)


def next_power_of_2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


# The smallest size with a bucket between two powers of two: below it the padding is a few rows.
FINE_FROM = 24


def bucket_size(n: int, fine: bool = False) -> int:
    """`n` rounded up to its compile bucket: the next power of two or, with `fine`, also three
    quarters of one from 24 up (24, 32, 48, 64, 96, 128, ...), which caps the padding at a third of
    the bucket instead of a half, for twice the programs."""
    p = next_power_of_2(n)
    if fine and n <= p * 3 // 4 and p * 3 // 4 >= FINE_FROM:
        return p * 3 // 4
    return p


def bucket_sizes(top: int, fine: bool = False) -> list[int]:
    """Every bucket from 1 up to `top`'s own, ascending."""
    sizes, n = [], 1
    while True:
        sizes.append(bucket_size(n, fine))
        if sizes[-1] >= bucket_size(top, fine):
            return sizes
        n = sizes[-1] + 1


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
    widest = max(len(c.block_table) for c in chunks)
    tables = np.full((len(chunks), widest), NULL_BLOCK, np.int32)
    for s, c in enumerate(chunks):
        tables[s, : len(c.block_table)] = c.block_table
    return assemble_batch(
        np.fromiter((t for c in chunks for t in c.token_ids), np.int32),
        np.array([c.num_computed_tokens for c in chunks], np.int32),
        np.array([len(c.token_ids) for c in chunks], np.int32),
        tables, np.array([len(c.block_table) for c in chunks], np.int32), block_size,
        pad_tokens_to=pad_tokens_to, pad_seqs_to=pad_seqs_to, pad_blocks_to=pad_blocks_to,
    )


def bucketed_batch(chunks: list[SeqChunk], block_size: int, fine_buckets: bool) -> Batch:
    """`build_batch` over each chunk's table cut to the blocks its tokens reach (a request may hold
    more: a drafter's lookahead), padded to the step buckets: tokens and sequences by `bucket_size`,
    the block table to a power of two."""
    chunks = [replace(c, block_table=c.block_table[:-(-(c.num_computed_tokens + len(c.token_ids)) // block_size)])
              for c in chunks]
    return build_batch(chunks, block_size, pad_tokens_to=bucket_size(sum(len(c.token_ids) for c in chunks),
                                                                     fine_buckets),
                       pad_seqs_to=bucket_size(len(chunks), fine_buckets),
                       pad_blocks_to=next_power_of_2(max(len(c.block_table) for c in chunks)))


def assemble_batch(
    input_ids: np.ndarray,
    num_computed: np.ndarray,
    num_new: np.ndarray,
    block_tables: np.ndarray,
    num_blocks: np.ndarray,
    block_size: int,
    *,
    pad_tokens_to: int | None = None,
    pad_seqs_to: int | None = None,
    pad_blocks_to: int | None = None,
    token_source: np.ndarray | None = None,
    lora_slots: np.ndarray | None = None,
) -> Batch:
    """The batch from per-sequence arrays, in numpy operations over whole arrays (no Python loop
    per sequence or token): `input_ids` [T] the new tokens in sequence order, `num_computed` and
    `num_new` [S] each sequence's cached and new token counts, `block_tables` [S, >= its blocks]
    and `num_blocks` [S] how many of each row are its blocks; `token_source` [T] as in `Batch`;
    `lora_slots` [S] each sequence's LoRA slot (its tokens' in the batch; padding takes none)."""
    n, t = len(num_new), int(num_new.sum())
    if input_ids.shape != (t,):
        raise ValueError(f"input_ids holds {input_ids.shape[0]} tokens but the sequences feed {t}")
    max_blocks = int(num_blocks.max())
    t_pad, s_pad, b_pad = pad_tokens_to or t, pad_seqs_to or n, pad_blocks_to or max_blocks
    if t_pad < t or s_pad < n or b_pad < max_blocks:
        raise ValueError(
            f"padding ({t_pad} tokens, {s_pad} seqs, {b_pad} blocks) is smaller than the batch "
            f"({t} tokens, {n} seqs, {max_blocks} blocks)"
        )
    context = num_computed + num_new
    short = np.flatnonzero(context > num_blocks * block_size)
    if short.size:
        s = int(short[0])
        raise ValueError(f"sequence {s} needs {int(context[s])} cache slots but its block table holds "
                         f"{int(num_blocks[s])} blocks of {block_size}")
    starts = np.zeros(n + 1, np.int32)
    np.cumsum(num_new, out=starts[1:])
    seq = np.repeat(np.arange(n, dtype=np.int32), num_new)  # the sequence of every token
    positions = np.zeros(t_pad, np.int32)
    positions[:t] = np.arange(t, dtype=np.int32) - starts[seq] + num_computed[seq]
    slot_mapping = np.full(t_pad, NULL_BLOCK * block_size, np.int32)
    slot_mapping[:t] = block_tables[seq, positions[:t] // block_size] * block_size + positions[:t] % block_size
    padded_ids = np.zeros(t_pad, np.int32)
    padded_ids[:t] = input_ids
    source = np.full(t_pad, -1, np.int32)
    if token_source is not None:
        source[:t] = token_source
    tables = np.full((s_pad, b_pad), NULL_BLOCK, np.int32)
    width = min(b_pad, block_tables.shape[1])
    tables[:n, :width] = block_tables[:, :width]
    context_lens = np.zeros(s_pad, np.int32)
    context_lens[:n] = context
    query_start_loc = np.full(s_pad + 1, t, np.int32)
    query_start_loc[:n] = starts[:n]
    logits_indices = np.zeros(s_pad, np.int32)
    logits_indices[:n] = starts[1:] - 1
    token_slots = None
    if lora_slots is not None:
        token_slots = np.full(t_pad, -1, np.int32)
        token_slots[:t] = lora_slots[seq]
    return Batch(
        input_ids=padded_ids, positions=positions, slot_mapping=slot_mapping, block_tables=tables,
        context_lens=context_lens, query_start_loc=query_start_loc, logits_indices=logits_indices,
        num_seqs=n, num_tokens=t, token_source=source, lora_slots=token_slots,
    )
