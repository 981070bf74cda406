"""Building an engine: config -> memory plan -> weights -> KV cache -> scheduler, runner, core and
the two processors, each step logged in plain words.

`build_engine_parts(config)` is the one builder; the offline `Engine` and the serving `AsyncEngine`
are siblings that drive the parts it returns, from the caller's thread or from their own.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import jax

from paxserve.config import EngineConfig
from paxserve.core.kv_cache_manager import KVCacheManager
from paxserve.core.lora_slots import LoraSlots
from paxserve.core.scheduler import Scheduler, SchedulerConfig
from paxserve.distributed.cluster import Cluster, PlanChannel
from paxserve.distributed.rendezvous import settings_digest
from paxserve.engine.client import ServingLimits
from paxserve.engine.chat_template.pool import RenderPool
from paxserve.engine.engine_core import EngineCore
from paxserve.engine.generation_config import GENERATION_CONFIG_MODES, resolve_sampling_defaults
from paxserve.engine.input_processor import InputProcessor
from paxserve.engine.lora_loader import LoraLoader
from paxserve.engine.numerics import NumericsPlan
from paxserve.engine.output_processor import OutputProcessor
from paxserve.engine.stats import StatsLogger
from paxserve.kernels import AttentionBackend, resolve_attention_backend
from paxserve.kernels.kv_cache import KV_CACHE_DTYPES
from paxserve.kernels.matmul_dispatch import resolve_matmul_kernel
from paxserve.models.loader import ModelInfo, inspect_model, load_model
from paxserve.models.param_cache import cache_root
from paxserve.models.quant_weights import GroupQuantizedWeight, QuantizedWeight, with_matmul_kernel
from paxserve.models.registry import get_architecture
from paxserve.models.sharding import TensorParallel, device_share, param_bytes, split_config
from paxserve.models.eagle3 import Eagle3Config, inspect_eagle3, load_eagle3
from paxserve.spec_decode.draft_model import DraftModel
from paxserve.spec_decode.eagle3 import Eagle3Proposer
from paxserve.worker.memory_plan import (
    DeviceMemory,
    KVCachePlan,
    configure_allocator,
    device_memory,
    kv_bytes_per_block,
    plan_kv_cache,
)
from paxserve.worker.model_runner import ModelRunner, zero_kv_cache
from paxserve.worker.sampling.sampler import SamplerState
from paxserve.worker.step_functions import StepShapes, measure_activation_bytes

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    """A built engine's pieces. Rank 0 of several hosts (or a single host) drives `core` through
    the processors; ranks 1..N-1 only run `runner` for rank 0 (`is_worker`)."""

    config: EngineConfig
    cluster: Cluster | None
    channel: PlanChannel | None  # rank 0 -> workers (None on a single host, or once closed)
    attention_backend: AttentionBackend
    activation_bytes: int  # what the plan reserves for the largest step's temporaries
    plan: KVCachePlan
    model: Any  # paxserve.models.loader.LoadedModel
    sampling_defaults: Mapping[str, Any]  # --generation-config, SamplingParams' names
    max_num_batched_tokens: int
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    stats: StatsLogger
    core: EngineCore
    input_processor: InputProcessor
    output_processor: OutputProcessor
    warmup_seconds: float = 0.0  # how long start-up compilation took (0 with warmup=False)
    numerics_check: Any = None  # the start-up check of a quantized setting (a CheckResult), if it ran

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def model_config(self) -> Any:
        return self.model.config

    @property
    def max_model_len(self) -> int:
        return self.plan.max_model_len

    @property
    def is_worker(self) -> bool:
        """A rank 1..N-1 of a multi-host engine: it runs rank 0's steps, not requests."""
        return self.cluster is not None and self.cluster.rank != 0

    @property
    def limits(self) -> ServingLimits:
        return ServingLimits(max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size,
                             max_num_seqs=self.config.max_num_seqs, block_size=self.config.block_size,
                             num_gpu_blocks=self.plan.num_blocks,
                             enable_prefix_caching=self.config.enable_prefix_caching,
                             sampling_defaults=dict(self.sampling_defaults or {}))


