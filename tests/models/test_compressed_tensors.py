"""Pre-quantized compressed-tensors checkpoints, written by the compressed-tensors library itself from
a tiny random Llama (the format llm-compressor saves and most published FP8 / W8A8 / W4A16 checkpoints
use), are read as stored: fp8 and int8 per channel or tensor, packed 4- and 8-bit groups with and
without zero points, the checkpoint's own fp8 KV scales; their logits equal the library's own
decompression of the same weights run by transformers (which quantizes fp8 activations per token as
paxserve's fp8 x fp8 path does on Hopper). Unsupported schemes and missing scales are clear errors."""

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


@pytest.mark.parametrize("name", sorted(CASES))
def test_compressed_tensors_checkpoints_compute_transformers_logits(name: str, tmp_path: Path, report) -> None:
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


def test_the_checkpoints_kv_scales_are_read(tmp_path: Path) -> None:
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
    k, v = load_model(directory, dtype="float32").kv_scales
    np.testing.assert_allclose(k, [0.04, 0.08], rtol=1e-6)
    np.testing.assert_allclose(v, [0.02, 0.04], rtol=1e-6)


def test_unsupported_schemes_and_missing_scales_are_clear_errors(tmp_path: Path) -> None:
    directory, _ = _write(tmp_path / "ok", CASES["w4a16-group"][0], "pack-quantized", None)
    config = json.loads((directory / "config.json").read_text())
    for key, value, match in (
        ("format", "nvfp4-pack-quantized", r"nvfp4-pack-quantized int4 per group of 32 are not supported; supported: fp8"),
        ("quant_method", "awq", r"quant_method='awq'.*reads 'gguf', 'compressed-tensors' checkpoints"),
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
