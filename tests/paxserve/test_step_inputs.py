"""`paxserve.worker.step_inputs`: flattening sequences into one padded batch, exactly, and its validation."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from paxserve.kernels.metadata import NULL_BLOCK, AttentionMetadata
from paxserve.worker.step_inputs import Batch, SeqChunk, build_batch, next_power_of_2

BLOCK_SIZE = 4


def three_sequences() -> list[SeqChunk]:
    """A fresh 5-token prompt, a decode token at position 6, and a 3-token chunk on 3 cached tokens."""
    return [
        SeqChunk(token_ids=[11, 12, 13, 14, 15], num_computed_tokens=0, block_table=[3, 7]),
        SeqChunk(token_ids=[21], num_computed_tokens=6, block_table=[5, 2]),
        SeqChunk(token_ids=[31, 32, 33], num_computed_tokens=3, block_table=[9, 4]),
    ]


def test_hand_worked_batch_with_padding() -> None:
    batch = build_batch(three_sequences(), BLOCK_SIZE, pad_tokens_to=12, pad_seqs_to=5, pad_blocks_to=4)
    # Seq 0: positions 0-3 fill block 3 (slots 12-15), position 4 opens block 7 (slot 28).
    # Seq 1: position 6 is block_table[1] = 2, offset 2 -> slot 10.
    # Seq 2: position 3 is block 9 offset 3 (39); positions 4, 5 are block 4 offsets 0, 1 (16, 17).
    # Padding tokens point at the null block's first slot.
    np.testing.assert_array_equal(batch.input_ids, [11, 12, 13, 14, 15, 21, 31, 32, 33, 0, 0, 0])
    np.testing.assert_array_equal(batch.positions, [0, 1, 2, 3, 4, 6, 3, 4, 5, 0, 0, 0])
    np.testing.assert_array_equal(batch.slot_mapping, [12, 13, 14, 15, 28, 10, 39, 16, 17, 0, 0, 0])
    np.testing.assert_array_equal(
        batch.block_tables, [[3, 7, 0, 0], [5, 2, 0, 0], [9, 4, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(batch.context_lens, [5, 7, 6, 0, 0])
    np.testing.assert_array_equal(batch.query_start_loc, [0, 5, 6, 9, 9, 9])
    np.testing.assert_array_equal(batch.logits_indices, [4, 5, 8, 0, 0])
    assert batch.num_seqs == 3
    assert batch.num_tokens == 9
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens", "query_start_loc",
                 "logits_indices"):
        assert getattr(batch, name).dtype == np.int32, name
    # Padding slots are all in the null block.
    assert np.all(batch.slot_mapping[batch.num_tokens :] // BLOCK_SIZE == NULL_BLOCK)


def test_hand_worked_batch_without_padding() -> None:
    batch = build_batch(three_sequences(), BLOCK_SIZE)
    assert batch.input_ids.shape == (9,)
    assert batch.block_tables.shape == (3, 2)
    np.testing.assert_array_equal(batch.slot_mapping, [12, 13, 14, 15, 28, 10, 39, 16, 17])
    np.testing.assert_array_equal(batch.query_start_loc, [0, 5, 6, 9])
    np.testing.assert_array_equal(batch.context_lens, [5, 7, 6])
    np.testing.assert_array_equal(batch.logits_indices, [4, 5, 8])
    np.testing.assert_array_equal(batch.block_tables, [[3, 7], [5, 2], [9, 4]])


def test_uneven_block_tables_and_exact_fit() -> None:
    """Shorter tables pad with the null block; a context that fills its table exactly is fine."""
    chunks = [
        SeqChunk([1], num_computed_tokens=7, block_table=[6, 1]),  # position 7: last slot of block 1
        SeqChunk([2, 3], num_computed_tokens=0, block_table=[8]),
    ]
    batch = build_batch(chunks, BLOCK_SIZE)
    np.testing.assert_array_equal(batch.block_tables, [[6, 1], [8, 0]])
    np.testing.assert_array_equal(batch.slot_mapping, [1 * 4 + 3, 8 * 4, 8 * 4 + 1])
    np.testing.assert_array_equal(batch.context_lens, [8, 2])


def test_metadata_from_batch_maps_tokens_to_sequences() -> None:
    batch = build_batch(three_sequences(), BLOCK_SIZE, pad_tokens_to=12, pad_seqs_to=5)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(batch.slot_mapping), block_tables=jnp.asarray(batch.block_tables),
        context_lens=jnp.asarray(batch.context_lens), query_start_loc=jnp.asarray(batch.query_start_loc),
        logits_indices=jnp.asarray(batch.logits_indices),
    )
    np.testing.assert_array_equal(md.token_seq_ids(12), [0, 0, 0, 0, 0, 1, 2, 2, 2, 4, 4, 4])
    np.testing.assert_array_equal(md.token_is_valid(12), [True] * 9 + [False] * 3)
    assert md.num_seqs == 5


def test_seq_chunk_context_len() -> None:
    assert SeqChunk([5, 6, 7], num_computed_tokens=10, block_table=[1, 2, 3]).context_len == 13


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(token_ids=[], num_computed_tokens=0, block_table=[1]), "at least one token"),
        (dict(token_ids=[1], num_computed_tokens=-1, block_table=[1]), "num_computed_tokens"),
        (dict(token_ids=[1], num_computed_tokens=0, block_table=[1, NULL_BLOCK]), "null block"),
    ],
    ids=["empty-tokens", "negative-computed", "null-block"],
)
def test_seq_chunk_rejects_bad_input(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SeqChunk(**kwargs)


def test_build_batch_needs_a_sequence() -> None:
    with pytest.raises(ValueError, match="at least one sequence"):
        build_batch([], BLOCK_SIZE)


def test_block_table_too_small() -> None:
    chunks = [SeqChunk([1], 0, [2]), SeqChunk([1, 2, 3], num_computed_tokens=2, block_table=[1])]
    with pytest.raises(ValueError) as info:
        build_batch(chunks, BLOCK_SIZE)
    message = str(info.value)
    assert "sequence 1" in message and "5 cache slots" in message and "1 blocks of 4" in message


@pytest.mark.parametrize(
    "padding",
    [dict(pad_tokens_to=8), dict(pad_seqs_to=2), dict(pad_blocks_to=1)],
    ids=["tokens", "seqs", "blocks"],
)
def test_padding_smaller_than_batch(padding: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="smaller than the batch") as info:
        build_batch(three_sequences(), BLOCK_SIZE, **padding)
    assert "9 tokens, 3 seqs, 2 blocks" in str(info.value)


def test_padding_equal_to_batch_is_fine() -> None:
    batch: Batch = build_batch(three_sequences(), BLOCK_SIZE, pad_tokens_to=9, pad_seqs_to=3, pad_blocks_to=2)
    np.testing.assert_array_equal(batch.query_start_loc, [0, 5, 6, 9])


@pytest.mark.parametrize(
    ("n", "minimum", "expected"),
    [(0, 1, 1), (1, 1, 1), (2, 1, 2), (3, 1, 4), (4, 1, 4), (5, 1, 8), (1000, 1, 1024), (1024, 1, 1024),
     (1025, 1, 2048), (3, 16, 16), (16, 16, 16), (17, 16, 32)],
)
def test_next_power_of_2(n: int, minimum: int, expected: int) -> None:
    assert next_power_of_2(n, minimum) == expected


def test_fine_buckets_cap_padding_at_a_third_and_stay_powers_of_two_otherwise() -> None:
    from paxserve.worker.step_inputs import bucket_size, bucket_sizes

    for n in range(1, 5000):
        coarse, fine = bucket_size(n), bucket_size(n, fine=True)
        assert coarse == next_power_of_2(n) and n <= fine <= coarse
        if n > 16:
            assert (fine - n) / fine < 1 / 3 + 1e-9, (n, fine)
    assert bucket_sizes(256, fine=True) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert bucket_sizes(200, fine=True)[-1] == 256 and bucket_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 128]