def build_engine_parts(config: EngineConfig) -> EngineParts:
    """Everything an engine runs on, ready (warmed up unless `config.warmup` is False)."""
    # Before anything starts JAX's backend: its GPU pool is sized once, at start.
    from jax._src import xla_bridge

    logger.info("GPU memory: %s", configure_allocator(config.gpu_memory_utilization,
                                                      xla_bridge.backends_are_initialized()))
    cluster = _join_cluster(config, xla_bridge.backends_are_initialized())
    # Rank 0's device calls go to the workers before it makes them (`paxserve.distributed.worker_loop`).
    channel = None if cluster is None else cluster.channel()
    if config.trust_remote_code:
        logger.warning("--trust-remote-code / trust_remote_code=True has no effect: paxserve never runs code "
                       "from a checkpoint and loads only the architectures it implements")
    # --generation-config DIR is read and checked now, before the weights load; "auto" reads the
    # model's own file, which load_model returns.
    file_defaults = None if config.generation_config in GENERATION_CONFIG_MODES else \
        resolve_sampling_defaults(config.generation_config, {}, "")
    config = _resolve_hub_ids(config)
    info = inspect_model(config.model, config.dtype, quantization=config.quantization)
    if channel is not None:
        _check_same_model(channel, f"{info.config!r}|{info.dtype}|{info.quantization!r}")
    # Checked before anything loads: a size the model cannot split fails naming the valid ones.
    tp = TensorParallel.create(info.config, config.tensor_parallel_size,
                               expert_parallel=config.enable_expert_parallel) \
        if config.tensor_parallel_size > 1 else None
    # Memory is planned per device, from one device's share of the model (its heads, its slice of
    # every width, its KV heads): the host side then sees one cache of num_blocks blocks.
    local_cfg = info.config if tp is None else tp.local
    kv_dtype = info.dtype if config.kv_cache_dtype == "auto" else KV_CACHE_DTYPES[config.kv_cache_dtype]
    attention_backend = _attention_backend(config, local_cfg, info.dtype, kv_dtype)
    logger.info("attention: %s (%s)", attention_backend.describe(), attention_backend)
    spec = config.speculative_config
    draft_info = _inspect_draft(config, info) if spec is not None and spec.method == "draft_model" else None
    eagle_info = _inspect_eagle3(config, info) if spec is not None and spec.method == "eagle3" else None
    plan, activation_bytes = _plan_memory(config, info, tp, attention_backend, channel, cluster, kv_dtype, draft_info,
                                          eagle_info)
    numerics = NumericsPlan.make(config, info, tp, None if kv_dtype == info.dtype else kv_dtype, _device_memory())
    keep_unquantized = numerics.needs_unquantized
    # The cache is zeroed on a thread while the weights load (the two take about as long on a CPU);
    # on an accelerator, not while the check's unquantized weights need the room.
    early_kv = tp is None and (not keep_unquantized or jax.devices()[0].platform == "cpu")
    kv_zeroing = zero_kv_cache(local_cfg, plan.num_blocks, config.block_size, kv_dtype) if early_kv else None
    model = load_model(config.model, config.dtype, tokenizer=config.tokenizer,
                       tensor_parallel_size=config.tensor_parallel_size,
                       enable_expert_parallel=config.enable_expert_parallel, quantization=config.quantization,
                       keep_unquantized=keep_unquantized)
    _choose_matmul_kernel(config, model)
    kv_scales, numerics_check = numerics.run(model, attention_backend)
    # vLLM's --generation-config: defaults for the sampling fields a request leaves unset.
    sampling_defaults, defaults_line = file_defaults or resolve_sampling_defaults(
        config.generation_config, model.generation_config, model.source)
    if defaults_line is not None:
        logger.info("%s", defaults_line)
    max_num_batched_tokens = config.max_num_batched_tokens or max(2048, config.max_num_seqs)
    kv = KVCacheManager(plan.num_blocks, config.block_size, config.enable_prefix_caching)
    scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, max_num_batched_tokens, plan.max_model_len,
                                          num_lookahead_tokens=0 if draft_info is None and eagle_info is None
                                          else spec.num_speculative_tokens, policy=config.scheduling_policy), kv,
                          LoraSlots(config.max_loras) if config.enable_lora else None)
    is_worker = cluster is not None and cluster.rank != 0
    if spec is not None and spec.method == "ngram":
        logger.info("speculative decoding: n-gram proposals of up to %d tokens (n-grams of %d-%d tokens looked up in "
                    "the prompt and output), verified in the next step (1 + the proposals' logits rows per "
                    "sequence), as many as measured step times say pay", spec.num_speculative_tokens,
                    spec.prompt_lookup_min, spec.prompt_lookup_max)
    if config.enforce_eager:
        logger.info("--enforce-eager: every step program scans the layers' stacked weights (faster compiles; each "
                    "step copies the layers' weights, so small batches decode slower)")
    runner = ModelRunner(model, plan.num_blocks, config.block_size, plan.max_model_len,
                         attention_backend=attention_backend, max_num_seqs=config.max_num_seqs,
                         program_store=_program_store(config, cluster), background_compile=config.compile_in_background,
                         kv_cache=None if kv_zeroing is None else kv_zeroing.result(),
                         kv_cache_dtype=kv_dtype, kv_scales=kv_scales,
                         plan_sink=channel.send if channel is not None and not is_worker else None,
                         num_spec_tokens=0 if spec is None else spec.num_speculative_tokens,
                         aux_layers=() if eagle_info is None else eagle_info[0].aux_layers,
                         lora=_lora_shape(config), split_layers=not config.enforce_eager)
    draft = None if draft_info is None else _load_draft(config, draft_info, plan, runner, max_num_batched_tokens,
                                                        cluster)
    eagle = None if eagle_info is None else _load_eagle3(config, model, plan, runner, cluster)
    stats = StatsLogger(config.log_stats_interval)
    core = EngineCore(runner, kv, scheduler, model.config.vocab_size, stats,
                      async_scheduling=_async_scheduling(config), isolate_failed_steps=cluster is None,
                      speculative=spec, draft=draft, eagle=eagle)
    # Chat templates render in killable processes (started on the first chat request): a template
    # that runs past its limit is stopped whatever it does.
    input_processor = InputProcessor(model.tokenizer, model.config.vocab_size, model.config.eos_token_ids,
                                     plan.max_model_len, config.seed, sampling_defaults=sampling_defaults,
                                     renderer=RenderPool(num_workers=2), lora=_lora_loader(config, model),
                                     priority_scheduling=config.scheduling_policy == "priority")
    parts = EngineParts(config, cluster, channel, attention_backend, activation_bytes, plan, model, sampling_defaults,
                        max_num_batched_tokens, kv, scheduler, runner, stats, core, input_processor,
                        OutputProcessor(model.tokenizer))
    parts.numerics_check = numerics_check
    if config.warmup:
        parts.warmup_seconds = _warmup(runner, config.max_num_seqs, max_num_batched_tokens)
        if draft is not None or eagle is not None:
            start = time.perf_counter()
            count = draft.warmup(runner.warm_decode_widths) if draft is not None else \
                eagle.warmup(runner.warm_decode_widths, len(eagle.cfg.aux_layers) * model.config.hidden_size)
            logger.info("speculative decoding: %d single-sequence %s passes ready in %.1fs (block widths %s; "
                        "other shapes compile when first needed, and are stored)", count,
                        "draft-model" if draft is not None else "EAGLE-3 head", time.perf_counter() - start,
                        runner.warm_decode_widths)
    return parts


