"""Start-up numerics of a quantized setting: the fp8 KV cache's scales and the check against the
unquantized model (paxserve/worker/quantization_check.py), decided before the weights load and
remembered on disk.

One prefill of the fixed prompts through the unquantized model gives both the reference logits and,
from the K and V it wrote, the fp8 scales (--calculate-kv-scales); a second through the served
setting gives the logits the check compares. The outcome (figures and scales) is stored under a key
of everything that decides it (the checkpoint's files, dtype, quantization, KV dtype, attention
backend, split, JAX and the source that traces into the programs), so a restart of the same setting
reads it instead of paying the two compiles again (about 8 s of a 12 s start of SmolLM2 on a 2-core
CPU, benchmarks/RESULTS.md). Thresholds are applied to stored figures at every start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from paxserve.config import EngineConfig, QuantizationCheck
from paxserve.models.loader import ModelInfo, resolve_source
from paxserve.models.param_cache import cache_root
from paxserve.models.quant_weights import WeightQuantization
from paxserve.models.registry import get_architecture
from paxserve.models.sharding import TensorParallel, param_bytes
from paxserve.worker.programs import environment_fingerprint, source_fingerprint
from paxserve.worker.quantization_check import CheckResult, check_against, enforce, make_probe

logger = logging.getLogger(__name__)


def _checkpoint_identity(model: str | None) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of the files a checkpoint's numbers depend on."""
    kind, path = resolve_source(model)
    files = [path] if kind == "gguf" else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())
    return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


