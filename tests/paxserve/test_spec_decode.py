"""Speculative decoding: the n-gram proposer, the schedule of proposed tokens, the verification's
exactness (greedy and seeded sampled outputs equal those without proposals, token for token) and
the target distribution kept by rejection sampling."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxserve import Engine, SamplingParams
from paxserve.config import EngineConfig
from paxserve.sampling_params import StructuredOutputsParams
from paxserve.core.kv_cache_manager import KVCacheManager
from paxserve.core.request import Request
from paxserve.core.scheduler import Scheduler, SchedulerConfig
from paxserve.spec_decode.acceptance import AcceptanceRate, DraftBackoff, SpecDecodingStats
from paxserve.spec_decode.config import SpeculativeConfig
from paxserve.spec_decode.ngram import NgramProposer
from paxserve.spec_decode.planner import StepTimes, drafting_pays, plan_drafts
from paxserve.worker.sampling.host_inputs import SamplingRow, build_sampling_inputs
from paxserve.worker.sampling.sampler import SamplerState, SamplingMetadata
from paxserve.worker.sampling.verify import kept_rows, verify
from tests.helpers import make_tiny_llama
from tests.paxserve.tiny_checkpoints import MODEL_VOCAB as VOCAB, save_byte_tokenizer

# ---- configuration ------------------------------------------------------------------------------


def test_the_config_reads_vllm_json_and_names_what_is_wrong() -> None:
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == \
        ("ngram", 4, 1, 3)
    draft = SpeculativeConfig.parse({"model": "/some/draft", "num_speculative_tokens": 2})
    assert (draft.method, draft.model) == ("draft_model", "/some/draft")
    bad = [({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
           ({"method": "ngram"}, "num_speculative_tokens"),
           ({"method": "magic", "num_speculative_tokens": 2}, "method"),
           ({"method": "mtp", "num_speculative_tokens": 2}, "not available"),
           ({"method": "draft_model", "num_speculative_tokens": 2}, "model.* is required"),
           ({"method": "ngram", "model": "/some/draft", "num_speculative_tokens": 2}, "uses no model"),
           ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min"),
           ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown keys"),
           ("{not json", "JSON")]
    for value, words in bad:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(value)
    with pytest.raises(ValueError, match="EngineConfig.speculative_config.num_speculative_tokens"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": -1})


def test_ngram_lookup_proposes_what_followed_the_longest_latest_match() -> None:
    proposer = NgramProposer(1, 3)
    # The tail (7, 8, 9) occurred at 1..3, followed by 10, 11, 12.
    assert proposer.propose([1, 7, 8, 9, 10, 11, 12, 5, 7, 8, 9], 2) == [10, 11]
    # Longest first: the 2-gram (8, 9) matches later than the 3-gram would, but the 3-gram wins.
    assert proposer.propose([7, 8, 9, 1, 2, 0, 8, 9, 3, 7, 8, 9], 1) == [1]
    assert proposer.propose([1, 2, 3, 4], 3) == []
    assert proposer.propose([4, 4], 3) == [4]  # a match near the end proposes what there is
    assert NgramProposer(2, 2).propose([5, 1, 5], 2) == []  # a 1-gram match does not count


def test_back_off_pauses_a_request_whose_proposals_fail_and_resumes_it() -> None:
    backoff = DraftBackoff()
    backoff.record(3, 0, 0.5)
    backoff.record(3, 0, 0.5)
    paused = 0
    while not backoff.allows():
        paused += 1
    assert paused >= 4
    backoff.record(3, 3, 0.5)
    assert backoff.allows()
    engine = AcceptanceRate()
    assert engine.rate == 0.5
    engine.record(4, 1)  # the first was accepted, the second rejected, the rest never tried
    assert engine.rate == 1.5 / 3
    stats = SpecDecodingStats()
    stats.record(3, 2)
    stats.record(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.accepted_per_position == [1, 1, 0] and stats.mean_acceptance_length == 2.0


def test_with_async_scheduling_a_request_that_finds_nothing_lets_steps_overlap_longer_each_time() -> None:
    backoff = DraftBackoff()
    assert backoff.wants_results()
    overlapped = []
    for _ in range(6):  # each time its results were waited for, it found nothing to propose
        backoff.found_nothing()
        n = 0
        while not backoff.wants_results():
            backoff.waited()  # steps it decodes with its token in flight count the pause down
            n += 1
        overlapped.append(n)
    assert overlapped == [1, 2, 4, 8, 16, 16]
    backoff.found_nothing()
    backoff.record(3, 1, 0.5)  # a proposal accepted: the next miss pauses for one step again
    assert backoff.next_idle == 1


def test_the_plan_verifies_what_pays_for_its_share_of_the_step() -> None:
    likely, unlikely = DraftBackoff(accepted=9.0, tried=10.0), DraftBackoff(accepted=1.0, tried=10.0)
    gains = [likely.gains(3, 0.5), unlikely.gains(3, 0.5)]
    assert gains[0][0] > gains[0][1] > gains[0][2] > 0.6 and gains[1][0] < 0.2
    # A plain step is measured first; unmeasured verifying steps are then tried (and measured).
    assert plan_drafts(gains, 4, lambda d: None) == [0, 0]
    assert plan_drafts(gains, 4, lambda d: 0.010 if d == 0 else None) == [3, 3]
    # Weight-bound (a GPU's small decode step): rows are free, everything goes in.
    assert plan_drafts(gains, 4, lambda d: 0.010) == [3, 3]
    # Compute-bound (this CPU): a token costs 0.4 of a decoding request's share of the step, so only
    # proposals likelier than that pay; at 1.6 none does.
    assert plan_drafts(gains, 4, lambda d: 0.006 + 0.001 * (4 + d)) == [3, 0]
    assert plan_drafts(gains, 4, lambda d: 0.006 + 0.004 * (1 + d)) == [0, 0]
    # A bucket jump: the first proposal costs the jump, the rest ride along.
    assert plan_drafts(gains, 4, lambda d: 0.010 if d == 0 else 0.012) == [3, 3]
    # A verifying program not compiled yet: nothing waits for it.
    assert plan_drafts(gains, 4, lambda d: 0.010 if d == 0 else math.inf) == [0, 0]
    # A gain within the estimates' noise is not taken (here 1.02x plain decoding's rate).
    assert plan_drafts([[0.5]], 4, lambda d: 0.010 * (1 + 0.1 * d)) == [0]
    # A draft model's passes must pay too: 4 requests, 3 likely proposals each, a 10 ms plain step.
    sure = [likely.gains(3, 0.5)] * 4
    assert drafting_pays(sure, 4, 0.010, 0.011, 0.004)  # a small draft: 13 tokens in 15 ms beat 4 in 10 ms
    assert not drafting_pays(sure, 4, 0.010, 0.011, 0.030)  # three passes as slow as the target's: 13 in 41 ms
    assert drafting_pays(sure, 4, 0.010, 0.011, None)  # unmeasured: tried, then measured
    assert not drafting_pays(sure, 4, None, 0.011, 0.004)  # but a plain step is measured first
    # A verifying step never measured (the plan verified none) costs at least a plain one: proposals
    # unlikely to be accepted do not keep a measured draft running.
    unlikely_ones = [unlikely.gains(3, 0.1)] * 4
    assert not drafting_pays(unlikely_ones, 4, 0.010, None, 0.004)
    assert drafting_pays(sure, 4, 0.010, None, 0.004)
    times = StepTimes()
    times.record("p", 5.0)  # the first step of a program (it may have compiled it) is not counted
    assert times.get("p") is None
    for seconds in (0.3, 0.1, 0.2, 9.0, 0.2):
        times.record("p", seconds)
    assert times.get("p") == 0.2


def test_the_acceptance_rule_runs_over_each_sequences_consecutive_rows() -> None:
    # Three sequences (batch rows 5, 2, 7) with 2, 0 and 1 proposals, then a padding row.
    tokens = jnp.array([10, 11, 12, 20, 30, 31, 0])
    drafts = jnp.array([10, 99, -1, -1, 30, -1, -1])
    batch_row = jnp.array([5, 5, 5, 2, 7, 7, 0])
    kept, last = kept_rows(tokens, drafts, batch_row)
    assert kept.tolist() == [True, True, False, True, True, True, True]
    assert last.tolist() == [False, True, False, True, False, True, True]


# ---- the schedule --------------------------------------------------------------------------------


def _scheduler(num_blocks: int = 20, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=64),
                     KVCacheManager(num_blocks, block_size=4, enable_caching=True))


def test_proposals_are_scheduled_with_slots_and_rejected_ones_are_stepped_back_over() -> None:
    sched = _scheduler()
    request = Request("a", [1, 2, 3], SamplingParams(temperature=0.0), max_tokens=10, eos_token_ids=(99,))
    sched.add_request(request)
    sched.update_from_output(sched.schedule(), [4])  # the prompt: 4 tokens, one block
    request.spec_token_ids = [5, 6, 7]
    out = sched.schedule()
    (row,) = out.scheduled
    assert (row.num_new_tokens, row.num_computed_tokens, row.spec_token_ids) == (4, 3, [5, 6, 7])
    assert sched.kv.num_blocks("a") == 2 and request.spec_token_ids == []
    # The proposal 5 was right, 6 was not: the sampler kept 5 and its own 8.
    sched.update_from_output(out, [[5, 8]])
    assert request.output_token_ids == [4, 5, 8] and request.num_computed_tokens == 5
    # Only blocks of known tokens enter the prefix cache (block 1 holds 4, 5 and two proposals).
    assert sched.kv._num_registered["a"] == 1
    # EOS inside an accepted run ends the request there; what follows is dropped.
    request.spec_token_ids = [9, 99, 10]
    out = sched.schedule()
    assert sched.update_from_output(out, [[9, 99, 10, 11]]) == [request]
    assert request.output_token_ids == [4, 5, 8, 9, 99]
    assert sched.kv.num_free_blocks == 19


def test_when_memory_is_short_proposals_and_lookahead_give_way_before_any_preemption() -> None:
    for lookahead in (0, 3):
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                          num_lookahead_tokens=lookahead), KVCacheManager(4, 4, False))
        a, b = (Request(rid, [1, 2, 3], SamplingParams(temperature=0.0), max_tokens=10) for rid in "ab")
        for r in (a, b):
            sched.add_request(r)
        first = sched.schedule()
        if lookahead:  # the prompts' lookahead did not fit beside each other: b went without
            assert sched.kv.num_blocks("a") == 2 and sched.kv.num_blocks("b") == 1
        sched.update_from_output(first, [4, 4])
        assert sched.kv.num_free_blocks == 0 or lookahead == 0
        a.spec_token_ids, b.spec_token_ids = [5, 6, 7], [5, 6, 7]
        out = sched.schedule()
        # Three blocks for two requests: plain decoding fits, the proposals of both do not.
        assert not out.preempted_ids and [s.request_id for s in out.scheduled] == ["a", "b"]
        assert sum(len(s.spec_token_ids) for s in out.scheduled) < 6


def test_a_draft_models_lookahead_slots_are_allocated_up_to_max_model_len() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=12,
                                      num_lookahead_tokens=3), KVCacheManager(20, block_size=4, enable_caching=True))
    request = Request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0.0), max_tokens=7)
    sched.add_request(request)
    out = sched.schedule()
    assert sched.kv.num_blocks("a") == 2  # 5 prompt tokens and 3 slots for the draft's pages
    sched.update_from_output(out, [6])
    request.spec_token_ids = [7, 8, 9]
    sched.update_from_output(sched.schedule(), [[7, 8, 9, 10]])  # 9 computed + 3 = 12 slots
    assert sched.kv.num_blocks("a") == 3
    sched.update_from_output(sched.schedule(), [11])  # 10 computed: the lookahead stops at max_model_len
    assert sched.kv.num_blocks("a") == 3


def test_the_budget_trims_proposals_and_prompt_scoring_drops_them() -> None:
    sched = _scheduler(budget=3)
    request = Request("a", [1, 2], SamplingParams(temperature=0.0), max_tokens=10)
    sched.add_request(request)
    sched.update_from_output(sched.schedule(), [3])
    request.spec_token_ids = [4, 5, 6, 7]
    (row,) = sched.schedule().scheduled
    assert row.num_new_tokens == 3 and row.spec_token_ids == [4, 5]

    sched = _scheduler()
    first = Request("a", [1, 2], SamplingParams(temperature=0.0), max_tokens=10)
    sched.add_request(first)
    sched.update_from_output(sched.schedule(), [3])
    scoring = Request("b", [1, 2, 3], SamplingParams(temperature=0.0, prompt_logprobs=1), max_tokens=4)
    from paxserve.core.prompt_logprobs import PromptLogprobsBuffer
    scoring.prompt_logprobs = PromptLogprobsBuffer.empty(3, 1)
    sched.add_request(scoring)
    first.spec_token_ids = [4, 5]
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens, s.spec_token_ids) for s in out.scheduled] == [("a", 1, []), ("b", 3, [])]
    assert first.num_computed_tokens == 3


# ---- the verification's distribution -------------------------------------------------------------


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Many seeds, one position with a proposal: the kept token is distributed as the target's
    (temperature 1, then top-p 0.8, which drops the tail), and the proposal is accepted with
    its probability."""
    vocab, n = 8, 4000
    logits = np.log(np.array([0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02], np.float32))
    draft = 1
    for top_p, target in ((1.0, np.exp(logits)), (0.8, None)):
        if target is None:  # top-p 0.8 keeps 0.30 + 0.22 + 0.16 + 0.12 (the mass before 0.12 is < 0.8)
            target = np.where(np.arange(vocab) < 4, np.exp(logits), 0.0)
        target = target / target.sum()
        rows = [SamplingRow(SamplingParams(temperature=1.0, top_p=top_p), [1], [], seed=i, eos_token_ids=())
                for i in range(n) for _ in range(2)]
        inputs = build_sampling_inputs(rows, 2 * n, vocab)
        inputs.step[1::2] += 1  # a sequence's second row samples the position after
        inputs.batch_row[1::2] = inputs.batch_row[0::2]  # both rows are one sequence's
        md = SamplingMetadata.from_inputs(inputs)
        drafts = jnp.asarray(np.tile(np.array([draft, -1], np.int32), n))
        packed, _ = jax.jit(verify)(jnp.tile(jnp.asarray(logits)[None], (2 * n, 1)), md,
                                    SamplerState.zeros(2 * n + 1, vocab), drafts, jnp.full((2 * n, 1), -1))
        first = np.asarray(packed[0::2, 0]).astype(int)
        counts = np.bincount(first, minlength=vocab)
        expected = target * n
        keep = expected > 0
        chi2 = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
        assert counts[~keep].sum() == 0
        assert chi2 < 24.3, (chi2, counts, expected)  # chi-square, 7 degrees of freedom, p = 0.001
        assert abs((first == draft).mean() - target[draft]) < 4 * np.sqrt(target[draft] / n)


