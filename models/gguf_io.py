"""GGUF files (llama.cpp's format) presented like a Hugging Face checkpoint, without torch.

`GGUFCheckpoint` gives the config dict transformers builds for the file (`hf_config`) and the
tensors under the names and values transformers' modeling code expects (`read`), dequantized with
the `gguf` package. Architectures: llama (Llama, Mistral, SmolLM...; with `llama.expert_count`,
Mixtral), qwen2, qwen3, qwen2moe, qwen3moe, gemma3. llama.cpp stores each MoE layer's experts as
stacked tensors (`ffn_gate_exps` and `ffn_up_exps` [experts, width, hidden], `ffn_down_exps`); the
gate and up stacks are read as the one `mlp.experts.gate_up_proj` transformers v5 keeps in memory.

Why not call transformers' own GGUF loader (`modeling_gguf_pytorch_utils.load_gguf_checkpoint`)?
It needs torch, which paxserve does not have at run time, and it works out the tensor names from a
torch model instance. So the config keys come from its table (`GGUF_CONFIG_MAPPING`) and go through
its config classes; the tensor names and value transforms are written out below and checked
against it by tests/models/test_gguf_*.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from paxserve.models.gguf_weights import KEPT_TYPES, HostCodes, decode
from paxserve.models.optional_import import import_for

_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")

_ATTENTION = {
    "attn_norm.weight": "input_layernorm.weight",
    **{f"attn_{g}.{kind}": f"self_attn.{h}_proj.{kind}" for g, h in
       (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for kind in ("weight", "bias")},
}
_MLP = {f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
# Two GGUF names mapped to one HF name are its parts, concatenated on axis 1 in this order.
_EXPERTS = {
    "ffn_gate_inp.weight": "mlp.gate.weight",  # the router
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
_SHARED_EXPERT = {
    **{f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")},
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",  # stored as [hidden], read as [1, hidden]
}
# llama.cpp's layout before stacked experts (early 2024): one tensor per expert, `blk.{i}.ffn_gate.{e}.weight`.
_PER_EXPERT = re.compile(r"^blk\.\d+\.ffn_(?:gate|up|down)\.\d+\.weight$")


@dataclass(frozen=True)
class _Arch:
    """How one GGUF `general.architecture` maps onto its transformers model."""

    hf_architecture: str
    model_type: str  # transformers' config `model_type`
    layer_names: dict[str, str]  # GGUF name after `blk.{i}.` -> HF name after `model.layers.{i}.`
    permuted_qk: bool = False  # llama.cpp interleaves Q/K rows (only its llama converter does)
    norm_plus_one: bool = False  # llama.cpp stores Gemma norm weights as w + 1
    has_head_dim: bool = True  # the config class has a `head_dim` field (Qwen2Config has not)
    has_bias_flag: bool = True  # `attention_bias` is a config field (Qwen2 always has q/k/v biases)
    table: str | None = None  # its key in transformers' GGUF_CONFIG_MAPPING, when not the GGUF architecture
    extra_keys: tuple[tuple[str, str], ...] = ()  # GGUF keys (after `{arch}.`) -> config keys, beyond that table
    moe: bool = False  # MoE layers; a Qwen file's layers without a router are dense (`mlp_only_layers`)


# Written out rather than derived from `gguf`'s TensorNameMap (HF -> GGUF for every model family at
# once, so it cannot say which HF name a GGUF tensor has in *this* family); transformers derives it
# from a model instance. Mistral GGUFs are `llama` files: llama.cpp runs them as Llama (no window).
_LLAMA_LIKE = {**_ATTENTION, **_MLP, "ffn_norm.weight": "post_attention_layernorm.weight"}
_ARCHS = {
    "llama": _Arch("LlamaForCausalLM", "llama", _LLAMA_LIKE, permuted_qk=True),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", _LLAMA_LIKE, has_head_dim=False, has_bias_flag=False),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", {**_LLAMA_LIKE, **_QK_NORM}),
    "qwen2moe": _Arch("Qwen2MoeForCausalLM", "qwen2_moe", {**_LLAMA_LIKE, **_EXPERTS, **_SHARED_EXPERT},
                      has_head_dim=False, has_bias_flag=False, table="qwen2_moe", moe=True),
    "qwen3moe": _Arch("Qwen3MoeForCausalLM", "qwen3_moe", {**_LLAMA_LIKE, **_QK_NORM, **_EXPERTS},
                      table="qwen3_moe", moe=True),
    "gemma3": _Arch("Gemma3ForCausalLM", "gemma3_text", {
        **_ATTENTION, **_MLP, **_QK_NORM,
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    }, norm_plus_one=True),
}
# A `llama` file with experts is Mixtral as llama.cpp's converter writes it (transformers builds a dense
# Llama from it, MLPs left random); its config is Llama's table plus the expert counts, as llama.cpp reads them.
_MIXTRAL = _Arch("MixtralForCausalLM", "mixtral", {**_LLAMA_LIKE, **_EXPERTS}, permuted_qk=True, table="llama",
                 extra_keys=(("expert_count", "num_local_experts"), ("expert_used_count", "num_experts_per_tok")),
                 moe=True)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
# llama.cpp's rope scaling keys -> transformers' `rope_parameters` keys (yarn's extras included).
_ROPE_SCALING_KEYS = {
    "factor": ("factor", float),
    "original_context_length": ("original_max_position_embeddings", int),
    "attn_factor": ("attention_factor", float),
    "yarn_beta_fast": ("beta_fast", float),
    "yarn_beta_slow": ("beta_slow", float),
}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of each head's rotary halves (rows 2i, 2i+1 -> i, i + D/2);
    the same reshape as transformers' `LlamaTensorProcessor._reverse_permute_weights`."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _arch_of(gguf_arch: str | None, metadata: dict[str, Any]) -> _Arch | None:
    if gguf_arch == "llama" and metadata.get("llama.expert_count"):
        return _MIXTRAL
    return _ARCHS.get(gguf_arch)


def model_type_of(gguf_arch: str | None) -> str | None:
    """transformers' `model_type` for a GGUF architecture (None for one paxserve does not map)."""
    return _ARCHS[gguf_arch].model_type if gguf_arch in _ARCHS else None


