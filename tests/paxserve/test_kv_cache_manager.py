"""KVCacheManager: block counts at block boundaries, exact block ids, prefix-cache hits and free order."""

from __future__ import annotations

import pytest

from paxserve.core.kv_cache_manager import KVCacheManager, cdiv
from paxserve.core.request import Request, RequestStatus
from paxserve.sampling_params import SamplingParams

BS = 4


def make_req(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens),
        max_tokens=max_tokens,
    )


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> tuple[list[int], int]:
    """What the scheduler does for a waiting request: look up hits, allocate, set num_computed."""
    hits, num_hit = kv.get_computed_blocks(req)
    n = req.num_tokens - num_hit if num_new is None else num_new
    assert kv.allocate_slots(req, n, hits)
    req.num_computed_tokens = num_hit
    return [b.block_id for b in hits], num_hit


def run(req: Request, n: int) -> None:
    """Pretend the step ran: n more tokens are in the cache."""
    req.num_computed_tokens += n


def ref_cnts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def test_cdiv():
    assert [cdiv(n, 4) for n in range(0, 10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


@pytest.mark.parametrize("n, blocks", [(1, 1), (2, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (12, 3), (13, 4)])
def test_block_count_at_boundaries(n, blocks):
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    req = make_req("r", list(range(n)))
    assert kv.allocate_slots(req, n)
    assert kv.block_ids("r") == list(range(1, blocks + 1))
    assert kv.num_free_blocks == 9 - blocks


def test_growth_one_token_at_a_time():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    req = make_req("r", [7], max_tokens=20)
    expected_blocks = []
    for step in range(13):
        # One token to compute each step: prompt token, then each sampled token.
        assert req.num_tokens - req.num_computed_tokens == 1
        assert kv.allocate_slots(req, 1)
        total = req.num_computed_tokens + 1
        expected_blocks = list(range(1, cdiv(total, BS) + 1))
        assert kv.block_ids("r") == expected_blocks, f"step {step}: {total} tokens"
        run(req, 1)
        req.append_output(100 + step)
    # 13 tokens -> a new block only at tokens 1, 5, 9, 13.
    assert expected_blocks == [1, 2, 3, 4]
    assert kv.num_free_blocks == 5


def test_growth_in_chunks_and_exact_ids_with_two_requests():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    a = make_req("a", list(range(10)))
    b = make_req("b", list(range(100, 103)))
    assert kv.allocate_slots(a, 6)  # chunk of 6: blocks 1, 2
    assert kv.block_ids("a") == [1, 2]
    assert kv.allocate_slots(b, 3)  # block 3
    assert kv.block_ids("b") == [3]
    run(a, 6)
    run(b, 3)
    assert kv.allocate_slots(a, 2)  # 8 tokens: still 2 blocks
    assert kv.block_ids("a") == [1, 2]
    run(a, 2)
    assert kv.allocate_slots(a, 2)  # 10 tokens: block 4
    assert kv.block_ids("a") == [1, 2, 4]
    assert kv.allocate_slots(b, 2)  # 5 tokens: block 5
    assert kv.block_ids("b") == [3, 5]
    assert kv.block_ids("nope") == []


def test_short_pool_returns_false_and_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=False)  # 3 usable
    a = make_req("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    assert kv.block_ids("a") == [1, 2]
    b = make_req("b", list(range(8)))
    before = (ref_cnts(kv), kv.pool.free_queue.block_ids())
    assert not kv.allocate_slots(b, 8)  # needs 2, 1 free
    assert (ref_cnts(kv), kv.pool.free_queue.block_ids()) == before
    assert kv.block_ids("b") == []
    assert "b" not in kv.req_blocks
    # A running request that cannot grow keeps what it had.
    run(a, 8)
    assert not kv.allocate_slots(a, 5)  # 13 tokens: needs 2 more
    assert kv.block_ids("a") == [1, 2]
    assert (ref_cnts(kv), kv.pool.free_queue.block_ids()) == before
    assert kv.allocate_slots(a, 4)  # 12 tokens: exactly 1 more
    assert kv.block_ids("a") == [1, 2, 3]
    assert kv.num_free_blocks == 0


def test_prefix_hit_exact_ids():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + 2
    a = make_req("a", prompt)
    assert admit(kv, a) == ([], 0)
    assert kv.block_ids("a") == [1, 2, 3]
    run(a, 10)
    b = make_req("b", prompt[:8] + [77, 78, 79])
    assert admit(kv, b) == ([1, 2], 8)
    assert b.num_computed_tokens == 8
    assert kv.block_ids("b") == [1, 2, 4]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]


def test_last_prompt_token_is_always_recomputed():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    prompt = list(range(1, 9))  # exactly 2 full blocks
    a = make_req("a", prompt)
    admit(kv, a)
    run(a, 8)
    assert kv.block_ids("a") == [1, 2]
    b = make_req("b", prompt)
    hits, num_hit = kv.get_computed_blocks(b)
    # Block 2 holds the last prompt token: never a hit, even though it is cached.
    assert [x.block_id for x in hits] == [1]
    assert num_hit == 4
    assert kv.pool.get_cached_block(kv.req_hashes["a"][1]) is kv.pool.blocks[2]
    assert kv.allocate_slots(b, 4, hits)
    b.num_computed_tokens = num_hit
    assert kv.block_ids("b") == [1, 3]
    # b's own second block holds the same tokens as block 2 but stays private.
    assert kv.pool.blocks[3].block_hash is None
    assert kv.pool.blocks[2].block_hash is not None
    # A one-block prompt never hits anything.
    c = make_req("c", [1, 2, 3, 4])
    assert kv.get_computed_blocks(c) == ([], 0)


def test_one_token_past_the_boundary_hits_both_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    a = make_req("a", list(range(1, 9)))
    admit(kv, a)
    run(a, 8)
    b = make_req("b", list(range(1, 9)) + [50])
    assert admit(kv, b) == ([1, 2], 8)
    assert kv.block_ids("b") == [1, 2, 3]


def test_chained_hashes_no_hit_after_different_prefix():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(kv, a)
    run(a, 9)
    # Second block's tokens are the same, the first differs: no hit at all.
    b = make_req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(kv, b) == ([], 0)
    assert kv.block_ids("b") == [4, 5, 6]
    # Same first block, different second: only the first hits.
    c = make_req("c", [1, 2, 3, 4, 5, 6, 7, 0, 9])
    assert admit(kv, c) == ([1], 4)
    assert kv.block_ids("c") == [1, 7, 8]


def test_hit_on_freed_cached_block_leaves_free_list():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    prompt = list(range(1, 11))
    a = make_req("a", prompt)
    admit(kv, a)
    run(a, 10)
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    b = make_req("b", prompt)
    assert admit(kv, b) == ([1, 2], 8)
    # 1 and 2 were taken out of the middle of the free list; b's third block is the next free one.
    assert kv.block_ids("b") == [1, 2, 4]
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]


def test_hits_on_free_blocks_count_against_capacity():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)  # 3 usable
    prompt = list(range(1, 10))  # 9 tokens: 3 blocks
    a = make_req("a", prompt)
    admit(kv, a)
    run(a, 9)
    kv.free(a)
    assert kv.num_free_blocks == 3
    # b hits blocks 1, 2 (free), needs 2 new for 13 tokens: 2 + 2 > 3 free.
    b = make_req("b", prompt + [10, 11, 12, 13])
    hits, num_hit = kv.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [1, 2]
    assert num_hit == 8
    before = (ref_cnts(kv), kv.pool.free_queue.block_ids(), dict(kv.pool.cached))
    assert not kv.allocate_slots(b, 5, hits)
    assert (ref_cnts(kv), kv.pool.free_queue.block_ids(), dict(kv.pool.cached)) == before
    assert kv.block_ids("b") == []
    # With one new block it fits exactly.
    assert kv.allocate_slots(b, 4, hits)
    assert kv.block_ids("b") == [1, 2, 3]
    assert kv.num_free_blocks == 0


