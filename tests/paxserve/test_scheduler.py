"""Scheduler: token budget, chunked prefill, preemption by recompute, abort, finishing; plus a
hypothesis test of the block/ref-count invariants over random add / step / abort sequences."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paxserve.core.kv_cache_manager import KVCacheManager, cdiv
from paxserve.core.request import Request, RequestStatus
from paxserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from paxserve.sampling_params import SamplingParams
from paxserve.worker.input_batch import InputBatch

BS = 4


def make_sched(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 128,
    enable_caching: bool = True,
    block_size: int = BS,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len),
        KVCacheManager(num_blocks, block_size, enable_caching),
    )


def make_req(rid: str, prompt, max_tokens: int = 4, eos=(), **params) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, **params),
        max_tokens=max_tokens,
        eos_token_ids=tuple(eos),
    )


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request_id, s.num_new_tokens) for s in out.scheduled]


def step(sched: Scheduler, token: int | dict[str, int] = 7) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with a fake model that samples `token` (or token[request_id])."""
    out = sched.schedule()
    sampled = [token[s.request_id] if isinstance(token, dict) else token for s in out.scheduled]
    return out, sched.update_from_output(out, sampled)


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> int:
    for n in range(max_steps):
        if not sched.num_unfinished:
            return n
        out, _ = step(sched)
        assert out.scheduled, "a step with unfinished requests scheduled nothing"
    raise AssertionError("requests did not finish")


# ---------------------------------------------------------------- config and admission checks


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(0, 8, 32)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(1, 0, 32)


def test_budget_running_first_then_waiting_fcfs():
    sched = make_sched(max_num_batched_tokens=10)
    for rid, n in (("a", 6), ("b", 6), ("c", 3), ("d", 2)):
        base = 100 * (ord(rid) - ord("a") + 1)  # distinct prompts: no prefix hits
        sched.add_request(make_req(rid, range(base, base + n), max_tokens=5))
    out, _ = step(sched)
    assert plan(out) == [("a", 6), ("b", 4)]  # b's prompt is chunked, c and d wait
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    out, _ = step(sched)
    # Running first (a decodes, b finishes its prompt), then c, then d gets the rest of the budget.
    assert plan(out) == [("a", 1), ("b", 2), ("c", 3), ("d", 2)]
    out, _ = step(sched)
    assert plan(out) == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]
    assert out.num_scheduled_tokens == 4


def test_waiting_is_fcfs_even_when_a_later_one_would_fit():
    sched = make_sched(num_blocks=5, max_num_batched_tokens=64)  # 4 usable blocks
    sched.add_request(make_req("a", range(9), max_tokens=2))  # 3 blocks
    sched.add_request(make_req("b", range(100, 108), max_tokens=2))  # 2 blocks: does not fit
    sched.add_request(make_req("c", [50], max_tokens=2))  # 1 block: would fit, but waits its turn
    out, _ = step(sched)
    assert plan(out) == [("a", 9)]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_chunked_prefill_samples_nothing_until_prompt_done():
    sched = make_sched(max_num_batched_tokens=10)
    req = make_req("r", range(100, 125), max_tokens=3)  # 25 tokens
    sched.add_request(req)
    expected = [(10, [1, 2, 3]), (20, [1, 2, 3, 4, 5]), (25, [1, 2, 3, 4, 5, 6, 7])]
    for i, (computed, blocks) in enumerate(expected):
        out, finished = step(sched, token=40 + i)
        assert plan(out) == [("r", [10, 10, 5][i])]
        assert req.num_computed_tokens == computed
        assert sched.kv.block_ids("r") == blocks
        assert finished == []
        assert req.output_token_ids == ([] if i < 2 else [42])
    assert req.status == RequestStatus.RUNNING
    out, _ = step(sched, token=50)
    assert plan(out) == [("r", 1)]
    assert req.output_token_ids == [42, 50]


