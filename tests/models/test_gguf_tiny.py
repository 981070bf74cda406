"""Tiny GGUF files written here from random transformers checkpoints, the way llama.cpp's converter
writes them (its tensor names from `gguf`'s own name map, Gemma norms stored +1, no Q/K
permutation outside llama), read by `GGUFCheckpoint` and by transformers' GGUF loader: both must
give back the checkpoint. Plus the clear errors for what paxserve does not support."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from paxserve.models.gguf_io import GGUFCheckpoint
from paxserve.models.tokenizer import tokenizer_from_gguf

TEXTS = ["Hello there, the thin thing", "  two  spaces\tand\ttabs\n\nnewlines", "the 123 4567 1e-9",
         "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "naïve 日本語 🤖 ٣", "", "   ", "I'm you're THEY'LL"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "t h", "th in", "Ġ th", "e r", "Ġ s", "p a", "c e", "Ġ a", "n d"]
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """A small byte-level BPE vocabulary: the 256 byte characters, a few merges, three control tokens."""
    tokens = list(bytes_to_unicode().values())
    tokens += ["".join(m.split(" ")) for m in _MERGES if "".join(m.split(" ")) not in tokens] + _SPECIALS
    types = [1] * (len(tokens) - len(_SPECIALS)) + [3] * len(_SPECIALS)  # 1 normal, 3 control
    return tokens, types, _MERGES


def _random_model(kind: str, **overrides: Any) -> torch.nn.Module:
    """A transformers model with every parameter random (norms and biases too, which HF inits to 1/0)."""
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    tokens, _, _ = _byte_level_vocab()
    base = dict(vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                bos_token_id=256 + len(_MERGES) - 1, eos_token_id=len(tokens) - 1)
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                             "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM)}[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**base, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return model


def _write_gguf(path: Path, arch: str, kv: dict[str, Any], tensors: dict[str, np.ndarray],
                tokenizer: bool = True) -> Path:
    """A GGUF file: `kv` are metadata keys without the `{arch}.` prefix (python ints are uint32)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        full = key if key.startswith(("general.", "tokenizer.")) else f"{arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        elif isinstance(value, str):
            w.add_string(full, value)
        else:
            w.add_array(full, value)
    if tokenizer:
        tokens, types, merges = _byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|im_start|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_pad_token_id(tokens.index("<|endoftext|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    for name, value in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _convert(model: torch.nn.Module, arch: str, path: Path) -> Path:
    """What llama.cpp's `convert_hf_to_gguf.py` writes for a qwen2 / qwen3 / gemma3 checkpoint."""
    c = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    tensors = {}
    for hf_name, value in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # llama.cpp writes the output matrix only when it is not the embedding
        value = value.numpy()
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            value = value + 1  # Gemma3Model.modify_tensors
        tensors[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))] = value
    kv = dict(context_length=c.max_position_embeddings, embedding_length=c.hidden_size,
              block_count=c.num_hidden_layers, feed_forward_length=c.intermediate_size,
              **{"attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
                 "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
                 "rope.freq_base": float(c.rope_parameters.get("rope_theta", 0) if arch != "gemma3"
                                         else c.rope_parameters["full_attention"]["rope_theta"])})
    if getattr(c, "head_dim", None) is not None:
        kv |= {"attention.key_length": c.head_dim, "attention.value_length": c.head_dim}
    if arch == "gemma3":
        kv["attention.sliding_window"] = c.sliding_window
    return _write_gguf(path, arch, kv, tensors)


CASES = {
    "qwen2": dict(tie_word_embeddings=False),  # q/k/v biases, untied head
    "qwen3": dict(tie_word_embeddings=True, head_dim=128),  # q/k norms, head_dim != hidden / heads
    "gemma3": dict(head_dim=32, sliding_window=16, layer_types=None),  # four norms per layer, stored +1
}


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    arch = request.param
    model = _random_model(arch, **CASES[arch])
    directory = tmp_path_factory.mktemp(f"gguf-{arch}")
    path = _convert(model, arch, directory / f"tiny-{arch}.gguf")
    hf = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=path.name, dtype=torch.float32)
    return dict(arch=arch, model=model, path=path, ckpt=GGUFCheckpoint(path), hf=hf)


def test_config_matches_transformers_and_the_checkpoint(converted: dict[str, Any]) -> None:
    ours, hf, original = converted["ckpt"].hf_config(), converted["hf"].config, converted["model"].config
    assert ours["architectures"] == [type(converted["model"]).__name__]
    ignore = {"architectures", "_model_name_or_path", "dtype", "quantization_config"}
    reference = {k: v for k, v in hf.to_diff_dict().items() if k not in ignore}
    assert {k: v for k, v in ours.items() if k not in ignore} == reference
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "tie_word_embeddings", "rope_parameters", "layer_types",
                "sliding_window", "max_position_embeddings"):
        if hasattr(original, key):
            assert ours.get(key, getattr(original, key)) == getattr(original, key), key


