"""The bundled SmolLM2-135M-Instruct GGUF against Hugging Face transformers loading the same file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from paxserve.models import LoadedModel, load_model
from paxserve.models.bundled import default_model_path
from paxserve.worker.model_runner import ModelRunner
from paxserve.worker.step_inputs import SeqChunk, build_batch
from tests.helpers import compute_logits, rel_error

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three primes."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about cats."}],
]
PLAIN_PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    "]
TEXTS = [
    "Hello world",
    " leading space and  double  spaces\tand tabs\n\nnew lines",
    "Unicode: naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 🤖🎉👍🏽",
    "Numbers 1234567890 3.14159 -42 1e-9, code: `x = {'a': [1, 2]}` && echo $HOME",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n<|endoftext|>",
    "",
    "      ",
    "a" * 300,
]


@pytest.fixture(scope="module")
def loads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Load the default model twice: converting the GGUF, then from the on-disk param cache."""
    cache = tmp_path_factory.mktemp("paxserve-cache")
    first = load_model(None, cache_dir=cache)
    second = load_model(None, cache_dir=cache)
    return {"first": first, "cached": second}


@pytest.fixture(scope="module")
def ours(loads: dict[str, Any]) -> LoadedModel:
    return loads["cached"]


@pytest.fixture(scope="module")
def hf(hf_smollm2: tuple[Any, Any]) -> tuple[Any, Any]:
    return hf_smollm2


def test_default_model_resolves_to_bundled_smollm2(loads: dict[str, Any], report) -> None:
    first, cached = loads["first"], loads["cached"]
    assert Path(first.source) == default_model_path()
    assert first.config.architecture == "LlamaForCausalLM"
    assert (first.config.num_layers, first.config.hidden_size, first.config.num_kv_heads) == (30, 576, 3)
    assert not first.from_cache and cached.from_cache
    for a, b in zip(jax.tree_util.tree_leaves(first.params), jax.tree_util.tree_leaves(cached.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    report(f"default model load: first {first.load_seconds:.1f}s, from param cache {cached.load_seconds:.1f}s")


def test_tokenizer_encodes_and_decodes_like_hf(ours: LoadedModel, hf: tuple[Any, Any]) -> None:
    _, hf_tok = hf
    tok = ours.tokenizer
    rng = np.random.default_rng(0)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text), text
        assert tok.decode(ids) == hf_tok.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)
    random_ids = rng.integers(0, ours.config.vocab_size, 200).tolist()  # arbitrary ids, partial UTF-8 included
    assert tok.decode(random_ids) == hf_tok.decode(random_ids)
    assert (tok.bos_token, tok.eos_token) == (hf_tok.bos_token, hf_tok.eos_token)
    assert tok.decode(tok.encode(TEXTS[2])) == TEXTS[2]


def test_chat_template_renders_like_hf(ours: LoadedModel, hf: tuple[Any, Any]) -> None:
    _, hf_tok = hf
    for chat in CHATS:
        for gen_prompt in (True, False):
            ours_text = ours.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen_prompt)
            assert ours_text == hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen_prompt)
            assert ours_text.endswith("<|im_start|>assistant\n") == gen_prompt


def _prompt_ids(tokenizer: Any) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CHATS]
    return [tokenizer.encode(t) for t in texts + PLAIN_PROMPTS]


def test_prefill_logits_match_hf(ours: LoadedModel, hf: tuple[Any, Any], report) -> None:
    hf_model, _ = hf
    prompts = _prompt_ids(ours.tokenizer)
    runner = ModelRunner(ours, num_blocks=64, block_size=16)
    tables, next_block = [], 63
    for p in prompts:  # pages handed out from the top down: non-contiguous in logical order
        n = -(-len(p) // 16)
        tables.append(list(range(next_block, next_block - n, -1)))
        next_block -= n
    ours_logits = compute_logits(runner, build_batch([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)], 16,
                                             pad_tokens_to=256, pad_seqs_to=8, pad_blocks_to=8))
    worst = (0.0, 0.0)
    for row, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf_model(torch.tensor([p])).logits[0, -1].numpy()
        worst = max(worst, rel_error(ours_logits[row], ref), key=lambda x: x[1])
    report(f"SmolLM2 prefill: max abs err {worst[0]:.2e}, max rel err {worst[1]:.2e}")
    assert worst[1] < 1e-4


