"""The host's LoRA bookkeeping (paxserve/core/lora_slots.py): device slots handed out least recently
used first and never taken from an adapter a running request uses; host memory holding the last
`max_cpu_loras` adapters read; requests checked where they are made."""

from __future__ import annotations

import pytest

from paxserve.core.lora_slots import LoraCache, LoraSlots
from paxserve.lora_request import LoRARequest


def test_slots_go_to_the_least_recently_used_adapter_no_running_request_uses() -> None:
    slots = LoraSlots(2)
    assert slots.acquire(7, set()) == (0, True)
    assert slots.acquire(9, {7}) == (1, True)
    assert slots.acquire(7, {7, 9}) == (0, False)  # held: nothing to write, and now most recently used
    # Both slots are in use by running requests: the third adapter must wait.
    assert slots.acquire(11, {7, 9}) is None and slots.slot(11) is None
    # 9 is no longer used and least recently used: its slot changes hands.
    assert slots.acquire(11, {7}) == (1, True)
    assert slots.resident == {7: 0, 11: 1} and slots.slot(9) is None
    # 7 is now the least recently used, but a running request uses it: 11's slot goes instead.
    assert slots.acquire(9, {7}) == (1, True)
    assert slots.release(9) == 1 and slots.slot(9) is None
    assert slots.acquire(12, {7}) == (1, True)  # the freed slot, with 7 untouched
    assert slots.release(99) is None
    with pytest.raises(ValueError, match="max_loras must be an integer >= 1"):
        LoraSlots(0)


def test_the_host_cache_reads_each_adapter_once_while_it_is_held() -> None:
    reads: list[str] = []

    def read(request: LoRARequest) -> str:
        if request.lora_path == "/broken":
            raise ValueError("adapter_config.json not found")
        reads.append(request.lora_path)
        return f"weights of {request.lora_name}"

    cache = LoraCache(2, read)
    a, b, c = (LoRARequest(name, i, f"/{name}") for i, name in enumerate(("a", "b", "c"), start=1))
    assert cache.get(a) == "weights of a" and cache.get(b) == "weights of b"
    assert cache.get(a) == "weights of a" and reads == ["/a", "/b"]
    cache.get(c)  # over max_cpu_loras: b, the least recently used, is dropped
    assert 2 not in cache and 1 in cache and 3 in cache
    cache.get(b)  # read again; a is dropped now
    assert reads == ["/a", "/b", "/c", "/b"] and cache.num_reads == 4 and 1 not in cache
    with pytest.raises(ValueError, match="LoRA id 3 is 'c' at /c, not /elsewhere: one id per adapter"):
        cache.get(LoRARequest("c2", 3, "/elsewhere"))
    with pytest.raises(ValueError, match="adapter_config.json not found"):
        cache.get(LoRARequest("broken", 9, "/broken"))
    assert 9 not in cache
    cache.drop(3)
    assert 3 not in cache and 2 in cache


@pytest.mark.parametrize("args,words", [(("", 1, "/p"), "lora_name must be a non-empty string"),
                                        (("a", 0, "/p"), "lora_int_id must be an integer >= 1"),
                                        (("a", True, "/p"), "lora_int_id must be an integer >= 1"),
                                        (("a", 1, ""), "lora_path must be a non-empty path")])
def test_a_lora_request_names_what_is_wrong(args: tuple, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        LoRARequest(*args)


def test_the_scheduler_passes_over_a_request_whose_adapter_has_no_slot_and_loads_it_once_one_frees() -> None:
    """One device slot: the first adapter's requests and a base-model request run; the second
    adapter's request waits without blocking those behind it, and takes the slot (a write) once the
    first adapter's requests are done. A prefix-cache key differs by adapter."""
    from paxserve.core.kv_cache_manager import KVCacheManager
    from paxserve.core.request import Request, RequestStatus
    from paxserve.core.scheduler import Scheduler, SchedulerConfig
    from paxserve.sampling_params import SamplingParams

    sched = Scheduler(SchedulerConfig(4, 64, 64), KVCacheManager(32, 4, True), LoraSlots(1))
    adapters = {1: "weights-1", 2: "weights-2"}

    def request(rid: str, lora_id: int) -> Request:
        lora = None if not lora_id else LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}")
        return Request(rid, [3, 4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=2), 2, lora_request=lora,
                       lora_adapter=adapters.get(lora_id))

    for rid, lora_id in (("r1", 1), ("r2", 2), ("r3", 1), ("r4", 0)):
        sched.add_request(request(rid, lora_id))
    out = sched.schedule()
    assert [n.request_id for n in out.new_requests] == ["r1", "r3", "r4"]
    assert [n.lora_slot for n in out.new_requests] == [0, 0, -1]
    assert out.lora_loads == [(0, "weights-1")]
    assert [r.request_id for r in sched.waiting] == ["r2"]
    for rid in ("r1", "r3"):
        sched.finish(sched.requests[rid], RequestStatus.FINISHED_STOPPED)
    out = sched.schedule()
    assert [(n.request_id, n.lora_slot) for n in out.new_requests] == [("r2", 0)]
    assert out.lora_loads == [(0, "weights-2")]
    keys = {lora_id: sched.kv._hashes(request(f"k{lora_id}", lora_id), 4)[0] for lora_id in (0, 1, 2)}
    assert len({k.value for k in keys.values()}) == 3


def test_lora_settings_are_checked_naming_the_field_and_the_flags_parse_both_forms() -> None:
    import argparse

    from paxserve.config import EngineConfig
    from paxserve.server.lora import LoraModule, parse_lora_module

    for kwargs, field in [({"max_loras": 0}, "max_loras"), ({"max_lora_rank": 1024}, "max_lora_rank"),
                          ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"), ({"max_loras": True}, "max_loras")]:
        with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
            EngineConfig(enable_lora=True, **kwargs)
    assert parse_lora_module("sql = /a/sql") == LoraModule("sql", "/a/sql")
    assert parse_lora_module('{"name": "chat", "path": "/a/chat", "base_model_name": "org/m"}') == \
        LoraModule("chat", "/a/chat", "org/m")
    for bad in ("sql", "=/a", '{"name": "x"}', '{"name": "x", "path": "/p", "rank": 8}', "{not json"):
        with pytest.raises(argparse.ArgumentTypeError, match="--lora-modules"):
            parse_lora_module(bad)