def test_penalties_at_a_verified_position_count_the_proposals_before_it() -> None:
    """Token 5 is the best at both positions; proposed at the first, it is penalised at the second
    (kept only if the first was), so the second samples 6."""
    vocab = 8
    logits = jnp.asarray(np.tile(np.array([0, 0, 0, 0, 0, 3.0, 2.0, 0], np.float32), (2, 1)))
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    inputs = build_sampling_inputs([SamplingRow(params, [1], [], 0, (), state_row=1)] * 2, 2, vocab)
    inputs.step[1] += 1
    inputs.batch_row[1] = inputs.batch_row[0]
    md = SamplingMetadata.from_inputs(inputs)
    packed, state = jax.jit(verify)(logits, md, SamplerState.zeros(2, vocab), jnp.array([5, -1]),
                                    jnp.array([[-1], [5]]))
    assert np.asarray(packed[:, 0]).astype(int).tolist() == [5, 6]
    assert np.asarray(state.counts[1]).tolist() == [0, 0, 0, 0, 0, 1, 1, 0]


# ---- the engine ----------------------------------------------------------------------------------

ARGS: dict[str, Any] = dict(warmup=False, log_stats_interval=0, compilation_cache_dir="", max_model_len=256,
                            kv_cache_memory_bytes=8 * 2**20, compile_in_background=False)
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama with a small vocabulary and a byte-level tokenizer (grammars need one)."""
    directory = tmp_path_factory.mktemp("tiny-spec")
    make_tiny_llama(directory, seed=3, vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=512, eos_token_id=256)
    return save_byte_tokenizer(directory)


class OracleProposer:
    """Proposes the continuation plain decoding gave (`answers`: prompt + output), right for the
    first `right` tokens of every proposal and wrong after: every accept and reject path runs."""

    def __init__(self, answers: list[list[int]], right: int, vocab_size: int = VOCAB) -> None:
        self.answers = answers  # a request with none finds nothing to propose
        self.right = right
        self.vocab_size = vocab_size
        self.calls = 0

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        self.calls += 1
        tokens = tokens.tolist()
        for answer in self.answers:
            if answer[:len(tokens)] == tokens:
                nxt = answer[len(tokens):len(tokens) + k]
                return [t if i < self.right else (t + 1) % self.vocab_size for i, t in enumerate(nxt)]
        return []


class FlatTimes:
    """Every step takes as long, whatever it verifies, and a draft model's passes take no time: the
    plan verifies every proposal. What the engine measured is kept in `recorded`."""

    def __init__(self) -> None:
        self.recorded: list[tuple[Any, float]] = []

    def record(self, program: Any, seconds: float) -> None:
        self.recorded.append((program, seconds))

    def get(self, program: Any) -> float:
        return 0.0 if program[0] == "draft" else 1.0


def record_proposals(drafter: Any) -> list[tuple[list[int], list[int]]]:
    """Wrap a drafter's `propose_batch`: the returned list fills with (the request's tokens, what it
    proposed after them) for every non-empty proposal."""
    seen: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose_batch

    def recording(requests, rooms, block_ids):  # noqa: ANN001, ANN202
        out = propose(requests, rooms, block_ids)
        seen.extend((r.token_ids_slice(0, r.num_tokens), p) for r, p in zip(requests, out) if p)
        return out

    drafter.propose_batch = recording
    return seen


PROMPTS = [list(range(40, 70)) + list(range(40, 50)), [7, 8, 9] * 6, list(range(100, 112)),
           list(range(200, 260))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True, logprobs=2)


# Requests whose sampling needs more than the logits at each verified position: penalties count the
# proposals before the position, a grammar is advanced through them.
EXTRA = [(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                                     frequency_penalty=0.5, presence_penalty=0.2)),
         (PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(
             regex=r"[0-9]{3}-[a-z]{2,8}"))),
         (PROMPTS[3], SamplingParams(temperature=1.0, seed=5, max_tokens=24, structured_outputs=StructuredOutputsParams(
             regex=r"[a-z]{6,12}-[0-9]{2}")))]


@pytest.fixture(scope="module")
def plain(tiny_dir: Path) -> dict[str, list]:
    engine = Engine(str(tiny_dir), **ARGS)
    out = {name: engine.generate(PROMPTS, params, use_tqdm=False) for name, params in
           (("greedy", GREEDY), ("sampled", SAMPLED))}
    out["extra"] = engine.generate([p for p, _ in EXTRA], [q for _, q in EXTRA], use_tqdm=False)
    return out


# Block size 8 runs in a pool too small for the batch: requests are preempted and recomputed
# mid-speculation.
SMALL_POOL = dict(kv_cache_memory_bytes=None, num_gpu_blocks_override=14, max_model_len=96)


# Block size 16 (the default) verifies in test_with_background_compiles_no_step_waits_for_a_verifying_program
# and on the real SmolLM2 (tests/models/test_smollm2.py). At block size 8 proposals are right for 3 of
# 4 tokens: accepted runs long enough for a stop to fall inside one, and rejections, under preemption.
@pytest.mark.parametrize("block_size,prefix_caching,right,overlap", [(8, True, 3, False), (32, False, 1, True)])
def test_verified_outputs_equal_plain_decoding_greedy_and_seeded(
        tiny_dir: Path, plain: dict[str, list], block_size: int, prefix_caching: bool, right: int,
        overlap: bool) -> None:
    """`overlap`: with async scheduling, and proposals for every other request only: steps wait for
    their predecessors' results where a request proposes, and overlap them where none will."""
    k = 4 if block_size == 8 else 3
    engine = Engine(str(tiny_dir), speculative_config={"method": "ngram", "num_speculative_tokens": k},
                    block_size=block_size, enable_prefix_caching=prefix_caching, async_scheduling=overlap,
                    **({**ARGS, **SMALL_POOL} if block_size == 8 else ARGS))
    core = engine.parts.core
    extra = plain["extra"]
    assert [o.outputs[0].finish_reason for o in extra[1:]] == ["stop", "stop"]  # the grammars ended them
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        expected = plain[name] + extra
        prompts = PROMPTS + [p for p, _ in EXTRA]
        core._speculator.proposer = OracleProposer([p + o.outputs[0].token_ids for i, (p, o)
                                                    in enumerate(zip(prompts, expected)) if not overlap or i % 2 == 0],
                                                   right)
        core._speculator.times = FlatTimes()  # every proposal is verified, whatever this machine's step times
        outs = engine.generate(prompts, [params] * len(PROMPTS) + [q for _, q in EXTRA], use_tqdm=False)
        for out, want in zip(outs, expected):
            assert out.outputs[0].token_ids == want.outputs[0].token_ids
            if want.outputs[0].logprobs is not None:
                got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
                ref = [lp[t].logprob for lp, t in zip(want.outputs[0].logprobs, want.outputs[0].token_ids)]
                np.testing.assert_allclose(got, ref, atol=1e-4)
    stats = core.spec_stats
    assert stats.num_accepted_tokens >= min(right, k) * stats.num_drafts // 2 > 0
    if right < k:
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # rejections happened too
    if overlap:
        assert core.num_spec_waits > 0 and core.num_overlapped_steps > 0, (core.num_spec_waits,
                                                                            core.num_overlapped_steps)
        # Under async scheduling a step is timed from its dispatch to the next one's (a waited-for
        # step's time then includes the host's work for the next), plain and verifying steps alike.
        recorded = core._speculator.times.recorded
        assert {p[0] for p, _ in recorded} >= {"verify", engine.runner.decode_kind} and min(s for _, s in recorded) > 0
    if block_size == 8:
        assert core.stats.preemptions > 0
        # Stop token ids and max_tokens that fall inside an accepted run cut exactly where plain
        # decoding stops.
        answer = plain["greedy"][2].outputs[0].token_ids
        stop_at = next(i for i in range(6, 16) if answer[i] not in answer[:i])
        stopped = engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                               stop_token_ids=[answer[stop_at]]), use_tqdm=False)[0]
        assert stopped.outputs[0].token_ids == answer[:stop_at + 1] and stopped.outputs[0].finish_reason == "stop"
        short = engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                                use_tqdm=False)[0]
        assert short.outputs[0].token_ids == answer[:7] and short.outputs[0].finish_reason == "length"
    assert engine.kv.num_free_blocks == engine.plan.num_blocks - 1


