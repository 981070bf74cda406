"""Tiny mixture-of-experts GGUF files written here from random transformers models the way
llama.cpp's converter writes them (tensor names from `gguf`'s own name map, experts stacked per
layer, Q/K permuted for the llama architecture): qwen2moe (shared expert), qwen3moe (a dense layer
among sparse ones) and Mixtral (a `llama` file with `llama.expert_count`). `GGUFCheckpoint` must
give back the model's config and every tensor, and the loaded model its logits. transformers'
own GGUF loader reads qwen2moe / qwen3moe (its config is compared, and for the all-sparse
qwen2moe its tensors too) but not Mixtral, which is compared with the original model only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from paxserve.models import load_model
from paxserve.models.gguf_io import GGUFCheckpoint
from paxserve.worker.model_runner import ModelRunner
from paxserve.worker.step_inputs import SeqChunk, build_batch
from tests.helpers import compute_logits, rel_error
from tests.models.family_checkpoints import FAMILIES
from tests.models.test_gguf_tiny import _byte_level_vocab, _write_gguf

LOGIT_TOL = 1e-4
GGUF_ARCH = {"mixtral": "llama", "qwen2-moe": "qwen2moe", "qwen3-moe": "qwen3moe"}
# What transformers' qwen2_moe / qwen3_moe GGUF tables do not read, set from the file (gguf_io).
DEVIATIONS = {"qwen2-moe": {"moe_intermediate_size", "shared_expert_intermediate_size"},
              "qwen3-moe": {"moe_intermediate_size", "mlp_only_layers"}}


def _random_moe_model(family: str) -> torch.nn.Module:
    """The tiny model tests/models/family_checkpoints.py defines for `family`, over this file's
    vocabulary; Mixtral without a window, which llama.cpp's llama architecture has no key for."""
    config_cls, model_cls, overrides = FAMILIES[family]
    tokens, _, _ = _byte_level_vocab()
    overrides = {**overrides, "vocab_size": len(tokens), "bos_token_id": 1, "eos_token_id": 2}
    if family == "mixtral":
        overrides["sliding_window"] = None
    config = getattr(transformers, config_cls)(**overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(len(family))
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = "norm" in name and name.endswith("weight")
            p.copy_((1.0 if is_norm else 0.0) + (0.1 if is_norm else 0.15) * torch.randn_like(p))
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's rotary halves interleaved (rows i, i + D/2 -> 2i, 2i+1)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert_moe(model: torch.nn.Module, arch: str, path: Path) -> Path:
    """What llama.cpp's `convert_hf_to_gguf.py` writes: it stacks each layer's per-expert matrices
    into `mlp.experts.{gate,up,down}_proj`, so transformers' in-memory `gate_up_proj` is split back
    into its gate and up halves here. gguf's qwen3moe map has no dense MLP (llama.cpp makes every
    qwen3moe layer sparse), so a dense layer's tensors take qwen3's names, which gguf_io reads."""
    c = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, c.num_hidden_layers)
    state: dict[str, np.ndarray] = {}
    for hf_name, value in model.state_dict().items():
        value = value.numpy()
        if hf_name.endswith("mlp.experts.gate_up_proj"):
            gate, up = np.split(value, 2, axis=1)
            state[hf_name.replace("gate_up_proj", "gate_proj.weight")] = gate
            state[hf_name.replace("gate_up_proj", "up_proj.weight")] = up
        elif hf_name.endswith("mlp.experts.down_proj"):
            state[hf_name + ".weight"] = value
        elif hf_name.endswith("shared_expert_gate.weight"):
            state[hf_name] = value.reshape(-1)  # llama.cpp's ffn_gate_inp_shexp is [hidden]
        elif arch == "llama" and hf_name.endswith("q_proj.weight"):
            state[hf_name] = _permute(value, c.num_attention_heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            state[hf_name] = _permute(value, c.num_key_value_heads)
        else:
            state[hf_name] = value
    tensors = {}
    for hf_name, value in state.items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None and arch == "qwen3moe":
            gguf_name = dense_names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        tensors[gguf_name] = value
    experts = getattr(c, "num_local_experts", None) or c.num_experts
    kv = dict(context_length=c.max_position_embeddings, embedding_length=c.hidden_size,
              block_count=c.num_hidden_layers, feed_forward_length=c.intermediate_size, expert_count=experts,
              expert_used_count=c.num_experts_per_tok,
              **{"attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
                 "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
                 "rope.freq_base": float(c.rope_parameters["rope_theta"])})
    if arch == "llama":
        kv["rope.dimension_count"] = c.hidden_size // c.num_attention_heads
    else:
        kv["expert_feed_forward_length"] = c.moe_intermediate_size
    if arch == "qwen2moe":
        kv["expert_shared_feed_forward_length"] = c.shared_expert_intermediate_size
    if getattr(c, "head_dim", None) is not None:
        kv |= {"attention.key_length": c.head_dim, "attention.value_length": c.head_dim}
    return _write_gguf(path, arch, kv, tensors)


@pytest.fixture(scope="module", params=sorted(GGUF_ARCH))
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    family = request.param
    model = _random_moe_model(family)
    directory = tmp_path_factory.mktemp(f"gguf-{family}")
    path = _convert_moe(model, GGUF_ARCH[family], directory / f"tiny-{family}.gguf")
    return dict(family=family, model=model, path=path, ckpt=GGUFCheckpoint(path))


def test_config_matches_transformers_and_the_model(converted: dict[str, Any]) -> None:
    family, ours, original = converted["family"], converted["ckpt"].hf_config(), converted["model"].config
    assert ours["architectures"] == [type(converted["model"]).__name__]
    if family in DEVIATIONS:  # transformers cannot read a Mixtral GGUF (it builds a dense Llama)
        path = converted["path"]
        reference = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_diff_dict()
        ignore = {"architectures", "_model_name_or_path", "dtype", "quantization_config"} | DEVIATIONS[family]
        assert {k: v for k, v in ours.items() if k not in ignore} == {
            k: v for k, v in reference.items() if k not in ignore}
    built = type(original)(**{k: v for k, v in ours.items() if k != "model_type"})
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "tie_word_embeddings", "rope_parameters", "max_position_embeddings",
                "rms_norm_eps", "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step",
                "qkv_bias", "attention_bias", "sliding_window", "use_sliding_window"):
        if hasattr(original, key):
            want = getattr(original, key)
            if key == "head_dim" and want is None:  # MixtralConfig's None: hidden / heads
                want = original.hidden_size // original.num_attention_heads
            assert getattr(built, key) == pytest.approx(want), key