@dataclass
class NumericsPlan:
    """What start-up does about a quantized setting, decided before the weights load."""

    config: EngineConfig
    fp8_cache: np.dtype | None  # the KV cache's fp8 dtype, or None
    weights: str | None  # the weight quantization's description, or None
    thresholds: QuantizationCheck
    check: bool  # run the comparison (needs the unquantized weights)
    key: str | None  # where the outcome is stored (None: not stored)
    stored: dict[str, Any] | None  # an earlier start's outcome for this exact setting

    @classmethod
    def make(cls, config: EngineConfig, info: ModelInfo, tp: TensorParallel | None, fp8: np.dtype | None,
             memory: Any) -> "NumericsPlan":
        """`fp8`: the KV cache's fp8 dtype (None for a cache in the model's dtype); `memory`: the
        accelerator's, or None on a CPU."""
        # A checkpoint quantized already (GGUF, compressed-tensors, AWQ, GPTQ) is served with its own
        # weights exactly: there is no unquantized model to check it against.
        weights = info.quantization.describe() if isinstance(info.quantization, WeightQuantization) else None
        thresholds = QuantizationCheck.parse(config.quantization_check)
        quantized = fp8 is not None or weights is not None
        check = quantized and thresholds.enabled
        if quantized and not thresholds.enabled:
            logger.warning("quantization check off (--quantization-check off): the quantized setting is served "
                           "without comparing it to the unquantized model")
        if check and weights is not None and memory is not None:
            check = _unquantized_fits(config, info, tp, memory)
        key = stored = None
        # Several hosts run the check's programs together: a record one host has and another has
        # not would leave the second waiting in a collective for the first, so they always check.
        if check and config.nnodes == 1:
            key = cls._key(config, info, tp)
            path = cls._path(key)
            try:
                stored = json.loads(path.read_text()) if path.exists() else None
            except (OSError, ValueError) as e:
                logger.warning("numerics record %s is unreadable (%s); checking again", path, e)
        return cls(config, fp8, weights, thresholds, check, key, stored)

    @property
    def needs_unquantized(self) -> bool:
        """Whether the loader must also keep the full-width weights (for a check not done before)."""
        return self.check and self.stored is None and self.weights is not None

    @property
    def what(self) -> str:
        return ", ".join(filter(None, [self.weights, self.fp8_cache is not None and
                                       f"{self.fp8_cache.name} KV cache" or None]))

    @staticmethod
    def _key(config: EngineConfig, info: ModelInfo, tp: TensorParallel | None) -> str:
        parts = [_checkpoint_identity(config.model), str(info.dtype), repr(info.quantization), config.kv_cache_dtype,
                 config.calculate_kv_scales, config.attention_backend, None if tp is None else tp.size,
                 environment_fingerprint(), source_fingerprint()]
        return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]

    @staticmethod
    def _path(key: str) -> Path:
        return cache_root() / "numerics" / f"{key}.json"

    def run(self, model: Any, backend: Any) -> tuple[tuple[np.ndarray, np.ndarray] | None, CheckResult | None]:
        """(the fp8 cache's scales or None, the check's result or None); raises ValueError when the
        setting fails the check. Drops the model's unquantized weights."""
        if self.fp8_cache is None and self.weights is None:
            return None, None
        calculate = self.fp8_cache is not None and self.config.calculate_kv_scales
        # Without --calculate-kv-scales, a checkpoint's own scales (vLLM's order of preference).
        own = getattr(model, "kv_scales", None) if self.fp8_cache is not None and not calculate else None
        if own is not None:
            logger.info("fp8 KV cache scales from the checkpoint: K %.3g-%.3g, V %.3g-%.3g over the layers",
                        own[0].min(), own[0].max(), own[1].min(), own[1].max())
        if self.stored is not None:
            result = CheckResult(**self.stored["result"])
            scales = tuple(np.asarray(self.stored[n], np.float32) for n in ("k_scale", "v_scale")) \
                if calculate else own
            logger.info("quantization check: this exact setting was checked on %s; its stored figures are used "
                        "(not run again)", self.stored["when"])
            enforce(result, self.thresholds, self.what)
            return scales, result
        if not self.check and not calculate:
            if own is None:
                self._warn_unit_scales()
            return own, None
        probe = make_probe(model, backend)
        reference_params = model.params if model.unquantized_params is None else model.unquantized_params
        start = time.perf_counter()
        with ThreadPoolExecutor(2, thread_name_prefix="paxserve-numerics") as pool:  # both compiles at once
            compiled_reference = pool.submit(probe.compile, reference_params)
            compiled_served = pool.submit(probe.compile, model.params, self.fp8_cache) if self.check else None
            reference_program = compiled_reference.result()
            served_program = None if compiled_served is None else compiled_served.result()
        reference, cache = probe.prefill(reference_params, compiled=reference_program)
        scales = probe.scales_from(cache, self.fp8_cache) if calculate else own
        if calculate:
            logger.info("fp8 KV cache scales from %d tokens of fixed text (--calculate-kv-scales): K %.3g-%.3g, "
                        "V %.3g-%.3g over the layers", probe.positions, scales[0].min(), scales[0].max(),
                        scales[1].min(), scales[1].max())
        elif self.fp8_cache is not None and own is None:
            self._warn_unit_scales()
        if not self.check:
            return scales, None
        result = check_against(probe, reference, model.params, self.fp8_cache, scales, served_program, start)
        model.unquantized_params = None  # its full-width weights go before the KV cache is made
        self._store(result, scales)
        enforce(result, self.thresholds, self.what)
        return scales, result

    def _warn_unit_scales(self) -> None:
        if self.fp8_cache is not None:
            logger.warning("fp8 KV cache with every K and V scale 1.0 (--calculate-kv-scales is off): values past "
                           "%g saturate and small ones lose precision",
                           float(ml_dtypes.finfo(self.fp8_cache).max))

    def _store(self, result: CheckResult, scales: tuple[np.ndarray, np.ndarray] | None) -> None:
        record = {"result": asdict(result), "when": time.strftime("%Y-%m-%d %H:%M:%S"), "setting": self.what}
        if scales is not None:
            record |= {"k_scale": scales[0].tolist(), "v_scale": scales[1].tolist()}
        path = self._path(self.key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = path.with_suffix(f".{time.time_ns()}.tmp")
            staging.write_text(json.dumps(record))
            staging.replace(path)
        except OSError as e:  # remembering is an optimisation; the check itself ran
            logger.warning("could not store the numerics record at %s: %s", path, e)


def _unquantized_fits(config: EngineConfig, info: ModelInfo, tp: TensorParallel | None, memory: Any) -> bool:
    """Whether the unquantized weights fit beside the quantized ones on an accelerator (they are
    dropped before the KV cache is made, so the plan need not count them)."""
    arch = get_architecture(info.config.architecture)
    devices = 1 if tp is None else tp.size
    need = (info.weight_bytes + param_bytes(arch.abstract_params(info.config, info.dtype))) / devices
    usable = memory.usable(config.gpu_memory_utilization)
    if need > usable:
        logger.warning("quantization check skipped: the unquantized weights beside the quantized ones need %.1f GiB "
                       "per device, more than the %.1f GiB usable; the %s model is served unchecked", need / 2**30,
                       usable / 2**30, info.quantization.method)
        return False
    return True