def _resolve_hub_ids(config: EngineConfig) -> EngineConfig:
    """The config with a model or tokenizer given as a Hugging Face Hub id replaced by its local
    files (fetched into the hub cache unless there already); a revision for a local path is an error."""
    from paxserve.models.hub import is_hub_id, resolve_hub_id

    changes: dict[str, Any] = {}
    for field, revision_field, tokenizer_only in (("model", "revision", False), ("tokenizer", "tokenizer_revision",
                                                                                    True)):
        name, revision = getattr(config, field), getattr(config, revision_field)
        if is_hub_id(name):
            changes[field] = resolve_hub_id(name, revision, config.download_dir, field, tokenizer_only)
            logger.info("%s %s: %s", field, name, changes[field])
        elif revision is not None:
            raise ValueError(f"EngineConfig.{revision_field}={revision!r} applies to a {field} given as a Hugging "
                             f"Face Hub id (org/name); {field}={name!r} is local")
    spec = config.speculative_config
    if spec is not None and is_hub_id(spec.model):  # a draft model or EAGLE-3 head by id (its main revision)
        changes["speculative_config"] = replace(spec, model=resolve_hub_id(spec.model, None, config.download_dir,
                                                                           "speculative_config.model"))
    return replace(config, **changes) if changes else config


def _lora_shape(config: EngineConfig) -> tuple[int, int] | None:
    """(device slots, max rank) of the LoRA adapters the steps take, or None without LoRA."""
    return (config.max_loras, config.max_lora_rank) if config.enable_lora else None


