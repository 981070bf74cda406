"""AsyncEngine behaviour a server's clients notice: cancellation at any moment, leaving early,
duplicate ids, invalid input, backpressure (pausing slow readers), death, the input workers and the
snapshot. One tiny engine (a 2-layer random Llama with SmolLM2's tokenizer) serves the whole file;
each test runs its own AsyncEngine over it and ends with every KV block back in the pool."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import numpy as np
import pytest

from paxserve import AsyncEngine, Engine, SamplingParams
from paxserve.engine.async_engine import EngineDeadError
from paxserve.outputs import RequestOutput
from paxserve.sampling_params import RequestOutputKind
from tests.paxserve.test_engine import TEST_ENGINE_ARGS, VOCAB, tiny_dir  # noqa: F401 - module fixture

DELTA = RequestOutputKind.DELTA
# 32 usable blocks of 16 tokens (512 tokens): two 240-token requests cannot both fit beside a third
# request's blocks. At most 4 sequences and 64 tokens per step keep the compiled shapes few.
MAX_NUM_SEQS = 4
ARGS: dict[str, Any] = {**TEST_ENGINE_ARGS, "num_gpu_blocks_override": 33, "max_num_seqs": MAX_NUM_SEQS,
                        "max_num_batched_tokens": 64}

_rng = np.random.default_rng(11)
SHORT = [_rng.integers(3, VOCAB, 24).tolist() for _ in range(16)]  # 24-token prompts
LONG = _rng.integers(3, VOCAB, 40).tolist()  # the paused request's prompt
BIG = [_rng.integers(3, VOCAB, 100).tolist() for _ in range(2)]  # prompts of the requests that need its blocks
GREEDY20 = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
GREEDY40 = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
GREEDY140 = SamplingParams(temperature=0.0, max_tokens=140, ignore_eos=True)


def greedy(max_tokens: int, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:  # noqa: F811
    return Engine(str(tiny_dir), **ARGS)


@pytest.fixture(scope="module")
def refs(engine: Engine) -> dict[str, Any]:
    """Greedy results of each prompt run alone on the offline engine (no AsyncEngine running)."""
    def run(prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
        out = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        return out.token_ids, out.text

    return {"short": [run(p, GREEDY20)[0] for p in SHORT[:5]], "long": run(LONG, GREEDY40),
            "long100": run(LONG, greedy(100)), "big": [run(p, GREEDY140)[0] for p in BIG]}


def serve(engine: Engine, body: Callable[[AsyncEngine], Awaitable[Any]], limit: float = 90.0, **kwargs: Any) -> Any:
    """Run `body(aeng)` on a fresh event loop over a fresh AsyncEngine (a hang fails after `limit`
    seconds); afterwards (threads stopped) end anything a failed test left in the engine, so later
    tests start clean."""
    async def main() -> Any:
        aeng = AsyncEngine(engine.parts, **kwargs)
        try:
            return await asyncio.wait_for(body(aeng), limit)
        finally:
            aeng.shutdown(timeout=10)

    try:
        return asyncio.run(main())
    finally:
        for rid in list(engine.core._samples) + list(engine.output_processor._states):
            engine.abort(rid)


async def settle(aeng: AsyncEngine, engine: Engine, timeout: float = 5.0) -> None:
    """Wait (briefly) for the step loop to apply what is in flight, then assert nothing is held."""
    deadline = time.monotonic() + timeout
    while True:
        s = aeng.snapshot
        clean = ((s.num_requests_running, s.num_requests_waiting, s.num_requests_paused) == (0, 0, 0)
                 and engine.kv.num_free_blocks == engine.plan.num_blocks - 1 and not aeng._streams
                 and not engine.core.has_unfinished_requests() and len(engine.output_processor) == 0)
        if clean or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    assert aeng.is_alive
    assert (s.num_requests_running, s.num_requests_waiting, s.num_requests_paused) == (0, 0, 0)
    assert engine.kv.num_free_blocks == engine.plan.num_blocks - 1
    assert not engine.core.has_unfinished_requests()
    assert len(engine.output_processor) == 0, "the output processor still tracks a finished request"
    assert not aeng._streams, "a stream of a finished request is still registered"


async def collect(aeng: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams,
                  sink: list[RequestOutput] | None = None) -> list[RequestOutput]:
    outs = sink if sink is not None else []
    async for out in aeng.generate(request_id, prompt, params):
        outs.append(out)
    return outs


def tokens_of(outs: list[RequestOutput], kind: RequestOutputKind) -> list[int]:
    if kind == DELTA:
        return [t for o in outs for t in o.outputs[0].token_ids]
    return outs[-1].outputs[0].token_ids


async def final_tokens(aeng: AsyncEngine, request_id: str, prompt: list[int],
                       params: SamplingParams = GREEDY20) -> list[int]:
    outs = await collect(aeng, request_id, prompt, params)
    assert outs[-1].finished
    return outs[-1].outputs[0].token_ids


async def wait_for_event(event: threading.Event, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not event.is_set():
        assert time.monotonic() < deadline, "timed out waiting for the engine"
        await asyncio.sleep(0.002)


def slow_once(monkeypatch: pytest.MonkeyPatch, obj: Any, name: str, seconds: float) -> tuple[threading.Event,
                                                                                               threading.Event]:
    """Make the next call of obj.name sleep `seconds` first; returns (entered, returned) events."""
    original = getattr(obj, name)
    entered, returned, armed = threading.Event(), threading.Event(), [True]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if armed[0]:
            armed[0] = False
            entered.set()
            time.sleep(seconds)
            try:
                return original(*args, **kwargs)
            finally:
                returned.set()
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)
    return entered, returned


# ---- 1. cancellation at every moment --------------------------------------------------------------


def test_cancel_before_input_processing_finished(engine: Engine, refs: dict, monkeypatch: pytest.MonkeyPatch
                                                 ) -> None:
    async def body(aeng: AsyncEngine) -> None:
        got: list[RequestOutput] = []
        # Cancelled before the task ever ran, and right after it started (awaiting its input worker).
        for i, yield_first in enumerate((False, True)):
            task = asyncio.create_task(collect(aeng, f"early-{i}", SHORT[0], greedy(50), got))
            if yield_first:
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        # Cancelled while a slow input worker is still tokenizing: the worker finishes, nothing is queued.
        entered, returned = slow_once(monkeypatch, aeng.input_processor, "process", 0.2)
        prompt_tokens = aeng.snapshot.prompt_tokens
        task = asyncio.create_task(collect(aeng, "early-slow", SHORT[0], greedy(50), got))
        await wait_for_event(entered)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for_event(returned)
        await asyncio.sleep(0.3)
        assert got == []
        assert aeng.snapshot.prompt_tokens == prompt_tokens, "a cancelled request was still run"
        await settle(aeng, engine)
        assert await final_tokens(aeng, "early-after", SHORT[0]) == refs["short"][0]
        await settle(aeng, engine)

    serve(engine, body)


def test_cancel_while_waiting_for_the_first_output(engine: Engine, refs: dict, monkeypatch: pytest.MonkeyPatch
                                                   ) -> None:
    async def body(aeng: AsyncEngine) -> None:
        entered, returned = slow_once(monkeypatch, engine.runner, "collect", 0.3)
        got: list[RequestOutput] = []
        generated = aeng.snapshot.generation_tokens
        task = asyncio.create_task(collect(aeng, "first-wait", SHORT[1], greedy(200), got))
        await wait_for_event(entered)  # its prefill step is running
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for_event(returned)
        assert got == []
        await settle(aeng, engine)
        assert aeng.snapshot.generation_tokens - generated < 100, "the cancelled request ran on"
        assert await final_tokens(aeng, "first-wait-after", SHORT[1]) == refs["short"][1]
        await settle(aeng, engine)

    serve(engine, body)


@pytest.mark.parametrize("kind,in_consumer", [(DELTA, False), (RequestOutputKind.CUMULATIVE, False), (DELTA, True)],
                         ids=["delta", "cumulative", "delta-cancelled-while-the-reader-writes"])
def test_cancel_mid_stream_after_k_outputs(engine: Engine, refs: dict, kind: RequestOutputKind,
                                           in_consumer: bool) -> None:
    async def body(aeng: AsyncEngine) -> None:
        for k in (1, 2, 3, 8, 17):
            got: list[RequestOutput] = []
            reached = asyncio.Event()

            async def reader() -> None:
                async for out in aeng.generate(f"mid-{kind.name}-{k}", SHORT[k % 5], greedy(200, kind)):
                    got.append(out)
                    if len(got) == k:
                        reached.set()
                    if in_consumer:
                        await asyncio.sleep(0.002)  # a write to the client: cancelled here, not inside generate()

            generated = aeng.snapshot.generation_tokens
            task = asyncio.create_task(reader())
            await asyncio.wait_for(reached.wait(), 60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert len(got) >= k and not any(o.finished for o in got)
            head = tokens_of(got, kind)[:20]  # what arrived before the cancellation is the greedy answer's start
            assert head == refs["short"][k % 5][:len(head)]
            await settle(aeng, engine)
            assert aeng.snapshot.generation_tokens - generated < 100, "the cancelled request ran on"
        assert await final_tokens(aeng, f"mid-{kind.name}-after", SHORT[2]) == refs["short"][2]
        await settle(aeng, engine)

    serve(engine, body)


def test_wait_for_timeouts_on_many_requests_while_others_complete(engine: Engine, refs: dict) -> None:
    async def body(aeng: AsyncEngine) -> None:
        before = await final_tokens(aeng, "storm-before", SHORT[0])
        assert before == refs["short"][0]
        timeouts = np.geomspace(0.001, 0.2, 32)
        # The first round compiles most step shapes (so its timeouts mostly land while steps are
        # compiling); the second runs on warm shapes, so its timeouts land mid-stream.
        for rnd in range(2):
            survivors = [asyncio.create_task(collect(aeng, f"keep-{rnd}-{i}", SHORT[1 + i],
                                                     greedy(20, DELTA if i % 2 else RequestOutputKind.CUMULATIVE)))
                         for i in range(4)]

            async def doomed(j: int, timeout: float) -> list[RequestOutput] | None:
                kind = DELTA if j % 2 else RequestOutputKind.CUMULATIVE
                try:
                    return await asyncio.wait_for(collect(aeng, f"doomed-{rnd}-{j}", SHORT[5 + j % 11],
                                                          greedy(100, kind)), timeout)
                except TimeoutError:
                    return None

            results = await asyncio.gather(*(doomed(j, float(t)) for j, t in enumerate(timeouts)))
            assert sum(r is None for r in results) >= 16, "the storm was meant to time out"
            for j, r in enumerate(results):
                if r is not None:  # a request that beat its timeout is complete
                    assert r[-1].finished
                    assert len(tokens_of(r, DELTA if j % 2 else RequestOutputKind.CUMULATIVE)) == 100
            kept = await asyncio.wait_for(asyncio.gather(*survivors), 60)
            for i, outs in enumerate(kept):
                kind = DELTA if i % 2 else RequestOutputKind.CUMULATIVE
                assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
                assert tokens_of(outs, kind) == refs["short"][1 + i]
            await settle(aeng, engine)
        assert await final_tokens(aeng, "storm-after", SHORT[0]) == before
        await settle(aeng, engine)

    serve(engine, body)


# ---- 2. leaving the stream early ------------------------------------------------------------------


def test_break_and_aclose_abort_the_request(engine: Engine) -> None:
    async def body(aeng: AsyncEngine) -> None:
        generated = aeng.snapshot.generation_tokens
        async for _ in aeng.generate("leave-break", SHORT[3], greedy(200)):
            break  # the generator is dropped: its finaliser closes it
        await settle(aeng, engine)
        assert aeng.snapshot.generation_tokens - generated < 100, "the request ran on after the break"

        generated = aeng.snapshot.generation_tokens
        gen = aeng.generate("leave-aclose", SHORT[4], greedy(200, DELTA))
        first = await gen.__anext__()
        assert not first.finished
        await gen.aclose()
        await settle(aeng, engine)
        assert aeng.snapshot.generation_tokens - generated < 100, "the request ran on after aclose()"
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()

    serve(engine, body)


# ---- 3. request ids -------------------------------------------------------------------------------


def test_duplicate_request_id_is_refused_and_the_first_completes(engine: Engine, refs: dict) -> None:
    async def body(aeng: AsyncEngine) -> None:
        gen = aeng.generate("dup", SHORT[1], GREEDY20)
        first = await gen.__anext__()
        assert not first.finished
        with pytest.raises(ValueError, match="already in use"):
            async for _ in aeng.generate("dup", SHORT[2], GREEDY20):
                pass
        outs = [first] + [o async for o in gen]
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == refs["short"][1]
        assert outs[-1].prompt_token_ids == SHORT[1]
        # Once it is done, the id is free again.
        assert await final_tokens(aeng, "dup", SHORT[2]) == refs["short"][2]
        await settle(aeng, engine)

    serve(engine, body)


def test_reusing_an_aborted_request_id_at_once_gets_only_its_own_tokens(
        engine: Engine, refs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(aeng: AsyncEngine) -> list[int]:
        gen = aeng.generate("reused", SHORT[3], greedy(50))
        await gen.__anext__()
        entered, _ = slow_once(monkeypatch, engine.runner, "collect", 0.5)
        await wait_for_event(entered)  # a step carrying the old request is running
        await gen.aclose()  # a client goes away; its id comes straight back with a new prompt
        outs = await collect(aeng, "reused", SHORT[2], GREEDY20)
        await settle(aeng, engine)
        assert outs[-1].prompt_token_ids == SHORT[2]
        return outs[-1].outputs[0].token_ids

    tokens = serve(engine, body)
    assert tokens == refs["short"][2], f"got {len(tokens)} tokens for a max_tokens=20 request"


# ---- 4. invalid input -----------------------------------------------------------------------------


def test_invalid_input_raises_before_anything_streams(engine: Engine, refs: dict) -> None:
    async def body(aeng: AsyncEngine) -> None:
        cases = [
            ([5, VOCAB], GREEDY20, "outside the vocabulary"),
            ([5] * 256, GREEDY20, "maximum context length is 256 tokens"),
            ([5] * 250, greedy(100), r"'max_tokens' or 'max_completion_tokens' is too large: 100"),
            ([], GREEDY20, "at least one token"),
        ]
        for i, (prompt, params, message) in enumerate(cases):
            got: list[RequestOutput] = []
            with pytest.raises(ValueError, match=message):
                await collect(aeng, f"bad-{i}", prompt, params, got)
            assert got == []
        assert aeng.is_alive and not aeng._streams
        assert await final_tokens(aeng, "good-after-bad", SHORT[3]) == refs["short"][3]
        await settle(aeng, engine)

    serve(engine, body)


# ---- 5, 6. backpressure ---------------------------------------------------------------------------


async def wait_paused(aeng: AsyncEngine, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while aeng.snapshot.num_requests_paused != n:
        assert time.monotonic() < deadline, f"expected {n} paused requests, snapshot {aeng.snapshot}"
        await asyncio.sleep(0.01)


def test_a_slow_reader_pauses_its_request_and_loses_nothing(engine: Engine, refs: dict) -> None:
    async def body(aeng: AsyncEngine) -> None:
        gen = aeng.generate("slow-reader", LONG, greedy(100, DELTA))
        outs = [await gen.__anext__()]
        await wait_paused(aeng, 1)  # the reader stopped reading: the request is held
        stream = aeng._streams[aeng._active["slow-reader"]]
        # The output thread may still be merging the last step made before the pause: read the
        # counts once they have stopped moving, then check they stay put while paused.
        counts = lambda: (aeng.snapshot.generation_tokens, stream.pending.num_output_tokens)  # noqa: E731
        previous, deadline = None, time.monotonic() + 30
        while (current := counts()) != previous:
            assert time.monotonic() < deadline, "the paused request's counts never settled"
            previous = current
            await asyncio.sleep(0.3)
        generated, pending = current
        await asyncio.sleep(1.0)
        snap = aeng.snapshot
        assert snap.num_requests_paused == 1
        assert snap.generation_tokens == generated, "a paused request kept generating"
        # max_pending_tokens plus what the steps in flight made while the pause travelled (a few
        # tokens; more on a loaded machine), and no more while it stays paused.
        assert stream.pending.num_output_tokens == pending
        assert 4 < pending <= 50, f"{pending} tokens pending behind a max_pending_tokens=4 reader"
        outs += [o async for o in gen]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        tokens = [t for o in outs for t in o.outputs[0].token_ids]
        assert tokens == refs["long100"][0]
        assert "".join(o.outputs[0].text for o in outs) == refs["long100"][1]
        await settle(aeng, engine)

    serve(engine, body, max_pending_tokens=4)


def test_a_paused_request_gives_its_blocks_to_others_and_is_recomputed(engine: Engine, refs: dict) -> None:
    async def body(aeng: AsyncEngine) -> None:
        gen = aeng.generate("paused-victim", LONG, greedy(40, DELTA))
        outs = [await gen.__anext__()]
        await wait_paused(aeng, 1)
        preemptions = aeng.snapshot.num_preemptions
        # Two 240-token requests (15 blocks each) do not fit in 32 blocks beside the paused one's.
        others = await asyncio.wait_for(asyncio.gather(
            *(collect(aeng, f"needs-blocks-{i}", BIG[i], greedy(140, DELTA)) for i in range(2))), 60)
        for i, other in enumerate(others):
            assert [t for o in other for t in o.outputs[0].token_ids] == refs["big"][i]
        snap = aeng.snapshot
        assert snap.num_preemptions > preemptions, "the paused request was meant to give up its blocks"
        assert snap.num_requests_paused == 1 and snap.num_requests_running == 0  # it waits, holding nothing
        assert engine.kv.num_free_blocks == engine.plan.num_blocks - 1
        outs += [o async for o in gen]
        assert outs[-1].finished
        assert [t for o in outs for t in o.outputs[0].token_ids] == refs["long"][0]
        assert "".join(o.outputs[0].text for o in outs) == refs["long"][1]
        await settle(aeng, engine)

    serve(engine, body, max_pending_tokens=4)


def test_paused_readers_do_not_starve_new_requests(engine: Engine, refs: dict) -> None:
    async def body(aeng: AsyncEngine) -> None:
        gens = [aeng.generate(f"stalled-{i}", SHORT[5 + i], greedy(40, DELTA)) for i in range(MAX_NUM_SEQS)]
        for g in gens:
            await g.__anext__()
        await wait_paused(aeng, MAX_NUM_SEQS)  # max_num_seqs readers have all stopped reading
        try:
            tokens = await asyncio.wait_for(final_tokens(aeng, "newcomer", SHORT[0]), 2)
        except TimeoutError:
            tokens = None
        for g in gens:
            await g.aclose()
        await settle(aeng, engine)
        assert tokens == refs["short"][0], "a new request never started while max_num_seqs readers were paused"

    serve(engine, body, max_pending_tokens=4)


# ---- 8. input workers -----------------------------------------------------------------------------


def test_run_input_uses_an_input_worker_and_survives_cancelled_callers(engine: Engine, refs: dict) -> None:
    async def body(aeng: AsyncEngine) -> None:
        thread = await aeng.run_input(threading.current_thread)
        assert thread is not threading.current_thread()
        assert thread is not aeng._step_thread and thread is not aeng._output_thread
        assert thread.name.startswith("paxserve-input")
        # Callers cancelled while their work runs (and while it is still queued behind busy workers).
        tasks = [asyncio.create_task(aeng.run_input(time.sleep, 0.3)) for _ in range(4)]
        await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with pytest.raises(asyncio.CancelledError):
                await t
        assert await asyncio.wait_for(aeng.run_input(lambda a, b=0: a + b, 40, b=2), 5) == 42
        with pytest.raises(KeyError):
            await aeng.run_input({}.__getitem__, "missing")  # the work's own error reaches its caller
        assert aeng.is_alive
        assert await final_tokens(aeng, "after-run-input", SHORT[4]) == refs["short"][4]
        await settle(aeng, engine)

    serve(engine, body)


# ---- 9. the snapshot ------------------------------------------------------------------------------


def test_snapshot_is_readable_while_a_long_step_runs(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(aeng: AsyncEngine) -> None:
        gen = aeng.generate("long-step", SHORT[2], greedy(60, DELTA))
        await gen.__anext__()
        entered, returned = slow_once(monkeypatch, engine.runner, "collect", 1.0)
        await wait_for_event(entered)
        worst = 0.0
        for _ in range(20):
            start = time.perf_counter()
            snap = aeng.snapshot
            worst = max(worst, time.perf_counter() - start)
            assert snap.num_requests_running == 1
            start = time.perf_counter()
            await asyncio.sleep(0.01)  # the event loop itself is not held up either
            worst = max(worst, time.perf_counter() - start - 0.01)
        assert not returned.is_set(), "the long step was meant to be running throughout"
        assert worst < 0.05
        outs = [o async for o in gen]
        assert outs[-1].finished
        await settle(aeng, engine)

    serve(engine, body)


def test_shutdown_ends_open_streams(engine: Engine) -> None:
    async def body(aeng: AsyncEngine) -> BaseException | None:
        gen = aeng.generate("open-at-shutdown", SHORT[1], greedy(200, DELTA))
        await gen.__anext__()
        aeng.shutdown(timeout=10)
        assert not aeng.is_alive

        async def drain() -> None:
            async for _ in gen:
                pass

        try:
            await asyncio.wait_for(drain(), 2)
        except TimeoutError:
            return None
        except Exception as e:  # noqa: BLE001 - any error that ends the stream is an answer
            return e
        return None

    ended = serve(engine, body)
    assert ended is not None, "the open stream's reader still waits 2 s after shutdown()"


# ---- 7. death (last: it leaves this AsyncEngine dead) ---------------------------------------------


def test_a_dead_step_loop_fails_every_stream_and_new_requests(engine: Engine, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    async def body(aeng: AsyncEngine) -> None:
        deaths: list[BaseException] = []
        aeng.on_death(deaths.append)
        gen = aeng.generate("open-at-death", SHORT[0], greedy(100, DELTA))
        await gen.__anext__()
        boom = RuntimeError("the device fell off the bus")
        original, calls = engine.core.step, []

        def step_raising_once() -> Any:
            if not calls:
                calls.append(1)
                raise boom
            return original()

        monkeypatch.setattr(engine.core, "step", step_raising_once)  # outside the step's own isolation
        async def drain() -> None:
            async for _ in gen:
                pass

        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(drain(), 10)
        assert not aeng.is_alive
        deadline = time.monotonic() + 5
        while not deaths and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert deaths == [boom]
        late: list[BaseException] = []
        aeng.on_death(late.append)  # registered after the death: called at once
        assert late == [boom]
        with pytest.raises(EngineDeadError):
            async for _ in aeng.generate("after-death", SHORT[1], GREEDY20):
                pass
        with pytest.raises(EngineDeadError):
            await aeng.run_input(int, "1")
        start = time.monotonic()
        aeng.shutdown(timeout=10)
        assert time.monotonic() - start < 2.0

    serve(engine, body)
    # The dead loop freed nothing; `serve` ended what it left, and the pool is whole again.
    assert not engine.core.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.plan.num_blocks - 1
