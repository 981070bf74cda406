"""Every family, dense and mixture-of-experts, through the one decoder against Hugging Face
transformers (torch, CPU, float32).

Per family (tests/models/family_checkpoints.py): prefill logits of prompts shorter and longer
than the window; greedy decode far past the window over shuffled pages at block sizes 8/16/32
with every step's logits checked; and the full engine (chunked prefill, preemption, prefix
caching) giving transformers' greedy tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from paxserve import Engine, SamplingParams
from paxserve.models import LoadedModel, load_model
from paxserve.worker.model_runner import ModelRunner
from paxserve.worker.step_inputs import SeqChunk, build_batch
from tests.helpers import compute_logits, rel_error, release_compiled_programs
from tests.models.family_checkpoints import FAMILIES, MOE_FAMILIES, VOCAB, make_family_checkpoint
from tests.paged_greedy import greedy_tokens_and_logits
from tests.paxserve.test_engine import TEST_ENGINE_ARGS, assert_no_blocks_held

LOGIT_TOL = 1e-4


_BUILT: dict[str, tuple[Any, LoadedModel, str, Path]] = {}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, LoadedModel, str, Path]]:
    # Built once per family even when pytest's ordering of the parametrized tests sets it up again
    # (a family's compiled programs then come back from the run's persistent compilation cache).
    if request.param not in _BUILT:
        directory = tmp_path_factory.mktemp(request.param)
        hf = make_family_checkpoint(request.param, directory, seed=len(request.param))
        _BUILT[request.param] = (hf, load_model(directory), request.param, directory)
    yield _BUILT[request.param]
    release_compiled_programs()  # eleven families' programs would not fit in one process's mappings


def prompts_for(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, n).tolist() for n in lengths]


def hf_logits(hf: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits[0].numpy()


def hf_greedy(hf: Any, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    hf.generation_config = GenerationConfig(max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [s[0].numpy() for s in out.logits]


def test_config_maps_onto_the_spec(family) -> None:
    hf, model, name, _ = family
    cfg, hcfg = model.config, hf.config
    assert cfg.num_layers == hcfg.num_hidden_layers and cfg.vocab_size == hcfg.vocab_size
    windows = getattr(hcfg, "sliding_window", None)
    if name in ("gemma3", "qwen2-window"):
        expected = tuple(windows if t == "sliding_attention" else 0 for t in hcfg.layer_types)
        assert cfg.layer_windows == expected and 0 in expected and any(expected)
    elif name in ("mistral-window", "mixtral"):
        assert cfg.layer_windows == (12,) * cfg.num_layers
    else:
        assert not any(cfg.layer_windows)
    if name == "gemma3":
        assert cfg.local_rope_theta == 1e4 and cfg.rope_theta == 1e6 and cfg.rope_scaling.rope_type == "linear"
    assert cfg.alibi == (name == "falcon-rw-alibi")
    if name in MOE_FAMILIES:
        assert cfg.num_experts == getattr(hcfg, "num_local_experts", getattr(hcfg, "num_experts", None)) and cfg.num_experts_per_tok == hcfg.num_experts_per_tok
        assert cfg.moe_renormalize == (name == "mixtral" or hcfg.norm_topk_prob)
        assert cfg.shared_expert_size == (40 if name == "qwen2-moe" else 0)
        assert cfg.dense_mlp_layers == ((1,) if name == "qwen3-moe" else ())
    else:
        assert cfg.num_experts == 0


def test_prefill_logits_match_hf(family, report) -> None:
    hf, model, name, _ = family
    prompts = prompts_for(1, [5, 23, 41, 1])  # shorter than, and several times, every window
    runner = ModelRunner(model, num_blocks=32, block_size=16)
    free = np.random.default_rng(0).permutation(np.arange(1, 32)).tolist()
    chunks = [SeqChunk(p, 0, [free.pop() for _ in range(-(-len(p) // 16))]) for p in prompts]
    ours = compute_logits(runner, build_batch(chunks, 16, pad_tokens_to=128, pad_seqs_to=4, pad_blocks_to=4))
    worst = max(rel_error(ours[row], hf_logits(hf, p)[-1])[1] for row, p in enumerate(prompts))
    report(f"{name}: prefill max rel err {worst:.2e}")
    assert worst < LOGIT_TOL


# Every block size where the page layout meets the model's own attention (windows that skip pages,
# ALiBi distances); block 16 alone for plain causal families (the MoE ones without a window included:
# experts never see the pages), whose paging is the same code every other family runs at all three
# sizes. Block 8 of the families tests/models/test_tensor_parallel.py decodes at TP 1 (against
# transformers' logits, past the window) is left to that test.
PLAIN_CAUSAL = ("mistral-no-window", "qwen3-bias", "falcon-grouped", "falcon-multi-query", "qwen2-moe", "qwen3-moe")
DECODED_BY_TP_TEST = {("mistral-window", 8), ("gemma3", 8), ("mixtral", 8)}
# Paging at blocks 8 and 32 is covered once per window kind (Mistral's, Gemma 3's, ALiBi's), block 16
# once per window kind too (Gemma 3's and Qwen2's windows at 16; ALiBi at 8 and 32 brackets it).
BLOCK_16_ONLY = {("qwen2-window", 8), ("qwen2-window", 32), ("mixtral", 32), ("mistral-window", 16),
                 ("falcon-rw-alibi", 16)}
# Decode of these plain-causal variants is the code their siblings run (Mistral without a window is
# Llama's; grouped Falcon is multi-query Falcon with more KV heads): their prefill is still checked.
NOT_DECODED = {"mistral-no-window", "falcon-grouped"}
DECODE_CASES = [(name, b) for name in FAMILIES for b in ((16,) if name in PLAIN_CAUSAL else (8, 16, 32))
                if (name, b) not in DECODED_BY_TP_TEST | BLOCK_16_ONLY and name not in NOT_DECODED]


@pytest.mark.parametrize("family,block_size", DECODE_CASES, indirect=["family"],
                         ids=[f"{name}-{b}" for name, b in DECODE_CASES], scope="module")
def test_decode_past_the_window_over_shuffled_pages_matches_hf(family, block_size: int, report) -> None:
    hf, model, name, _ = family
    prompts = prompts_for(block_size, [19, 30])
    steps = 24  # the window (8 to 12 tokens) slides well past the prompt
    runner = ModelRunner(model, num_blocks=2 * (64 // block_size + 1) + 4, block_size=block_size)
    ours_tokens, ours_logits = greedy_tokens_and_logits(runner, prompts, steps, shuffle_seed=block_size)
    worst = 0.0
    for i, p in enumerate(prompts):
        ref_tokens, ref_logits = hf_greedy(hf, p, steps)
        assert ours_tokens[i] == ref_tokens, f"{name} prompt {i}: greedy tokens differ"
        worst = max([worst] + [rel_error(o, r)[1] for o, r in zip(ours_logits[i], ref_logits)])
    report(f"{name} block {block_size}: {steps} steps max rel err {worst:.2e}, greedy tokens identical")
    assert worst < LOGIT_TOL


# The engine adds nothing model-specific beyond the forward pass the tests above check, so of the MoE
# families only the one with both MLP kinds (Qwen3-MoE, dense layers among sparse) runs it here, and
# of the dense ones those whose attention meets chunked prefill over cached pages in its own way
# (windows, ALiBi, Gemma's local and global layers): a plain causal family runs Llama's code there.
# One family per attention path the engine must page correctly: local/global windows with a soft cap
# (Gemma 3), ALiBi (Falcon), and MoE with a dense layer (Qwen3-MoE). Plain windows (Mistral, Qwen2)
# are decoded over shuffled pages at every block size above, and the TP engine test runs Llama.
ENGINE_FAMILIES = ["gemma3", "falcon-rw-alibi", "qwen3-moe"]


@pytest.mark.parametrize("family", ENGINE_FAMILIES, indirect=True)
def test_engine_greedy_with_chunked_prefill_preemption_and_prefix_cache(family) -> None:
    """The whole engine on a pool too small for the batch (preemption), a token budget smaller than
    the prompts (chunked prefill) and prompts sharing a prefix (prefix caching): every output is
    transformers' greedy continuation, and every block comes back. Qwen3-MoE (Qwen3's attention,
    sparse and dense layers) runs with speculative decoding for every other request too (proposals
    right for two tokens, then wrong): a verifying step is a ragged multi-token step, which chunked
    prefill already takes through the other families' attention paths."""
    from tests.paxserve.test_spec_decode import FlatTimes, OracleProposer

    hf, _, name, directory = family
    shared = prompts_for(5, [20])[0]
    prompts = [shared + t for t in prompts_for(6, [3, 17, 9, 25])] + prompts_for(7, [33, 4])
    refs = [hf_greedy(hf, p, 12)[0] for p in prompts]
    speculative = name == "qwen3-moe"
    eng = Engine(str(directory), **{**TEST_ENGINE_ARGS, "block_size": 8, "num_gpu_blocks_override": 10,
                                    "max_model_len": 64, "max_num_batched_tokens": 16, "max_num_seqs": 4},
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3} if speculative else None)
    if speculative:
        speculator = eng.parts.core._speculator
        speculator.proposer = OracleProposer([p + r for i, (p, r) in enumerate(zip(prompts, refs)) if i % 2 == 0],
                                             right=2, vocab_size=eng.model_config.vocab_size)
        speculator.times = FlatTimes()
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o, ref in zip(prompts, outs, refs):
        assert o.outputs[0].token_ids == ref, f"{name}: engine output differs from HF"
    if speculative:
        stats = speculator.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert eng.stats.preemptions > 0, "the pool was meant to force preemption"
    assert eng.kv.prefix_stats.hits > 0, "the shared prefix was meant to hit the prefix cache"
    assert_no_blocks_held(eng)


def test_gemma3_multimodal_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """`Gemma3ForConditionalGeneration` as transformers saves it (text model under
    `language_model.model.`, a vision tower beside it): the text model loads and its logits equal
    the multimodal model's on text-only input."""
    from tests.models.family_checkpoints import make_gemma3_multimodal_checkpoint

    hf = make_gemma3_multimodal_checkpoint(tmp_path, seed=4)
    model = load_model(tmp_path)
    assert model.config.architecture == "Gemma3ForConditionalGeneration" and model.config.layer_windows[0] == 8
    prompts = prompts_for(3, [30, 6])
    runner = ModelRunner(model, num_blocks=16, block_size=16)
    ours = compute_logits(runner, build_batch([SeqChunk(prompts[0], 0, [5, 2]), SeqChunk(prompts[1], 0, [9])], 16,
                                             pad_tokens_to=64, pad_seqs_to=2, pad_blocks_to=2))
    for row, p in enumerate(prompts):
        assert rel_error(ours[row], hf_logits(hf, p)[-1])[1] < LOGIT_TOL
