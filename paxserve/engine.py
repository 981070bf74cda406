"""The Engine: `schedule -> build batch -> run jitted step -> update requests -> emit outputs`."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from models.loader import cache_root, inspect_model, load_model
from models.registry import get_architecture
from paxserve.batch import SeqChunk, next_power_of_2
from paxserve.config import EngineConfig
from paxserve.detokenizer import IncrementalDetokenizer
from paxserve.kv_cache_manager import KVCacheManager
from paxserve.memory import plan_kv_cache
from paxserve.model_runner import ModelRunner, measure_activation_bytes
from paxserve.outputs import CompletionOutput, Logprob, RequestOutput
from paxserve.request import Request, RequestStatus
from paxserve.sampling_metadata import SampledTokens, SamplingRow, build_sampling_inputs
from paxserve.sampling_params import SamplingParams
from paxserve.scheduler import Scheduler, SchedulerConfig
from paxserve.stats import StatsLogger
from pallas_kernels import resolve_attention_backend

logger = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass(slots=True)
class _UserRequest:
    """A request as the user sees it: one prompt and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    outputs: list[CompletionOutput]
    want_logprobs: int | None
    changed: bool = False
    cached_tokens: int = field(default=0)

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


def _device_memory_bytes() -> int | None:
    """The accelerator's memory limit, or None on CPU (the KV cache then uses a host budget)."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() or {}
    return stats.get("bytes_limit")


def _enable_compilation_cache(directory: str) -> None:
    # JAX's persistent cache is process-wide configuration; the engine sets it only if nobody has.
    if not jax.config.jax_compilation_cache_dir:
        Path(directory).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class Engine:
    """Offline and streaming generation over a paged KV cache with continuous batching.

    `Engine()` serves the bundled SmolLM2-135M-Instruct; keyword arguments are `EngineConfig`'s
    (vLLM's names: max_model_len, gpu_memory_utilization, block_size, max_num_seqs, ...).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.config = config = EngineConfig(model=model, **engine_args)
        if config.compilation_cache_dir != "":
            _enable_compilation_cache(config.compilation_cache_dir or str(cache_root() / "xla"))
        info = inspect_model(model, config.dtype)
        self.attention_backend = resolve_attention_backend(
            config.attention_backend, jax.devices()[0].platform, num_heads=info.config.num_heads,
            num_kv_heads=info.config.num_kv_heads, head_dim=info.config.head_dim, block_size=config.block_size,
            dtype=info.dtype)
        logger.info("attention backend: %s", self.attention_backend)
        device_bytes = _device_memory_bytes()
        activation_bytes = 0
        if device_bytes is not None and config.num_gpu_blocks_override is None and config.kv_cache_memory_bytes is None:
            model_len = config.max_model_len if isinstance(config.max_model_len, int) else \
                info.config.max_position_embeddings
            activation_bytes = measure_activation_bytes(
                info.config, get_architecture(info.config.architecture), info.dtype, config.block_size,
                config.max_num_batched_tokens or max(2048, config.max_num_seqs), config.max_num_seqs,
                -(-model_len // config.block_size), attention_backend=self.attention_backend)
            logger.info("activation peak of the largest step: %.2f GiB", activation_bytes / 2**30)
        self.plan = plan_kv_cache(info.config, config, info.dtype.itemsize, info.weight_bytes, device_bytes,
                                  activation_bytes)
        self.model = load_model(model, config.dtype)
        self.tokenizer = self.model.tokenizer
        self.model_config = self.model.config
        self.max_model_len = self.plan.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(2048, config.max_num_seqs)
        self.kv = KVCacheManager(self.plan.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, self.max_num_batched_tokens, self.max_model_len), self.kv
        )
        self.runner = ModelRunner(self.model, self.plan.num_blocks, config.block_size, self.max_model_len,
                                  attention_backend=self.attention_backend)
        self.stats = StatsLogger(config.log_stats_interval)
        self._requests: dict[str, _UserRequest] = {}
        self._sample_owner: dict[str, _UserRequest] = {}
        self._seed_rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self.warmup_seconds = 0.0  # how long start-up compilation took (0 with warmup=False)
        if config.warmup:
            self._warmup()

    # ---- requests ------------------------------------------------------------------------------

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
            return prompt, ids
        ids = list(prompt)
        if any(not isinstance(t, (int, np.integer)) for t in ids):
            raise ValueError("prompt: token id prompts must be lists of integers")
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {self.model_config.vocab_size})")
        return None, ids

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> None:
        """Queue a prompt (text or token ids). Invalid input raises ValueError and changes nothing."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("prompt: the prompt must contain at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
                f"{len(ids)} input tokens, which leaves no room for output. Please reduce the length of the prompt."
            )
        params.check_vocab(self.model_config.vocab_size)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        samples, detoks = [], []
        for i in range(params.n):
            seed = self._sample_seed(params.seed, i, params.n)
            samples.append(Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}", prompt_token_ids=ids,
                sampling_params=params, max_tokens=max_tokens, eos_token_ids=eos, seed=seed,
                parent_id=request_id, sample_index=i,
            ))
            detoks.append(IncrementalDetokenizer(self.tokenizer, ids, params))
        user = _UserRequest(request_id, text, ids, samples, detoks,
                            [CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None,
                                              cumulative_logprob=0.0 if params.logprobs is not None else None)
                             for i in range(params.n)],
                            params.logprobs)
        added = []
        try:
            for s in samples:
                self.scheduler.add_request(s)
                added.append(s)
        except ValueError:
            for s in added:
                self.scheduler.abort(s.request_id)
            raise
        self._requests[request_id] = user
        for s in samples:
            self._sample_owner[s.request_id] = user

    def _sample_seed(self, seed: int | None, index: int, n: int) -> int:
        if seed is None:
            return int(self._seed_rng.integers(0, 2**63))
        if n == 1:
            return seed
        # Distinct, reproducible streams for the n samples of one seeded request.
        return int(np.random.default_rng([seed, index]).integers(0, 2**63))

    def abort(self, request_id: str) -> None:
        """Stop a request now; its KV blocks are freed at once. Unknown ids are ignored."""
        user = self._requests.pop(request_id, None)
        if user is None:
            return
        for sample, out in zip(user.samples, user.outputs):
            self._sample_owner.pop(sample.request_id, None)
            if not sample.status.finished:
                self.scheduler.abort(sample.request_id)
                out.finish_reason = "abort"

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes (e.g. between benchmark runs over the same prompts)."""
        self.kv.pool.reset_prefix_cache()

    def metrics(self) -> dict[str, float]:
        """Counters and gauges for monitoring (call on the engine's own thread)."""
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.kv.usage,
            "prefix_cache_queries": self.kv.prefix_stats.queries,
            "prefix_cache_hits": self.kv.prefix_stats.hits,
            "num_preemptions": self.stats.preemptions,
            "prompt_tokens": self.stats.prompt_tokens,
            "generation_tokens": self.stats.generation_tokens,
        }

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return the outputs of requests that advanced or finished."""
        out = self.scheduler.schedule()
        for req in out.preempted:
            logger.debug("preempted %s (recomputed later)", req.request_id)
        if not out.scheduled:
            return []
        completes = [s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens for s in out.scheduled]
        chunks = [
            SeqChunk(s.request.token_ids_slice(s.request.num_computed_tokens,
                                               s.request.num_computed_tokens + s.num_new_tokens),
                     s.request.num_computed_tokens, self.kv.block_ids(s.request.request_id))
            for s in out.scheduled
        ]
        batch = self.runner.build(chunks)
        rows = [SamplingRow(s.request.sampling_params, s.request.prompt_token_ids, s.request.output_token_ids,
                            s.request.seed, s.request.eos_token_ids) for s in out.scheduled]
        sampled = self.runner.execute(batch, build_sampling_inputs(rows, batch.context_lens.shape[0],
                                                                   self.model_config.vocab_size))
        num_prompt_tokens = sum(s.num_new_tokens for s in out.scheduled
                                if s.num_new_tokens > 1 or s.request.num_output_tokens == 0)
        finished_now = {r.request_id for r in self.scheduler.update_from_output(out, sampled.token_ids)}
        for row, (s, complete) in enumerate(zip(out.scheduled, completes)):
            if complete:
                self._record_token(s.request, row, sampled, s.request.request_id in finished_now)
        self.stats.on_step(num_prompt_tokens, sum(completes), len(out.preempted))
        self.stats.maybe_log(self)
        return self._collect_outputs()

    def _record_token(self, req: Request, row: int, sampled: SampledTokens, finished: bool) -> None:
        user = self._sample_owner.get(req.request_id)
        if user is None:
            return
        i = req.sample_index
        out, detok = user.outputs[i], user.detokenizers[i]
        token = req.output_token_ids[-1]
        out.token_ids.append(token)
        out.delta_token_ids.append(token)
        if user.want_logprobs is not None and sampled.sampled_logprobs is not None:
            out.logprobs.append(self._logprobs_entry(token, row, sampled, user.want_logprobs))
            out.cumulative_logprob += float(sampled.sampled_logprobs[row])
        # A token that ended the request as EOS or a stop token id is not part of the text (vLLM).
        ended_by_token = finished and req.status == RequestStatus.FINISHED_STOPPED
        stop = None if ended_by_token else detok.update([token])
        if stop is not None:
            if finished:  # the same token also hit max_tokens: the stop string wins, as in vLLM
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            req.stop_reason = stop
        if req.status.finished:
            detok.finish()
            out.finish_reason = req.status.value
            out.stop_reason = req.stop_reason
        delta = detok.get_delta()
        out.text += delta
        out.delta_text += delta
        user.changed = True
        if req.num_cached_tokens:
            user.cached_tokens = max(user.cached_tokens, req.num_cached_tokens)

    def _logprobs_entry(self, token: int, row: int, sampled: SampledTokens, k: int) -> dict[int, Logprob]:
        top_ids = sampled.top_token_ids[row].tolist()
        top_lps = sampled.top_logprobs[row].tolist()
        decode = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else (lambda t: None)
        entry = {token: Logprob(float(sampled.sampled_logprobs[row]),
                                rank=top_ids.index(token) + 1 if token in top_ids else None, decoded_token=decode(token))}
        for rank, (tid, lp) in enumerate(zip(top_ids[:k], top_lps[:k]), start=1):
            entry.setdefault(int(tid), Logprob(float(lp), rank=rank, decoded_token=decode(int(tid))))
        return entry

    def _collect_outputs(self) -> list[RequestOutput]:
        results = []
        for rid, user in list(self._requests.items()):
            if not user.changed:
                continue
            user.changed = False
            results.append(RequestOutput(
                request_id=rid, prompt=user.prompt, prompt_token_ids=user.prompt_token_ids,
                outputs=[CompletionOutput(
                    index=o.index, text=o.text, token_ids=list(o.token_ids), cumulative_logprob=o.cumulative_logprob,
                    logprobs=list(o.logprobs) if o.logprobs is not None else None, finish_reason=o.finish_reason,
                    stop_reason=o.stop_reason, delta_text=o.delta_text, delta_token_ids=o.delta_token_ids,
                ) for o in user.outputs],
                finished=user.finished, num_cached_tokens=user.cached_tokens,
            ))
            for o in user.outputs:
                o.delta_text, o.delta_token_ids = "", []
            if user.finished:
                del self._requests[rid]
                for s in user.samples:
                    self._sample_owner.pop(s.request_id, None)
        return results

    # ---- offline API ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); outputs come back in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
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
        if self.tokenizer is None or not (chat_template or self.tokenizer.chat_template):
            raise ValueError("messages: this model has no chat template; pass chat_template=")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      chat_template=chat_template)
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        outs = self.generate(prompts, sampling_params, use_tqdm)
        for out in outs:
            out.prompt = self.tokenizer.decode(out.prompt_token_ids)
        return outs

    def _run_batch(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.add_request(rid, prompt, p)
            results: dict[str, RequestOutput] = {}
            bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
            start, generated = time.perf_counter(), 0
            while self.has_unfinished_requests():
                for out in self.step():
                    generated += sum(len(o.delta_token_ids) for o in out.outputs)
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
                bar.set_postfix_str(f"{generated / max(time.perf_counter() - start, 1e-9):.1f} tok/s", refresh=False)
            bar.close()
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        return [results[rid] for rid in ids]

    # ---- start-up ------------------------------------------------------------------------------

    def _warmup(self) -> None:
        """Compile the greedy decode step for every batch-size bucket now, not during the first
        requests. Other shapes compile on first use; all land in the persistent compilation cache."""
        top = min(next_power_of_2(self.config.max_num_seqs), next_power_of_2(self.max_num_batched_tokens))
        sizes = [1 << i for i in range(top.bit_length())]
        greedy = SamplingParams(temperature=0.0)
        start = time.perf_counter()
        for s in tqdm(sizes, desc="Compiling decode buckets", unit="bucket", disable=None):
            chunks = [SeqChunk([0], 0, [1]) for _ in range(s)]  # writes land in a free block, never read
            rows = [SamplingRow(greedy, [0], [], 0, ()) for _ in range(s)]
            batch = self.runner.build(chunks)
            self.runner.execute(batch, build_sampling_inputs(rows, batch.context_lens.shape[0],
                                                             self.model_config.vocab_size))
        self.warmup_seconds = time.perf_counter() - start
        logger.info("compiled %d decode buckets (batch sizes %s) in %.1fs", len(sizes), sizes, self.warmup_seconds)