def test_hit_on_shared_in_use_block_costs_no_free_block():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)  # 3 usable
    prompt = list(range(1, 10))
    a = make_req("a", prompt)
    admit(kv, a)  # blocks 1, 2, 3: pool full
    run(a, 9)
    assert kv.num_free_blocks == 0
    b = make_req("b", prompt[:8] + [99])
    hits, _ = kv.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [1, 2]
    assert not kv.allocate_slots(b, 1, hits)  # needs 1 new, 0 free
    kv2 = KVCacheManager(num_blocks=5, block_size=BS, enable_caching=True)  # 4 usable
    a = make_req("a", prompt)
    admit(kv2, a)
    run(a, 9)
    assert kv2.num_free_blocks == 1
    assert admit(kv2, b) == ([1, 2], 8)  # in-use hits are free of charge
    assert kv2.block_ids("b") == [1, 2, 4]


def test_prefix_stats_in_tokens_once_per_admitted_request():
    from paxserve.core.scheduler import Scheduler, SchedulerConfig

    kv = KVCacheManager(num_blocks=7, block_size=BS, enable_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    assert kv.prefix_stats.hit_rate == 0.0
    a = make_req("a", list(range(1, 11)), max_tokens=3)
    sched.add_request(a)
    sched.update_from_output(sched.schedule(), [7])
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (10, 0)
    b = make_req("b", list(range(1, 11)) + [0, 0, 0], max_tokens=3)
    c = make_req("c", list(range(30, 42)), max_tokens=2)  # 3 blocks: no room while a and b hold 5 of 6
    sched.add_request(b)
    sched.add_request(c)
    for _ in range(2):  # c is looked up at every step but counted only once admitted
        sched.update_from_output(out := sched.schedule(), [7] * len(out.scheduled))
    assert c.status == RequestStatus.WAITING
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (23, 8)
    assert kv.prefix_stats.hit_rate == pytest.approx(8 / 23)
    while sched.num_unfinished:
        sched.update_from_output(out := sched.schedule(), [7] * len(out.scheduled))
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (35, 8)


def test_free_puts_tail_block_first():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    a = make_req("a", list(range(1, 14)))  # 13 tokens: blocks 1..4
    admit(kv, a)
    run(a, 13)
    kv.free(a)
    assert kv.block_ids("a") == []
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 4, 3, 2, 1]
    # Fill the never-used blocks: the next one handed out is a's tail block, then its third.
    b = make_req("b", list(range(100, 121)))  # 21 tokens: 6 blocks
    admit(kv, b)
    assert kv.block_ids("b") == [5, 6, 7, 8, 9, 4]
    # Block 4 was not full (one token) so had no hash; blocks 1..3 are still cached.
    c = make_req("c", list(range(1, 14)))
    hits, num_hit = kv.get_computed_blocks(c)
    assert ([x.block_id for x in hits], num_hit) == ([1, 2, 3], 12)
    kv.free(b)
    assert kv.pool.free_queue.block_ids() == [3, 2, 1, 4, 9, 8, 7, 6, 5]
    assert admit(kv, c) == ([1, 2, 3], 12)
    assert kv.block_ids("c") == [1, 2, 3, 4]
    assert kv.pool.free_queue.block_ids() == [9, 8, 7, 6, 5]