def test_decode_and_prefill_mixed_in_one_step():
    sched = make_sched(max_num_batched_tokens=8)
    a = make_req("a", [1, 2, 3], max_tokens=5)
    sched.add_request(a)
    step(sched, token=9)
    b = make_req("b", range(20, 32), max_tokens=5)  # 12 tokens
    sched.add_request(b)
    out, _ = step(sched, token={"a": 10, "b": 11})
    assert plan(out) == [("a", 1), ("b", 7)]  # a decodes, b prefills a chunk in the same batch
    assert a.output_token_ids == [9, 10]
    assert b.output_token_ids == []
    out, _ = step(sched, token={"a": 12, "b": 13})
    assert plan(out) == [("a", 1), ("b", 5)]
    assert b.output_token_ids == [13]
    assert b.num_computed_tokens == 12


def test_max_num_seqs_respected():
    sched = make_sched(max_num_seqs=2)
    for rid, mt in (("a", 1), ("b", 3), ("c", 2)):
        sched.add_request(make_req(rid, [1, 2], max_tokens=mt))
    out, finished = step(sched)
    assert plan(out) == [("a", 2), ("b", 2)]
    assert [r.request_id for r in finished] == ["a"]
    assert [r.request_id for r in sched.running] == ["b"]
    out, _ = step(sched)  # a's slot is free: c joins
    assert plan(out) == [("b", 1), ("c", 2)]
    assert len(sched.running) == 2


def test_n_samples_share_prompt_blocks_in_one_step():
    sched = make_sched()
    prompt = list(range(1, 11))  # 10 tokens
    sched.add_request(make_req("s0", prompt, max_tokens=2))
    sched.add_request(make_req("s1", prompt, max_tokens=2))
    out, _ = step(sched)
    assert plan(out) == [("s0", 10), ("s1", 2)]
    assert sched.kv.block_ids("s0") == [1, 2, 3]
    assert sched.kv.block_ids("s1") == [1, 2, 4]
    assert [sched.kv.pool.blocks[i].ref_cnt for i in range(1, 5)] == [2, 2, 1, 1]
    assert sched.requests["s1"].num_cached_tokens == 8
    assert sched.requests["s0"].num_cached_tokens == 0


def test_prefix_hits_skip_computation_and_stats():
    sched = make_sched()
    prompt = list(range(1, 14))  # 13 tokens
    sched.add_request(make_req("a", prompt, max_tokens=1))
    out, _ = step(sched)
    assert plan(out) == [("a", 13)]
    assert sched.kv.num_free_blocks == 63  # a finished: all blocks back (cached)
    sched.add_request(make_req("b", prompt, max_tokens=1))
    out, _ = step(sched)
    assert plan(out) == [("b", 1)]  # 12 of 13 tokens from the cache
    assert (sched.kv.prefix_stats.queries, sched.kv.prefix_stats.hits) == (26, 12)


# ---------------------------------------------------------------- finishing


def test_finish_by_max_tokens():
    sched = make_sched()
    req = make_req("r", [1, 2, 3], max_tokens=3)
    sched.add_request(req)
    free0 = sched.kv.num_free_blocks
    for i in range(3):
        out, finished = step(sched, token=10 + i)
        assert finished == ([req] if i == 2 else [])
    assert req.output_token_ids == [10, 11, 12]
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.status.finished
    assert sched.num_unfinished == 0 and sched.requests == {}
    assert sched.kv.num_free_blocks == free0
    assert sched.kv.block_ids("r") == []
    assert "r" not in sched.kv.req_hashes
    assert plan(sched.schedule()) == []


def test_finish_by_eos():
    sched = make_sched()
    req = make_req("r", [1, 2], max_tokens=10, eos=(2, 3))
    sched.add_request(req)
    step(sched, token=5)
    out, finished = step(sched, token=3)
    assert finished == [req]
    assert req.output_token_ids == [5, 3]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.stop_reason is None
    assert sched.kv.num_free_blocks == 63


def test_ignore_eos():
    sched = make_sched()
    req = make_req("r", [1], max_tokens=3, eos=(2,), ignore_eos=True)
    sched.add_request(req)
    for _ in range(3):
        step(sched, token=2)
    assert req.output_token_ids == [2, 2, 2]
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_finish_by_stop_token_ids():
    sched = make_sched()
    req = make_req("r", [1, 2], max_tokens=10, eos=(2,), stop_token_ids=[8, 9])
    sched.add_request(req)
    step(sched, token=4)
    _, finished = step(sched, token=9)
    assert finished == [req]
    assert req.output_token_ids == [4, 9]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.stop_reason == 9


