"""`paxserve.worker.sampling.sampler` + `paxserve.worker.sampling.host_inputs`: the on-device sampler against numpy, its
batch independence, its persistent per-request state, and the host-side builder of its inputs."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paxserve.sampling_params import MAX_LOGPROBS, SamplingParams
from paxserve.worker.sampling.host_inputs import (
    PACKED_WIDTH,
    SampledTokens,
    SamplingRow,
    build_sampling_inputs,
    build_state_writes,
    needs_state,
    unpack,
)
from paxserve.worker.sampling.sampler import (
    SamplerState,
    SamplingMetadata,
    apply_penalties_and_bias,
    apply_top_k_top_p_min_p,
    sample,
    state_writes_args,
    write_state_rows,
)

V = 64
EOS = 7
_sample = jax.jit(sample)
_process = jax.jit(apply_penalties_and_bias)
_write = jax.jit(write_state_rows)


def row(prompt: list[int] | None = None, output: list[int] | None = None, seed: int = 0, **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), prompt or [1, 2, 3], output or [], seed, (EOS,))


def with_state(rows: list[SamplingRow], num_state_rows: int = 9, vocab: int = V) -> SamplerState:
    """A fresh sampler state holding each row that needs one (rows 1, 2, ... in order), as the engine
    writes it when those requests start running."""
    state = SamplerState.zeros(num_state_rows, vocab)
    writes = []
    for r in rows:
        if needs_state(r.params, r.eos_token_ids):
            r.state_row = len(writes) + 1
            writes.append((r.state_row, r))
    return _write(state, *state_writes_args(build_state_writes(writes, num_state_rows, vocab))) if writes else state


def run(rows: list[SamplingRow], logits: np.ndarray) -> SampledTokens:
    state = with_state(rows, vocab=logits.shape[1])
    inputs = build_sampling_inputs(rows, logits.shape[0], logits.shape[1])
    packed, _ = _sample(logits, SamplingMetadata.from_inputs(inputs), state)
    assert packed.shape == (logits.shape[0], PACKED_WIDTH)
    return unpack(np.asarray(packed), len(rows))


def random_logits(num_rows: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(num_rows, vocab)) * scale).astype(np.float32)


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def softmax(x: np.ndarray) -> np.ndarray:
    return np.exp(np_log_softmax(x))


# --- greedy and its equivalents -------------------------------------------------------------------


def test_greedy_and_padding_rows_take_the_argmax() -> None:
    logits = random_logits(8)
    out = run([row(temperature=0.0) for _ in range(5)], logits)
    assert out.token_ids == logits[:5].argmax(-1).tolist()
    # No row asked for logprobs: the columns are there (fixed width) but never computed.
    assert not out.sampled_logprobs.any() and not out.top_token_ids.any() and not out.top_logprobs.any()
    # Padding rows are greedy with nothing else: their column 0 is the argmax too.
    inputs = build_sampling_inputs([row(temperature=0.0)], 8, V)
    packed, _ = _sample(logits, SamplingMetadata.from_inputs(inputs), SamplerState.zeros(2, V))
    np.testing.assert_array_equal(np.asarray(packed)[:, 0], logits.argmax(-1))


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    logits = random_logits(8, seed=1)
    rows = [row(seed=i, top_k=1, temperature=1.5) for i in range(4)]
    rows += [row(seed=i, top_p=1e-6, temperature=0.7) for i in range(4)]
    assert run(rows, logits).token_ids == logits.argmax(-1).tolist()


# --- randomness ------------------------------------------------------------------------------------


def test_seeded_row_ignores_row_index_and_batch_mates() -> None:
    target_logits = random_logits(1, seed=2, scale=1.0)[0]
    target = row(output=[5, 6], seed=1234, temperature=1.0)
    alone = run([target], target_logits[None])
    mates = [
        row(temperature=0.0, presence_penalty=1.0, output=[3, 3, 9]),
        row(seed=9, top_k=3, top_p=0.5, min_p=0.1, logprobs=20),
        row(seed=1234, temperature=0.3, logit_bias={4: 50.0}, min_tokens=5, stop_token_ids=[11]),
    ]
    for index in range(4):
        rows = mates[:index] + [target] + mates[index:]
        logits = random_logits(8, seed=index)
        logits[index] = target_logits
        assert run(rows, logits).token_ids[index] == alone.token_ids[0]


def test_seed_and_step_change_the_draw() -> None:
    logits = np.zeros((64, V), np.float32)  # uniform: every token equally likely
    by_seed = run([row(seed=s, temperature=1.0) for s in range(64)], logits).token_ids
    by_step = run([row(seed=5, output=[0] * n, temperature=1.0) for n in range(64)], logits).token_ids
    high_word = run([row(seed=5 + 2**32, output=[0] * n, temperature=1.0) for n in range(64)], logits).token_ids
    assert len(set(by_seed)) > 30 and len(set(by_step)) > 30
    assert by_step != high_word
    assert run([row(seed=5, output=[0] * 3, temperature=1.0)], logits[:1]).token_ids == [by_step[3]]


def test_draws_follow_the_tempered_softmax() -> None:
    n, vocab = 2000, 16
    base = np.linspace(-2.0, 2.0, vocab).astype(np.float32)
    top_shares = []
    for temperature in (0.5, 1.0, 2.0):
        rows = [row(seed=42, output=[0] * i, temperature=temperature) for i in range(n)]
        counts = np.bincount(run(rows, np.tile(base, (n, 1))).token_ids, minlength=vocab)
        expected = softmax(base / temperature)
        total_variation = 0.5 * np.abs(counts / n - expected).sum()
        assert total_variation < 0.05, (temperature, counts, expected)
        top_shares.append(counts[-1] / n)
    # Hotter is flatter: the favourite's share falls as the temperature rises.
    assert top_shares[0] > top_shares[1] > top_shares[2]


def test_top_k_top_p_min_p_keep_only_their_sets() -> None:
    logits = np.tile(random_logits(1, seed=3, scale=1.0), (48, 1))
    order = np.argsort(-logits[0])
    probs = softmax(logits[0])
    cum_before = np.cumsum(probs[order]) - probs[order]
    nucleus = set(order[cum_before < 0.6].tolist())
    ratio = probs[order] / probs.max()
    min_p = float(ratio[3] + ratio[4]) / 2  # keeps exactly the top 4
    rows = [row(seed=s, top_k=5) for s in range(16)]
    rows += [row(seed=s, top_p=0.6) for s in range(16)]
    rows += [row(seed=s, min_p=min_p) for s in range(16)]
    tokens = run(rows, logits).token_ids
    assert set(tokens[:16]) <= set(order[:5].tolist()) and len(set(tokens[:16])) > 1
    assert set(tokens[16:32]) <= nucleus and len(set(tokens[16:32])) > 1
    assert set(tokens[32:]) <= set(order[:4].tolist()) and len(set(tokens[32:])) > 1


def test_neutral_filters_change_nothing_bitwise() -> None:
    # Peaked logits with a long tail: the accumulated top-p mass rounds to 1 before the tail ends,
    # so `mass_before < top_p` alone would mask tail tokens of top_p == 1 rows.
    logits = random_logits(8, vocab=512, seed=4, scale=10.0)
    logits[1, :7] = -np.inf
    inputs = build_sampling_inputs([row(seed=1), row(seed=2)], 8, 512)
    md = SamplingMetadata.from_inputs(inputs)
    np.testing.assert_array_equal(np.asarray(jax.jit(apply_top_k_top_p_min_p)(logits, md)), logits)


_MODES = {"greedy": {"temperature": 0.0}, "random": {}, "filtered": {"top_k": 5, "min_p": 0.01}}


def _variant_rows(mode: str, penalties: bool, logprobs: int | None) -> list[SamplingRow]:
    """A greedy row, a seeded sampled row (unless all-greedy), then one using the features."""
    rows = [row(temperature=0.0), row(seed=77, output=[2, 2]) if mode != "greedy" else row(temperature=0.0)]
    extra = {**_MODES[mode], **({"presence_penalty": 0.5} if penalties else {}), "logprobs": logprobs}
    return rows + [row(seed=5, output=[9], **extra)]


def test_one_program_serves_every_feature_mix_and_leaves_other_rows_alone() -> None:
    """Greedy, sampled and filtered rows, penalties and logprobs are runtime data: a batch of one
    shape compiles once whatever its rows use, and a row's token never depends on its mates'."""
    logits = random_logits(4, seed=10)
    sampled_tokens = set()
    before = _sample._cache_size()
    for mode, penalties, logprobs in itertools.product(_MODES, (False, True), (None, 0, 4, 20)):
        rows = _variant_rows(mode, penalties, logprobs)
        out = run(rows, logits)
        assert out.token_ids[0] == logits[0].argmax()
        if mode != "greedy":
            sampled_tokens.add(out.token_ids[1])
        if logprobs is not None:
            assert out.top_token_ids[2, :3].tolist() == np.argsort(-logits[2])[:3].tolist()
    assert _sample._cache_size() - before <= 1  # at most this test's own shape, once
    assert len(sampled_tokens) == 1  # bit-identical draw in all 16 sampling mixes


def test_the_step_lowers_for_cuda() -> None:
    rows = _variant_rows("filtered", True, 20) + [row(logit_bias={1: 2.0}, min_tokens=3, stop_token_ids=[4])]
    state = with_state(rows)
    md = SamplingMetadata.from_inputs(build_sampling_inputs(rows, 4, V))
    lowered = jax.jit(sample).trace(random_logits(4), md, state).lower(lowering_platforms=("cuda",))
    assert "sort" in lowered.as_text()


# --- logits processing -----------------------------------------------------------------------------


def test_logit_bias_forces_and_forbids() -> None:
    logits = random_logits(4, seed=5)
    top = logits.argmax(-1)
    second = np.argsort(-logits, axis=-1)[:, 1]
    rows = [
        row(temperature=0.0, logit_bias={9: 100.0}),
        row(seed=3, logit_bias={9: 100.0}),
        row(temperature=0.0, logit_bias={int(top[2]): -100.0}),
        row(seed=4, temperature=0.01, logit_bias={int(top[3]): -100.0}),
    ]
    tokens = run(rows, logits).token_ids
    assert tokens[:2] == [9, 9]
    assert tokens[2:] == second[2:].tolist()


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached() -> None:
    logits = random_logits(6, seed=6)
    logits[:, EOS] = 50.0
    logits[:, 12] = 40.0  # a stop token, the runner-up
    logits[:, 20] = 30.0
    kw = dict(temperature=0.0, min_tokens=3, stop_token_ids=[12])
    rows = [
        row(output=[1, 1], **kw),  # 2 < 3: both suppressed
        row(output=[1, 1, 1], **kw),  # reached: eos wins again
        row(output=[1], ignore_eos=True, **kw),  # eos allowed, stop id still suppressed
        row(output=[1], seed=3, **{**kw, "temperature": 1.0}),  # sampled rows are suppressed too
        row(output=[], **{**kw, "stop_token_ids": None}),  # eos only
        row(output=[], temperature=0.0),  # no min_tokens
    ]
    assert run(rows, logits).token_ids == [20, EOS, EOS, 20, 12, EOS]


def test_penalties_and_bias_match_numpy() -> None:
    rng = np.random.default_rng(7)
    logits = random_logits(8, seed=7)
    rows = []
    for i in range(6):
        rows.append(row(
            prompt=rng.integers(0, V, 10).tolist(),
            output=rng.integers(0, V, int(rng.integers(1, 20))).tolist(),
            repetition_penalty=float(rng.uniform(0.5, 2.0)),
            presence_penalty=float(rng.uniform(-2, 2)),
            frequency_penalty=float(rng.uniform(-2, 2)),
            logit_bias={int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, V, 3)},
            min_tokens=i * 3,
            stop_token_ids=[30],
        ))
    rows.append(row(output=[4, 4], logit_bias={4: 1.0}))  # penalties off in a penalty batch
    state = with_state(rows)
    inputs = build_sampling_inputs(rows, 8, V)
    got = np.asarray(_process(logits, SamplingMetadata.from_inputs(inputs), state))
    want = logits.astype(np.float64).copy()
    for i, r in enumerate(rows):
        p, x = r.params, want[i]
        for t, b in (p.logit_bias or {}).items():
            x[t] += np.float32(b)
        if len(r.output_token_ids) < p.min_tokens:
            x[[EOS, 30]] = -np.inf
        counts = np.bincount(r.output_token_ids, minlength=V)
        seen = (counts > 0) | np.isin(np.arange(V), r.prompt_token_ids)
        rep = np.float32(p.repetition_penalty)
        x[seen] = np.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
        x -= np.float32(p.frequency_penalty) * counts + np.float32(p.presence_penalty) * (counts > 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[6], logits[6] + np.eye(V, dtype=np.float32)[4])  # bias only, exactly
    np.testing.assert_array_equal(got[7], logits[7])  # padding


def test_logprobs_are_of_the_raw_logits() -> None:
    logits = random_logits(8, seed=8)
    rows = [
        row(seed=1, logprobs=3, temperature=0.5, presence_penalty=1.5, output=[int(logits[0].argmax())] * 3),
        row(seed=2, logprobs=0, top_k=4, logit_bias={5: 20.0}),
        row(temperature=0.0, logprobs=5, repetition_penalty=1.8, prompt=[int(logits[2].argmax())]),
        row(seed=3),  # wants none; still computed, ignored by the engine
    ]
    out = run(rows, logits)
    assert out.top_token_ids is not None and out.top_logprobs is not None and out.sampled_logprobs is not None
    assert out.top_token_ids.shape == (4, MAX_LOGPROBS)  # always the most a request may ask for
    assert out.token_ids[1] == 5  # the bias moved the draw but not the logprobs
    ref = np_log_softmax(logits[:4])
    np.testing.assert_allclose(out.sampled_logprobs, ref[np.arange(4), out.token_ids], rtol=1e-5)
    np.testing.assert_array_equal(out.top_token_ids, np.argsort(-ref, axis=-1)[:, :MAX_LOGPROBS])
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, out.top_token_ids, -1), rtol=1e-5)


def test_logprob_token_ids_report_those_tokens_in_their_order_beside_rows_that_want_the_top_ones() -> None:
    logits = random_logits(4, seed=9)
    chosen = [7, 0, V - 1]
    rows = [row(temperature=0.0, logprob_token_ids=chosen), row(temperature=0.0, logprobs=4),
            row(seed=5, logprob_token_ids=[3])]
    out = run(rows, logits)
    ref = np_log_softmax(logits[:3])
    np.testing.assert_allclose(out.sampled_logprobs, ref[np.arange(3), out.token_ids], rtol=1e-5)
    assert out.top_token_ids[0, :3].tolist() == chosen and out.top_token_ids[2, 0] == 3
    np.testing.assert_allclose(out.top_logprobs[0, :3], ref[0, chosen], rtol=1e-5)
    np.testing.assert_allclose(out.top_logprobs[2, 0], ref[2, 3], rtol=1e-5)
    # The row between them still gets its top ones.
    np.testing.assert_array_equal(out.top_token_ids[1], np.argsort(-ref[1])[:MAX_LOGPROBS])


# --- host side -------------------------------------------------------------------------------------


def test_unpack_round_trip_and_validation() -> None:
    k = MAX_LOGPROBS
    packed = np.zeros((3, PACKED_WIDTH), np.float32)
    packed[:, 0] = [7, 3, 0]
    packed[:2, 1] = [-0.5, -1.5]
    packed[:2, 2:4] = [7, 3]
    packed[:2, 2 + k : 4 + k] = [[-0.5, -1.5], [-0.25, -1.5]]
    out = unpack(packed, 2)
    assert out.token_ids == [7, 3]
    np.testing.assert_array_equal(out.sampled_logprobs, [-0.5, -1.5])
    np.testing.assert_array_equal(out.top_token_ids[:, :2], [[7, 3], [7, 3]])
    assert out.top_token_ids.dtype == np.int32 and out.top_token_ids.shape == (2, k)
    np.testing.assert_array_equal(out.top_logprobs[:, :2], [[-0.5, -1.5], [-0.25, -1.5]])
    big = np.zeros((1, PACKED_WIDTH), np.float32)
    big[0, 0] = 2**24 - 1
    assert unpack(big, 1).token_ids == [2**24 - 1]
    with pytest.raises(ValueError, match="expected"):
        unpack(packed[:, :6], 2)
    with pytest.raises(ValueError, match="num_rows"):
        unpack(packed, 4)


def test_builder_rows_padding_and_neutralised_rows() -> None:
    greedy_with_filters = row(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2, logprobs=2)
    inputs = build_sampling_inputs([greedy_with_filters, row(top_k=V), row(top_k=-1, seed=2**40 + 3)], 4, V)
    assert inputs.num_rows == 3
    np.testing.assert_array_equal(inputs.top_k, [0, 0, 0, 0])
    np.testing.assert_array_equal(inputs.top_p, [1, 1, 1, 1])
    np.testing.assert_array_equal(inputs.seed[2], [2**8, 3])
    assert inputs.logprobs.tolist() == [True, False, False, False]
    assert inputs.keep.tolist() == [True, True, True, False]  # padding keeps nothing
    assert inputs.state_row.tolist() == [0, 0, 0, 0]
    penalised = row(min_p=0.1, frequency_penalty=0.5, output=list(range(17)), min_tokens=20, max_tokens=32)
    inputs = build_sampling_inputs([row(temperature=1e-6, top_p=0.5), row(output=list(range(17)))], 2, V)
    assert inputs.temperature[0] == 0  # numerically greedy
    assert inputs.step.tolist() == [0, 17]
    with pytest.raises(ValueError, match="no sampler-state row"):  # penalties need their state
        build_sampling_inputs([penalised], 1, V)
    penalised.state_row = 3
    inputs = build_sampling_inputs([penalised], 1, V)
    assert inputs.state_row.tolist() == [3] and inputs.frequency_penalty.tolist() == [0.5]
    with pytest.raises(ValueError, match="smaller"):
        build_sampling_inputs([row(), row()], 1, V)
    with pytest.raises(ValueError, match="seed"):
        row(seed=-1)
    with pytest.raises(ValueError, match="seed"):
        row(seed=2**64)


def test_which_requests_need_state_and_what_is_written() -> None:
    assert not needs_state(SamplingParams(), (EOS,))
    assert not needs_state(SamplingParams(min_tokens=3, ignore_eos=True), (EOS,))  # nothing to hold back
    assert needs_state(SamplingParams(min_tokens=3), (EOS,))
    assert needs_state(SamplingParams(repetition_penalty=1.2), ())
    assert needs_state(SamplingParams(logit_bias={5: -1.0}), ())
    r = row(prompt=[3, 3, 40], output=[5, 9, 5], repetition_penalty=1.2, logit_bias={63: 2.5}, min_tokens=4,
            stop_token_ids=[33])
    writes = build_state_writes([(2, r), (5, row(logit_bias={1: 1.0}))], 9, V)
    assert writes.rows.tolist() == [2, 5]
    assert writes.counts[0].nonzero()[0].tolist() == [5, 9] and writes.counts[0, 5] == 2
    bits = np.unpackbits(writes.prompt_mask.view(np.uint8), axis=1, bitorder="little")
    assert bits[0].nonzero()[0].tolist() == [3, 40] and not bits[1].any()  # no penalties: no prompt set
    held = np.unpackbits(writes.suppress_mask.view(np.uint8), axis=1, bitorder="little")
    assert held[0].nonzero()[0].tolist() == [EOS, 33]
    assert writes.bias[0, 63] == 2.5 and writes.bias[1, 1] == 1.0 and np.count_nonzero(writes.bias) == 2
    three = build_state_writes([(1, r), (2, r), (3, r)], 9, V)
    assert three.rows.tolist() == [1, 2, 3, 9]  # padded to a power of two with a row past the end
    with pytest.raises(ValueError, match="state row"):
        build_state_writes([(0, r)], 9, V)


# --- the state across steps ---------------------------------------------------------------------------


def test_kept_tokens_are_counted_on_the_device_as_a_rebuilt_state_would_be() -> None:
    """The step counts each kept token into its row, so a request's penalties after n steps equal
    those of a state written from scratch with its n tokens (what a preempted request gets); rows
    whose token is not kept (a prompt chunk) and the null row count nothing."""
    rng = np.random.default_rng(11)
    penalised = row(prompt=[1, 2], seed=3, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)
    chunk = row(prompt=[4, 5], seed=4, frequency_penalty=1.0)
    free = row(seed=5)
    rows = [penalised, chunk, free]
    state = with_state(rows)
    assert [r.state_row for r in rows] == [1, 2, 0]
    chunk.keep = False
    for _ in range(12):
        inputs = build_sampling_inputs(rows, 4, V)
        packed, state = _sample(random_logits(4, seed=int(rng.integers(1000)), scale=1.0),
                                SamplingMetadata.from_inputs(inputs), state)
        token = unpack(np.asarray(packed), 3).token_ids[0]
        penalised.output_token_ids = penalised.output_token_ids + [token]
        free.output_token_ids = free.output_token_ids + [token]
    counts = np.asarray(state.counts)
    np.testing.assert_array_equal(counts[1], np.bincount(penalised.output_token_ids, minlength=V))
    assert not counts[2].any() and not counts[0].any() and not counts[3:].any()
    rebuilt = with_state([penalised])
    np.testing.assert_array_equal(np.asarray(rebuilt.counts)[1], counts[1])
    logits = random_logits(1, seed=99)
    md = SamplingMetadata.from_inputs(build_sampling_inputs([penalised], 1, V))
    np.testing.assert_array_equal(np.asarray(_process(logits, md, state)), np.asarray(_process(logits, md, rebuilt)))


# --- batch independence, randomised -----------------------------------------------------------------

_params = st.fixed_dictionaries({}, optional={
    "temperature": st.sampled_from([0.0, 0.5, 1.0]),
    "top_k": st.sampled_from([0, 1, 5]),
    "top_p": st.sampled_from([1.0, 0.3]),
    "min_p": st.sampled_from([0.0, 0.2]),
    "presence_penalty": st.sampled_from([0.0, 1.0]),
    "repetition_penalty": st.sampled_from([1.0, 1.5]),
    "logit_bias": st.sampled_from([None, {3: 5.0}]),
    "min_tokens": st.sampled_from([0, 2]),
    "logprobs": st.sampled_from([None, 0, 3]),
})


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(target=_params, mates=st.lists(_params, max_size=3), index=st.integers(0, 3), seed=st.integers(0, 2**63 - 1))
def test_a_rows_draw_never_depends_on_its_neighbours(target: dict, mates: list[dict], index: int, seed: int) -> None:
    logits = random_logits(4, seed=seed % 1000, scale=1.0)
    target_row = row(output=[3, 1], seed=seed, **target)
    alone = run([target_row], logits[:1]).token_ids[0]
    rows = [row(output=[3], seed=i, **m) for i, m in enumerate(mates)]
    index = min(index, len(rows))
    rows.insert(index, target_row)
    logits[[0, index]] = logits[[index, 0]]
    assert run(rows, logits).token_ids[index] == alone
