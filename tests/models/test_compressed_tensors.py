"""Pre-quantized compressed-tensors checkpoints, written by the compressed-tensors library itself from
a tiny random Llama (the format llm-compressor saves and most published FP8 / W8A8 / W4A16 checkpoints
use), are read as stored: fp8 and int8 per channel or tensor, packed 4- and 8-bit groups with and
without zero points, the checkpoint's own fp8 KV scales; their logits equal the library's own
decompression of the same weights run by transformers (which quantizes fp8 activations per token as
paxserve's fp8 x fp8 path does on Hopper). Unsupported schemes and missing scales are clear errors.
AutoAWQ checkpoints equal their conversion by compressed-tensors' own converter; AutoGPTQ ones (no
maintained CPU reader exists) the float checkpoint of the weights their layout describes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import compressed_tensors.quantization as ct_quantization
import jax
import numpy as np
import pytest
import torch

from paxserve.kernels import REFERENCE
from paxserve.models import load_model
from paxserve.models.loader import inspect_model
from paxserve.models.quant_weights import GroupQuantizedWeight, QuantizedWeight
from paxserve.worker.quantization_check import make_probe
from tests.helpers import make_tiny_llama

IDS = [3, 17, 50, 9, 41, 77, 5, 100, 200, 31]


def _args(**kw: Any) -> Any:
    return ct_quantization.QuantizationArgs(**kw)


# name -> (weights, compressed format, input activations, the leaf paxserve keeps, its bits)
CASES = {
    "w4a16-group": (dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True), "pack-quantized",
                    None, GroupQuantizedWeight, 4),
    "w4a16-group-zero-points": (dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False),
                                "pack-quantized", None, GroupQuantizedWeight, 8),
    "w8a16-channel": (dict(num_bits=8, type="int", strategy="channel", symmetric=True), "pack-quantized", None,
                      GroupQuantizedWeight, 8),
    "int8-channel": (dict(num_bits=8, type="int", strategy="channel", symmetric=True), "int-quantized", None,
                     QuantizedWeight, 8),
    "fp8-tensor": (dict(num_bits=8, type="float", strategy="tensor", symmetric=True), "float-quantized", None,
                   QuantizedWeight, 8),
    "fp8-dynamic": (dict(num_bits=8, type="float", strategy="channel", symmetric=True), "float-quantized",
                    dict(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True), QuantizedWeight, 8),
}


def _write(directory: Path, weights: dict, fmt: str, acts: dict | None) -> tuple[Path, np.ndarray]:
    """A tiny Llama quantized by compressed-tensors (scales from each weight's own range, as a
    min-max observer sets them) and saved compressed, as llm-compressor saves one; and the
    reference logits of IDS: the library's own decompression of those compressed weights, run by
    transformers' model (which also quantizes the activations where the scheme says so). Loading
    the saved directory with transformers would do the same, except that transformers 5 re-inits
    packed zero points of the wrong shape (a size-mismatch warning), so the in-memory model is used."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, compute_dynamic_scales_and_zp

    model = make_tiny_llama(directory, seed=3)
    w = _args(**weights)
    config = ct_quantization.QuantizationConfig(
        config_groups={"group_0": ct_quantization.QuantizationScheme(
            targets=["Linear"], weights=w, input_activations=None if acts is None else _args(**acts))},
        ignore=["lm_head"])
    ct_quantization.apply_quantization_config(model, config)
    for name, module in model.named_modules():
        if hasattr(module, "weight_scale"):
            weight = module.weight.data
            if w.strategy == "group":
                scale, zero = compute_dynamic_scales_and_zp(weight, w, module)
            elif w.strategy == "channel":
                scale, zero = calculate_qparams(weight.amin(1, keepdim=True), weight.amax(1, keepdim=True), w)
            else:
                scale, zero = calculate_qparams(weight.amin(), weight.amax(), w)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(str(directory))
    compressor.update_config(str(directory))
    compressor.decompress_model(model)
    with torch.no_grad():
        return directory, model(torch.tensor([IDS])).logits[0].numpy()


# Four of the six (the suite's time): fp8 per tensor is read by the KV-scale test below, and packed int8
# channels take the same path as packed int4 groups.
@pytest.mark.parametrize("name", ["fp8-dynamic", "int8-channel", "w4a16-group", "w4a16-group-zero-points"])
def test_compressed_tensors_checkpoints_compute_the_librarys_own_logits(name: str, tmp_path: Path, report) -> None:
    weights, fmt, acts, leaf, bits = CASES[name]
    directory, want = _write(tmp_path, weights, fmt, acts)
    model = load_model(directory, dtype="float32")
    qkv = model.params.layers.qkv_w
    assert isinstance(qkv, leaf) and model.quantization.method == "compressed-tensors"
    assert qkv.bits == bits if leaf is GroupQuantizedWeight else qkv.q.dtype.itemsize == 1
    assert inspect_model(directory, dtype="float32").weight_bytes == \
        sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
    if acts is not None:  # what a GPU with fp8 tensor cores runs: fp8 x fp8, per-token activation scales
        params = jax.tree.map(lambda w: w.replace(fp8_activations=True) if isinstance(w, QuantizedWeight) else w,
                              model.params, is_leaf=lambda w: isinstance(w, QuantizedWeight))
    else:
        params = model.params
    probe = dataclasses.replace(make_probe(model, REFERENCE), prompts=(tuple(IDS),))
    got, _ = probe.prefill(params)
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    assert err < 1e-5 and np.array_equal(got.argmax(-1), want.argmax(-1)), err
    report(f"compressed-tensors {name}: logits equal the library's decompressed model's to {err:.1e} (relative)")


