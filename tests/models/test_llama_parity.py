"""Functional Llama over the paged KV cache against Hugging Face transformers (torch, CPU, float32)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from paxserve.models import LoadedModel, load_model
from paxserve.worker.step_inputs import SeqChunk, build_batch, next_power_of_2
from tests.paged_greedy import greedy_tokens_and_logits
from paxserve.worker.model_runner import ModelRunner
from tests.helpers import compute_logits, make_tiny_llama, rel_error

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}

CONFIGS: dict[str, dict[str, Any]] = {
    # GQA ratio 1, head_dim 32 (hidden 128 / 4 heads), untied, plain RoPE.
    "mha-d32-untied": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4),
    # GQA ratio 4, head_dim 64, tied embeddings, llama3 RoPE scaling, attention bias.
    "gqa4-d64-tied-llama3-bias": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                      tie_word_embeddings=True, attention_bias=True, rope_parameters=LLAMA3_ROPE),
    # GQA ratio 2, yarn RoPE scaling, MLP bias.
    "gqa2-yarn-mlpbias": dict(num_attention_heads=4, num_key_value_heads=2, mlp_bias=True, rope_parameters=YARN_ROPE,
                              max_position_embeddings=256),
}
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LoadedModel, str]:
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_llama(directory, seed=len(request.param), **CONFIGS[request.param])
    return hf, load_model(directory), request.param


def hf_logits(hf: Any, ids: list[int]) -> np.ndarray:
    """All-position logits of one sequence from the HF model."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def prompts_for(seed: int, lengths: list[int], vocab: int = 256) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def test_prefill_logits_match_hf(tiny, report) -> None:
    hf, model, name = tiny
    prompts = prompts_for(1, [5, 17, 33, 1])
    runner = ModelRunner(model, num_blocks=32, block_size=16)
    rng = np.random.default_rng(0)
    free = rng.permutation(np.arange(1, 32)).tolist()
    chunks = [SeqChunk(p, 0, [free.pop() for _ in range(-(-len(p) // 16))]) for p in prompts]
    ours = compute_logits(runner, build_batch(chunks, 16, pad_tokens_to=64, pad_seqs_to=8, pad_blocks_to=4))
    worst = (0.0, 0.0)
    for row, p in enumerate(prompts):
        abs_err, rel = rel_error(ours[row], hf_logits(hf, p)[-1])
        worst = max(worst, (abs_err, rel), key=lambda x: x[1])
    report(f"{name}: prefill max abs err {worst[0]:.2e}, max rel err {worst[1]:.2e}")
    assert worst[1] < LOGIT_TOL


# Blocks 8 and 32 page every family in test_families.py; here the Llama variants decode at 16.
@pytest.mark.parametrize("block_size", [16])
def test_decode_through_shuffled_pages_matches_hf_cached_decode(tiny, block_size: int, report) -> None:
    hf, model, name = tiny
    prompts = prompts_for(block_size, [11, 26])
    steps = 17  # the prefill step plus 16 decode steps
    runner = ModelRunner(model, num_blocks=64 // block_size * 2 + 8, block_size=block_size)
    ours_tokens, ours_logits = greedy_tokens_and_logits(runner, prompts, steps, shuffle_seed=block_size)
    # No early stop: compare every step even where a random model happens to emit its EOS id.
    hf.generation_config = GenerationConfig(max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
    worst = 0.0
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), output_logits=True, return_dict_in_generate=True)
        ref_tokens = out.sequences[0, len(p):].tolist()
        assert ours_tokens[i] == ref_tokens, f"prompt {i}: greedy tokens differ"
        for ours_step, ref_step in zip(ours_logits[i], out.logits):
            worst = max(worst, rel_error(ours_step, ref_step[0].numpy())[1])
    report(f"{name} block {block_size}: 16 decode steps max rel err {worst:.2e}, greedy tokens identical")
    assert worst < LOGIT_TOL


def _run(runner: ModelRunner, chunks: list[SeqChunk]) -> np.ndarray:
    bs = runner.block_size
    num_tokens = sum(len(c.token_ids) for c in chunks)
    return compute_logits(runner, build_batch(chunks, bs, pad_tokens_to=next_power_of_2(num_tokens, 8),
                                      pad_seqs_to=next_power_of_2(len(chunks)), pad_blocks_to=8))


def test_chunked_prefill_equals_one_pass(tiny, report) -> None:
    hf, model, name = tiny
    (prompt,) = prompts_for(7, [37])
    table = [9, 2, 14, 5, 11]  # scattered pages, block size 8
    whole = _run(ModelRunner(model, 16, 8), [SeqChunk(prompt, 0, table)])[0]
    runner = ModelRunner(model, 16, 8)
    ref = hf_logits(hf, prompt)
    done = 0
    for size in (13, 11, 13):  # chunk boundaries fall inside blocks
        logits = _run(runner, [SeqChunk(prompt[done:done + size], done, table)])[0]
        done += size
        assert rel_error(logits, ref[done - 1])[1] < LOGIT_TOL
    abs_err, rel = rel_error(logits, whole)
    report(f"{name}: 3-chunk prefill vs one pass max abs err {abs_err:.2e}")
    assert rel < 1e-5


def test_mixed_batch_gives_each_sequence_its_own_logits(tiny, report) -> None:
    """Prompt chunks and decode tokens of different sequences in one step don't interact."""
    hf, model, name = tiny
    a, b, c = prompts_for(11, [21, 9, 17])
    tables = {"a": [3, 12, 7], "b": [15, 4], "c": [1, 10, 6]}
    # Step 1 puts A's first 20 tokens and C's first 10 in the cache; step 2 mixes A's decode token,
    # B's whole prompt and C's second chunk.
    first = [SeqChunk(a[:20], 0, tables["a"]), SeqChunk(c[:10], 0, tables["c"])]
    second = {"a": SeqChunk(a[20:], 20, tables["a"]), "b": SeqChunk(b, 0, tables["b"]),
              "c": SeqChunk(c[10:], 10, tables["c"])}
    mixed_runner = ModelRunner(model, 16, 8)
    _run(mixed_runner, first)
    mixed = _run(mixed_runner, list(second.values()))
    worst = 0.0
    for row, (key, prompt) in enumerate(zip("abc", (a, b, c))):
        alone_runner = ModelRunner(model, 16, 8)
        if key != "b":
            _run(alone_runner, [first[0] if key == "a" else first[1]])
        alone = _run(alone_runner, [second[key]])[0]
        assert rel_error(mixed[row], alone)[1] < 1e-5, f"sequence {key} changed by its batch mates"
        worst = max(worst, rel_error(mixed[row], hf_logits(hf, prompt)[-1])[1])
    report(f"{name}: mixed prefill+decode batch max rel err vs HF {worst:.2e}")
    assert worst < LOGIT_TOL


def test_bfloat16_is_as_accurate_as_hf_bfloat16(tmp_path, report) -> None:
    """bfloat16 weights and activations (float32 accumulation): error against the float32 model is
    no worse than Hugging Face's own bfloat16 run."""
    from transformers import LlamaForCausalLM

    hf32 = make_tiny_llama(tmp_path, seed=5, **CONFIGS["gqa4-d64-tied-llama3-bias"])
    hf16 = LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval()
    model = load_model(tmp_path, "bfloat16")
    assert model.dtype.name == "bfloat16"
    prompts = prompts_for(2, [9, 30])
    runner = ModelRunner(model, num_blocks=16, block_size=16)
    ours = compute_logits(runner, build_batch([SeqChunk(prompts[0], 0, [4]), SeqChunk(prompts[1], 0, [7, 2])], 16,
                                      pad_tokens_to=64, pad_seqs_to=2, pad_blocks_to=2))
    ours_err = max(rel_error(ours[i], hf_logits(hf32, p)[-1])[1] for i, p in enumerate(prompts))
    hf_err = max(rel_error(hf_logits(hf16, p)[-1], hf_logits(hf32, p)[-1])[1] for p in prompts)
    report(f"bfloat16 prefill rel err vs float32: ours {ours_err:.2e}, HF bfloat16 {hf_err:.2e}")
    assert ours_err <= 1.5 * hf_err
