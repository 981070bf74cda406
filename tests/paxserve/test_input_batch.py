"""`paxserve.input_batch`: rows of the running requests, and the scheduler's report of requests that
left the running set (which is what gives rows back)."""

from __future__ import annotations

import pytest

from paxserve.input_batch import InputBatch
from paxserve.kv_cache_manager import KVCacheManager
from paxserve.request import Request
from paxserve.sampling_params import SamplingParams
from paxserve.scheduler import Scheduler, SchedulerConfig


def test_rows_are_handed_out_once_and_given_back() -> None:
    batch = InputBatch(3)
    assert [batch.add("a", True), batch.add("b", False), batch.add("c", True)] == [1, 2, 3]
    assert batch.state_row("a") == 1 and batch.state_row("b") == 0 and batch.state_row("zzz") == 0
    with pytest.raises(ValueError, match="already holds row 1"):
        batch.add("a", True)
    with pytest.raises(RuntimeError, match="all 3 rows are taken"):
        batch.add("d", False)
    batch.remove("b")
    batch.remove("never-added")  # ignored
    assert "b" not in batch and len(batch) == 2
    assert batch.add("d", True) == 2 and batch.state_row("d") == 2
    batch.clear()
    assert len(batch) == 0 and batch.state_row("a") == 0
    with pytest.raises(ValueError, match="max_num_seqs"):
        InputBatch(0)


def _request(rid: str, num_prompt: int, max_tokens: int) -> Request:
    return Request(rid, list(range(10, 10 + num_prompt)), SamplingParams(max_tokens=max_tokens), max_tokens)


def test_the_scheduler_reports_every_request_that_stopped_running_once() -> None:
    """Finished, aborted and preempted requests are reported by the next schedule(), each once, so
    a holder of per-running-request state can let it go; a request that never ran is not."""
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)  # 3 usable blocks
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16), kv)
    for rid, n in (("a", 4), ("b", 4), ("c", 4)):
        sched.add_request(_request(rid, n, 8))
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a", "b", "c"] and out.left_running_ids == []
    sched.update_from_output(out, [1, 1, 1])
    sched.abort("c")
    sched.add_request(_request("w", 4, 2))
    sched.abort("w")  # aborted while waiting: it never ran
    out = sched.schedule()  # a and b both need a second block: b (the newer) is preempted
    assert out.left_running_ids == ["c", "b"] and [r.request_id for r in out.preempted] == ["b"]
    sched.update_from_output(out, [2] * len(out.scheduled))
    assert sched.schedule().left_running_ids == []