def test_the_checkpoints_kv_scales_are_read(tmp_path: Path) -> None:  # and an fp8 per-tensor checkpoint loads
    """As llm-compressor writes an fp8 KV cache scheme: a scalar `self_attn.k_scale` and `v_scale`
    per layer and `kv_cache_scheme` in the config (compressed-tensors 0.20 attaches them only
    through its attention hooks, so they are written here)."""
    import safetensors.torch

    directory, _ = _write(tmp_path, CASES["fp8-tensor"][0], "float-quantized", None)
    tensors = safetensors.torch.load_file(str(directory / "model.safetensors"))
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.04 * (layer + 1))
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.02 * (layer + 1))
    safetensors.torch.save_file(tensors, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                        "dynamic": False, "symmetric": True}
    (directory / "config.json").write_text(json.dumps(config))
    model = load_model(directory, dtype="float32")
    assert isinstance(model.params.layers.qkv_w, QuantizedWeight)
    k, v = model.kv_scales
    np.testing.assert_allclose(k, [0.04, 0.08], rtol=1e-6)
    np.testing.assert_allclose(v, [0.02, 0.04], rtol=1e-6)


def test_unsupported_schemes_and_missing_scales_are_clear_errors(tmp_path: Path) -> None:
    directory, _ = _write(tmp_path / "ok", CASES["w4a16-group"][0], "pack-quantized", None)
    config = json.loads((directory / "config.json").read_text())
    for key, value, match in (
        ("format", "nvfp4-pack-quantized", r"nvfp4-pack-quantized int4 per group of 32 are not supported; supported: fp8"),
        ("quant_method", "bitsandbytes", r"quant_method='bitsandbytes'.*reads 'gguf', 'compressed-tensors', 'awq', "
                                         r"'gptq' checkpoints"),
    ):
        qc = {**config["quantization_config"], key: value}
        qc["config_groups"] = {g: {**c, "format": None} for g, c in qc["config_groups"].items()}
        (directory / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        with pytest.raises(ValueError, match=match):
            load_model(directory, dtype="float32")
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization='int8' cannot apply to .*quantized already"):
        load_model(directory, quantization="int8")

    import safetensors.torch

    tensors = safetensors.torch.load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    safetensors.torch.save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj is stored quantized but has no weight_scale"):
        load_model(directory, dtype="float32")


# ---- AutoAWQ and AutoGPTQ checkpoints ---------------------------------------------------------------

_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM packing: nibble k holds column 8w + ORDER[k]
GROUP = 32


def _pack(codes: np.ndarray, order: list[int] | None = None) -> np.ndarray:
    """[rows, cols] 4-bit codes -> [rows, cols / 8] int32, eight per word along the columns."""
    rows, cols = codes.shape
    c = codes.reshape(rows, cols // 8, 8).astype(np.uint32)
    if order is not None:
        c = c[..., order]
    return (c << (4 * np.arange(8, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32).view(np.int32)


def _quantized_modules(directory: Path) -> tuple[dict[str, np.ndarray], list[str]]:
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(str(directory / "model.safetensors"))
    return tensors, sorted(n.removesuffix(".weight") for n in tensors
                           if n.endswith("_proj.weight") and "layers" in n)


def _random_codes(rng: np.random.Generator, out: int, n_in: int, symmetric: bool) -> tuple[np.ndarray, ...]:
    """(codes [in, out], zeros [groups, out], float16 scales [groups, out]) and the weight they make."""
    q = rng.integers(0, 16, (n_in, out))
    # Zeros from 1: AutoGPTQ's v1 layout stores zero - 1, so a zero of 0 cannot be written (its -1 would
    # spill into the neighbouring nibbles); quantizers writing v1 never produce one.
    zeros = np.full((n_in // GROUP, out), 8) if symmetric else rng.integers(1, 16, (n_in // GROUP, out))
    scales = (rng.uniform(0.005, 0.03, (n_in // GROUP, out))).astype(np.float16)
    rows = np.arange(n_in) // GROUP
    weight = scales.astype(np.float32)[rows] * (q - zeros[rows]).astype(np.float32)  # exact: float16 scales
    return q, zeros, scales, weight


def test_autoawq_checkpoints_equal_their_compressed_tensors_conversion(tmp_path: Path) -> None:
    """An AutoAWQ GEMM checkpoint, and the same checkpoint converted by compressed-tensors' own
    AutoAWQ converter, give the same logits bit for bit (each weight is scale * (q - zero) exactly)."""
    import safetensors.numpy
    import safetensors.torch
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    awq = tmp_path / "awq"
    make_tiny_llama(awq, seed=5)
    tensors, modules = _quantized_modules(awq)
    rng = np.random.default_rng(0)
    for m in modules:
        out, n_in = tensors.pop(m + ".weight").shape
        q, zeros, scales, _ = _random_codes(rng, out, n_in, symmetric=False)
        tensors |= {m + ".qweight": _pack(q, _AWQ_ORDER), m + ".qzeros": _pack(zeros, _AWQ_ORDER), m + ".scales": scales}
    safetensors.numpy.save_file(tensors, str(awq / "model.safetensors"))
    config = json.loads((awq / "config.json").read_text())
    awq_config = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    (awq / "config.json").write_text(json.dumps(config | {"quantization_config": awq_config}))

    ct = tmp_path / "ct"
    ct.mkdir()
    converted = AutoAWQConverter(group_size=GROUP).process(safetensors.torch.load_file(str(awq / "model.safetensors")))
    safetensors.torch.save_file({k: v.contiguous() for k, v in converted.items()}, str(ct / "model.safetensors"))
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP, "symmetric": False}
    ct_config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}, "ignore": ["lm_head"]}
    (ct / "config.json").write_text(json.dumps(config | {"quantization_config": ct_config}))

    logits = {}
    for name, directory in (("awq", awq), ("ct", ct)):
        model = load_model(directory, dtype="float32")
        assert model.quantization.method == ("compressed-tensors" if name == "ct" else "awq")
        assert isinstance(model.params.layers.down_w, GroupQuantizedWeight)
        probe = dataclasses.replace(make_probe(model, REFERENCE), prompts=(tuple(IDS),))
        logits[name], _ = probe.prefill(model.params)
    assert model.params.layers.qkv_w.bits == 8  # compressed-tensors zero points: q - zero in a byte
    awq_model = load_model(awq, dtype="float32")
    assert awq_model.params.layers.qkv_w.bits == 4  # AWQ: nibbles with a float32 offset per group
    np.testing.assert_array_equal(logits["awq"], logits["ct"])


@pytest.mark.parametrize("variant", ["sym", "act-order"])  # zero points as offsets: the AutoAWQ test
def test_autogptq_checkpoints_compute_their_dequantized_weights(variant: str, tmp_path: Path) -> None:
    """AutoGPTQ's layout (codes packed along the inputs, zeros stored minus one), symmetric, with zero
    points, and in activation order (groups not contiguous: dequantized at load): the logits of the
    same weights written as a float checkpoint, bit for bit."""
    import safetensors.numpy

    gptq, plain = tmp_path / "gptq", tmp_path / "plain"
    make_tiny_llama(gptq, seed=6)
    make_tiny_llama(plain, seed=6)
    tensors, modules = _quantized_modules(gptq)
    rng = np.random.default_rng(1)
    for m in modules:
        out, n_in = tensors.pop(m + ".weight").shape
        q, zeros, scales, weight = _random_codes(rng, out, n_in, symmetric=variant == "sym")
        g_idx = np.arange(n_in) // GROUP
        if variant == "act-order":  # rows visited in a permuted order: each row's group by that order
            g_idx = g_idx[rng.permutation(n_in)]
            weight = scales.astype(np.float32)[g_idx] * (q - zeros[g_idx]).astype(np.float32)
        tensors |= {m + ".qweight": _pack(q.T).T.copy(), m + ".qzeros": _pack(zeros - 1), m + ".scales": scales,
                    m + ".g_idx": g_idx.astype(np.int32)}
        plain_tensors = safetensors.numpy.load_file(str(plain / "model.safetensors"))
        plain_tensors[m + ".weight"] = weight.T.copy()
        safetensors.numpy.save_file(plain_tensors, str(plain / "model.safetensors"))
    safetensors.numpy.save_file(tensors, str(gptq / "model.safetensors"))
    config = json.loads((gptq / "config.json").read_text())
    qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": variant == "sym",
          "desc_act": variant == "act-order", "checkpoint_format": "gptq"}
    (gptq / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))

    model, reference = load_model(gptq, dtype="float32"), load_model(plain, dtype="float32")
    qkv = model.params.layers.qkv_w
    if variant == "act-order":
        assert not isinstance(qkv, GroupQuantizedWeight)
    else:
        assert isinstance(qkv, GroupQuantizedWeight) and qkv.bits == 4 and (qkv.offset is None) == (variant == "sym")
    probe = dataclasses.replace(make_probe(model, REFERENCE), prompts=(tuple(IDS),))
    np.testing.assert_array_equal(probe.prefill(model.params)[0], probe.prefill(reference.params)[0])
