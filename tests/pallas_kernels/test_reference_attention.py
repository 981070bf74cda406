"""`ragged_paged_attention_reference` and `write_kv_reference` against a naive numpy attention.

Every case writes a ragged batch (decode tokens and prompt chunks on top of cached context) into a
two-layer paged cache through shuffled block tables, with every unused page (and the null block 0)
filled with NaN, then checks the attention of layer 1 against dense causal softmax attention over
each sequence's K/V gathered in logical order. Inputs are random on every run; the seed is in every
failure message and can be pinned with PAXSERVE_TEST_SEED.
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import paxserve.kernels.reference as ref_module
from paxserve.kernels.metadata import NULL_BLOCK, AttentionMetadata
from paxserve.kernels.reference import ragged_paged_attention_reference, write_kv_reference
from paxserve.worker.step_inputs import Batch, SeqChunk, build_batch

BASE_SEED = int(os.environ.get("PAXSERVE_TEST_SEED", secrets.randbits(31)))
print(f"test_reference_attention: PAXSERVE_TEST_SEED={BASE_SEED}")

NUM_LAYERS = 2
LAYER = 1  # the layer under test; layer 0 must never be read or written

_attention = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "soft_cap"))
_write = jax.jit(write_kv_reference)


@dataclass(frozen=True)
class Seq:
    """One sequence of a batch: `num_computed` tokens already cached, `query_len` new ones, and
    `extra_blocks` allocated blocks beyond what its context needs (NaN, never written)."""

    num_computed: int
    query_len: int
    extra_blocks: int = 0

    @property
    def context_len(self) -> int:
        return self.num_computed + self.query_len


@dataclass
class Case:
    """A whole randomised problem: cache contents, batch metadata and the true K/V per sequence."""

    seed: int
    block_size: int
    num_kv_heads: int
    group: int
    head_dim: int
    dtype: np.dtype
    seqs: list[Seq]
    batch: Batch
    k_cache: np.ndarray  # before this step's write
    v_cache: np.ndarray
    q: np.ndarray  # [T_pad, H, D]
    k_new: np.ndarray  # [T_pad, KVH, D]
    v_new: np.ndarray
    k_true: list[np.ndarray]  # per sequence [context_len, KVH, D], logical order
    v_true: list[np.ndarray]
    block_tables: list[list[int]]
    used_blocks: set[int]

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    def metadata(self) -> AttentionMetadata:
        b = self.batch
        return AttentionMetadata(
            slot_mapping=jnp.asarray(b.slot_mapping),
            block_tables=jnp.asarray(b.block_tables),
            context_lens=jnp.asarray(b.context_lens),
            query_start_loc=jnp.asarray(b.query_start_loc),
            logits_indices=jnp.asarray(b.logits_indices),
        )


def _seed_for(label: str) -> int:
    return (BASE_SEED * 1_000_003 + sum(ord(c) * 31**i for i, c in enumerate(label))) % (2**31)


def _round(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return x.astype(dtype)


def make_case(
    label: str,
    seqs: list[Seq],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int = 32,
    dtype: np.dtype = np.dtype(np.float32),
    pad_tokens: int = 0,
    pad_seqs: int = 0,
    pad_blocks_to: int | None = None,
    spare_blocks: int = 3,
) -> Case:
    seed = _seed_for(label)
    rng = np.random.default_rng(seed)
    blocks_needed = [math.ceil(s.context_len / block_size) + s.extra_blocks for s in seqs]
    num_blocks = 1 + sum(blocks_needed) + spare_blocks
    ids = rng.permutation(np.arange(1, num_blocks))  # never the null block 0
    tables, start = [], 0
    for n in blocks_needed:
        tables.append([int(i) for i in ids[start : start + n]])
        start += n
    used = {b for t in tables for b in t}

    shape = (NUM_LAYERS, num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = np.full(shape, np.nan, np.float32)
    v_cache = np.full(shape, np.nan, np.float32)
    # Layer 0 holds finite garbage: reading it instead of layer 1 gives wrong numbers, writing it is seen.
    k_cache[0] = rng.standard_normal(shape[1:])
    v_cache[0] = rng.standard_normal(shape[1:])
    k_cache, v_cache = _round(k_cache, dtype), _round(v_cache, dtype)

    k_true, v_true = [], []
    for s, table in zip(seqs, tables):
        k = _round(rng.standard_normal((s.context_len, num_kv_heads, head_dim)).astype(np.float32), dtype)
        v = _round(rng.standard_normal((s.context_len, num_kv_heads, head_dim)).astype(np.float32), dtype)
        k_true.append(k)
        v_true.append(v)
        for pos in range(s.num_computed):  # the cached context, written the slow obvious way
            k_cache[LAYER, table[pos // block_size], pos % block_size] = k[pos]
            v_cache[LAYER, table[pos // block_size], pos % block_size] = v[pos]

    chunks = [
        SeqChunk(token_ids=list(range(1, s.query_len + 1)), num_computed_tokens=s.num_computed, block_table=t)
        for s, t in zip(seqs, tables)
    ]
    num_tokens = sum(s.query_len for s in seqs)
    batch = build_batch(
        chunks,
        block_size,
        pad_tokens_to=num_tokens + pad_tokens if pad_tokens else None,
        pad_seqs_to=len(seqs) + pad_seqs if pad_seqs else None,
        pad_blocks_to=pad_blocks_to,
    )
    t_pad = batch.slot_mapping.shape[0]
    num_heads = num_kv_heads * group
    q = rng.standard_normal((t_pad, num_heads, head_dim)).astype(np.float32)
    # Padding tokens carry NaN K/V: they land in the null block, which must stay unread.
    k_new = np.full((t_pad, num_kv_heads, head_dim), np.nan, np.float32)
    v_new = np.full((t_pad, num_kv_heads, head_dim), np.nan, np.float32)
    k_new, v_new = _round(k_new, dtype), _round(v_new, dtype)
    t = 0
    for s, k, v in zip(seqs, k_true, v_true):
        k_new[t : t + s.query_len] = k[s.num_computed :]
        v_new[t : t + s.query_len] = v[s.num_computed :]
        t += s.query_len
    return Case(
        seed=seed, block_size=block_size, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
        dtype=np.dtype(dtype), seqs=seqs, batch=batch, k_cache=k_cache, v_cache=v_cache, q=_round(q, dtype),
        k_new=k_new, v_new=v_new, k_true=k_true, v_true=v_true, block_tables=tables, used_blocks=used,
    )


def naive_attention(
    case: Case,
    k_cache_layer: np.ndarray,
    v_cache_layer: np.ndarray,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> np.ndarray:
    """Dense causal softmax attention per sequence in float64 over K/V gathered by block table."""
    group = case.group
    out = np.zeros(case.q.shape, np.float64)
    t = 0
    for s, table in zip(case.seqs, case.block_tables):
        ctx = s.context_len
        k = k_cache_layer[table].reshape(-1, case.num_kv_heads, case.head_dim)[:ctx].astype(np.float64)
        v = v_cache_layer[table].reshape(-1, case.num_kv_heads, case.head_dim)[:ctx].astype(np.float64)
        for i in range(s.query_len):
            pos = s.num_computed + i
            keys = np.arange(ctx)
            allowed = keys <= pos
            if sliding_window is not None:
                allowed &= keys > pos - sliding_window
            for h in range(case.num_heads):
                kv = h // group
                scores = k[allowed, kv] @ case.q[t + i, h].astype(np.float64) * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                p = np.exp(scores - scores.max())
                out[t + i, h] = (p / p.sum()) @ v[allowed, kv]
        t += s.query_len
    return out


def run_step(
    case: Case, *, sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This step as the engine runs it: write the new K/V, then attend. Returns (out, k_cache, v_cache)."""
    md = case.metadata()
    layer = jnp.asarray(LAYER, jnp.int32)
    k_cache, v_cache = _write(
        jnp.asarray(case.k_cache), jnp.asarray(case.v_cache), layer, jnp.asarray(case.k_new),
        jnp.asarray(case.v_new), md.slot_mapping,
    )
    out = _attention(
        jnp.asarray(case.q), k_cache, v_cache, layer, md, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    return np.asarray(out), np.asarray(k_cache), np.asarray(v_cache)


def check_case(
    case: Case, *, sliding_window: int | None = None, soft_cap: float | None = None, sm_scale: float | None = None
) -> None:
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(case.head_dim)
    out, k_cache, v_cache = run_step(case, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    info = f"seed={case.seed} (PAXSERVE_TEST_SEED={BASE_SEED})"
    assert out.dtype == case.dtype, info

    # The write put every sequence's tokens where its block table says: the gathered cache is the truth.
    for s, table, k, v in zip(case.seqs, case.block_tables, case.k_true, case.v_true):
        got_k = k_cache[LAYER, table].reshape(-1, case.num_kv_heads, case.head_dim)[: s.context_len]
        got_v = v_cache[LAYER, table].reshape(-1, case.num_kv_heads, case.head_dim)[: s.context_len]
        np.testing.assert_array_equal(got_k, k, err_msg=info)
        np.testing.assert_array_equal(got_v, v, err_msg=info)
    np.testing.assert_array_equal(k_cache[0], case.k_cache[0], err_msg=f"layer 0 was written; {info}")
    np.testing.assert_array_equal(v_cache[0], case.v_cache[0], err_msg=f"layer 0 was written; {info}")

    ref = naive_attention(
        case, k_cache[LAYER], v_cache[LAYER], sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
    )
    n = case.batch.num_tokens
    got = out[:n].astype(np.float64)
    assert np.all(np.isfinite(got)), f"NaN/inf in real tokens' output (an unused page was read); {info}"
    rel = float(np.max(np.abs(got - ref[:n])) / np.max(np.abs(ref[:n])))
    tol = 1e-5 if case.dtype == np.float32 else 1e-2
    assert rel < tol, f"relative error {rel:.3g} >= {tol}; {info}"
    # Padding tokens produce exactly zero.
    assert np.array_equal(out[n:].astype(np.float32), np.zeros_like(out[n:], np.float32)), info


# Context lengths hit: 1, one block exactly, exact multiples, partially filled last blocks and the
# most the padded block table allows; decode (query length 1) mixed with prompt chunks on cached context.
def _mixed_seqs(bs: int, max_blocks: int) -> list[Seq]:
    return [
        Seq(0, 1),  # context 1
        Seq(bs - 1, 1),  # decode that fills exactly one block
        Seq(0, 5),  # fresh prompt chunk
        Seq(bs + 3, 2 * bs - 3),  # chunk on cached context ending at an exact block multiple (3 blocks)
        Seq(max_blocks * bs - 1, 1, 0),  # decode at the longest length the block table allows
        Seq(bs // 2, bs + 1, extra_blocks=1),  # chunk crossing blocks, one allocated block still empty
    ]


@pytest.mark.parametrize(
    ("block_size", "group", "dtype"),
    [
        (8, 1, np.float32),
        (16, 2, np.float32),
        (32, 4, np.float32),
        (16, 8, np.float32),
        (16, 4, ml_dtypes.bfloat16),
        (8, 8, ml_dtypes.bfloat16),
    ],
    ids=lambda p: getattr(p, "__name__", str(p)),
)
def test_mixed_ragged_batch_matches_naive(block_size: int, group: int, dtype: type) -> None:
    max_blocks = 4
    case = make_case(
        f"mixed-{block_size}-{group}-{np.dtype(dtype).name}",
        _mixed_seqs(block_size, max_blocks),
        block_size=block_size, num_kv_heads=2, group=group, dtype=np.dtype(dtype),
        pad_tokens=5, pad_seqs=2, pad_blocks_to=max_blocks,
    )
    assert case.batch.block_tables.shape[1] == max_blocks
    assert case.seqs[4].context_len == max_blocks * block_size
    check_case(case)


@pytest.mark.parametrize("num_kv_heads", [1, 4])
def test_single_long_prompt_and_pure_decode(num_kv_heads: int) -> None:
    """A lone prompt from position 0 (no padding) and a pure decode batch."""
    prompt = make_case(
        f"prompt-{num_kv_heads}", [Seq(0, 37)], block_size=16, num_kv_heads=num_kv_heads, group=2, head_dim=64
    )
    check_case(prompt)
    decode = make_case(
        f"decode-{num_kv_heads}", [Seq(n, 1) for n in (0, 15, 16, 31, 47, 2)], block_size=16,
        num_kv_heads=num_kv_heads, group=2, head_dim=64, pad_tokens=2, pad_seqs=2, pad_blocks_to=3,
    )
    check_case(decode)


def test_sliding_window() -> None:
    case = make_case(
        "window", [Seq(20, 1), Seq(3, 12), Seq(0, 9), Seq(30, 4)], block_size=8, num_kv_heads=2, group=2,
        pad_tokens=3, pad_seqs=1,
    )
    check_case(case, sliding_window=7)


def test_soft_cap() -> None:
    case = make_case(
        "softcap", [Seq(10, 1), Seq(0, 11), Seq(17, 6)], block_size=8, num_kv_heads=2, group=4,
        pad_tokens=2, pad_seqs=1,
    )
    # A large sm_scale makes the scores big enough that the cap (tanh) really bends them.
    check_case(case, soft_cap=5.0, sm_scale=1.0)
    out_uncapped, _, _ = run_step(case, sm_scale=1.0)
    out_capped, _, _ = run_step(case, sm_scale=1.0, soft_cap=5.0)
    n = case.batch.num_tokens
    assert np.max(np.abs(out_capped[:n] - out_uncapped[:n])) > 1e-2, "soft_cap had no effect"


@pytest.mark.parametrize("per_iteration", [1, 3, 64])
@pytest.mark.parametrize("decode", [False, True])
def test_work_items_split_across_loop_iterations(monkeypatch: pytest.MonkeyPatch, per_iteration: int,
                                                 decode: bool) -> None:
    """KV chunks of one page each and a few work items per loop iteration: a query block's chunks
    straddle iterations and repeat within one, and the merged softmax must still be exact."""
    seqs = [Seq(21, 1), Seq(0, 1), Seq(9, 1)] if decode else [Seq(5, 7), Seq(0, 1), Seq(9, 3), Seq(30, 2)]
    case = make_case(f"split{per_iteration}{decode}", seqs, block_size=8, num_kv_heads=2, group=2,
                     pad_tokens=1, pad_seqs=1)
    monkeypatch.setattr(ref_module, "_DECODE_CHUNK", case.block_size)
    monkeypatch.setattr(ref_module, "_PREFILL_CHUNK", case.block_size)
    monkeypatch.setattr(ref_module, "_KEYS_PER_ITERATION", per_iteration * case.block_size)
    md = case.metadata()
    sm_scale = 1.0 / math.sqrt(case.head_dim)
    k_cache, v_cache = write_kv_reference(
        jnp.asarray(case.k_cache), jnp.asarray(case.v_cache), LAYER, jnp.asarray(case.k_new),
        jnp.asarray(case.v_new), md.slot_mapping,
    )
    out = np.asarray(ref_module.ragged_paged_attention_reference(
        jnp.asarray(case.q), k_cache, v_cache, LAYER, md, sm_scale=sm_scale))
    ref = naive_attention(case, np.asarray(k_cache[LAYER]), np.asarray(v_cache[LAYER]), sm_scale=sm_scale)
    n = case.batch.num_tokens
    rel = float(np.max(np.abs(out[:n] - ref[:n])) / np.max(np.abs(ref[:n])))
    assert rel < 1e-5, f"relative error {rel:.3g}; seed={case.seed}"
    assert np.all(out[n:] == 0)


def test_write_kv_places_each_token_at_its_slot() -> None:
    """Token at position p of a sequence lands at block_table[p // bs], offset p % bs of the layer
    written; padding tokens touch only block 0; nothing else changes."""
    bs, kvh, d = 8, 2, 16
    rng = np.random.default_rng(_seed_for("write"))
    seqs = [Seq(0, 3), Seq(7, 1), Seq(5, 12), Seq(16, 1)]
    blocks_needed = [math.ceil(s.context_len / bs) for s in seqs]
    num_blocks = 1 + sum(blocks_needed) + 2
    ids = [int(i) for i in rng.permutation(np.arange(1, num_blocks))]
    tables = []
    for n in blocks_needed:
        tables.append(ids[:n])
        ids = ids[n:]
    chunks = [SeqChunk(list(range(s.query_len)), s.num_computed, t) for s, t in zip(seqs, tables)]
    batch = build_batch(chunks, bs, pad_tokens_to=24, pad_seqs_to=6, pad_blocks_to=4)
    t_pad = batch.slot_mapping.shape[0]
    shape = (NUM_LAYERS, num_blocks, bs, kvh, d)
    k_cache = rng.standard_normal(shape).astype(np.float32)
    v_cache = rng.standard_normal(shape).astype(np.float32)
    k_new = rng.standard_normal((t_pad, kvh, d)).astype(np.float32) + 100.0  # distinguishable from the cache
    v_new = rng.standard_normal((t_pad, kvh, d)).astype(np.float32) - 100.0

    k_out, v_out = write_kv_reference(
        jnp.asarray(k_cache), jnp.asarray(v_cache), LAYER, jnp.asarray(k_new), jnp.asarray(v_new),
        jnp.asarray(batch.slot_mapping),
    )
    k_out, v_out = np.asarray(k_out), np.asarray(v_out)
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    t = 0
    for s, table in zip(seqs, tables):
        for i in range(s.query_len):
            pos = s.num_computed + i
            expected_k[LAYER, table[pos // bs], pos % bs] = k_new[t + i]
            expected_v[LAYER, table[pos // bs], pos % bs] = v_new[t + i]
            np.testing.assert_array_equal(k_out[LAYER, table[pos // bs], pos % bs], k_new[t + i])
        t += s.query_len
    # Everything outside the null block is exactly the expected cache: layer 0 and other slots untouched.
    np.testing.assert_array_equal(k_out[:, 1:], expected_k[:, 1:])
    np.testing.assert_array_equal(v_out[:, 1:], expected_v[:, 1:])
    np.testing.assert_array_equal(k_out[0], k_cache[0])
    # Padding tokens went to the null block of the written layer, and only there.
    num_pad = t_pad - batch.num_tokens
    assert num_pad > 0
    changed = np.any(k_out[LAYER, NULL_BLOCK] != k_cache[LAYER, NULL_BLOCK], axis=(-1, -2))
    assert changed.any(), "padding tokens did not write to the null block"
    pad_values = k_new[batch.num_tokens :]
    for offset in np.flatnonzero(changed):
        assert any(np.array_equal(k_out[LAYER, NULL_BLOCK, offset], p) for p in pad_values)


def test_write_kv_casts_to_cache_dtype() -> None:
    cache = jnp.zeros((NUM_LAYERS, 3, 4, 1, 8), jnp.bfloat16)
    k = jnp.full((2, 1, 8), 1.0 + 2**-12, jnp.float32)  # rounds to 1.0 in bfloat16
    k_out, v_out = write_kv_reference(cache, cache, 1, k, -k, jnp.asarray([5, 6], jnp.int32))
    assert k_out.dtype == jnp.bfloat16 and v_out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(k_out[1, 1, 1:3], np.float32), np.ones((2, 1, 8), np.float32))
    np.testing.assert_array_equal(np.asarray(v_out[1, 1, 1:3], np.float32), -np.ones((2, 1, 8), np.float32))
    assert float(jnp.abs(k_out[0]).sum()) == 0.0