def test_free_evicts_tail_hash_first():
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_caching=True)  # 4 usable
    a = make_req("a", list(range(1, 13)))  # 12 tokens: 3 full blocks, all cached
    admit(kv, a)
    run(a, 12)
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [4, 3, 2, 1]
    c = make_req("c", list(range(1, 13)) + [13])
    hits, _ = kv.get_computed_blocks(c)
    assert [b.block_id for b in hits] == [1, 2, 3]
    x = make_req("x", [50, 51, 52, 53, 54])
    admit(kv, x)  # the never-used block 4, then a's tail block 3 (evicted)
    assert kv.block_ids("x") == [4, 3]
    assert kv.pool.blocks[3].block_hash is None
    assert kv.pool.blocks[2].block_hash is not None
    hits, num_hit = kv.get_computed_blocks(c)  # block 3's hash is gone: hits stop at 2 blocks
    assert ([b.block_id for b in hits], num_hit) == ([1, 2], 8)
    kv.free(x)
    assert kv.pool.free_queue.block_ids() == [2, 1, 3, 4]
    assert admit(kv, c) == ([1, 2], 8)
    assert kv.block_ids("c") == [1, 2, 3, 4]


def test_free_shared_blocks_only_unreferenced_join_free_list():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    prompt = list(range(1, 11))
    a = make_req("a", prompt)
    admit(kv, a)
    run(a, 10)
    b = make_req("b", prompt)
    admit(kv, b)
    assert kv.block_ids("b") == [1, 2, 4]
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    kv.free(b)
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 3, 4, 2, 1]
    assert all(x.ref_cnt == 0 for x in kv.pool.blocks)
    kv.free(b)  # freeing a request with no blocks is a no-op
    assert kv.num_free_blocks == 9


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    prompt = list(range(1, 11))
    a = make_req("a", prompt)
    assert admit(kv, a) == ([], 0)
    run(a, 10)
    b = make_req("b", prompt)
    assert admit(kv, b) == ([], 0)
    assert kv.block_ids("b") == [4, 5, 6]
    assert kv.pool.cached == {}
    assert all(x.block_hash is None for x in kv.pool.blocks)
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (0, 0)
    kv.free(a)
    c = make_req("c", prompt)
    assert admit(kv, c) == ([], 0)


