"""Quantization on the real bundled SmolLM2 (its GGUF written out as a float32 checkpoint): int8
weights with an fp8 KV cache pass the start-up check, keep the perplexity of a fixed text within a
few percent, and a deliberately wrong scale fails the check at its default thresholds.
(benchmarks/quantization.py measures each setting on a longer text; RESULTS.md has the figures.)"""

from __future__ import annotations

import math

import numpy as np
import pytest

from paxserve import Engine, SamplingParams
from paxserve.config import QuantizationCheck
from paxserve.kernels import REFERENCE
from paxserve.models.bundled import default_model_path
from paxserve.models.gguf_export import export_gguf_as_hf
from paxserve.worker.quantization_check import enforce, make_probe, run_check

TEXT = (
    "The printing press changed how knowledge travelled. Before it, books were copied by hand, slowly and "
    "with errors that multiplied from copy to copy. Within fifty years of Gutenberg's first Bible, presses "
    "in more than two hundred European cities had produced millions of volumes. Scholars could compare the "
    "same text in distant libraries, scientists could publish tables and diagrams that stayed exact, and "
    "reformers could reach readers faster than their opponents could answer. Historians still argue about "
    "how much the press caused and how much it merely accelerated, but few doubt that the cost of a book "
    "fell by an order of magnitude, and that literacy followed the falling price. The same pattern appears "
    "with later technologies: the telegraph, the radio and the internet each lowered the cost of sending a "
    "message, and each was followed by an argument about whether cheaper messages made people wiser."
)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, Engine]:
    directory = export_gguf_as_hf(default_model_path(), tmp_path_factory.mktemp("smollm2-f32"), "float32")
    common = dict(kv_cache_memory_bytes=2**28, max_model_len=1024, warmup=False, compilation_cache_dir="", log_stats_interval=0)
    full = Engine(str(directory), **common)
    quantized = Engine(str(directory), quantization="int8", kv_cache_dtype="fp8", calculate_kv_scales=True, **common)
    return full, quantized


def _perplexity(engine: Engine, ids: list[int]) -> float:
    out = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return math.exp(float(np.mean([-entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], ids[1:])])))


def test_int8_weights_and_fp8_cache_pass_the_check_and_keep_the_perplexity(engines) -> None:
    full, quantized = engines
    check = quantized.parts.numerics_check
    assert check is not None and check.top1 >= 0.9 and check.mean_kl <= 0.05, check
    assert full.parts.numerics_check is None  # nothing quantized, nothing checked
    ids = full.parts.tokenizer.encode(TEXT)
    assert len(ids) > 150
    base, got = _perplexity(full, ids), _perplexity(quantized, ids)
    assert abs(got / base - 1) < 0.05, (base, got)


def test_a_wrong_scale_fails_the_default_check_on_the_real_model(engines) -> None:
    full, quantized = engines
    model = quantized.parts.model
    layers = model.params.layers
    wrong = model.params.replace(layers=layers.replace(down_w=layers.down_w.replace(scale=layers.down_w.scale * 2)))
    result = run_check(make_probe(model, REFERENCE), wrong, full.parts.model.params)
    with pytest.raises(ValueError, match=r"quantization check failed for int8: top-1 agreement"):
        enforce(result, QuantizationCheck(), "int8")