def test_min_tokens_suppresses_eos_and_stop_tokens():
    sched = make_sched()
    req = make_req("r", [1], max_tokens=10, eos=(2,), min_tokens=3, stop_token_ids=[9])
    sched.add_request(req)
    _, finished = step(sched, token=2)
    assert finished == [] and req.status == RequestStatus.RUNNING
    _, finished = step(sched, token=9)
    assert finished == [] and req.status == RequestStatus.RUNNING
    assert req.stop_reason is None
    _, finished = step(sched, token=2)  # the 3rd output token: min_tokens reached
    assert finished == [req]
    assert req.output_token_ids == [2, 9, 2]
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_append_output_directly():
    req = make_req("r", [1], max_tokens=2, eos=(2,), min_tokens=1)
    assert req.append_output(2) == RequestStatus.FINISHED_STOPPED
    req = make_req("r", [1], max_tokens=2)
    assert req.append_output(5) is None
    assert req.first_token_time is not None
    assert req.append_output(6) == RequestStatus.FINISHED_LENGTH
    assert req.all_token_ids == [1, 5, 6]
    assert req.token_ids_slice(0, 3) == [1, 5, 6]
    assert req.token_ids_slice(1, 3) == [5, 6]
    assert req.token_ids_slice(0, 1) == [1]


# ---------------------------------------------------------------- abort


def test_abort_running_frees_blocks_at_once():
    sched = make_sched(max_num_batched_tokens=8)
    free0 = sched.kv.num_free_blocks
    a = make_req("a", range(20), max_tokens=5)  # chunked: still prefilling after one step
    b = make_req("b", [1, 2, 3], max_tokens=3)
    sched.add_request(a)
    step(sched)
    assert sched.kv.block_ids("a") == [1, 2]
    sched.add_request(b)
    assert sched.abort("a") is a
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_free_blocks == free0
    assert sched.kv.block_ids("a") == []
    assert "a" not in sched.requests and a not in sched.running
    assert sched.abort("a") is None  # unknown now
    for _ in range(5):
        out, _ = step(sched)
        assert all(s.request_id != "a" for s in out.scheduled)
    assert a.num_computed_tokens == 8
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert sched.kv.num_free_blocks == free0


def test_abort_waiting():
    sched = make_sched(max_num_seqs=1)
    free0 = sched.kv.num_free_blocks
    a = make_req("a", [1, 2, 3], max_tokens=3)
    b = make_req("b", [4, 5], max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    used = free0 - sched.kv.num_free_blocks
    assert used == 1
    assert sched.abort("b") is b
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert list(sched.waiting) == []
    assert free0 - sched.kv.num_free_blocks == used
    for _ in range(4):
        out, _ = step(sched)
        assert all(s.request_id != "b" for s in out.scheduled)
    assert b.output_token_ids == [] and b.num_computed_tokens == 0
    assert sched.num_unfinished == 0
    assert sched.kv.num_free_blocks == free0
    assert sched.abort("nope") is None


def test_abort_one_of_two_sharing_blocks_keeps_shared_ones():
    sched = make_sched()
    prompt = list(range(1, 11))
    s0, s1 = make_req("s0", prompt, max_tokens=4), make_req("s1", prompt, max_tokens=4)
    sched.add_request(s0)
    sched.add_request(s1)
    step(sched)
    assert sched.kv.block_ids("s1") == [1, 2, 4]
    free_before = sched.kv.num_free_blocks
    sched.abort("s0")  # only s0's private block 3 comes back
    assert sched.kv.num_free_blocks == free_before + 1
    assert [sched.kv.pool.blocks[i].ref_cnt for i in range(1, 5)] == [1, 1, 0, 1]
    run_to_completion(sched)
    assert s1.output_token_ids == [7] * 4
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)