@pytest.fixture(scope="module")
def hf_greedy(ours: LoadedModel, hf: tuple[Any, Any]) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, HF's greedy 32-token continuations stopping at EOS), computed once."""
    hf_model, _ = hf
    prompts = _prompt_ids(ours.tokenizer)
    eos = ours.config.eos_token_ids
    hf_model.generation_config = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=list(eos),
                                                  pad_token_id=eos[0])
    with torch.no_grad():
        refs = [hf_model.generate(torch.tensor([p]))[0, len(p):].tolist() for p in prompts]
    return prompts, refs


def test_engine_generate_matches_hf(hf_greedy, tmp_path) -> None:
    """The whole engine (scheduler, block pool, on-device sampler, detokenizer) on the bundled model:
    transformers' greedy tokens for every prompt (the model alone through shuffled pages is checked
    on tiny checkpoints of every family; this is the real model end to end)."""
    from paxserve import Engine, SamplingParams

    prompts, refs = hf_greedy
    engine = Engine(max_model_len=512, max_num_seqs=8, warmup=False, log_stats_interval=0,
                    compilation_cache_dir="", kv_cache_memory_bytes=64 * 2**20)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    for out, ref in zip(outs, refs):
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == engine.tokenizer.decode(ref, skip_special_tokens=True)
        assert out.outputs[0].finish_reason == ("stop" if ref[-1] in engine.model_config.eos_token_ids else "length")
    chat = engine.chat(CHATS[0], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == refs[0]
    assert "Paris" in outs[0].outputs[0].text


def test_speculative_decoding_gives_transformers_tokens(hf, hf_greedy) -> None:
    """n-gram speculation on the bundled model: the same greedy tokens as transformers, on a usual
    prompt and on a grounded one (repeat a passage) whose proposals are mostly accepted."""
    from paxserve import Engine, SamplingParams

    hf_model, _ = hf
    prompts, refs = hf_greedy
    from tests.paxserve.test_spec_decode import FlatTimes

    # --enforce-eager: its many verify buckets compile ~3.5x faster with the layers scanned (the same
    # outputs as split layers, tests/models/test_layer_split.py); the test above runs the default.
    engine = Engine(max_model_len=512, max_num_seqs=8, warmup=False, log_stats_interval=0, compilation_cache_dir="",
                    kv_cache_memory_bytes=64 * 2**20, compile_in_background=False, enforce_eager=True,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    # Every proposal verified, whatever this machine's step times (the plan weighs them on a real
    # server; under a loaded test run it may rightly verify none).
    engine.parts.core._speculator.times = FlatTimes()
    passage = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly "
               "quick daft zebras jump. The five boxing wizards jump quickly.")
    grounded = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this text exactly: {passage}"}], add_generation_prompt=True,
        tokenize=False), add_special_tokens=False)
    eos = engine.model_config.eos_token_ids
    with torch.no_grad():
        grounded_ref = hf_model.generate(torch.tensor([grounded]), attention_mask=torch.ones(1, len(grounded),
                                         dtype=torch.long), max_new_tokens=32, do_sample=False,
                                         eos_token_id=list(eos), pad_token_id=eos[0])[0, len(grounded):].tolist()
    # One of the usual prompts beside it (batched, with little to find) is enough: every prompt's
    # plain decoding is test_engine_generate_matches_hf's.
    outs = engine.generate(prompts[:1] + [grounded], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs[:1] + [grounded_ref]
    stats = engine.parts.core.spec_stats
    assert stats.num_accepted_tokens >= 10, stats