def _lora_loader(config: EngineConfig, model: Any) -> LoraLoader | None:
    if not config.enable_lora:
        return None
    cfg = model.config
    return LoraLoader(cfg, model.architecture.layout(cfg), config.max_lora_rank, model.dtype,
                      config.max_cpu_loras or config.max_loras, base_models=(config.model,))


def _lora_bytes(config: EngineConfig, info: ModelInfo, tp: TensorParallel | None) -> int:
    """The device bytes of the LoRA slots (all of them on each device: a bound, since under tensor
    parallelism B of the fused QKV and gate|up and A of o and down are split)."""
    from paxserve.models.lora import abstract_weights
    from paxserve.models.sharding import stored_config

    if not config.enable_lora:
        return 0
    cfg = info.config if tp is None else stored_config(info.config, tp.size)
    slots = abstract_weights(cfg, get_architecture(cfg.architecture).layout(cfg), config.max_loras,
                             config.max_lora_rank, info.dtype)
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(slots))
    logger.info("LoRA: %d device slots of rank up to %d (%.1f MiB), %d adapters kept in host memory",
                config.max_loras, config.max_lora_rank, total / 2**20, config.max_cpu_loras or config.max_loras)
    return total


def _attention_backend(config: EngineConfig, cfg: Any, dtype: Any, kv_dtype: Any) -> AttentionBackend:
    """The attention implementation for a model of `cfg` (one device's share) on this device."""
    return resolve_attention_backend(
        config.attention_backend, jax.devices()[0].platform, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, block_size=config.block_size, dtype=dtype, sliding_window=cfg.sliding_window,
        alibi=cfg.alibi, compute_capability=getattr(jax.local_devices()[0], "compute_capability", None),
        kv_dtype=kv_dtype)


def _inspect_draft(config: EngineConfig, info: ModelInfo) -> ModelInfo:
    """The draft model's shapes, checked against the target's before anything loads."""
    spec = config.speculative_config
    try:
        draft = inspect_model(spec.model, config.dtype)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config.model={spec.model!r} cannot be read: {e}") from e
    if draft.config.vocab_size != info.config.vocab_size:
        raise ValueError(f"speculative_config.model={spec.model!r} has a vocabulary of {draft.config.vocab_size} "
                         f"tokens, the target model {info.config.vocab_size}: a draft model must share the target's "
                         "vocabulary (the same tokenizer)")
    if config.tensor_parallel_size > 1:  # split over the target's devices as the target is
        try:
            TensorParallel.create(draft.config, config.tensor_parallel_size)
        except ValueError as e:
            raise ValueError(f"speculative_config.model={spec.model!r} is split over the target's devices: {e}") \
                from None
    return draft


def _inspect_eagle3(config: EngineConfig, info: ModelInfo) -> tuple[Eagle3Config, int]:
    """An EAGLE-3 head's config and weight bytes, checked against the target's before anything loads."""
    spec = config.speculative_config
    try:
        return inspect_eagle3(spec.model, info.config, info.dtype.itemsize)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config.model={spec.model!r} cannot serve as an EAGLE-3 head: {e}") from e


