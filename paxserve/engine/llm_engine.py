"""The offline Engine: a thin facade over input processor -> engine core -> output processor.

It builds the pieces (memory plan, weights, KV cache, compiled buckets) and drives them from the
caller's thread: `generate`/`chat` for batches, `add_request`/`step`/`abort` for a custom loop.
`AsyncEngine` drives the same pieces from its own threads for the server.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from paxserve.config import EngineConfig
from paxserve.core.interface import EngineCoreRequest, EngineSnapshot
from paxserve.core.kv_cache_manager import KVCacheManager
from paxserve.core.scheduler import Scheduler, SchedulerConfig
from paxserve.distributed.cluster import Cluster, PlanChannel
from paxserve.distributed.rendezvous import settings_digest
from paxserve.engine.engine_core import EngineCore
from paxserve.engine.generation_config import GENERATION_CONFIG_MODES, resolve_sampling_defaults
from paxserve.engine.input_processor import InputProcessor, Prompt
from paxserve.engine.output_processor import OutputProcessor
from paxserve.engine.stats import StatsLogger
from paxserve.kernels import resolve_attention_backend
from paxserve.models.loader import cache_root, inspect_model, load_model
from paxserve.models.registry import get_architecture
from paxserve.models.sharding import TensorParallel, device_share, param_bytes
from paxserve.outputs import RequestOutput
from paxserve.sampling_params import RequestOutputKind, SamplingParams
from paxserve.worker.memory_plan import DeviceMemory, configure_allocator, device_memory, plan_kv_cache
from paxserve.worker.model_runner import STOP, ModelRunner, zero_kv_cache
from paxserve.worker.sampling.sampler import SamplerState
from paxserve.worker.step_functions import StepShapes, measure_activation_bytes

logger = logging.getLogger(__name__)

__all__ = ["Engine", "Prompt"]


def _device_memory() -> DeviceMemory | None:
    """The accelerator's total memory and JAX's pool on it, or None on CPU (the KV cache then uses
    a host budget)."""
    device = jax.local_devices()[0]  # this host's (another host's devices cannot be queried)
    if device.platform == "cpu":
        return None
    return device_memory(device.memory_stats())


class Engine:
    """Offline and streaming generation over a paged KV cache with continuous batching.

    `Engine()` serves the bundled SmolLM2-135M-Instruct; keyword arguments are `EngineConfig`'s
    (vLLM's names: max_model_len, gpu_memory_utilization, block_size, max_num_seqs, ...).

    Over several hosts (`nnodes`, `node_rank`, `master_addr`, `master_port`), every rank builds the
    engine with the same arguments; rank 0 then uses it as usual and calls `close()` at the end,
    the others call `run_worker()`, which runs rank 0's steps until then.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.config = config = EngineConfig(model=model, **engine_args)
        # Before anything starts JAX's backend: its GPU pool is sized once, at start.
        from jax._src import xla_bridge

        logger.info("GPU memory: %s", configure_allocator(config.gpu_memory_utilization,
                                                          xla_bridge.backends_are_initialized()))
        # Multi-host: every rank joins before JAX starts its backend (the runtime spans the processes).
        self.cluster: Cluster | None = None
        if config.nnodes > 1:
            if xla_bridge.backends_are_initialized() and not Cluster.is_started():
                raise ValueError("a multi-host engine (nnodes > 1) must be built before anything else starts JAX in "
                                 "its process: JAX's distributed runtime cannot join once a backend is running")
            self.cluster = Cluster.join(config.cluster_config(), settings_digest(config.shared_settings()))
        # Rank 0's device calls go to the workers before it makes them (`paxserve.distributed.worker_loop`).
        self._channel: PlanChannel | None = None if self.cluster is None else self.cluster.channel()
        if config.trust_remote_code:
            logger.warning("--trust-remote-code / trust_remote_code=True has no effect: paxserve never runs code "
                           "from a checkpoint and loads only the architectures it implements")
        # --generation-config DIR is read and checked now, before the weights load; "auto" reads the
        # model's own file, which load_model returns.
        file_defaults = None if config.generation_config in GENERATION_CONFIG_MODES else \
            resolve_sampling_defaults(config.generation_config, {}, "")
        # Step programs are kept in the engine's own store (paxserve/worker/programs.py), loaded without
        # tracing; JAX's persistent cache would only hand back executables that cannot be stored.
        info = inspect_model(model, config.dtype)
        if self._channel is not None:
            self._check_same_model(self._channel, f"{info.config!r}|{info.dtype}")
        arch = get_architecture(info.config.architecture)
        # Checked before anything loads: a size the model cannot split fails naming the valid ones.
        tp = TensorParallel.create(info.config, config.tensor_parallel_size,
                                   expert_parallel=config.enable_expert_parallel) \
            if config.tensor_parallel_size > 1 else None
        # Memory is planned per device, from one device's share of the model (its heads, its slice of
        # every width, its KV heads): the host side then sees one cache of num_blocks blocks.
        local_cfg = info.config if tp is None else tp.local
        weight_bytes = info.weight_bytes if tp is None else param_bytes(device_share(
            info.config, tp.size, lambda c: arch.abstract_params(c, info.dtype), tp.expert_parallel))
        self.attention_backend = resolve_attention_backend(
            config.attention_backend, jax.devices()[0].platform, num_heads=local_cfg.num_heads,
            num_kv_heads=local_cfg.num_kv_heads, head_dim=local_cfg.head_dim, block_size=config.block_size,
            dtype=info.dtype, sliding_window=local_cfg.sliding_window, alibi=local_cfg.alibi,
            compute_capability=getattr(jax.local_devices()[0], "compute_capability", None))
        logger.info("attention backend: %s", self.attention_backend)
        memory = _device_memory()
        device_bytes = None if memory is None else memory.total_bytes
        if memory is not None:
            logger.info("GPU memory: %.1f GiB on the device, JAX's pool %.1f GiB; planning with %.1f GiB "
                        "(gpu_memory_utilization %s)", memory.total_bytes / 2**30, memory.pool_bytes / 2**30,
                        memory.usable(config.gpu_memory_utilization) / 2**30, config.gpu_memory_utilization)
        self.activation_bytes = 0  # what the plan reserves for the largest step's temporaries
        if device_bytes is not None and config.num_gpu_blocks_override is None and config.kv_cache_memory_bytes is None:
            model_len = config.max_model_len if isinstance(config.max_model_len, int) else \
                info.config.max_position_embeddings
            shapes = StepShapes(info.config, arch, info.dtype, config.block_size, 2, config.max_num_seqs + 1,
                                self.attention_backend, tp)
            self.activation_bytes = measure_activation_bytes(
                shapes, config.max_num_batched_tokens or max(2048, config.max_num_seqs), config.max_num_seqs,
                -(-model_len // config.block_size))
            logger.info("activation peak of the largest step: %.2f GiB%s", self.activation_bytes / 2**30,
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
        self.plan = plan_kv_cache(local_cfg, config, info.dtype.itemsize, weight_bytes, device_bytes,
                                  self.activation_bytes, num_devices=1 if tp is None else tp.size,
                                  sampler_state_bytes=sampler_bytes,
                                  pool_bytes=None if memory is None else memory.pool_bytes)
        if self.cluster is not None and self._channel is not None:
            # Every rank holds the same block ids: all take the smallest rank's plan.
            blocks = [int(b) for b in self._channel.gather("kv_blocks", str(self.plan.num_blocks))]
            if min(blocks) != self.plan.num_blocks:
                self.plan = plan_kv_cache(local_cfg, replace(config, num_gpu_blocks_override=min(blocks)),
                                          info.dtype.itemsize, weight_bytes, device_bytes, self.activation_bytes,
                                          num_devices=tp.size if tp is not None else 1,
                                          sampler_state_bytes=sampler_bytes)
            logger.info("multi-host: node rank %d of %d; KV cache of %d blocks on every rank (the smallest plan, "
                        "node rank %d's; each planned %s)", self.cluster.rank, self.cluster.nnodes,
                        self.plan.num_blocks, blocks.index(min(blocks)), blocks)
        # The cache is zeroed on a thread while the weights load (the two take about as long on a CPU).
        kv_zeroing = zero_kv_cache(local_cfg, self.plan.num_blocks, config.block_size, info.dtype) \
            if tp is None else None
        self.model = load_model(model, config.dtype, tokenizer=config.tokenizer,
                                tensor_parallel_size=config.tensor_parallel_size,
                                enable_expert_parallel=config.enable_expert_parallel)
        # vLLM's --generation-config: defaults for the sampling fields a request leaves unset.
        self.sampling_defaults, defaults_line = file_defaults or resolve_sampling_defaults(
            config.generation_config, self.model.generation_config, self.model.source)
        if defaults_line is not None:
            logger.info("%s", defaults_line)
        self.tokenizer = self.model.tokenizer
        self.model_config = self.model.config
        self.max_model_len = self.plan.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(2048, config.max_num_seqs)
        self.kv = KVCacheManager(self.plan.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, self.max_num_batched_tokens, self.max_model_len), self.kv
        )
        store = None if config.compilation_cache_dir == "" else Path(config.compilation_cache_dir or
                                                                      cache_root() / "programs")
        if self.cluster is not None and store is not None:
            # A program over several processes' devices is not one to serialize and reload as it is.
            logger.info("multi-host: step programs are compiled at every start, not stored")
            store = None
        self.runner = ModelRunner(self.model, self.plan.num_blocks, config.block_size, self.max_model_len,
                                  attention_backend=self.attention_backend, max_num_seqs=config.max_num_seqs,
                                  program_store=store, background_compile=config.compile_in_background,
                                  kv_cache=None if kv_zeroing is None else kv_zeroing.result(),
                                  plan_sink=self._channel.send if self._channel is not None and not self.is_worker
                                  else None)
        self.stats = StatsLogger(config.log_stats_interval)
        async_scheduling = config.async_scheduling
        platform = jax.devices()[0].platform
        if async_scheduling is None:
            async_scheduling = platform != "cpu"
            why = (f"the default on {platform}" if async_scheduling else
                   "the default on CPU: its steps run on the host's own cores, so building the next step beside "
                   "one only makes them contend (measured 11% slower offline; benchmarks/RESULTS.md)")
        else:
            why = "as asked"
        self.core = EngineCore(self.runner, self.kv, self.scheduler, self.model_config.vocab_size, self.stats,
                               async_scheduling=async_scheduling, isolate_failed_steps=self.cluster is None)
        logger.info("%s (%s)", "async scheduling: each step is built while the previous one runs on the device"
                    if async_scheduling else "synchronous scheduling: each step runs to the end before the next", why)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size,
                                              self.model_config.eos_token_ids, self.max_model_len, config.seed,
                                              sampling_defaults=self.sampling_defaults)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.warmup_seconds = 0.0  # how long start-up compilation took (0 with warmup=False)
        if config.warmup:
            self._warmup()

    # ---- requests (the three pieces, driven from the caller's thread) --------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *,
                    cache_salt: str | None = None) -> None:
        """Queue a prompt (text, token ids, or vLLM's {"prompt" | "prompt_token_ids", "cache_salt"}
        dict). Invalid input raises ValueError naming the field and changes nothing."""
        request = self.input_processor.process(request_id, prompt, params, cache_salt=cache_salt)
        self.add_processed_request(request)

    def add_processed_request(self, request: EngineCoreRequest) -> None:
        self.output_processor.add_request(request)
        try:
            self.core.add_request(request)
        except ValueError:
            self.output_processor.abort_request(request.request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Stop a request now; its KV blocks are freed at once. Unknown ids are ignored."""
        self.core.abort_request(request_id)
        self.output_processor.abort_request(request_id)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return the outputs of requests that advanced or finished."""
        processed = self.output_processor.process(self.core.step())
        self.core.finish_samples(processed.samples_to_finish)
        for request_id in processed.requests_to_abort:
            self.core.abort_request(request_id)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or len(self.output_processor) > 0

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes (e.g. between benchmark runs over the same prompts)."""
        self.kv.reset_prefix_cache()

    def snapshot(self) -> EngineSnapshot:
        """Counters and gauges for monitoring (call on the thread that runs the steps)."""
        return self.core.snapshot()

    # ---- offline API ---------------------------------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a request without any gets (vLLM's LLM.get_default_sampling_params):
        the model's generation_config defaults (see --generation-config), else paxserve's. Explicit
        SamplingParams are used as given, so start from these to keep the model's defaults:
        `replace(engine.get_default_sampling_params(), max_tokens=64)`."""
        return self.input_processor.default_sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); outputs come back in input order."""
        if isinstance(prompts, (str, Mapping)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params_list)} for {len(prompts)} prompts")
        return self._run_batch(prompts, params_list, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered by the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = self.input_processor.render_chat(conv, chat_template=chat_template,  # type: ignore[arg-type]
                                                    add_generation_prompt=add_generation_prompt)
            prompts.append(self.input_processor.tokenize(text, add_special_tokens=False, param="messages"))
        outs = self.generate(prompts, sampling_params, use_tqdm)
        for out in outs:
            out.prompt = self.tokenizer.decode(out.prompt_token_ids)
        return outs

    def _run_batch(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        # Validate everything first, so a bad prompt anywhere in the list queues nothing.
        requests = [self.input_processor.process(rid, prompt, replace(p, output_kind=RequestOutputKind.FINAL_ONLY))
                    for rid, prompt, p in zip(ids, prompts, params)]
        try:
            for request in requests:
                self.add_processed_request(request)
            results: dict[str, RequestOutput] = {}
            bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
            start, generated = time.perf_counter(), 0
            while self.has_unfinished_requests():
                for out in self.step():
                    results[out.request_id] = out  # final outputs only
                    generated += out.num_output_tokens
                    bar.update(1)
                bar.set_postfix_str(f"{generated / max(time.perf_counter() - start, 1e-9):.1f} tok/s", refresh=False)
            bar.close()
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        return [results[rid] for rid in ids]

    # ---- multi-host ----------------------------------------------------------------------------

    @property
    def is_worker(self) -> bool:
        """A rank 1..N-1 of a multi-host engine: it runs rank 0's steps (`run_worker`), not requests."""
        return self.cluster is not None and self.cluster.rank != 0

    def run_worker(self) -> int:
        """On ranks 1..N-1: run rank 0's steps until rank 0 closes the engine; returns how many ran."""
        if not self.is_worker or self._channel is None:
            raise ValueError("run_worker is for node ranks 1..N-1 of a multi-host engine (nnodes > 1, node_rank > 0)")
        from paxserve.distributed.worker_loop import run_worker

        return run_worker(self.runner, self._channel)

    def close(self) -> None:
        """On rank 0 of a multi-host engine: tell the workers this engine is done (they return from
        `run_worker`). Elsewhere, nothing to do."""
        if self.cluster is None or self.is_worker or self._channel is None or self.cluster.lost:
            return
        try:
            self._channel.send((STOP,))
        except Exception as e:  # noqa: BLE001 - the workers are gone already: nothing to tell
            logger.warning("multi-host: could not tell the workers to stop (%s)", e)
        self._channel = None

    @staticmethod
    def _check_same_model(channel: PlanChannel, description: str) -> None:
        import hashlib

        digest = hashlib.sha256(description.encode()).hexdigest()[:16]
        digests = channel.gather("model", digest)
        others = [rank for rank, d in enumerate(digests) if d != digests[0]]
        if others:
            raise ValueError(f"node rank(s) {', '.join(map(str, others))} loaded a model of another shape or dtype "
                             f"than node rank 0: every rank must be given the same checkpoint")

    # ---- start-up ------------------------------------------------------------------------------

    def _warmup(self) -> None:
        """Make sure the decode step of every batch-size bucket and its sampler are ready now, not
        during the first requests (loaded from what a previous start stored, nothing traced, or
        compiled; with background compiles only the single-sequence one before ready). Other stored
        programs load when first needed; other buckets compile then, or ahead of it in the background."""
        start = time.perf_counter()
        loaded, compiled, unloaded = self.runner.warmup(self.config.max_num_seqs, self.max_num_batched_tokens)
        self.warmup_seconds = time.perf_counter() - start
        # benchmarks/startup.py parses this line up to "compiled now".
        logger.info("step programs ready in %.1fs: %d loaded from the program store, %d compiled now; "
                    "%d more stored programs found, left to load on first use", self.warmup_seconds, loaded,
                    compiled, unloaded)
