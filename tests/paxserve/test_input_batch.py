"""`paxserve.worker.input_batch`: the persistent batch's rows, kept from the scheduler's plain-data output,
and the scheduler's report of requests that left the running set (which is what gives rows back).
The randomised check that it always equals a from-scratch build is in test_scheduler.py."""

from __future__ import annotations

import numpy as np
import pytest

from paxserve.core.kv_cache_manager import KVCacheManager
from paxserve.core.request import Request
from paxserve.core.scheduler import NewRequestData, ScheduledRequest, Scheduler, SchedulerConfig
from paxserve.sampling_params import SamplingParams
from paxserve.worker.input_batch import InputBatch

V = 64


def new(rid: str, prompt: list[int], blocks: list[int], output: list[int] | None = None, **params) -> NewRequestData:
    return NewRequestData(rid, prompt, output or [], SamplingParams(**params), 5, (7,), blocks)


def row(batch: InputBatch, request_id: str) -> int:
    return batch._rows[request_id]


def state_row(batch: InputBatch, request_id: str) -> int:
    """The request's sampler-state row, or 0 when it needs none (or holds no row)."""
    r = batch._rows.get(request_id)
    return 0 if r is None else int(batch.sampling.state_row[r])


def test_rows_are_handed_out_once_and_given_back() -> None:
    batch = InputBatch(3, max_blocks_per_seq=4, block_size=4, vocab_size=V)
    assert batch.add(new("a", [1, 2], [3], presence_penalty=1.0)) is not None  # its state must be written
    assert batch.add(new("b", [1], [4])) is None
    assert batch.add(new("c", [1], [5], logit_bias={3: 1.0})).state_row == 3
    assert [row(batch, r) for r in "abc"] == [1, 2, 3]
    assert state_row(batch, "a") == 1 and state_row(batch, "b") == 0 and state_row(batch, "zzz") == 0
    with pytest.raises(RuntimeError, match="all 3 rows are taken"):
        batch.add(new("d", [1], [6]))
    batch.remove("b")
    batch.remove("never-added")  # ignored
    assert "b" not in batch and len(batch) == 2
    assert batch.add(new("d", [9], [6], min_tokens=2)) is not None and row(batch, "d") == 2
    with pytest.raises(ValueError, match="more than the 4"):
        batch.append_blocks("d", [1, 2, 3, 4])
    for request_id in ("a", "c", "d"):
        batch.remove(request_id)
    assert len(batch) == 0 and state_row(batch, "a") == 0
    with pytest.raises(ValueError, match="max_num_seqs"):
        InputBatch(0, 4, 4, V)


def test_a_step_is_gathered_from_the_rows() -> None:
    """Two rows in a chosen order: a decode token and a prompt chunk, through their block tables,
    with their sampling columns; the kept token is appended, the chunk's is not."""
    batch = InputBatch(4, max_blocks_per_seq=4, block_size=4, vocab_size=V)
    batch.add(new("dec", [11, 12, 13, 14, 15], [3, 7], output=[16], temperature=0.5, top_k=3, logprobs=2))
    batch.add(new("pre", list(range(30, 40)), [9, 4], repetition_penalty=1.1))
    step = batch.prepare([ScheduledRequest("pre", 6, 0, [], samples=False), ScheduledRequest("dec", 1, 5, [])],
                         lambda t, n, b: (8, 4, 4))
    b = step.batch
    assert b.input_ids.tolist() == [30, 31, 32, 33, 34, 35, 16, 0]
    assert b.positions.tolist() == [0, 1, 2, 3, 4, 5, 5, 0]
    assert b.slot_mapping.tolist() == [36, 37, 38, 39, 16, 17, 29, 0]  # block 9, block 4; block 7 offset 1
    assert b.block_tables.tolist() == [[9, 4, 0, 0], [3, 7, 0, 0], [0] * 4, [0] * 4]
    assert b.context_lens.tolist() == [6, 6, 0, 0] and b.logits_indices.tolist() == [5, 6, 0, 0]
    sampling = step.sampling
    assert sampling.temperature.tolist() == [1.0, 0.5, 0.0, 0.0]
    assert sampling.keep.tolist() == [False, True, False, False] and step.keep == [False, True]
    assert sampling.step.tolist() == [0, 1, 0, 0] and sampling.logprobs.tolist() == [False, True, False, False]
    assert sampling.state_row.tolist() == [row(batch, "pre"), 0, 0, 0]
    assert sampling.allowed_token_bitmask is None  # nothing constrained: nothing to send
    batch.record(step, [50, 60])
    assert batch.token_ids[row(batch, "dec")] == [11, 12, 13, 14, 15, 16, 60]
    assert batch.token_ids[row(batch, "pre")] == list(range(30, 40))
    batch.append_blocks("dec", [2])
    assert batch.block_table[row(batch, "dec")].tolist() == [3, 7, 2, 0]
    np.testing.assert_array_equal(batch.num_tokens[[row(batch, "dec"), row(batch, "pre")]], [7, 10])


def _request(rid: str, num_prompt: int, max_tokens: int) -> Request:
    return Request(rid, list(range(10, 10 + num_prompt)), SamplingParams(max_tokens=max_tokens), max_tokens)


def test_the_scheduler_reports_every_request_that_stopped_running_once() -> None:
    """Finished, aborted and preempted requests are reported by the next schedule(), each once, so
    the persistent batch can give their rows back; a request that never ran is not."""
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)  # 3 usable blocks
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16), kv)
    for rid, n in (("a", 4), ("b", 4), ("c", 4)):
        sched.add_request(_request(rid, n, 8))
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["a", "b", "c"] and out.left_running_ids == []
    assert [n.request_id for n in out.new_requests] == ["a", "b", "c"]
    assert [n.block_ids for n in out.new_requests] == [[1], [2], [3]]
    sched.update_from_output(out, [1, 1, 1])
    sched.abort("c")
    sched.add_request(_request("w", 4, 2))
    sched.abort("w")  # aborted while waiting: it never ran
    out = sched.schedule()  # a and b both need a second block: b (the newer) is preempted
    assert out.left_running_ids == ["c", "b"] and out.preempted_ids == ["b"]
    assert [(s.request_id, s.num_computed_tokens, s.new_block_ids) for s in out.scheduled] == [("a", 4, [3])]
    sched.update_from_output(out, [2] * len(out.scheduled))
    assert sched.schedule().left_running_ids == []