def test_tensors_match_the_model(converted: dict[str, Any]) -> None:
    ckpt, original = converted["ckpt"], converted["model"].state_dict()
    assert ckpt.names() == set(original)
    for name in sorted(ckpt.names()):
        got = ckpt.read(name)
        assert got.dtype == np.float32 and got.shape == ckpt.shape(name) == tuple(original[name].shape), name
        np.testing.assert_array_equal(got, original[name].numpy(), err_msg=name)


@pytest.mark.parametrize("converted", ["qwen2-moe"], indirect=True)
def test_qwen2moe_tensors_match_transformers(converted: dict[str, Any]) -> None:
    """transformers' own loader on the one file it reads whole (qwen3moe's dense layer it cannot
    place), given the model's config: from the file alone it builds experts of the class's default
    widths and re-initialises every expert tensor (the widths are `DEVIATIONS`)."""
    ckpt, path = converted["ckpt"], converted["path"]
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                              config=converted["model"].config)
    hf_state = hf.state_dict()
    assert ckpt.names() == set(hf_state)
    for name in sorted(ckpt.names()):
        np.testing.assert_array_equal(ckpt.read(name), hf_state[name].numpy(), err_msg=name)


def test_loaded_model_logits_match_the_model(converted: dict[str, Any], tmp_path: Path, report) -> None:
    model = load_model(converted["path"], cache_dir=tmp_path, use_param_cache=False)
    cfg = model.config
    assert cfg.num_experts and cfg.dense_mlp_layers == ((1,) if converted["family"] == "qwen3-moe" else ())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 23)]
    runner = ModelRunner(model, num_blocks=8, block_size=16)
    chunks = [SeqChunk(prompts[0], 0, [3]), SeqChunk(prompts[1], 0, [5, 1])]
    ours = compute_logits(runner, build_batch(chunks, 16, pad_tokens_to=32, pad_seqs_to=2, pad_blocks_to=2))
    worst = 0.0
    for row, p in enumerate(prompts):
        with torch.no_grad():
            ref = converted["model"](torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long))
        worst = max(worst, rel_error(ours[row], ref.logits[0, -1].numpy())[1])
    report(f"{converted['family']} GGUF: prefill max rel err {worst:.2e}")
    assert worst < LOGIT_TOL