def test_n_samples_share_prompt_blocks():
    """n>1: the second sample is scheduled right after the first's allocate_slots (same step)."""
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    prompt = list(range(1, 11))  # 10 tokens
    s0, s1 = make_req("s0", prompt), make_req("s1", prompt)
    assert admit(kv, s0) == ([], 0)  # not yet run: hashes registered at allocation
    assert admit(kv, s1) == ([1, 2], 8)
    assert kv.block_ids("s0") == [1, 2, 3]
    assert kv.block_ids("s1") == [1, 2, 4]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    # The partial last blocks are private and uncached.
    assert kv.pool.blocks[3].block_hash is None and kv.pool.blocks[4].block_hash is None
    # They diverge while decoding without touching each other's blocks.
    run(s0, 10)
    run(s1, 2)
    s0.append_output(500)
    s1.append_output(600)
    for r in (s0, s1):
        assert kv.allocate_slots(r, 1)
    assert kv.block_ids("s0") == [1, 2, 3]
    assert kv.block_ids("s1") == [1, 2, 4]


def test_n_samples_block_aligned_prompt_share_all_but_last():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    prompt = list(range(1, 9))  # 8 tokens: 2 full blocks
    s0, s1 = make_req("s0", prompt), make_req("s1", prompt)
    admit(kv, s0)
    assert admit(kv, s1) == ([1], 4)
    assert kv.block_ids("s0") == [1, 2]
    assert kv.block_ids("s1") == [1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 1, 1]


def test_chunked_prefill_registers_only_blocks_full_after_the_step():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    prompt = list(range(1, 15))  # 14 tokens
    a = make_req("a", prompt)
    admit(kv, a, num_new=6)  # chunk 1: tokens 0..5 -> block 1 full, block 2 partial
    assert kv.block_ids("a") == [1, 2]
    assert kv.pool.blocks[1].block_hash is not None
    assert kv.pool.blocks[2].block_hash is None
    b = make_req("b", prompt)
    hits, num_hit = kv.get_computed_blocks(b)
    assert ([x.block_id for x in hits], num_hit) == ([1], 4)
    run(a, 6)
    assert kv.allocate_slots(a, 6)  # 12 tokens: blocks 2, 3 full
    assert kv.block_ids("a") == [1, 2, 3]
    assert kv.pool.blocks[2].block_hash is not None and kv.pool.blocks[3].block_hash is not None
    hits, num_hit = kv.get_computed_blocks(b)
    assert ([x.block_id for x in hits], num_hit) == ([1, 2, 3], 12)


def test_output_tokens_are_cached_too():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    a = make_req("a", [1, 2, 3])
    admit(kv, a)
    run(a, 3)
    a.append_output(4)  # block 1 = [1, 2, 3, 4] becomes full with the output token
    assert kv.pool.blocks[1].block_hash is None
    assert kv.allocate_slots(a, 1)
    assert kv.pool.blocks[1].block_hash is not None
    b = make_req("b", [1, 2, 3, 4, 5])
    assert admit(kv, b) == ([1], 4)


def test_rollback_forgets_only_the_registrations_of_the_failed_step():
    from paxserve.core.request import Request
    from paxserve.sampling_params import SamplingParams

    kv = KVCacheManager(16, 4, enable_caching=True)

    def req(rid: str, tokens: list[int]) -> Request:
        return Request(rid, tokens, SamplingParams(max_tokens=4), max_tokens=4)

    first = req("first", list(range(9)))
    assert kv.allocate_slots(first, 9)
    kv.take_registered()  # that step ran: its two full blocks hold their KV
    committed = dict(kv.pool.cached)
    assert len(committed) == 2
    second = req("second", list(range(100, 109)))
    assert kv.allocate_slots(second, 9)
    # A batch-mate in the same step may already share what the step is about to write.
    mate = req("mate", list(range(100, 110)))
    hits, num_hit = kv.get_computed_blocks(mate)
    assert num_hit == 8
    kv.rollback(kv.take_registered())  # the step failed: the second request's blocks were never written
    assert kv.pool.cached == committed
    assert kv.get_computed_blocks(req("later", list(range(100, 110))))[1] == 0
    assert kv.get_computed_blocks(req("again", list(range(9))))[1] == 8