def test_with_background_compiles_no_step_waits_for_a_verifying_program(tiny_dir: Path, plain: dict[str, list]) -> None:
    """As a server runs (programs compile in the background, step times are measured): proposals
    wait until their verifying programs are ready, then are verified where they pay."""
    engine = Engine(str(tiny_dir), speculative_config=SPEC, **{**ARGS, "compile_in_background": True})
    core = engine.parts.core
    answers = [p + o.outputs[0].token_ids for p, o in zip(PROMPTS, plain["greedy"])]
    core._speculator.proposer = OracleProposer(answers, right=3)
    first = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in plain["greedy"]]
    engine.runner.programs.wait()
    assert any(key[0] == "verify" for key in engine.runner.programs.keys())  # asked for, compiled aside
    drafts = core.spec_stats.num_drafts
    # Later runs find the programs their steps need compiled (a run may still ask for another width,
    # compiled for the next), and this tiny model's step costs about the same for 4 tokens or 16,
    # so right proposals pay.
    for _ in range(3):
        again = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in plain["greedy"]]
        engine.runner.programs.wait()
        if core.spec_stats.num_drafts > drafts:
            break
    assert core.spec_stats.num_drafts > drafts
    engine.runner.programs.close()


def test_a_draft_model_proposes_and_outputs_stay_plain_decodings(
        tiny_dir: Path, plain: dict[str, list], tmp_path: Path) -> None:
    """The target as its own draft (its greedy chain: every greedy proposal right, sampled ones
    often wrong) through forced preemption; drafts that cannot serve are refused before loading."""
    small = tmp_path / "small-vocab"
    make_tiny_llama(small, seed=9, vocab_size=300, max_position_embeddings=512)
    with pytest.raises(ValueError, match=f"vocabulary of 300 tokens, the target model {VOCAB}"):
        Engine(str(tiny_dir), speculative_config={"model": str(small), "num_speculative_tokens": 2}, **ARGS)
    with pytest.raises(ValueError, match="speculative_config.model=.*cannot be read"):
        Engine(str(tiny_dir), speculative_config={"model": str(tmp_path / "nowhere"), "num_speculative_tokens": 2},
               **ARGS)
    prompts = PROMPTS + [p for p, _ in EXTRA]
    engine = Engine(str(tiny_dir), speculative_config={"model": str(tiny_dir), "num_speculative_tokens": 3},
                    **{**ARGS, **SMALL_POOL, "block_size": 8})
    core = engine.parts.core
    core._speculator.times = FlatTimes()
    stats = core.spec_stats
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        outs = engine.generate(prompts, [params] * len(PROMPTS) + [q for _, q in EXTRA], use_tqdm=False)
        for out, want in zip(outs, plain[name] + plain["extra"]):
            assert out.outputs[0].token_ids == want.outputs[0].token_ids
        if name == "greedy":
            # Right but for the penalised row's (the draft proposes without its penalties).
            assert stats.num_drafts > 15 and stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens, stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # the sampled rows rejected some
    assert core.stats.preemptions > 0
    assert engine.kv.num_free_blocks == engine.plan.num_blocks - 1
    # The counters a server's /metrics shows, with vLLM's names.
    from paxserve.server.metrics import ServerMetrics

    metrics = ServerMetrics("tiny", 96)
    metrics.update_engine(core.snapshot().as_dict())
    text = metrics.render().decode()
    for name, value in (("num_drafts", stats.num_drafts), ("num_draft_tokens", stats.num_draft_tokens),
                        ("num_accepted_tokens", stats.num_accepted_tokens)):
        assert f'paxserve:spec_decode_{name}_total{{model_name="tiny"}} {float(value)}' in text, name
    assert (f'paxserve:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="0"}} '
            f'{float(stats.accepted_per_position[0])}') in text
