"""vLLM's --scheduling-policy priority: waiting requests start by (priority, arrival), lower values
first; a waiting request of a strictly better priority preempts the worst running request when the
batch (max_num_seqs) or the KV cache is full, and starts in that same step; equal priorities never
preempt each other and keep their arrival order; preempted requests' outputs are unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from paxserve import Engine, SamplingParams
from paxserve.core.kv_cache_manager import KVCacheManager
from paxserve.core.request import Request, RequestStatus
from paxserve.core.scheduler import Scheduler, SchedulerConfig
from tests.helpers import make_tiny_llama


def scheduler(max_num_seqs: int = 2, num_blocks: int = 64, policy: str = "priority") -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, 64, 64, policy=policy), KVCacheManager(num_blocks, 4, True))


def request(rid: str, priority: int, arrival: float, prompt_len: int = 6) -> Request:
    start = 3 + 20 * (sum(map(ord, rid)) % 10)  # prompts of their own: no prefix-cache sharing
    return Request(rid, list(range(start, start + prompt_len)), SamplingParams(temperature=0, max_tokens=8), 8,
                   priority=priority, arrival_time=arrival)


def started(out: Any) -> list[str]:
    return [n.request_id for n in out.new_requests]


def step(sched: Scheduler) -> Any:
    """One schedule whose step then returns a token for every row (as the engine core reports it)."""
    out = sched.schedule()
    sched.update_from_output(out, [1] * len(out.scheduled))
    return out


def test_a_better_priority_preempts_the_worst_running_request_when_the_batch_is_full_and_starts_at_once() -> None:
    sched = scheduler(max_num_seqs=2)
    sched.add_request(request("a", 5, 1.0))
    sched.add_request(request("b", 5, 2.0))
    assert started(step(sched)) == ["a", "b"]
    sched.add_request(request("c", 0, 3.0))
    out = step(sched)
    # b: the worst priority, and of two equal the later arrival.
    assert out.preempted_ids == ["b"] and started(out) == ["c"]
    assert [r.request_id for r in sched.running] == ["a", "c"] and sched.requests["b"].status == RequestStatus.PREEMPTED
    # An equal priority never preempts: d waits behind b (same priority, later arrival).
    sched.add_request(request("d", 5, 4.0))
    out = step(sched)
    assert out.preempted_ids == [] and started(out) == []
    assert [r.request_id for r in sched.waiting] == ["b", "d"]
    sched.finish(sched.requests["a"], RequestStatus.FINISHED_STOPPED)
    assert started(step(sched)) == ["b"]


def test_a_better_priority_takes_blocks_from_the_worst_running_request() -> None:
    # 8 usable blocks of 4 tokens: two running 12-token requests hold 6 (with their next token's).
    sched = scheduler(max_num_seqs=4, num_blocks=9)
    sched.add_request(request("low", 3, 1.0, prompt_len=12))
    sched.add_request(request("lower", 4, 2.0, prompt_len=12))
    assert started(step(sched)) == ["low", "lower"]
    sched.add_request(request("urgent", 1, 3.0, prompt_len=16))
    out = step(sched)
    assert out.preempted_ids == ["lower"] and started(out) == ["urgent"]
    # Under memory pressure while running, the worst priority gives its blocks up first, not the newest.
    assert sched._victim().request_id == "low"


def test_without_the_policy_arrival_order_rules() -> None:
    sched = scheduler(max_num_seqs=1, policy="fcfs")
    for i, priority in enumerate((5, 0, 3)):
        sched.add_request(request(f"r{i}", priority, float(i)))
    assert started(step(sched)) == ["r0"]
    assert [r.request_id for r in sched.waiting] == ["r1", "r2"]
    with pytest.raises(ValueError, match="scheduling policy"):
        SchedulerConfig(1, 1, 1, policy="lifo")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-priority")
    make_tiny_llama(directory, seed=5, num_key_value_heads=2)
    return directory


ARGS: dict[str, Any] = dict(warmup=False, log_stats_interval=0, compilation_cache_dir="", max_model_len=64,
                            kv_cache_memory_bytes=4 * 2**20, compile_in_background=False, block_size=8,
                            max_num_seqs=2)


def test_an_urgent_request_at_a_full_engine_starts_in_the_next_step_and_nobodys_tokens_change(tiny_dir: Path) -> None:
    engine = Engine(str(tiny_dir), scheduling_policy="priority", **ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = {"bg0": [5, 6, 7, 8, 9], "bg1": [10, 11, 12], "urgent": [40, 41, 42, 43]}
    alone = {rid: engine.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for rid, p in prompts.items()}
    engine.add_request("bg0", prompts["bg0"], params, priority=1)
    engine.add_request("bg1", prompts["bg1"], params, priority=1)
    outputs: dict[str, list[int]] = {}
    finished_order = []

    def step() -> list[str]:
        done = []
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
            if out.finished:
                done.append(out.request_id)
        finished_order.extend(done)
        return [out for out in outputs]

    for _ in range(3):
        step()
    engine.add_request("urgent", prompts["urgent"], params, priority=-1)
    step()
    assert "urgent" in outputs and len(outputs["urgent"]) >= 1  # its first token came in the next step
    assert engine.scheduler.requests["bg1"].num_preemptions == 1
    while engine.has_unfinished_requests():
        step()
    assert finished_order.index("urgent") < finished_order.index("bg1")
    assert outputs == alone
    plain = Engine(str(tiny_dir), **ARGS)
    with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
        plain.add_request("x", [5, 6], params, priority=2)