def test_abort_preempted_request():
    sched = make_sched(num_blocks=5, enable_caching=False)
    a = make_req("a", range(1, 6), max_tokens=6)
    b = make_req("b", range(11, 18), max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        out, _ = step(sched)
    assert out.preempted_ids == ["b"] and b.status == RequestStatus.PREEMPTED
    free_before = sched.kv.num_free_blocks
    assert sched.abort("b") is b
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert list(sched.waiting) == [] and sched.kv.num_free_blocks == free_before
    run_to_completion(sched)
    assert b.output_token_ids == [7, 7] and a.output_token_ids == [7] * 6
    assert sched.kv.num_free_blocks == 4


# ---------------------------------------------------------------- preemption


@pytest.mark.parametrize("enable_caching", [True, False])
def test_preempt_newest_and_resume(enable_caching):
    # 4 usable blocks of 4 tokens. a and b: 7-token prompts, 2 blocks each, full pool after step 1.
    sched = make_sched(num_blocks=5, max_num_batched_tokens=64, enable_caching=enable_caching)
    a = make_req("a", range(1, 8), max_tokens=3)
    b = make_req("b", range(11, 18), max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched, token={"a": 101, "b": 201})
    assert plan(out) == [("a", 7), ("b", 7)]
    assert sched.kv.block_ids("a") == [1, 2] and sched.kv.block_ids("b") == [3, 4]
    out, _ = step(sched, token={"a": 102, "b": 202})
    assert plan(out) == [("a", 1), ("b", 1)]
    assert sched.kv.num_free_blocks == 0
    c = make_req("c", [21, 22], max_tokens=1)
    sched.add_request(c)

    # a's 9th token needs a third block: b, the newest, is preempted.
    out = sched.schedule()
    assert sched.kv.block_ids("a") == [1, 2, 4]  # b's tail block (freed first) is reused first
    finished = sched.update_from_output(out, [103])
    assert out.preempted_ids == ["b"]
    assert plan(out) == [("a", 1)]  # c is not admitted in a step that preempted
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert b.output_token_ids == [201, 202]  # outputs kept
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # front of the queue
    assert sched.kv.block_ids("b") == []
    assert finished == [a] and a.output_token_ids == [101, 102, 103]

    # b resumes: prompt + its 2 outputs are recomputed, minus what the prefix cache still holds.
    assert sched.kv.pool.free_queue.block_ids() == [3, 4, 2, 1]
    out = sched.schedule()
    hits = 4 if enable_caching else 0  # b's first block survived (its second was evicted by a)
    assert plan(out) == [("b", 9 - hits), ("c", 2)]
    assert out.scheduled[0].num_computed_tokens == hits and b.num_computed_tokens == 9
    assert b.num_cached_tokens == 0  # counted at first scheduling only
    # With caching b takes back block 3 (a hit, pulled out of the free list [3, 4, 2, 1]) and two new
    # ones (4, then a's cached 2, evicted); without, the same ids in free-list order. c gets block 1.
    assert sched.kv.block_ids("b") == [3, 4, 2]
    assert sched.kv.block_ids("c") == [1]
    finished = sched.update_from_output(out, [203, 301])
    assert set(finished) == {b, c}
    assert b.output_token_ids == [201, 202, 203]
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert c.output_token_ids == [301]
    assert b.num_preemptions == 1 and c.num_preemptions == 0
    assert sched.kv.num_free_blocks == 4
    assert all(blk.ref_cnt == 0 for blk in sched.kv.pool.blocks)


def test_preempt_self_when_newest():
    # a (5 tokens) and b (7 tokens) fill the 4 usable blocks; a still has room, b does not.
    sched = make_sched(num_blocks=5, enable_caching=False)
    a = make_req("a", range(1, 6), max_tokens=6)
    b = make_req("b", range(11, 18), max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    step(sched)
    assert (a.num_tokens, b.num_tokens) == (7, 9)
    out, _ = step(sched)
    assert out.preempted_ids == ["b"]  # b is the newest: it preempts itself, a keeps running
    assert plan(out) == [("a", 1)]
    assert sched.running == [a]
    assert list(sched.waiting) == [b]
    assert b.output_token_ids == [7, 7] and b.num_computed_tokens == 0
    assert sched.kv.block_ids("a") == [1, 2]
    assert sched.kv.pool.free_queue.block_ids() == [4, 3]
    out, _ = step(sched)  # a: 8 tokens, 2 blocks; b needs 3 blocks, 2 free: stays waiting
    assert plan(out) == [("a", 1)] and out.preempted_ids == []
    out = sched.schedule()  # a's 9th token: takes block 4; b still cannot come in
    assert plan(out) == [("a", 1)] and out.preempted_ids == []
    assert sched.kv.block_ids("a") == [1, 2, 4]
    sched.update_from_output(out, [7])
    assert a.num_output_tokens == 5
    out, _ = step(sched)
    assert a.status == RequestStatus.FINISHED_LENGTH
    out = sched.schedule()  # b resumes: its prompt and 2 outputs are recomputed
    assert plan(out) == [("b", 9)]
    assert sched.kv.block_ids("b") == [3, 4, 2]
    sched.update_from_output(out, [8])
    run_to_completion(sched)
    assert b.output_token_ids == [7, 7, 8, 7] and b.status == RequestStatus.FINISHED_LENGTH
    assert b.num_preemptions == 1
    assert sched.kv.num_free_blocks == 4


def test_preempted_request_recomputes_in_chunks():
    # 4 usable blocks, budget 4: b is preempted twice and recomputes prompt + outputs in chunks.
    sched = make_sched(num_blocks=5, max_num_batched_tokens=4, enable_caching=False)
    a = make_req("a", range(1, 4), max_tokens=10)
    b = make_req("b", range(10, 15), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    expected = [
        # (scheduled, preempted, a's blocks, b's blocks), checked right after schedule()
        ([("a", 3), ("b", 1)], [], [1], [2]),
        ([("a", 1), ("b", 3)], [], [1], [2]),
        ([("a", 1), ("b", 1)], [], [1, 3], [2, 4]),
        ([("a", 1), ("b", 1)], [], [1, 3], [2, 4]),
        ([("a", 1), ("b", 1)], [], [1, 3], [2, 4]),
        ([("a", 1), ("b", 1)], [], [1, 3], [2, 4]),
        ([("a", 1)], ["b"], [1, 3, 4], []),  # a's 9th token needs a block: b (newest) goes
        ([("a", 1), ("b", 3)], [], [1, 3, 4], [2]),  # b resumes: 9 tokens to recompute, 3 fit
        ([("a", 1)], ["b"], [1, 3, 4], []),  # b's next chunk needs a second block: b preempts itself
        ([("a", 1), ("b", 3)], [], [1, 3, 4], [2]),  # a finishes in this step
        ([("b", 4)], [], [], [2, 4]),
        ([("b", 2)], [], [], [2, 4, 3]),  # 9 tokens recomputed: samples its 5th output
        ([("b", 1)], [], [], [2, 4, 3]),
    ]
    for i, (scheduled, preempted, a_blocks, b_blocks) in enumerate(expected):
        out = sched.schedule()
        assert plan(out) == scheduled, i
        assert out.preempted_ids == preempted, i
        assert (sched.kv.block_ids("a"), sched.kv.block_ids("b")) == (a_blocks, b_blocks), i
        if preempted:
            assert b.num_computed_tokens == 0 and sched.waiting[0] is b
        n_out = b.num_output_tokens
        sched.update_from_output(out, [10 + i] * len(out.scheduled))
        if 6 <= i <= 10:
            assert b.num_output_tokens == n_out == 4  # recompute chunks sample nothing
    assert sched.num_unfinished == 0
    assert a.output_token_ids == list(range(10, 20))
    assert b.output_token_ids == [12, 13, 14, 15, 21, 22]
    assert b.num_preemptions == 2 and a.num_preemptions == 0
    assert sched.kv.num_free_blocks == 4


def test_preemption_is_counted_and_everyone_finishes():
    sched = make_sched(num_blocks=6, max_num_seqs=4, max_num_batched_tokens=16, enable_caching=True)
    reqs = [make_req(f"r{i}", [i + 1] * 3, max_tokens=8) for i in range(4)]  # each grows to 3 blocks
    for r in reqs:
        sched.add_request(r)
    n = run_to_completion(sched)
    assert n > 8
    assert sum(r.num_preemptions for r in reqs) >= 1
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [7] * 8
    assert sched.kv.num_free_blocks == 5
    assert all(blk.ref_cnt == 0 for blk in sched.kv.pool.blocks)


# ---------------------------------------------------------------- random operation sequences

NUM_BLOCKS, MAX_SEQS, BUDGET, MAX_LEN = 12, 3, 10, 48  # 11 usable blocks = 44 tokens < 48
BASE = [5, 6, 7, 8, 5, 6, 7, 8, 9, 9, 5, 6, 7, 8, 1, 2, 3, 4, 1, 2, 3, 4, 5, 6]

prompts = st.one_of(
    st.lists(st.sampled_from([1, 2]), min_size=1, max_size=36),
    st.tuples(st.integers(1, len(BASE)), st.lists(st.sampled_from([1, 2, 3]), max_size=12)).map(
        lambda t: BASE[: t[0]] + t[1]
    ),
)
add_op = st.tuples(st.just("add"), prompts, st.integers(1, 16), st.booleans())
step_op = st.tuples(st.just("step"), st.lists(st.sampled_from([0, 1, 2, 3]), min_size=MAX_SEQS, max_size=MAX_SEQS))
abort_op = st.tuples(st.just("abort"), st.integers(0, 30))
ops = st.lists(st.one_of(add_op, add_op, step_op, step_op, step_op, abort_op), min_size=4, max_size=40)


def check_blocks(sched: Scheduler) -> None:
    kv, pool = sched.kv, sched.kv.pool
    holders: dict[int, list[tuple[Request, int]]] = {}
    for rid, blocks in kv.req_blocks.items():
        req = sched.requests[rid]
        assert req.status == RequestStatus.RUNNING, f"{rid} holds blocks while {req.status}"
        for i, blk in enumerate(blocks):
            holders.setdefault(blk.block_id, []).append((req, i))
    for r in sched.running:
        assert len(kv.req_blocks.get(r.request_id, [])) * kv.block_size >= r.num_computed_tokens
        assert r.status == RequestStatus.RUNNING
    for r in sched.waiting:
        assert kv.block_ids(r.request_id) == []
        assert r.num_computed_tokens == 0
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    free_ids = pool.free_queue.block_ids()
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    assert 0 not in free_ids and 0 not in holders
    assert pool.null_block.ref_cnt == 0
    assert sorted(free_ids + list(holders)) == list(range(1, pool.num_blocks))
    for blk in pool.blocks:
        assert blk.ref_cnt == len(holders.get(blk.block_id, []))
        if blk.ref_cnt == 0 and blk.block_id:
            assert blk.block_id in free_ids
    for block_id, hs in holders.items():
        blk = pool.blocks[block_id]
        if len(hs) > 1:
            assert blk.block_hash is not None, f"block {block_id} shared by {len(hs)} requests but not cached"
            assert len({i for _, i in hs}) == 1, "a shared block sits at different positions"
        if blk.block_hash is not None:
            assert pool.cached.get(blk.block_hash) is blk
            for req, i in hs:
                # A cached block holds exactly this request's tokens (and chained prefix) at that position.
                assert blk.block_hash.token_ids == tuple(req.token_ids_slice(i * kv.block_size, (i + 1) * kv.block_size))
                assert kv.req_hashes[req.request_id][i] == blk.block_hash
    for h, blk in pool.cached.items():
        assert blk.block_hash == h
    assert set(sched.requests) == {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting}
    assert len(sched.running) <= MAX_SEQS


def checked_step(sched: Scheduler, tokens: list[int], expected_out: dict[str, list[int]],
                 rows: InputBatch | None = None) -> None:
    """One step with every scheduling invariant checked. With `rows`, a persistent batch is kept in
    step from the output's plain data alone, and must equal a from-scratch build: each running
    request's block table, tokens and position."""
    running_before = list(sched.running)
    waiting_before = list(sched.waiting)
    out = sched.schedule()
    assert out.num_scheduled_tokens <= BUDGET
    assert len(sched.running) <= MAX_SEQS
    if sched.num_unfinished and not out.preempted_ids:
        assert out.scheduled, "nothing scheduled although requests are waiting"
    # Preempted requests are the newest running ones, newest first, now at the front of waiting.
    preempted = [r for r in running_before if r.request_id in out.preempted_ids]
    k = len(preempted)
    assert out.preempted_ids == [r.request_id for r in running_before[::-1][:k]]
    assert [r.request_id for r in list(sched.waiting)[:k]] == out.preempted_ids[::-1]
    for r in preempted:
        assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0
        assert sched.kv.block_ids(r.request_id) == []
        assert r.request_id in out.left_running_ids
    sched_reqs = [sched.requests[s.request_id] for s in out.scheduled]
    assert len(set(map(id, sched_reqs))) == len(sched_reqs)
    old = [r for r in sched_reqs if r in running_before]
    new = [r for r in sched_reqs if r not in running_before]
    assert sched_reqs == old + new  # running first
    assert old == [r for r in running_before if r in old]
    assert old == running_before[: len(old)]  # a prefix of the running order
    if out.preempted_ids:
        assert new == []  # no admission in a step that preempted
    assert new == waiting_before[: len(new)]  # FCFS
    assert [n.request_id for n in out.new_requests] == [r.request_id for r in new]
    if new:
        for s, r in zip(out.scheduled[: len(old)], old):
            assert s.num_new_tokens == r.num_tokens - s.num_computed_tokens
    for s, r in zip(out.scheduled, sched_reqs):
        # The computed count moves on at schedule time; a step completing the tokens holds one
        # placeholder for the token it samples.
        assert s.num_new_tokens >= 1 and s.num_computed_tokens + s.num_new_tokens == r.num_computed_tokens
        assert r.num_computed_tokens <= r.num_tokens
        assert s.samples == (r.num_computed_tokens == r.num_tokens)
        assert r.num_output_placeholders == int(s.samples)
        assert len(sched.kv.block_ids(r.request_id)) * sched.kv.block_size >= r.num_computed_tokens
        assert r.status == RequestStatus.RUNNING
        if r in new:
            assert s.new_block_ids == []  # its NewRequestData holds its whole table
            if r.num_preemptions == 0:
                assert s.num_computed_tokens == r.num_cached_tokens
    if rows is not None:
        for request_id in out.left_running_ids:
            rows.remove(request_id)
        for n in out.new_requests:
            rows.add(n)
        for s in out.scheduled:
            rows.append_blocks(s.request_id, s.new_block_ids)
        assert len(rows) == len(sched.running)
        for r in sched.running:
            row = rows._rows[r.request_id]
            table = sched.kv.block_ids(r.request_id)
            assert rows.block_table[row, : rows.num_blocks[row]].tolist() == table
            assert rows.token_ids[row] == r.all_token_ids
    check_blocks(sched)
    sampled = [tokens[k % len(tokens)] for k in range(len(out.scheduled))]
    for s, r, t in zip(out.scheduled, sched_reqs, sampled):
        if s.samples:
            expected_out[r.request_id].append(t)
    if rows is not None and out.scheduled:
        prepared = rows.prepare(out.scheduled, lambda t, n, b: (t, n, b))
        flat = [t for s, r in zip(out.scheduled, sched_reqs)
                for t in r.token_ids_slice(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens)]
        assert prepared.batch.input_ids.tolist() == flat
        rows.record(prepared, sampled)
    finished = sched.update_from_output(out, sampled)
    for r in finished:
        assert r.status.finished
        assert sched.kv.block_ids(r.request_id) == []
        assert r.request_id not in sched.requests
    for r in sched_reqs:
        assert r.output_token_ids == expected_out[r.request_id]
        assert r.num_output_tokens <= r.max_tokens
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.max_tokens
        if r.status == RequestStatus.FINISHED_STOPPED:
            assert r.output_token_ids[-1] in r.eos_token_ids
        assert r.num_output_placeholders == 0
        if not r.status.finished:
            assert r.num_computed_tokens <= r.num_tokens
    check_blocks(sched)


@pytest.mark.parametrize("enable_caching", [True, False])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops)
def test_random_add_step_abort_invariants(enable_caching, ops):
    """Random adds, steps and aborts keep every scheduling invariant, and a persistent batch kept
    from the scheduler's plain-data outputs alone always equals a from-scratch build."""
    sched = make_sched(NUM_BLOCKS, MAX_SEQS, BUDGET, MAX_LEN, enable_caching, block_size=BS)
    rows = InputBatch(MAX_SEQS, cdiv(MAX_LEN, BS), BS, vocab_size=64)
    ids: list[str] = []
    all_reqs: list[Request] = []
    expected_out: dict[str, list[int]] = {}
    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, eos = op
            req = make_req(f"r{len(ids)}", prompt, max_tokens=max_tokens, eos=(0,) if eos else ())
            total = len(prompt) + max_tokens
            if total > MAX_LEN or cdiv(total, sched.kv.block_size) > NUM_BLOCKS - 1:
                continue  # refused before the scheduler: by the input processor, or the memory plan's max_model_len
            sched.add_request(req)
            ids.append(req.request_id)
            all_reqs.append(req)
            expected_out[req.request_id] = []
        elif op[0] == "step":
            checked_step(sched, op[1], expected_out, rows)
        else:
            if not ids:
                continue
            rid = ids[op[1] % len(ids)]
            free_before = sched.kv.num_free_blocks
            held = len(sched.kv.block_ids(rid))
            # Blocks this request alone holds go back to the free list at once.
            private = sum(1 for b in sched.kv.req_blocks.get(rid, []) if b.ref_cnt == 1)
            req = sched.abort(rid)
            if req is None:
                assert rid not in sched.requests
            else:
                assert req.status == RequestStatus.FINISHED_ABORTED
                assert sched.kv.num_free_blocks == free_before + private
                assert private <= held
            check_blocks(sched)
    # Drain: every request must finish, and everything must come back.
    for _ in range(1000):
        if not sched.num_unfinished:
            break
        checked_step(sched, [1, 2, 3], expected_out, rows)
    else:
        raise AssertionError("livelock: requests never finished")
    for r in all_reqs:
        assert r.status.finished
    assert sched.requests == {} and sched.running == [] and not sched.waiting
    assert sched.kv.num_free_blocks == NUM_BLOCKS - 1
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)
    assert all(not blocks for blocks in sched.kv.req_blocks.values())
    assert sched.kv.req_hashes == {}
    assert sorted(sched.kv.pool.free_queue.block_ids()) == list(range(1, NUM_BLOCKS))


# ---- paused requests (a reader behind its stream) ----------------------------------------------------


def test_a_paused_request_is_not_scheduled_but_keeps_its_blocks():
    sched = make_sched()
    a, b = make_req("a", range(8)), make_req("b", range(100, 108))
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    blocks = sched.kv.block_ids("a")
    a.paused = True
    out, _ = step(sched)
    assert plan(out) == [("b", 1)]
    assert sched.kv.block_ids("a") == blocks and a.status == RequestStatus.RUNNING
    a.paused = False
    out, _ = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)]