def test_tensors_match_transformers_and_the_checkpoint(converted: dict[str, Any]) -> None:
    ckpt, hf_state = converted["ckpt"], converted["hf"].state_dict()
    original = converted["model"].state_dict()
    tied = converted["model"].config.tie_word_embeddings
    assert ckpt.names() == set(original) - ({"lm_head.weight"} if tied else set())
    for name in sorted(ckpt.names()):
        got = ckpt.read(name)
        assert got.dtype == np.float32 and got.shape == ckpt.shape(name) == tuple(original[name].shape), name
        np.testing.assert_array_equal(got, hf_state[name].numpy(), err_msg=name)
        # exact except Gemma's norms, which went through llama.cpp's +1 and back in float32
        np.testing.assert_allclose(got, original[name].numpy(), rtol=0, atol=1e-6, err_msg=name)


def test_tokenizer_matches_transformers(converted: dict[str, Any]) -> None:
    path = converted["path"]
    ours = tokenizer_from_gguf(converted["ckpt"])
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text)) == text
    tokens = _byte_level_vocab()[0]
    for special in _SPECIALS:  # control tokens stay whole, with the file's ids
        assert ours.encode(f"a{special}b", add_special_tokens=False)[1] == tokens.index(special)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (ref.bos_token, ref.eos_token, ref.pad_token)
    assert ours.chat_template == ref.chat_template == CHAT_TEMPLATE


def test_tokenizer_reloads_unchanged(converted: dict[str, Any], tmp_path: Path) -> None:
    """Through `save_pretrained` and AutoTokenizer, as the loader's param cache does. (A Qwen2Tokenizer
    would rebuild itself on reload with an NFC normalizer: "e\u0301" would change ids.)"""
    ours = tokenizer_from_gguf(converted["ckpt"])
    ours.save_pretrained(str(tmp_path))
    again = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    for text in TEXTS + ["e\u0301 cafe\u0301 \u212b"]:
        assert again.encode(text) == ours.encode(text), text
        assert again.decode(ours.encode(text)) == ours.decode(ours.encode(text)), text
    assert (again.bos_token, again.eos_token, again.pad_token) == (ours.bos_token, ours.eos_token, ours.pad_token)


def _minimal(tmp_path: Path, arch: str = "llama", tensors: dict[str, np.ndarray] | None = None,
             **kv: Any) -> GGUFCheckpoint:
    base = {"embedding_length": 8, "block_count": 1, "feed_forward_length": 16, "attention.head_count": 2,
            "attention.layer_norm_rms_epsilon": 1e-5, "vocab_size": 4}
    tensors = tensors or {"token_embd.weight": np.zeros((4, 8))}
    return GGUFCheckpoint(_write_gguf(tmp_path / f"{arch}.gguf", arch, {**base, **kv}, tensors, tokenizer=False))


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    ckpt = _minimal(tmp_path, "phi3")
    supported = "gemma3, llama, qwen2, qwen2moe, qwen3, qwen3moe"
    with pytest.raises(ValueError, match=f"'phi3' is not supported; supported: {supported}"):
        ckpt.hf_config()


@pytest.mark.parametrize("kv, tensors, message", [
    ({}, {"rope_freqs.weight": np.ones(4)}, "rope_freqs.weight"),
    ({"expert_count": 8}, {}, "lacks .llama.expert_used_count."),  # Mixtral, incomplete (test_gguf_moe.py)
    ({"rope.dimension_count": 2, "attention.key_length": 4}, {}, "partial rotary"),
    ({"attention.key_length": 4, "attention.value_length": 8}, {}, "value_length 8"),
    ({"rope.scaling.type": "longrope", "rope.scaling.factor": 2.0}, {}, "rope scaling 'longrope'"),
    ({"rope.scaling.type": "linear"}, {}, "without llama.rope.scaling.factor"),
])
def test_unsupported_features_are_clear_errors(tmp_path: Path, kv: dict, tensors: dict, message: str) -> None:
    ckpt = _minimal(tmp_path, tensors={"token_embd.weight": np.zeros((4, 8)), **tensors}, **kv)
    with pytest.raises(ValueError, match=message):
        ckpt.hf_config()


def test_missing_metadata_names_the_gguf_key(tmp_path: Path) -> None:
    ckpt = GGUFCheckpoint(_write_gguf(tmp_path / "x.gguf", "qwen2", {"embedding_length": 8},
                                      {"token_embd.weight": np.zeros((4, 8))}, tokenizer=False))
    with pytest.raises(ValueError, match="lacks 'qwen2.block_count'"):
        ckpt.hf_config()


