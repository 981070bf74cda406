"""GGUF weights kept quantized (`--quantization gguf`; the default on accelerators): each format read as codes and group scales gives `gguf`'s own
dequantized weights bit for bit; a tiny llama file mixing formats by layer (as Q4_K_M files do)
keeps them packed, computes the dequantized file's logits exactly, splits over two devices with
the same tokens, and falls back to full width for a float tensor; the real SmolLM2 (Q4_1) and Gemma
3 270M (Q4_K_M, in test_gguf_real.py) files give the dequantized files' logits and tokens, batched and
alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from paxserve.models import load_model
from paxserve.models.gguf_io import GGUFCheckpoint
from paxserve.models.gguf_weights import KINDS, GroupFormat, HostCodes, decode
from paxserve.models.loader import _as_laid_out, inspect_model
from paxserve.kernels import MatmulKernel
from paxserve.models.quant_weights import GroupQuantizedWeight, dequantize_kept, matmul_kernel, with_matmul_kernel
from paxserve.worker.model_runner import ModelRunner
from tests.models.test_gguf_tiny import _byte_level_vocab
from tests.paged_greedy import greedy_tokens_and_logits

_OFFSET_TYPES = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")


def _blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """Random valid blocks of a format (finite float16 headers of about `scale`), [rows, bytes per row]."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    n = rows * cols // block
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    f16 = lambda: (rng.standard_normal(n) * scale).astype(np.float16).view(np.uint8).reshape(n, 2)  # noqa: E731
    if type_name == "Q6_K":
        b[:, 208:210] = f16()
    else:
        b[:, 0:2] = f16()
        if type_name in _OFFSET_TYPES:
            b[:, 2:4] = f16()
    return b.reshape(rows, -1)


@pytest.mark.parametrize("type_name", sorted(KINDS))
def test_each_format_gives_ggufs_own_weights(type_name: str) -> None:
    rng = np.random.default_rng(len(type_name))
    raw = _blocks(type_name, 6, 512, rng)
    want = gguf.quants.dequantize(raw, GGMLQuantizationType[type_name])
    host = decode(raw, type_name, (6, 512))
    np.testing.assert_array_equal(host.dequantize().view(np.uint32), want.view(np.uint32))
    fmt = GroupFormat.for_types([type_name])
    assert fmt.bits == (4 if KINDS[type_name].high - min(KINDS[type_name].low, 0) <= 15 else 8)
    weight = fmt.encode(host.map(lambda a: a.T))  # as a linear weight [in, out]
    np.testing.assert_array_equal(np.asarray(weight.dequantize()), want.T)  # equal in value (a zero may lose its sign)
    table = weight.as_table()  # as an embedding [vocab, hidden]
    np.testing.assert_array_equal(np.asarray(table.dequantize()), want)
    np.testing.assert_array_equal(np.asarray(table.rows(jnp.array([4, 1])).dequantize()), want[[4, 1]])


@pytest.mark.parametrize("types,bits,group,scale_dtype,offset", [
    (("Q4_K", "Q6_K"), 8, 16, "float32", True),  # Q4_K_M's ffn_down
    (("Q5_0", "Q8_0"), 8, 32, "float16", False),  # Q4_K_M's attn_v
    (("Q4_0", "Q4_1"), 4, 32, "float16", True),  # signed Q4_0 nibbles stored shifted, with an offset
    (("Q4_K",), 4, 32, "float32", True),
])
def test_mixed_formats_share_one_storage(types: tuple[str, ...], bits: int, group: int, scale_dtype: str,
                                         offset: bool) -> None:
    rng = np.random.default_rng(0)
    fmt = GroupFormat.for_types(types)
    assert (fmt.bits, fmt.group, fmt.scale_dtype, fmt.offset) == (bits, group, scale_dtype, offset)
    raws = [_blocks(t, 4, 256, rng) for t in types]
    parts = [decode(raw, t, (4, 256)).regrouped(group) for raw, t in zip(raws, types)]
    stacked = HostCodes.concatenate(parts, axis=0)
    want = np.concatenate([gguf.quants.dequantize(raw, GGMLQuantizationType[t]) for raw, t in zip(raws, types)])
    weight = fmt.encode(stacked.map(lambda a: a.T))
    np.testing.assert_array_equal(np.asarray(weight.dequantize()), want.T)
    assert fmt.bits_per_weight() == bits + (2 if offset else 1) * (16 if scale_dtype == "float16" else 32) / group