def _small(tmp_path: Path, arch: str, tensors: dict[str, np.ndarray], **kv: Any) -> GGUFCheckpoint:
    """A file of a few zero tensors; `kv` overrides the metadata (None: leave the key out)."""
    base = {"embedding_length": 8, "block_count": 1, "feed_forward_length": 16, "attention.head_count": 2,
            "attention.layer_norm_rms_epsilon": 1e-5, "vocab_size": 4, "expert_count": 4, "expert_used_count": 2}
    kv = {k: v for k, v in {**base, **kv}.items() if v is not None}
    tensors = {"token_embd.weight": np.zeros((4, 8)), **tensors}
    return GGUFCheckpoint(_write_gguf(tmp_path / f"{arch}.gguf", arch, kv, tensors, tokenizer=False))


def test_per_expert_mixtral_tensors_are_a_clear_error(tmp_path: Path) -> None:
    """llama.cpp's Mixtral files from before stacked experts (`blk.{i}.ffn_gate.{e}.weight`)."""
    ckpt = _small(tmp_path, "llama", {"blk.0.ffn_gate_inp.weight": np.zeros((4, 8)),
                                      **{f"blk.0.ffn_{p}.{e}.weight": np.zeros((16, 8)) for p in ("gate", "up")
                                         for e in range(4)}})
    with pytest.raises(ValueError, match=r"one tensor each \(blk\.0\.ffn_gate\.0\.weight"):
        ckpt.hf_config()


@pytest.mark.parametrize("arch, kv, message", [
    ("qwen2", {}, "mixture-of-experts qwen2 GGUF files"),
    ("qwen3moe", {"expert_used_count": None}, "lacks 'qwen3moe.expert_used_count'"),
    ("llama", {"expert_used_count": None}, "lacks 'llama.expert_used_count'"),
])
def test_unsupported_or_incomplete_moe_files_are_clear_errors(tmp_path: Path, arch: str, kv: dict,
                                                              message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _small(tmp_path, arch, {}, **kv).hf_config()


def test_widths_from_the_tensors_without_keys_and_an_incomplete_fused_tensor(tmp_path: Path) -> None:
    """Without `expert_feed_forward_length` keys the widths come from the expert tensors; a gate
    stack without its up stack stays under its GGUF name (the loader's tensor check names both)."""
    ckpt = _small(tmp_path, "qwen2moe", {"blk.0.ffn_gate_inp.weight": np.zeros((4, 8)),
                                         "blk.0.ffn_gate_exps.weight": np.zeros((4, 6, 8)),
                                         "blk.0.ffn_gate_shexp.weight": np.zeros((10, 8))})
    config = ckpt.hf_config()
    assert (config["moe_intermediate_size"], config["shared_expert_intermediate_size"]) == (6, 10)
    assert config["mlp_only_layers"] == []  # transformers' to_diff_dict always writes it
    assert "blk.0.ffn_gate_exps.weight" in ckpt.names()
    assert "model.layers.0.mlp.experts.gate_up_proj" not in ckpt.names()


def test_mixtral_without_a_rope_base_takes_llama_cpps(tmp_path: Path) -> None:
    """llama.cpp's llama architecture defaults the base to 10000; MixtralConfig's default is 1e6."""
    config = _small(tmp_path, "llama", {}).hf_config()
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    assert config["rope_parameters"]["rope_theta"] == 10_000.0
