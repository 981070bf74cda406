"""SamplingParams.prompt_logprobs end to end, against transformers' log_softmax of the same tiny
random Llama (SmolLM2's vocabulary and tokenizer).

One engine serves every test: blocks of 32 tokens, 16 tokens per step (so the 62-token prompt is
always chunked: 16 + 16 + 16 + 14) and a pool of 3 usable blocks (so two requests that need two
blocks each force preemption). Prompts and request shapes are chosen so the whole file compiles
seven programs: plain steps of 16 tokens (1 or 2 sequences) and of 1 token, and the prompt-logprobs
variant of 16 tokens (1 sequence with 1 or 2 block-table columns, 2 with 2); the number of top
alternatives asked is runtime data, never a compile key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from paxserve import Engine, SamplingParams
from paxserve.core.prompt_logprobs import PromptLogprobsBuffer, build_prompt_logprobs_inputs
from paxserve.outputs import Logprob, RequestOutput
from paxserve.sampling_params import RequestOutputKind
from tests.paxserve import test_engine
from tests.paxserve.test_engine import TEST_ENGINE_ARGS, VOCAB

tiny_dir = test_engine.tiny_dir  # the module fixture: a tiny random Llama with SmolLM2's tokenizer

ARGS: dict[str, Any] = {**TEST_ENGINE_ARGS, "block_size": 32, "max_model_len": 96, "max_num_batched_tokens": 16,
                        "num_gpu_blocks_override": 4, "max_num_seqs": 2}
TOL = 2e-4  # logprobs against transformers (both float32; the error seen is about 3e-6)
# Closer than this to the token's logprob, another token may order either way by rounding. It is
# small because ranks in the middle of a 49152-token vocabulary are thousands, packed densely.
TIE = 2e-5

_rng = np.random.default_rng(5)
SHORT = _rng.integers(3, VOCAB, 12).tolist()  # one step
LONG = _rng.integers(3, VOCAB, 62).tolist()  # four chunks of at most 16
OTHER = _rng.integers(3, VOCAB, 48).tolist()  # the batch mate that asks for no prompt logprobs


def greedy(max_tokens: int = 1, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:
    return Engine(str(tiny_dir), **ARGS)


@pytest.fixture(scope="module")
def reference(tiny_dir: Path):  # noqa: ANN201
    """prompt -> transformers' float32 log_softmax of every position's logits, [P, V]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), torch_dtype=torch.float32).eval()
    cache: dict[tuple[int, ...], np.ndarray] = {}

    def logprobs(prompt: list[int]) -> np.ndarray:
        if tuple(prompt) not in cache:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
            cache[tuple(prompt)] = torch.log_softmax(logits.float(), dim=-1).numpy()
        return cache[tuple(prompt)]

    return logprobs