def _load_eagle3(config: EngineConfig, model: Any, plan: KVCachePlan, runner: ModelRunner,
                 cluster: Cluster | None) -> Eagle3Proposer:
    spec = config.speculative_config
    cfg, params = load_eagle3(spec.model, model.config, model.dtype)
    logger.info("speculative decoding: the EAGLE-3 head %s (%d-token draft vocabulary, reading the inputs of target "
                "layers %s) proposes up to %d tokens greedily before each step: the first from its catch-up pass over "
                "the last step's positions, each further one from a pass of its own; its one-layer KV pages share the "
                "target's blocks (%d slots of lookahead per request)", spec.model, cfg.draft_vocab_size,
                list(cfg.aux_layers), spec.num_speculative_tokens, spec.num_speculative_tokens)
    backend = _attention_backend(config, cfg.layer, model.dtype, model.dtype)
    return Eagle3Proposer(cfg, params, model.params.embed, plan.num_blocks, config.block_size, backend,
                          runner.fine_buckets, None if model.tp is None else model.tp.replicated,
                          _program_store(config, cluster), plan_sink=runner.plan_sink)


def _load_draft(config: EngineConfig, info: ModelInfo, plan: KVCachePlan, runner: ModelRunner,
                max_tokens_per_pass: int, cluster: Cluster | None) -> DraftModel:
    spec = config.speculative_config
    if info.config.max_position_embeddings < plan.max_model_len:
        raise ValueError(f"speculative_config.model={spec.model!r} takes {info.config.max_position_embeddings} "
                         f"positions, fewer than max_model_len={plan.max_model_len}: lower --max-model-len")
    model = load_model(spec.model, config.dtype, tensor_parallel_size=config.tensor_parallel_size)
    cfg = model.config if model.tp is None else model.tp.local
    backend = _attention_backend(config, cfg, model.dtype, model.dtype)
    logger.info("speculative decoding: the draft model %s (%s, %d layers, %.2f GiB) proposes up to %d tokens "
                "greedily before each step; its KV pages share the target's blocks (%d slots of lookahead per "
                "request); proposals are verified as many as measured step times say pay",
                spec.model, cfg.architecture, cfg.num_layers, info.weight_bytes / 2**30, spec.num_speculative_tokens,
                spec.num_speculative_tokens)
    return DraftModel(model, plan.num_blocks, config.block_size, backend, max_tokens_per_pass, runner.fine_buckets,
                      _program_store(config, cluster), plan_sink=runner.plan_sink,
                      split_layers=not config.enforce_eager)


def _choose_matmul_kernel(config: EngineConfig, model: Any) -> None:
    """Weights kept quantized run their matmuls on a kernel where one passes its self-check (the
    Mosaic GPU kernel on Hopper, the CPU kernel on a CPU: `resolve_matmul_kernel`); the choice is
    stored on the weights themselves. Before the numerics check, so that the check measures the path
    that serves."""
    is_quantized = lambda w: isinstance(w, (QuantizedWeight, GroupQuantizedWeight))  # noqa: E731
    quantized = [w for w in jax.tree.leaves(model.params, is_leaf=is_quantized) if is_quantized(w)]
    if not quantized:
        return
    device = jax.local_devices()[0]
    kernel = resolve_matmul_kernel(config.attention_backend, device.platform, dtype=model.dtype,
                                   compute_capability=getattr(device, "compute_capability", None))
    if kernel is not None:
        if model.tp is not None and kernel.tiles:  # each device's shard is cut from the plain order
            kernel = replace(kernel, tiles=False)
        model.params = with_matmul_kernel(model.params, kernel)
        where = ("the CPU kernel wherever it takes them (float32 activations, int8 or 4-bit codes; fp8 stays "
                 "XLA's)" if kernel.name == "cpu" else "the Mosaic GPU kernel wherever their shapes allow (inputs "
                 "a multiple of 128, outputs of 64; an fp8 x fp8 product stays XLA's)")
        logger.info("quantized matmuls: %d quantized weight fields run on %s", len(quantized), where)


def _join_cluster(config: EngineConfig, backend_running: bool) -> Cluster | None:
    """Multi-host: every rank joins before JAX starts its backend (the runtime spans the processes)."""
    if config.nnodes <= 1:
        return None
    if backend_running and not Cluster.is_started():
        raise ValueError("a multi-host engine (nnodes > 1) must be built before anything else starts JAX in "
                         "its process: JAX's distributed runtime cannot join once a backend is running")
    return Cluster.join(config.cluster_config(), settings_digest(config.shared_settings()))