def test_formats_it_does_not_keep_load_at_full_width() -> None:
    assert GroupFormat.for_types(["Q4_K", "F16"]) is None and GroupFormat.for_types(["Q3_K"]) is None


# A tiny llama file whose linear weights mix formats by layer, as llama.cpp's K-quant mixes do.
# K formats need inputs in whole super-blocks of 256, hence the widths.
HIDDEN, INTER, HEADS, KV_HEADS = 256, 512, 4, 2
TOKENS, TOKEN_TYPES, MERGES = _byte_level_vocab()
VOCAB = len(TOKENS)
LAYER_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q4_0",
     "ffn_up": "Q4_1", "ffn_down": "F16"},
    {"attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q8_0", "attn_output": "Q4_K", "ffn_gate": "Q4_1",
     "ffn_up": "Q4_0", "ffn_down": "Q4_K"},
]


def _write_mixed_llama(path: Path) -> Path:
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"context_length": 256, "embedding_length": HIDDEN, "block_count": len(LAYER_TYPES),
                       "feed_forward_length": INTER, "attention.head_count": HEADS,
                       "attention.head_count_kv": KV_HEADS, "vocab_size": VOCAB}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TOKENS)
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(VOCAB - 2)
    w.add_eos_token_id(VOCAB - 1)
    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}

    def add(name: str, type_name: str, shape: tuple[int, int], scale: float) -> None:
        if type_name in ("F16", "F32"):
            w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(type_name.lower().replace("f", "float")))
        else:  # the stored bytes; the writer works out the logical shape
            w.add_tensor(name, _blocks(type_name, *shape, rng, scale), raw_dtype=GGMLQuantizationType[type_name])

    add("token_embd.weight", "Q8_0", (VOCAB, HIDDEN), 0.01)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for i, types in enumerate(LAYER_TYPES):
        for part, shape in shapes.items():
            # Scales sized so the weights stay near 0.05 whatever the format's code range.
            scale = {"Q8_0": 4e-4, "Q6_K": 4e-5, "Q4_K": 1.5e-4, "Q5_K": 8e-5}.get(types[part], 6e-3)
            add(f"blk.{i}.{part}.weight", types[part], shape, scale)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_mixed_llama(tmp_path_factory.mktemp("gguf-kept") / "mixed.gguf")


def _dequantized_load(path: Path, model: Any) -> Any:
    """The same file read the other way: every tensor dequantized by `gguf` as it loads."""
    ckpt = _as_laid_out(GGUFCheckpoint(path), model.architecture)
    params, _ = model.architecture.params_from_hf(ckpt.read, model.config, model.dtype)
    return params