def test_rope_scaling_and_file_stated_settings_reach_the_config(tmp_path: Path) -> None:
    """What transformers' GGUF config reading drops (it reads none of these keys) is taken from the file."""
    qwen = _minimal(tmp_path, "qwen2", **{"rope.freq_base": 1e6, "rope.scaling.type": "yarn",
                                          "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 32768,
                                          "context_length": 131072}).hf_config()
    assert qwen["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                       "original_max_position_embeddings": 32768}
    (tmp_path / "g").mkdir()
    gemma = _minimal(tmp_path / "g", "gemma3", **{"rope.freq_base": 1e6, "rope.scaling.type": "linear",
                                                  "rope.scaling.factor": 8.0, "attention.key_length": 4,
                                                  "attention.sliding_window_pattern": 2, "block_count": 4}).hf_config()
    assert gemma["rope_parameters"] == {"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert gemma["layer_types"] == ["sliding_attention", "full_attention"] * 2
    (tmp_path / "q").mkdir()
    qwen3 = _minimal(tmp_path / "q", "qwen3", **{"attention.key_length": 16}).hf_config()
    assert qwen3["head_dim"] == 16  # transformers' GGUF table ignores it, leaving Qwen3Config's 128


def test_unsupported_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("bert")
    w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="tokenizer 'bert'"):
        tokenizer_from_gguf(GGUFCheckpoint(path))


def test_param_cache_entries_appear_whole_when_written_twice_or_over_a_damaged_one(tmp_path: Path) -> None:
    """Replicas starting together convert the same file at once: each writes its cache entry aside
    and renames it into place, so a reader sees a whole entry or none, and the loser drops its copy.
    An entry left without its completion mark (a crashed writer) is converted again and replaced."""
    import jax

    from paxserve.models.loader import _gguf_cache_entry, _load_gguf
    from paxserve.models.param_cache import COMPLETE, save_cached

    path = _convert(_random_model("qwen2", **CASES["qwen2"]), "qwen2", tmp_path / "tiny-qwen2.gguf")
    cache = tmp_path / "cache"
    params, hf_config, tokenizer, from_cache, _ = _load_gguf(path, "float32", cache, True)
    entry = _gguf_cache_entry(path, "float32", cache)
    assert not from_cache and (entry / COMPLETE).exists()

    class WriterMidway:  # the second writer, caught halfway through (params written, tokenizer next)
        def save_pretrained(self, directory: str) -> None:
            assert (entry / COMPLETE).exists(), "a reader now would find no entry, or a torn one"
            assert _load_gguf(path, "float32", cache, True)[3]
            tokenizer.save_pretrained(directory)

    save_cached(entry, params, hf_config, WriterMidway())  # the slower of two writers: its entry is dropped
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name], "a staging directory was left"
    again, _, _, from_cache, _ = _load_gguf(path, "float32", cache, True)
    assert from_cache
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    (entry / COMPLETE).unlink()
    assert not _load_gguf(path, "float32", cache, True)[3]  # damaged: converted again
    assert _load_gguf(path, "float32", cache, True)[3] and (entry / COMPLETE).exists()
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]
    params_file = entry / "params.safetensors"  # a complete entry whose weights file was cut short
    params_file.write_bytes(params_file.read_bytes()[: params_file.stat().st_size // 2])
    reloaded, _, _, from_cache, _ = _load_gguf(path, "float32", cache, True)
    assert not from_cache, "a truncated weights file was read"
    assert _load_gguf(path, "float32", cache, True)[3], "the damaged entry was not replaced"
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(reloaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_loads_of_one_file_at_once_convert_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two loads of the same file at once (replicas, or test workers, starting together): one
    converts, the other waits for its cache entry and reads it."""
    import threading
    import time

    from paxserve.models import loader

    path = _convert(_random_model("qwen2", **CASES["qwen2"]), "qwen2", tmp_path / "tiny-qwen2.gguf")
    convert, calls = loader._convert_gguf, []

    def slow_convert(*args: Any) -> Any:
        calls.append(args)
        time.sleep(1.0)  # long enough for the other load to arrive meanwhile
        return convert(*args)

    monkeypatch.setattr(loader, "_convert_gguf", slow_convert)
    results: list[bool] = []
    loads = [threading.Thread(target=lambda: results.append(loader._load_gguf(path, "float32", tmp_path / "c", True)[3]))
             for _ in range(2)]
    for t in loads:
        t.start()
    for t in loads:
        t.join(timeout=120)
    assert len(calls) == 1 and sorted(results) == [False, True]


def test_param_cache_file_keeps_every_dtype_and_refuses_another_model(tmp_path: Path) -> None:
    """The cache file holds bfloat16 (which safetensors' numpy side lacks) bit for bit, and reading it
    for a model whose params differ in shape fails instead of handing back wrong weights."""
    import jax
    import jax.numpy as jnp

    from paxserve.models.param_cache import _read_params, _write_params

    params = {"embed": jnp.linspace(-3, 3, 12, dtype=jnp.bfloat16).reshape(3, 4),
              "layers": [jnp.full((2,), 0.1, jnp.float16), jnp.arange(5, dtype=jnp.float32)]}
    _write_params(tmp_path / "p.safetensors", params)
    back = _read_params(tmp_path / "p.safetensors", jax.eval_shape(lambda: params))
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(back)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = {**params, "embed": jax.ShapeDtypeStruct((4, 3), jnp.bfloat16)}
    with pytest.raises(ValueError, match=r"\['embed'\] is bfloat16\[3, 4\], the model needs bfloat16\[4, 3\]"):
        _read_params(tmp_path / "p.safetensors", jax.eval_shape(lambda: other))
