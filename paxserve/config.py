"""Engine settings with vLLM's names and defaults; every invalid value fails at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from paxserve.spec_decode.config import SpeculativeConfig


BLOCK_SIZES = (8, 16, 32)
DTYPES = ("auto", "float32", "bfloat16", "float16")
# "auto": the Pallas kernel on a GPU, the XLA reference on CPU (see pallas_kernels/dispatch.py).
ATTENTION_BACKENDS = ("auto", "mosaic", "triton", "pallas", "reference")
# `--quantization`: linear weights quantized at load (paxserve.models.quant_weights holds the formats),
# or a quantized checkpoint's own ("gguf", "compressed-tensors", "awq", "gptq": always read as stored; naming
# it is optional).
QUANTIZATION_METHODS = ("fp8", "int8", "gguf", "compressed-tensors", "awq", "gptq")
# `--kv-cache-dtype` (vLLM's names): "auto" = the model's dtype; "fp8" = fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# With no GPU, the KV cache lives in host memory; like vLLM's CPU backend, take a fixed budget.
DEFAULT_CPU_KV_CACHE_BYTES = 4 * 2**30


def _bad(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"EngineConfig.{name}={value!r} is invalid: {allowed}")


def no_code_revision_message(what: str, value: str) -> str:
    """Why a code revision cannot be honoured (the CLI and EngineConfig say the same)."""
    return (f"{what} {value!r}: paxserve never runs code shipped with a checkpoint, so there is no code revision "
            "to fetch (--revision picks the weights' revision)")



@dataclass(frozen=True, slots=True)
class QuantizationCheck:
    """The start-up numerics check of a quantized setting (paxserve/worker/quantization_check.py):
    it passes when top-1 agreement with the unquantized model is >= `min_top1` and the mean KL
    divergence is <= `max_kl` nats."""

    min_top1: float = 0.90
    max_kl: float = 0.10
    enabled: bool = True

    @classmethod
    def parse(cls, text: str) -> "QuantizationCheck":
        """"on" (the defaults), "off", or "top1=0.95,kl=0.05" (either or both)."""
        value = str(text).strip().lower()
        if value in ("on", ""):
            return cls()
        if value == "off":
            return cls(enabled=False)
        usage = f"quantization_check={text!r} is invalid: use 'on', 'off' or 'top1=F,kl=F' (top1 in [0, 1], kl >= 0)"
        found: dict[str, float] = {}
        for part in value.split(","):
            key, sep, number = part.partition("=")
            if not sep or key.strip() not in ("top1", "kl"):
                raise ValueError(usage)
            try:
                found[key.strip()] = float(number)
            except ValueError:
                raise ValueError(usage) from None
        default = cls()
        top1, kl = found.get("top1", default.min_top1), found.get("kl", default.max_kl)
        if not 0.0 <= top1 <= 1.0 or not kl >= 0.0 or math.isinf(kl):
            raise ValueError(usage)
        return cls(min_top1=top1, max_kl=kl)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """vLLM's multi-node flags: --nnodes, --node-rank, --master-addr, --master-port, plus the
    start-up and liveness timeouts."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    init_timeout_s: float = 300.0  # how long start-up waits for every rank to join
    heartbeat_timeout_s: float = 10.0  # how long a rank may go unheard before the others give up on it

    def __post_init__(self) -> None:
        if not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise ValueError(f"nnodes must be an integer >= 1, got {self.nnodes!r}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes - 1}] for nnodes={self.nnodes}, got "
                             f"{self.node_rank!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError("master_addr must be rank 0's host name or address")
        if not isinstance(self.master_port, int) or not 1 <= self.master_port <= 65534:
            raise ValueError(f"master_port must be in [1, 65534] (rank 0 also listens on the next port), got "
                             f"{self.master_port!r}")
        if not self.init_timeout_s > 0:
            raise ValueError(f"distributed init timeout must be > 0 seconds, got {self.init_timeout_s}")
        if not self.heartbeat_timeout_s >= 1:
            raise ValueError(f"distributed heartbeat timeout must be >= 1 second, got {self.heartbeat_timeout_s}")

    @property
    def is_multi_host(self) -> bool:
        return self.nnodes > 1


# vLLM's largest --max-lora-rank.
MAX_LORA_RANK = 512


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None
    max_model_len: int | Literal["auto"] | None = None  # None: from the model config; "auto": largest that fits
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # tokens per step; None: max(2048, max_num_seqs)
    enable_prefix_caching: bool = True
    seed: int = 0
    dtype: str = "auto"
    # vLLM's --quantization: None, "fp8" or "int8" (linear weights quantized at load, per output channel),
    # or a quantized checkpoint's own ("gguf", "compressed-tensors", "awq", "gptq"), kept as stored either way.
    quantization: str | None = None
    # The start-up check of a quantized setting against the unquantized model: "on", "off", "top1=F,kl=F".
    quantization_check: str = "on"
    # vLLM's --kv-cache-dtype and --calculate-kv-scales: an fp8 cache holds one byte per value, with
    # one scale per layer for K and for V, computed at start from fixed prompts or else 1.0.
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE: whole experts per device instead of each split by width
    # Where compiled step programs are stored for later starts: None = <cache dir>/programs, "" = nowhere.
    compilation_cache_dir: str | None = None
    warmup: bool = True  # compile the decode buckets at start-up instead of on first use
    # vLLM's name for trading step speed for start-up: here the layers' weights stay stacked and every
    # program scans them (each pass copies its layers' weights; programs compile ~3.5x faster on a
    # 30-layer model) instead of small passes running them unrolled (models/layer_split.py).
    enforce_eager: bool = False
    # Compile a step's missing bucket off the step thread while a compiled one that covers it serves
    # (and the buckets growing batches reach next, before they do); False: compile in the step.
    compile_in_background: bool = True
    # vLLM's --async-scheduling: schedule and build step N+1 while step N runs on the device (its
    # sampled tokens stay there as N+1's inputs); outputs, stop checks and detokenization follow one
    # step behind, never emitting a token past a stop. None = on where the device is an accelerator,
    # off on CPU, whose "device" is the host's own cores (overlap only makes them contend).
    async_scheduling: bool | None = None
    # vLLM's --speculative-config: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min",
    # "prompt_lookup_max"}, {"model": PATH, ...} (a draft model) or {"method": "eagle3", "model": DIR, ...}
    # (a dict, its JSON text, or a SpeculativeConfig; parsed into the latter).
    speculative_config: Any = None
    # vLLM's LoRA flags: serve PEFT adapters of the model (requests name one: `LoRARequest`); the
    # device holds `max_loras` of them at once, each of rank up to `max_lora_rank`, and host memory
    # `max_cpu_loras` read ones (None: max_loras).
    # vLLM's --scheduling-policy: "fcfs" (arrival order) or "priority" (each request's `priority`,
    # lower first; a better one preempts worse running requests to start).
    scheduling_policy: str = "fcfs"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    log_stats_interval: float = 5.0  # seconds between stats log lines; 0 disables them
    attention_backend: str = "auto"  # "auto" | "mosaic" | "triton" ("pallas") | "reference"; resolved at start
    # Request defaults: "auto" = the checkpoint's generation_config.json (temperature, top_p, top_k,
    # min_p, repetition_penalty, max_new_tokens), "vllm" = paxserve's own, or a directory holding one.
    generation_config: str = "auto"
    tokenizer: str | None = None  # a local tokenizer directory or .gguf instead of the model's own
    trust_remote_code: bool = False  # accepted for vLLM compatibility; paxserve never runs remote code
    # A model or tokenizer given as a Hugging Face Hub id (`org/name`, `org/name:FILE.gguf`) is fetched
    # into the hub cache (or `download_dir`) at this revision (a branch, tag or commit; None: main).
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    code_revision: str | None = None  # refused: paxserve never runs a checkpoint's code
    # Multi-host (vLLM's --nnodes, --node-rank, --master-addr, --master-port): every rank builds the
    # engine with the same settings; rank 0 schedules, the others run its steps (paxserve/distributed/cluster.py).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    distributed_init_timeout: float = 300.0  # seconds start-up waits for every rank
    distributed_heartbeat_timeout: float = 10.0  # seconds a rank may go unheard before the engine stops

    def cluster_config(self) -> ClusterConfig:
        return ClusterConfig(self.nnodes, self.node_rank, self.master_addr, self.master_port,
                             self.distributed_init_timeout, self.distributed_heartbeat_timeout)

    def shared_settings(self) -> dict[str, object]:
        """The settings every rank of a multi-host engine must agree on (the model's own shape is
        compared once it is read)."""
        names = ("max_model_len", "gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks_override",
                 "block_size", "max_num_seqs", "max_num_batched_tokens", "dtype", "quantization", "kv_cache_dtype",
                 "calculate_kv_scales", "speculative_config", "tensor_parallel_size",
                 "enable_expert_parallel", "attention_backend", "nnodes", "enable_lora", "max_loras", "max_lora_rank")
        return {name: getattr(self, name) for name in names}

    def __post_init__(self) -> None:
        if self.max_model_len not in (None, "auto") and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise _bad("max_model_len", self.max_model_len, "must be a positive integer, 'auto' or None")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise _bad("gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise _bad("kv_cache_memory_bytes", self.kv_cache_memory_bytes, "must be a positive number of bytes")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise _bad("num_gpu_blocks_override", self.num_gpu_blocks_override,
                       "must be >= 2 (block 0 is reserved for padding)")
        if self.block_size not in BLOCK_SIZES:
            raise _bad("block_size", self.block_size, f"must be one of {', '.join(map(str, BLOCK_SIZES))}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise _bad("max_num_seqs", self.max_num_seqs, "must be an integer >= 1")
        if self.max_num_batched_tokens is not None and (
            not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1
        ):
            raise _bad("max_num_batched_tokens", self.max_num_batched_tokens, "must be an integer >= 1")
        if self.dtype not in DTYPES:
            raise _bad("dtype", self.dtype, f"must be one of {', '.join(DTYPES)}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise _bad("quantization", self.quantization,
                       f"must be None or one of {', '.join(QUANTIZATION_METHODS)} (fp8 and int8 quantize a float "
                       "checkpoint at load; the others name a quantized checkpoint's own)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise _bad("kv_cache_dtype", self.kv_cache_dtype, f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise _bad("calculate_kv_scales", self.calculate_kv_scales,
                       "computes the scales of an fp8 KV cache, so it needs kv_cache_dtype fp8, fp8_e4m3 or fp8_e5m2")
        try:
            QuantizationCheck.parse(self.quantization_check)
        except ValueError as e:
            raise ValueError(f"EngineConfig.{e}") from None
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise _bad("tensor_parallel_size", self.tensor_parallel_size,
                       "must be an integer >= 1 (the model's heads and widths must divide by it; checked at start)")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise _bad("enable_expert_parallel", self.enable_expert_parallel,
                       "places experts over the tensor-parallel devices, so it needs tensor_parallel_size > 1")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise _bad("seed", self.seed, "must be an integer >= 0")
        try:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        except ValueError as e:
            raise ValueError(f"EngineConfig.{e}") from None
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise _bad("scheduling_policy", self.scheduling_policy, "must be 'fcfs' or 'priority'")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _bad(name, value, "must be an integer >= 1")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise _bad("max_lora_rank", self.max_lora_rank, f"must be <= {MAX_LORA_RANK}")
        if self.max_cpu_loras is not None and (isinstance(self.max_cpu_loras, bool) or not isinstance(
                self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras):
            raise _bad("max_cpu_loras", self.max_cpu_loras, f"must be None or an integer >= max_loras ({self.max_loras})")
        if self.log_stats_interval < 0:
            raise _bad("log_stats_interval", self.log_stats_interval, "must be >= 0 seconds")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise _bad("attention_backend", self.attention_backend, f"must be one of {', '.join(ATTENTION_BACKENDS)}")
        if not isinstance(self.generation_config, str) or not self.generation_config.strip():
            raise _bad("generation_config", self.generation_config,
                       "must be 'auto', 'vllm' or a directory holding generation_config.json")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise _bad("tokenizer", self.tokenizer, "must be a local tokenizer directory or .gguf file, a hub id, or "
                       "None")
        for name in ("revision", "tokenizer_revision", "download_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _bad(name, value, "must be a non-empty string or None")
        if self.code_revision is not None:
            raise ValueError(no_code_revision_message("EngineConfig.code_revision", self.code_revision))
        try:
            cluster = self.cluster_config()
        except ValueError as e:
            raise ValueError(f"EngineConfig: {e}") from None
        if cluster.is_multi_host and self.tensor_parallel_size % self.nnodes:
            raise _bad("tensor_parallel_size", self.tensor_parallel_size,
                       f"spans all {self.nnodes} hosts (nnodes), so it must be a multiple of nnodes: each host "
                       "holds tensor_parallel_size / nnodes devices of the mesh")