def assert_no_blocks_held(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.plan.num_blocks - 1


def assert_matches(engine: Engine, entries: list[dict[int, Logprob] | None] | None, prompt: list[int],
                   ref: np.ndarray, k: int) -> None:
    """Every entry against transformers: the token's logprob, its exact rank (where no other token is
    within rounding of it), the top-k ids in order (where no tie decides them) and the decoded text."""
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    decode = engine.tokenizer.decode
    num_exact_ranks = 0
    for i in range(1, len(prompt)):
        token, row, entry = prompt[i], ref[i - 1], entries[i]
        assert entry is not None
        own = entry[token]
        assert abs(own.logprob - row[token]) < TOL, (i, own.logprob, row[token])
        # Rank bounds: other tokens surely above, and those that may be above by rounding (the
        # second count includes the token itself, hence no 1 +).
        lo, hi = 1 + int(np.sum(row > row[token] + TIE)), int(np.sum(row > row[token] - TIE))
        assert lo <= own.rank <= hi, (i, own.rank, lo, hi)
        num_exact_ranks += lo == hi
        order = np.argsort(-row, kind="stable")
        top = [int(t) for t in order[:k]]
        assert set(entry) == {token, *top}
        gaps = -np.diff(row[order[: k + 1]])
        for place, t in enumerate(top, start=1):
            assert abs(entry[t].logprob - row[t]) < TOL
            if t != token and (place == 1 or gaps[place - 2] > TIE) and gaps[place - 1] > TIE:
                assert entry[t].rank == place
        assert all(lp.decoded_token == decode([t]) for t, lp in entry.items())
    assert num_exact_ranks >= (len(prompt) - 1) // 2  # most ranks are decided and checked exactly


def run_to_end(engine: Engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


# ---- 1. equal to transformers ------------------------------------------------------------------


def test_prompt_logprobs_equal_transformers(engine: Engine, reference) -> None:  # noqa: ANN001
    out = engine.generate([SHORT], greedy(prompt_logprobs=5), use_tqdm=False)[0]
    assert_matches(engine, out.prompt_logprobs, SHORT, reference(SHORT), 5)
    assert all(o.logprobs is None for o in out.outputs)  # sampled-token logprobs were not asked for
    assert_no_blocks_held(engine)


# ---- 2. chunked prefill, preemption, prefix caching --------------------------------------------


def test_chunked_prefill_and_a_prefix_cache_hit_give_full_prompt_logprobs(engine: Engine, reference) -> None:  # noqa: ANN001
    ref = reference(LONG)
    first = engine.generate([LONG], greedy(prompt_logprobs=5), use_tqdm=False)[0]
    assert_matches(engine, first.prompt_logprobs, LONG, ref, 5)
    # The first run left LONG's full block in the prefix cache; a request asking for prompt
    # logprobs still computes (and scores) every prompt token.
    again = engine.generate([LONG], greedy(prompt_logprobs=5), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert again.prompt_logprobs == first.prompt_logprobs
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_no_blocks_held(engine)


def test_preemption_mid_prompt_neither_loses_nor_repeats_entries(engine: Engine, reference) -> None:  # noqa: ANN001
    engine.add_request("mid", LONG, greedy(prompt_logprobs=5))
    request = engine.scheduler.requests["mid"]
    for _ in range(3):  # two chunks of 16 (a third may be in flight, with async scheduling)
        if request.prompt_logprobs.num_filled < 32:
            engine.step()
    assert request.prompt_logprobs.num_filled == 32
    engine.scheduler.preempt_all()  # with the next chunk in flight, whose scores still land
    outs = run_to_end(engine)["mid"]
    assert request.num_preemptions == 1 and request.prompt_logprobs.num_filled == len(LONG) - 1
    assert_matches(engine, outs[-1].prompt_logprobs, LONG, reference(LONG), 5)
    assert_no_blocks_held(engine)


def test_a_batch_mate_without_prompt_logprobs_is_unaffected_under_preemption(engine: Engine, reference) -> None:  # noqa: ANN001
    runner, calls = engine.runner, []
    dispatch = runner.dispatch_model

    def counting(out, constrained=None, prompt=None):  # noqa: ANN001, ANN202
        calls.extend([1] if prompt is not None else [])
        return dispatch(out, constrained, prompt)

    runner.dispatch_model = counting
    before = set(runner.programs.keys())
    try:
        alone = engine.generate([OTHER], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        del runner.dispatch_model
    # A batch where nobody asks runs the plain program: no prompt-logprobs program is compiled or run.
    assert not calls
    assert not any(key[0] in ("all_logits", "score") for key in set(runner.programs.keys()) - before)
    preemptions = engine.stats.preemptions
    outs = engine.generate([OTHER, LONG], [greedy(8), greedy(prompt_logprobs=3)], use_tqdm=False)
    # 3 blocks of 32 cannot hold OTHER's 56 tokens and LONG's 62: LONG (the newer) is preempted, and
    # again on each try until OTHER is done; its recomputed chunks that only repeat scored positions
    # run the plain program.
    assert engine.stats.preemptions > preemptions, "the pool was meant to force preemption"
    assert outs[0].outputs[0].token_ids == alone
    assert outs[0].prompt_logprobs is None
    assert_matches(engine, outs[1].prompt_logprobs, LONG, reference(LONG), 3)
    assert_no_blocks_held(engine)


# ---- 3. n > 1, prompt_logprobs=0, output kinds --------------------------------------------------


def test_n_samples_share_one_list_and_zero_gives_only_the_token(engine: Engine, reference) -> None:  # noqa: ANN001
    two = engine.generate([LONG], greedy(n=2, prompt_logprobs=2), use_tqdm=False)[0]
    assert len(two.outputs) == 2
    assert_matches(engine, two.prompt_logprobs, LONG, reference(LONG), 2)
    # Sample 0 scored the prompt and registered its blocks; sample 1 took them from the prefix cache.
    assert two.num_cached_tokens == 32
    # prompt_logprobs=0: just the token's own entry. It runs the same program as a request for 5
    # (the device always computes the top MAX_LOGPROBS), so the entry is that request's, bit for bit.
    zero = engine.generate([SHORT], greedy(prompt_logprobs=0), use_tqdm=False)[0].prompt_logprobs
    five = engine.generate([SHORT], greedy(prompt_logprobs=5), use_tqdm=False)[0].prompt_logprobs
    assert zero is not None and zero[0] is None
    assert zero[1:] == [{t: e[t]} for e, t in zip(five[1:], SHORT[1:])]
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_output_kinds(engine: Engine, kind: RequestOutputKind) -> None:
    engine.add_request(f"kind-{kind.name}", LONG, greedy(3, prompt_logprobs=2, output_kind=kind))
    outs = run_to_end(engine)[f"kind-{kind.name}"]
    assert len(outs) == 3 and outs[0].prompt_logprobs is not None and len(outs[0].prompt_logprobs) == len(LONG)
    if kind == RequestOutputKind.DELTA:  # sent once, with the first output
        assert all(o.prompt_logprobs is None for o in outs[1:])
    else:
        assert all(o.prompt_logprobs == outs[0].prompt_logprobs for o in outs[1:])
    assert_no_blocks_held(engine)


# ---- 4. validation and the host-side mapping ---------------------------------------------------


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "3"])
def test_invalid_prompt_logprobs_name_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.prompt_logprobs=.*\[0, 20\]"):
        SamplingParams(prompt_logprobs=value)


def test_positions_score_the_next_prompt_token_across_chunks() -> None:
    prompt = list(range(100, 110))  # 10 tokens: positions 0..8 score tokens 1..9
    buffer = PromptLogprobsBuffer.empty(len(prompt), 2)
    # Row 0 is a batch mate's decode token; row 1 feeds positions 4..7 (4 already filled).
    buffer.num_filled = 4
    inputs = build_prompt_logprobs_inputs([(None, [7], 0, 1), (buffer, prompt, 4, 4)], 8)
    assert inputs is not None and inputs.spans == [None, (1, 4, 8)]
    # The last position of the chunk scores the first token of the next chunk (not in the batch).
    assert inputs.targets.tolist() == [0, 105, 106, 107, 108, 0, 0, 0]
    assert buffer.positions_needed(8, 2) == (8, 9)  # the last prompt position scores nothing
    assert buffer.positions_needed(0, 4) == (4, 4)  # recomputed after preemption: already filled
    assert build_prompt_logprobs_inputs([(buffer, prompt, 0, 4)], 4) is None  # nothing to do: plain step
    with pytest.raises(ValueError, match="do not continue"):
        buffer.fill(6, np.zeros((2, 12), np.float32))

