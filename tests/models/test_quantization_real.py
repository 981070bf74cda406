"""Quantization on the real bundled SmolLM2: int8 weights (quantized from the loaded model as the
loader quantizes a float checkpoint) with an fp8 KV cache (scales from the unquantized model's K and
V) agree with the unquantized model on a fixed text, keep its perplexity within a few percent, and a
deliberately wrong scale fails the start-up check at its default thresholds.
(benchmarks/quantization.py serves each setting through the engine on a longer text; RESULTS.md.)"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from paxserve.config import QuantizationCheck
from paxserve.kernels import REFERENCE
from paxserve.kernels.kv_cache import KV_CACHE_DTYPES
from paxserve.models import load_model
from paxserve.worker.quantization_check import check_against, compare_logits, enforce, make_probe
from tests.helpers import quantize_loaded

TEXT = (
    "The printing press changed how knowledge travelled. Before it, books were copied by hand, slowly and "
    "with errors that multiplied from copy to copy. Within fifty years of Gutenberg's first Bible, presses "
    "in more than two hundred European cities had produced millions of volumes. Scholars could compare the "
    "same text in distant libraries, scientists could publish tables and diagrams that stayed exact, and "
    "reformers could reach readers faster than their opponents could answer. Historians still argue about "
    "how much the press caused and how much it merely accelerated, but few doubt that the cost of a book "
    "fell by an order of magnitude, and that literacy followed the falling price."
)
FP8 = KV_CACHE_DTYPES["fp8"]


def _perplexity(logits: np.ndarray, ids: list[int]) -> float:
    shifted = logits[:-1] - logits[:-1].max(axis=-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return math.exp(-float(np.mean(logp[np.arange(len(ids) - 1), ids[1:]])))


def test_int8_weights_and_fp8_cache_keep_the_answers_and_a_wrong_scale_fails_the_check() -> None:
    model = load_model()  # the bundled GGUF, float32
    ids = model.tokenizer.encode(TEXT)
    probe = dataclasses.replace(make_probe(model, REFERENCE), prompts=(tuple(ids),))
    reference, cache = probe.prefill(model.params)
    scales = probe.scales_from(cache, FP8)
    int8 = quantize_loaded(model.params, "int8")
    served, _ = probe.prefill(int8, FP8, scales)
    top1, mean_kl, _ = compare_logits(reference, served)
    assert top1 >= 0.9 and mean_kl <= 0.05, (top1, mean_kl)
    base, got = _perplexity(reference, ids), _perplexity(served, ids)
    assert abs(got / base - 1) < 0.05, (base, got)

    layers = int8.layers  # one field's scales off by 2x: the kind of bug the check is for
    wrong = int8.replace(layers=layers.replace(down_w=layers.down_w.replace(scale=layers.down_w.scale * 2)))
    result = check_against(probe, reference, wrong, FP8, scales)
    with pytest.raises(ValueError, match=r"quantization check failed for int8: top-1 agreement"):
        enforce(result, QuantizationCheck(), "int8")
