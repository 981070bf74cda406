"""GGUF files (llama.cpp's format) read without torch: config, tensors and tokenizer.

Tensors are dequantized with the `gguf` package and renamed to the Hugging Face layout, undoing the
row permutation llama.cpp applies to Q and K, so one converter serves both formats. The tokenizer is
rebuilt with `tokenizers` from the vocabulary and merges stored in the file's metadata.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import quants

# GGUF `general.architecture` -> Hugging Face `architectures` name.
_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of each head's rotary halves (rows 2i, 2i+1 -> i, i + D/2)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """A GGUF file presented like a safetensors checkpoint: HF names, numpy tensors."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # the gguf reader raises assorted errors on damaged files
            raise ValueError(f"{self.path} is not a readable GGUF file: {e}") from None
        self.metadata: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                       "tokenizer.ggml.scores"):
                continue  # large arrays, read on demand by the tokenizer
            try:
                self.metadata[key] = field.contents()
            except Exception:  # noqa: BLE001 - an unreadable metadata entry we do not use
                continue
        self.arch = self.metadata.get("general.architecture")
        self._tensors = {}
        self._unknown: list[str] = []
        for t in self.reader.tensors:
            hf = _hf_name(t.name)
            if hf is None:
                self._unknown.append(t.name)
            else:
                self._tensors[hf] = t

    def field(self, key: str) -> Any:
        return self.reader.fields[key].contents() if key in self.reader.fields else None

    def hf_config(self) -> dict[str, Any]:
        """The metadata as a Hugging Face `config.json` dict."""
        if self.arch not in _ARCHITECTURES:
            raise ValueError(
                f"GGUF architecture {self.arch!r} is not supported; supported: {', '.join(sorted(_ARCHITECTURES))}"
            )
        a, md = self.arch, self.metadata
        need = lambda key: md[f"{a}.{key}"]  # noqa: E731
        try:
            n_heads = int(need("attention.head_count"))
            hidden = int(need("embedding_length"))
            cfg: dict[str, Any] = {
                "architectures": [_ARCHITECTURES[a]],
                "hidden_size": hidden,
                "num_hidden_layers": int(need("block_count")),
                "num_attention_heads": n_heads,
                "num_key_value_heads": int(md.get(f"{a}.attention.head_count_kv", n_heads)),
                "head_dim": int(md.get(f"{a}.attention.key_length", md.get(f"{a}.rope.dimension_count",
                                                                          hidden // n_heads))),
                "intermediate_size": int(need("feed_forward_length")),
                "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
                "rope_theta": float(md.get(f"{a}.rope.freq_base", 10000.0)),
                "max_position_embeddings": int(md.get(f"{a}.context_length", 2048)),
                "vocab_size": int(md.get(f"{a}.vocab_size") or len(self.field("tokenizer.ggml.tokens"))),
                "tie_word_embeddings": "lm_head.weight" not in self._tensors,
                "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors,
                "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
                "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
            }
        except KeyError as e:
            raise ValueError(f"{self.path}: GGUF metadata lacks {e.args[0]!r}") from None
        scaling = md.get(f"{a}.rope.scaling.type")
        if scaling in ("linear", "yarn"):
            cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(md[f"{a}.rope.scaling.factor"])}
            if f"{a}.rope.scaling.original_context_length" in md:
                cfg["rope_scaling"]["original_max_position_embeddings"] = int(
                    md[f"{a}.rope.scaling.original_context_length"]
                )
        elif scaling not in (None, "none"):
            raise ValueError(f"{self.path}: GGUF rope scaling {scaling!r} is not supported")
        if any(t.name == "rope_freqs.weight" for t in self.reader.tensors):
            raise ValueError(
                f"{self.path}: GGUF files with per-frequency rope factors (rope_freqs.weight, Llama 3.1 style) "
                "are not supported yet; load the Hugging Face checkpoint directory instead"
            )
        return cfg

    def names(self) -> set[str]:
        return set(self._tensors) | set(self._unknown)

    def shape(self, name: str) -> tuple[int, ...]:
        t = self._tensors[name]
        return tuple(int(d) for d in reversed(t.shape.tolist()))  # GGML lists dims innermost first

    def read(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        w = quants.dequantize(t.data, t.tensor_type).reshape(self.shape(name))
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, int(self.metadata[f"{self.arch}.attention.head_count"]))
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = self.metadata.get(f"{self.arch}.attention.head_count_kv",
                                      self.metadata[f"{self.arch}.attention.head_count"])
            w = _unpermute(w, int(heads))
        return w