def _check_same_model(channel: PlanChannel, description: str) -> None:
    digest = hashlib.sha256(description.encode()).hexdigest()[:16]
    digests = channel.gather("model", digest)
    others = [rank for rank, d in enumerate(digests) if d != digests[0]]
    if others:
        raise ValueError(f"node rank(s) {', '.join(map(str, others))} loaded a model of another shape or dtype "
                         f"than node rank 0: every rank must be given the same checkpoint")


def _device_memory() -> DeviceMemory | None:
    """The accelerator's total memory and JAX's pool on it, or None on CPU (the KV cache then uses
    a host budget)."""
    device = jax.local_devices()[0]  # this host's (another host's devices cannot be queried)
    if device.platform == "cpu":
        return None
    return device_memory(device.memory_stats())


def _plan_memory(config: EngineConfig, info: ModelInfo, tp: TensorParallel | None, backend: AttentionBackend,
                 channel: PlanChannel | None, cluster: Cluster | None, kv_dtype: Any,
                 draft: ModelInfo | None = None, eagle: tuple[Eagle3Config, int] | None = None
                 ) -> tuple[KVCachePlan, int]:
    """The KV cache plan (and the activation bytes it reserved), before the weights load. A draft
    model's or EAGLE-3 head's weights and cache pages count too."""
    arch = get_architecture(info.config.architecture)
    local_cfg = info.config if tp is None else tp.local
    weight_bytes = _device_weight_bytes(info, tp, tp is not None and tp.expert_parallel) + _lora_bytes(config, info, tp)
    memory = _device_memory()
    device_bytes = None if memory is None else memory.total_bytes
    if memory is not None:
        logger.info("GPU memory: %.1f GiB on the device, JAX's pool %.1f GiB; planning with %.1f GiB "
                    "(gpu_memory_utilization %s)", memory.total_bytes / 2**30, memory.pool_bytes / 2**30,
                    memory.usable(config.gpu_memory_utilization) / 2**30, config.gpu_memory_utilization)
    activation_bytes = 0
    if device_bytes is not None and config.num_gpu_blocks_override is None and config.kv_cache_memory_bytes is None:
        model_len = config.max_model_len if isinstance(config.max_model_len, int) else \
            info.config.max_position_embeddings
        shapes = StepShapes(info.config, arch, info.dtype, config.block_size, 2, config.max_num_seqs + 1, backend, tp,
                            info.quantization, None if kv_dtype == info.dtype else kv_dtype,
                            aux_layers=() if eagle is None else eagle[0].aux_layers, lora=_lora_shape(config))
        activation_bytes = measure_activation_bytes(
            shapes, config.max_num_batched_tokens or max(2048, config.max_num_seqs), config.max_num_seqs,
            -(-model_len // config.block_size))
        logger.info("activation peak of the largest step: %.2f GiB%s", activation_bytes / 2**30,
                    "" if tp is None else " per device")
    if tp is not None:
        logger.info("tensor parallel %d: per device %.3f GiB of weights (%.3f GiB in all) and %d of %d KV "
                    "head(s)%s", tp.size, weight_bytes / 2**30, info.weight_bytes / 2**30, local_cfg.num_kv_heads,
                    info.config.num_kv_heads, "" if tp.kv_replicas == 1 else
                    f" (each KV head repeated on {tp.kv_replicas} devices)")
    # Penalty counts, logit bias and prompt / held-back token sets of every running request, on
    # each device (sampling runs alike on all of them).
    sampler_bytes = SamplerState.num_bytes(config.max_num_seqs + 1, info.config.vocab_size)
    logger.info("sampler state: %d rows x %d tokens = %.1f MiB%s", config.max_num_seqs + 1,
                info.config.vocab_size, sampler_bytes / 2**20, "" if tp is None else " per device")
    num_devices = 1 if tp is None else tp.size
    draft_per_block = 0
    if draft is not None:  # split over the devices as the target is (never by experts: see _load_draft)
        weight_bytes += _device_weight_bytes(draft, tp)
        draft_per_block = kv_bytes_per_block(draft.config if tp is None else split_config(draft.config, tp.size)[0],
                                             config.block_size, draft.dtype.itemsize)
    if eagle is not None:  # whole on every device
        weight_bytes += eagle[1]
        draft_per_block = kv_bytes_per_block(eagle[0].layer, config.block_size, info.dtype.itemsize)
    plan = plan_kv_cache(local_cfg, config, kv_dtype.itemsize, weight_bytes, device_bytes, activation_bytes,
                         num_devices=num_devices, sampler_state_bytes=sampler_bytes,
                         pool_bytes=None if memory is None else memory.pool_bytes,
                         draft_bytes_per_block=draft_per_block)
    if kv_dtype.itemsize < info.dtype.itemsize:
        logger.info("KV cache in %s: %d bytes per value instead of %d in %s, so %.1fx the tokens fit in the same "
                    "memory (%d blocks of %d tokens)", kv_dtype.name, kv_dtype.itemsize, info.dtype.itemsize,
                    info.dtype.name, info.dtype.itemsize / kv_dtype.itemsize, plan.num_blocks, config.block_size)
    if cluster is not None and channel is not None:
        # Every rank holds the same block ids: all take the smallest rank's plan.
        blocks = [int(b) for b in channel.gather("kv_blocks", str(plan.num_blocks))]
        if min(blocks) != plan.num_blocks:
            plan = plan_kv_cache(local_cfg, replace(config, num_gpu_blocks_override=min(blocks)),
                                 kv_dtype.itemsize, weight_bytes, device_bytes, activation_bytes,
                                 num_devices=num_devices, sampler_state_bytes=sampler_bytes)
        logger.info("multi-host: node rank %d of %d; KV cache of %d blocks on every rank (the smallest plan, "
                    "node rank %d's; each planned %s)", cluster.rank, cluster.nnodes, plan.num_blocks,
                    blocks.index(min(blocks)), blocks)
    return plan, activation_bytes


def _device_weight_bytes(info: ModelInfo, tp: TensorParallel | None, expert_parallel: bool = False) -> int:
    """One device's share of a model's weights when split over `tp` (all of them without)."""
    if tp is None:
        return info.weight_bytes
    arch = get_architecture(info.config.architecture)
    return param_bytes(device_share(info.config, tp.size,
                                    lambda c: arch.abstract_params(c, info.dtype, info.quantization), expert_parallel))


def _program_store(config: EngineConfig, cluster: Cluster | None) -> Path | None:
    """Where step programs are stored (paxserve/worker/programs.py: loaded without tracing; JAX's
    persistent cache would only hand back executables that cannot be stored)."""
    if config.compilation_cache_dir == "":
        return None
    if cluster is not None:
        # A program over several processes' devices is not one to serialize and reload as it is.
        logger.info("multi-host: step programs are compiled at every start, not stored")
        return None
    return Path(config.compilation_cache_dir or cache_root() / "programs")


def _async_scheduling(config: EngineConfig) -> bool:
    platform = jax.devices()[0].platform
    if config.async_scheduling is None:
        on = platform != "cpu"
        why = (f"the default on {platform}" if on else
               "the default on CPU: its steps run on the host's own cores, so building the next step beside "
               "one only makes them contend (measured 11% slower offline; benchmarks/RESULTS.md)")
    else:
        on, why = config.async_scheduling, "as asked"
    logger.info("%s (%s)", "async scheduling: each step is built while the previous one runs on the device"
                if on else "synchronous scheduling: each step runs to the end before the next", why)
    if on and config.speculative_config is not None:
        logger.info("speculative decoding with async scheduling: a step is waited for before the next is built "
                    "when it verifies proposals or a request in it will likely propose (its last token must be "
                    "known); requests whose proposals keep finding nothing let steps overlap")
    return on


def _warmup(runner: ModelRunner, max_num_seqs: int, max_num_batched_tokens: int) -> float:
    """Make sure the decode step of every batch-size bucket and its sampler are ready now, not
    during the first requests (loaded from what a previous start stored, nothing traced, or
    compiled; with background compiles only the single-sequence one before ready). Other stored
    programs load when first needed; other buckets compile then, or ahead of it in the background."""
    start = time.perf_counter()
    loaded, compiled, unloaded = runner.warmup(max_num_seqs, max_num_batched_tokens)
    seconds = time.perf_counter() - start
    # benchmarks/startup.py parses this line up to "compiled now".
    logger.info("step programs ready in %.1fs: %d loaded from the program store, %d compiled now; "
                "%d more stored programs found, left to load on first use", seconds, loaded, compiled, unloaded)
    return seconds