def test_a_paused_request_gives_up_its_blocks_first():
    # 6 usable blocks of 4 tokens: a (older, paused) and b hold 2 each; c needs 3 to be admitted.
    sched = make_sched(num_blocks=7, enable_caching=False)
    a, b, c = make_req("a", range(7)), make_req("b", range(10, 17)), make_req("c", range(20, 29))
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    a.paused = True
    sched.add_request(c)
    out, _ = step(sched)
    assert out.preempted_ids == ["a"], "the paused request, not the newest running one, makes room"
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0 and a.paused
    assert ("c", 9) in plan(out) and ("b", 1) in plan(out)
    # While paused it is not readmitted, even with room; once resumed it is recomputed.
    run_to_completion_except(sched, {"a"})
    a.paused = False
    assert run_to_completion(sched) > 0 and a.status.finished and a.num_output_tokens == 4


def run_to_completion_except(sched: Scheduler, held: set[str]) -> None:
    while any(r.request_id not in held for r in sched.requests.values()):
        out, _ = step(sched)
        assert all(s.request_id not in held for s in out.scheduled)


def test_paused_requests_do_not_hold_every_batch_slot():
    sched = make_sched(max_num_seqs=2)
    a, b, c = make_req("a", range(5)), make_req("b", range(10, 15)), make_req("c", range(20, 25))
    for r in (a, b):
        sched.add_request(r)
    step(sched)
    a.paused = b.paused = True
    sched.add_request(c)
    out, _ = step(sched)
    assert out.preempted_ids == ["b"] and plan(out) == [("c", 5)]  # the newest paused one gives its slot up
    assert len(sched.running) == 2


def test_a_running_request_preempts_a_paused_one_before_itself():
    # a (paused) and b each hold blocks; b needs a new block when the pool is empty.
    sched = make_sched(num_blocks=5, enable_caching=False)  # 4 usable blocks
    a, b = make_req("a", range(8), max_tokens=8), make_req("b", range(10, 17), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a: 8 tokens (2 blocks), b: 7 (2 blocks); b's 9th token needs a 3rd block
    a.paused = True
    step(sched)
    out, _ = step(sched)
    assert out.preempted_ids == ["a"] and plan(out) == [("b", 1)]