def test_a_mixed_file_is_kept_packed_and_computes_the_dequantized_files_logits(mixed: Path, tmp_path: Path) -> None:
    # On a CPU the file stays quantized by default too, set to run on the CPU kernel.
    default = load_model(mixed, cache_dir=tmp_path)
    assert default.quantization.method == "gguf" and matmul_kernel(default.params) == MatmulKernel(name="cpu", tiles=True)
    model = load_model(mixed, cache_dir=tmp_path, quantization="gguf")
    p = model.params
    assert isinstance(p.embed, GroupQuantizedWeight) and p.embed.table and p.embed.shape == (VOCAB, HIDDEN)
    qkv, gate_up, o = p.layers.qkv_w, p.layers.up_w, p.layers.o_w
    assert not isinstance(p.layers.down_w, GroupQuantizedWeight)  # layer 0's ffn_down is F16
    assert (qkv.bits, qkv.group, qkv.scale.dtype) == (8, 16, np.float32)  # Q4_K, Q5_0, Q5_1, Q6_K, Q8_0
    assert (gate_up.bits, gate_up.group, gate_up.scale.dtype) == (4, 32, np.float16)  # Q4_0 and Q4_1
    assert (o.bits, o.group, o.offset is not None) == (8, 32, True)  # Q4_K and Q5_K
    assert qkv.tiled and gate_up.tiled and o.tiled  # in the CPU kernel's tile order (dequantized below as stored)
    assert model.quantization.method == "gguf"
    # The memory plan's figure (abstract shapes, no weights read) is what the loader placed.
    info = inspect_model(mixed, cache_dir=tmp_path, quantization="gguf")
    assert info.weight_bytes == sum(x.nbytes for x in jax.tree_util.tree_leaves(p))

    reference = _dequantized_load(mixed, model)
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(reference),
                                 jax.tree_util.tree_leaves(dequantize_kept(p, model.dtype))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))

    prompts = [[3, 17, 250, 9, 41, 77, 5], [8, 8, 260, 12]]
    # XLA's path (each weight dequantized before its dot) computes the dequantized file's logits bit
    # for bit; the CPU kernel the same tokens, its logits summed in another order.
    xla = dataclasses.replace(model, params=with_matmul_kernel(model.params, None))
    kept = greedy_tokens_and_logits(ModelRunner(xla, num_blocks=16, block_size=8, max_model_len=64), prompts, 4)
    plain = dataclasses.replace(model, params=reference, quantization=None)
    full = greedy_tokens_and_logits(ModelRunner(plain, num_blocks=16, block_size=8, max_model_len=64), prompts, 4)
    assert kept[0] == full[0]
    for a, b in zip(kept[1], full[1]):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    on_kernel = greedy_tokens_and_logits(ModelRunner(model, num_blocks=16, block_size=8, max_model_len=64), prompts, 4)
    assert on_kernel[0] == full[0]
    assert max(float(np.max(np.abs(x - y))) for a, b in zip(on_kernel[1], full[1]) for x, y in zip(a, b)) < 1e-4

    split = load_model(mixed, cache_dir=tmp_path, tensor_parallel_size=2, quantization="gguf")
    assert not split.params.layers.o_w.tiled  # each device's shard is cut from the plain order
    codes = split.params.layers.o_w.codes  # row-parallel: values and group scales split together
    assert codes.addressable_shards[0].data.shape[-2] == HIDDEN // 2
    assert split.params.layers.o_w.scale.addressable_shards[0].data.shape[-2] == HIDDEN // 32 // 2
    tokens, logits = greedy_tokens_and_logits(ModelRunner(split, num_blocks=16, block_size=8, max_model_len=64),
                                              prompts, 4)
    assert tokens == kept[0]
    assert max(float(np.max(np.abs(x - y))) for a, b in zip(logits, kept[1]) for x, y in zip(a, b)) < 1e-4


@pytest.mark.slow
def test_the_bundled_file_kept_quantized_computes_the_dequantized_files_logits(report) -> None:
    """SmolLM2's Q4_1 linears and Q8_0 embedding. (Gemma 3 270M's Q4_K_M file is served kept
    quantized against transformers' dequantization in tests/models/test_gguf_real.py.)"""
    from paxserve.kernels import REFERENCE
    from paxserve.worker.quantization_check import CHECK_TEXTS, make_probe

    model = load_model(quantization="gguf")
    assert model.quantization.method == "gguf"
    kept_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
    dequantized = dequantize_kept(model.params, model.dtype)
    full_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(dequantized))
    assert kept_bytes < 0.3 * full_bytes
    probe = make_probe(model, REFERENCE)
    prompts = [tuple(model.tokenizer.encode(text)) for text in CHECK_TEXTS]
    assert matmul_kernel(model.params) == MatmulKernel(name="cpu", tiles=True)
    worst = 0.0
    for batch in (prompts, prompts[:1]):  # batched, and alone
        probe = dataclasses.replace(probe, prompts=tuple(batch))
        kept, _ = probe.prefill(with_matmul_kernel(model.params, None))  # XLA's path: bit for bit
        full, _ = probe.prefill(dequantized)
        np.testing.assert_array_equal(kept, full)
        on_kernel, _ = probe.prefill(model.params)  # the CPU kernel: sums in another order
        np.testing.assert_array_equal(on_kernel.argmax(-1), full.argmax(-1))
        worst = max(worst, float(np.max(np.abs(on_kernel - full))))
    assert worst < 1e-3
    report(f"SmolLM2 GGUF kept quantized: {kept_bytes / 2**20:.0f} MiB of weights instead of {full_bytes / 2**20:.0f} "
           f"MiB dequantized, logits equal to the dequantized file's on {len(prompts)} prompts batched and alone "
           f"(XLA's path); on the CPU kernel the same top tokens, logits within {worst:.1e}")