class GGUFCheckpoint:
    """A GGUF file presented like a safetensors checkpoint: HF config, HF names, numpy tensors."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        gguf = import_for("gguf", "reading GGUF files")
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # the gguf reader raises assorted errors on damaged files
            raise ValueError(f"{self.path} is not a readable GGUF file: {e}") from None
        self.metadata: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key in _BIG_ARRAYS:
                continue  # large arrays, read on demand by the tokenizer
            try:
                self.metadata[key] = field.contents()
            except Exception:  # noqa: BLE001 - an unreadable metadata entry we do not use
                continue
        self.arch = self.metadata.get("general.architecture")
        self.spec = _arch_of(self.arch, self.metadata)
        self._gguf_tensors = {t.name: t for t in self.reader.tensors}
        self._tensors: dict[str, list[Any]] = {}  # HF name -> its GGUF tensor, or a fused tensor's parts
        self._unknown: list[str] = []
        for t in self.reader.tensors:
            hf = self._hf_name(t.name, self.spec)
            if hf is None:
                self._unknown.append(t.name)
            else:
                self._tensors.setdefault(hf, []).append(t)
        for hf, found in list(self._tensors.items()):
            if (m := _BLOCK.match(found[0].name)) is None:
                continue
            names = [g for g, h in self.spec.layer_names.items() if h == self.spec.layer_names[m.group(2)]]
            if len(names) > 1:  # a fused tensor: its parts in the spec's order or, lacking one, its
                got = {_BLOCK.match(t.name).group(2): t for t in found}  # parts unmapped (the check names them)
                if set(got) == set(names):
                    self._tensors[hf] = [got[g] for g in names]
                else:
                    del self._tensors[hf]
                    self._unknown += [t.name for t in found]

    @staticmethod
    def _hf_name(name: str, spec: _Arch | None) -> str | None:
        if spec is None:
            return None
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        m = _BLOCK.match(name)
        if m and m.group(2) in spec.layer_names:
            return f"model.layers.{m.group(1)}.{spec.layer_names[m.group(2)]}"
        return None

    def field(self, key: str) -> Any:
        return self.reader.fields[key].contents() if key in self.reader.fields else None

    def _spec(self) -> _Arch:
        if self.spec is None:
            raise ValueError(
                f"{self.path}: GGUF architecture {self.arch!r} is not supported; "
                f"supported: {', '.join(sorted(_ARCHS))}"
            )
        return self.spec

    def hf_config(self) -> dict[str, Any]:
        """The config dict transformers builds for this file, as `save_pretrained` writes it
        (`config.to_diff_dict()`), with `architectures` set."""
        from transformers import AutoConfig
        from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

        spec, a, md = self._spec(), self.arch, self.metadata
        self._check_supported()
        # What `load_gguf_checkpoint` does for these architectures: rename keys by its table, tie the
        # embeddings when there is no output matrix, count the vocabulary when the file does not say.
        # (transformers treats a llama file named exactly "mistral" as MistralForCausalLM; same tensors
        # and maths, so paxserve keeps Llama.)
        raw: dict[str, Any] = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(spec.model_type, {}))
        arch_table = {**GGUF_CONFIG_MAPPING[spec.table or a], **dict(spec.extra_keys)}
        for prefix, table in ((a, arch_table), ("tokenizer", GGUF_CONFIG_MAPPING["tokenizer"])):
            for suffix, hf_key in table.items():
                if hf_key is not None and f"{prefix}.{suffix}" in md:
                    raw[hf_key] = md[f"{prefix}.{suffix}"]
        required = ["num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "rms_norm_eps"]
        if spec.moe:  # llama.cpp needs both; transformers' class defaults (60 experts, top-4...) are not the file's
            required += [arch_table["expert_count"], "num_experts_per_tok"]
        for key in required:
            if key not in raw:
                gguf_key = next(f"{a}.{k}" for k, v in arch_table.items() if v == key)
                raise ValueError(f"{self.path}: GGUF metadata lacks {gguf_key!r}")
        raw["tie_word_embeddings"] = "output.weight" not in self._gguf_tensors
        if "vocab_size" not in raw:
            if "tokenizer.ggml.tokens" not in self.reader.fields:
                raise ValueError(f"{self.path}: GGUF metadata lacks {a}.vocab_size and tokenizer.ggml.tokens")
            raw["vocab_size"] = len(self.reader.fields["tokenizer.ggml.tokens"].data)
        raw |= self._deviations(spec)
        config = AutoConfig.for_model(spec.model_type, **raw)
        return {"architectures": [spec.hf_architecture], **config.to_diff_dict()}

    def _check_supported(self) -> None:
        """Features of the file that change the model's maths and that paxserve cannot express."""
        a, md = self.arch, self.metadata
        if "rope_freqs.weight" in self._gguf_tensors:
            raise ValueError(
                f"{self.path}: GGUF files with per-frequency rope factors (rope_freqs.weight, Llama 3.1 style) "
                "are not supported yet; load the Hugging Face checkpoint directory instead"
            )
        if md.get(f"{a}.expert_count") and not self._spec().moe:
            raise ValueError(f"{self.path}: mixture-of-experts {a} GGUF files ({a}.expert_count="
                             f"{md[f'{a}.expert_count']}) are not supported")
        per_expert = sorted(n for n in self._gguf_tensors if _PER_EXPERT.match(n))
        if per_expert:
            raise ValueError(f"{self.path}: experts stored one tensor each ({per_expert[0]}, llama.cpp's layout "
                             "of early 2024) are not supported; convert the model again with a current llama.cpp")
        k_len, v_len = md.get(f"{a}.attention.key_length"), md.get(f"{a}.attention.value_length")
        if k_len is not None and v_len is not None and k_len != v_len:
            raise ValueError(f"{self.path}: GGUF key_length {k_len} != value_length {v_len} is not supported")
        rot = md.get(f"{a}.rope.dimension_count")
        head_dim = k_len if k_len is not None else rot
        if rot is not None and head_dim is not None and rot != head_dim:
            raise ValueError(f"{self.path}: partial rotary embeddings (rope.dimension_count {rot} of head_dim "
                             f"{head_dim}) are not supported")
        scaling = md.get(f"{a}.rope.scaling.type")
        if scaling not in (None, "none", "linear", "yarn"):
            raise ValueError(f"{self.path}: GGUF rope scaling {scaling!r} is not supported for {a}")

    def _deviations(self, spec: _Arch) -> dict[str, Any]:
        """Where transformers' GGUF config reading drops something the file says (it reads none
        of these keys), set from the file so the model computes what llama.cpp computes. Each is
        absent from ordinary files of the dense models, so there the dict equals transformers';
        Qwen MoE files always state their experts' widths, which transformers' tables do not read."""
        a, md, out = self.arch, self.metadata, {}
        k_len = md.get(f"{a}.attention.key_length")
        if k_len is not None and spec.has_head_dim:
            out["head_dim"] = int(k_len)  # transformers' qwen3 table ignores it (Qwen3Config's 128 stands)
        elif k_len is not None and k_len != md[f"{a}.embedding_length"] // md[f"{a}.attention.head_count"]:
            raise ValueError(f"{self.path}: {a} with head_dim {k_len} != hidden_size / heads is not supported")
        if spec.has_bias_flag and "blk.0.attn_q.bias" in self._gguf_tensors:
            out["attention_bias"] = True  # transformers would build the model without them and drop them
        rope = self._rope_scaling()
        if a == "gemma3":
            local_theta = md.get(f"{a}.rope.freq_base_swa")
            types = self._gemma3_layer_types()
            if types is not None:
                out["layer_types"] = types
            if rope or local_theta is not None:  # otherwise leave the class's defaults, as transformers does
                theta = float(md.get(f"{a}.rope.freq_base", 1_000_000.0))
                out["rope_parameters"] = {
                    "full_attention": {"rope_type": "default", "rope_theta": theta, **rope},
                    "sliding_attention": {"rope_type": "default",
                                          "rope_theta": float(10_000.0 if local_theta is None else local_theta)},
                }
        elif rope:
            out["rope_parameters"] = {"rope_theta": float(md.get(f"{a}.rope.freq_base", 10_000.0)), **rope}
        elif spec is _MIXTRAL and f"{a}.rope.freq_base" not in md:  # llama.cpp's default, not MixtralConfig's 1e6
            out["rope_parameters"] = {"rope_type": "default", "rope_theta": 10_000.0}
        if spec.moe and spec is not _MIXTRAL:
            out |= self._qwen_moe_deviations()
        return out

    def _qwen_moe_deviations(self) -> dict[str, Any]:
        """The experts' widths (transformers' qwen2_moe / qwen3_moe tables read neither key, leaving
        the class defaults, 1408 and 5632 for Qwen2-MoE, 768 for Qwen3-MoE), from the key or, where a
        file lacks it, from the tensors; and the layers without a router as `mlp_only_layers`
        (transformers would make every layer sparse; llama.cpp has no dense layers in these files)."""
        a, md, out = self.arch, self.metadata, {}
        n = int(md[f"{a}.block_count"])
        sparse = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in self._gguf_tensors]
        for key, hf_key, tensor in (
            ("expert_feed_forward_length", "moe_intermediate_size", "ffn_gate_exps.weight"),  # [E, width, H]
            ("expert_shared_feed_forward_length", "shared_expert_intermediate_size", "ffn_gate_shexp.weight"),
        ):
            stored = self._gguf_tensors.get(f"blk.{sparse[0]}.{tensor}") if sparse else None
            if f"{a}.{key}" in md:
                out[hf_key] = int(md[f"{a}.{key}"])
            elif stored is not None:
                out[hf_key] = self._stored_shape(stored)[-2]
        if len(sparse) < n:
            out["mlp_only_layers"] = [i for i in range(n) if i not in sparse]
        return out

    def _rope_scaling(self) -> dict[str, Any]:
        a, md = self.arch, self.metadata
        scaling = md.get(f"{a}.rope.scaling.type")
        if scaling in (None, "none"):
            return {}
        out: dict[str, Any] = {"rope_type": scaling}
        for suffix, (key, cast) in _ROPE_SCALING_KEYS.items():
            if f"{a}.rope.scaling.{suffix}" in md:
                out[key] = cast(md[f"{a}.rope.scaling.{suffix}"])
        if "factor" not in out:
            raise ValueError(f"{self.path}: GGUF rope scaling {scaling!r} without {a}.rope.scaling.factor")
        return out

    def _gemma3_layer_types(self) -> list[str] | None:
        """llama.cpp assumes Gemma 3's 5 local : 1 global pattern, as transformers' default does;
        a file that states a pattern (an interval, or one flag per layer) is followed."""
        pattern = self.metadata.get("gemma3.attention.sliding_window_pattern")
        if pattern is None:
            return None
        n = int(self.metadata["gemma3.block_count"])
        if isinstance(pattern, list):
            if len(pattern) != n:
                raise ValueError(f"{self.path}: sliding_window_pattern has {len(pattern)} entries for {n} layers")
            return ["sliding_attention" if swa else "full_attention" for swa in pattern]
        if int(pattern) < 1:
            raise ValueError(f"{self.path}: gemma3.attention.sliding_window_pattern {pattern} is not supported")
        return ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(n)]

    def names(self) -> set[str]:
        return set(self._tensors) | set(self._unknown)

    @staticmethod
    def _stored_shape(t: Any) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(t.shape.tolist()))  # GGML lists dims innermost first

    def shape(self, name: str) -> tuple[int, ...]:
        shapes = [self._stored_shape(t) for t in self._tensors[name]]
        if len(shapes) > 1:  # gate and up expert stacks, [experts, width, hidden] each
            if len({(s[0], *s[2:]) for s in shapes}) > 1 or len(shapes[0]) < 2:
                raise ValueError(f"{self.path}: {name} has parts of shapes {shapes}, which do not concatenate")
            return (shapes[0][0], sum(s[1] for s in shapes), *shapes[0][2:])
        if name.endswith(".shared_expert_gate.weight") and len(shapes[0]) == 1:
            return (1, *shapes[0])
        return shapes[0]

    def types(self, name: str) -> list[str]:
        """The GGML formats of the tensor's stored parts ("Q4_K", "F32", ...)."""
        return [t.tensor_type.name for t in self._tensors[name]]

    def read_codes(self, name: str) -> HostCodes:
        """The tensor kept quantized (every part in a format `gguf_weights.KEPT_TYPES` names): codes
        and group scales in the orientation and order `read` gives, its weights `read`'s exactly."""
        spec, parts = self._spec(), self._tensors[name]
        decoded = [decode(t.data, t.tensor_type.name, self._stored_shape(t)) for t in parts]
        host = decoded[0] if len(decoded) == 1 else HostCodes.concatenate(decoded, axis=1)
        shape = self.shape(name)
        host = host.map(lambda a: a.reshape(*shape[:-1], a.shape[-1]))
        if spec.permuted_qk and ".self_attn.q_proj." in name:
            host = host.map(lambda a: _unpermute(a, int(self.metadata[f"{self.arch}.attention.head_count"])))
        elif spec.permuted_qk and ".self_attn.k_proj." in name:
            heads = self.metadata.get(f"{self.arch}.attention.head_count_kv",
                                      self.metadata[f"{self.arch}.attention.head_count"])
            host = host.map(lambda a: _unpermute(a, int(heads)))
        return host

    def read(self, name: str) -> np.ndarray:
        """The tensor as transformers' GGUF loader produces it: dequantized to float32, Q/K rows
        un-permuted for llama, Gemma norms with llama.cpp's +1 taken off (`Gemma2TensorProcessor`),
        gate and up experts concatenated (`Qwen2MoeTensorProcessor`)."""
        spec, parts = self._spec(), self._tensors[name]
        shape = self.shape(name)
        quants = import_for("gguf.quants", "reading GGUF files", "gguf")
        try:
            arrays = [quants.dequantize(t.data, t.tensor_type).reshape(self._stored_shape(t)) for t in parts]
        except NotImplementedError:
            raise ValueError(f"{self.path}: tensor {parts[0].name} is stored as {parts[0].tensor_type.name}, which "
                             f"paxserve cannot read; supported: F32, F16, BF16 and gguf's quantized formats "
                             f"(kept quantized: {', '.join(KEPT_TYPES)})") from None
        w = (arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=1)).reshape(shape)
        if spec.permuted_qk and ".self_attn.q_proj." in name:
            w = _unpermute(w, int(self.metadata[f"{self.arch}.attention.head_count"]))
        elif spec.permuted_qk and ".self_attn.k_proj." in name:
            heads = self.metadata.get(f"{self.arch}.attention.head_count_kv",
                                      self.metadata[f"{self.arch}.attention.head_count"])
            w = _unpermute(w, int(heads))
        if spec.norm_plus_one and name.endswith("norm.weight"):
            w = w - 1
        return w

