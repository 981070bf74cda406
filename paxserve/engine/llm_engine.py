"""The offline Engine: a thin facade over input processor -> engine core -> output processor.

It drives the parts `build_engine_parts` made (memory plan, weights, KV cache, compiled buckets)
from the caller's thread: `generate`/`chat` for batches, `add_request`/`step`/`abort` for a custom
loop. `AsyncEngine`, its sibling, drives the same kind of parts from its own threads for the server.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from typing import Any, Mapping, Sequence

import numpy as np
from tqdm.auto import tqdm

from paxserve.config import EngineConfig
from paxserve.core.interface import EngineCoreRequest, EngineSnapshot
from paxserve.engine.build import build_engine_parts
from paxserve.engine.input_processor import Prompt
from paxserve.lora_request import LoRARequest
from paxserve.outputs import RequestOutput
from paxserve.sampling_params import RequestOutputKind, SamplingParams
from paxserve.worker.model_runner import STOP

logger = logging.getLogger(__name__)

__all__ = ["Engine", "Prompt"]


class Engine:
    """Offline and streaming generation over a paged KV cache with continuous batching.

    `Engine()` serves the bundled SmolLM2-135M-Instruct; keyword arguments are `EngineConfig`'s
    (vLLM's names: max_model_len, gpu_memory_utilization, block_size, max_num_seqs, ...).

    Over several hosts (`nnodes`, `node_rank`, `master_addr`, `master_port`), every rank builds the
    engine with the same arguments; rank 0 then uses it as usual and calls `close()` at the end,
    the others call `run_worker()`, which runs rank 0's steps until then.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.parts = build_engine_parts(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    def __getattr__(self, name: str) -> Any:
        # The parts read as the engine's own attributes (engine.runner, engine.plan, engine.kv, ...).
        # Only names the class does not define reach here.
        parts = self.__dict__.get("parts")
        if parts is None:
            raise AttributeError(name)
        return getattr(parts, name)

    # ---- requests (the three pieces, driven from the caller's thread) --------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                    priority: int = 0) -> None:
        """Queue a prompt (text, token ids, or vLLM's {"prompt" | "prompt_token_ids", "cache_salt"}
        dict), with a LoRA adapter if the engine serves them and a priority if it schedules by them
        (lower first). Invalid input raises ValueError naming the field and changes nothing."""
        request = self.parts.input_processor.process(request_id, prompt, params, cache_salt=cache_salt,
                                                     lora_request=lora_request, priority=priority)
        self.add_processed_request(request)

    def add_processed_request(self, request: EngineCoreRequest) -> None:
        self.parts.core.add_request(request)  # refuses an id in use: the one place that knows every id
        self.parts.output_processor.add_request(request)

    def abort(self, request_id: str) -> None:
        """Stop a request now; its KV blocks are freed at once. Unknown ids are ignored."""
        self.parts.core.abort_request(request_id)
        self.parts.output_processor.abort_request(request_id)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return the outputs of requests that advanced or finished."""
        processed = self.parts.output_processor.process(self.parts.core.step())
        self.parts.core.finish_samples(processed.samples_to_finish)
        for request_id in processed.requests_to_abort:
            self.parts.core.abort_request(request_id)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.parts.core.has_unfinished_requests() or len(self.parts.output_processor) > 0

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes (e.g. between benchmark runs over the same prompts)."""
        self.parts.kv.reset_prefix_cache()

    def snapshot(self) -> EngineSnapshot:
        """Counters and gauges for monitoring (call on the thread that runs the steps)."""
        return self.parts.core.snapshot()

    # ---- offline API ---------------------------------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a request without any gets (vLLM's LLM.get_default_sampling_params):
        the model's generation_config defaults (see --generation-config), else paxserve's. Explicit
        SamplingParams are used as given, so start from these to keep the model's defaults:
        `replace(engine.get_default_sampling_params(), max_tokens=64)`."""
        return self.parts.input_processor.default_sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); outputs come back in input order.
        `lora_request`: one adapter for every prompt, or one (or None) per prompt; `priority`: one
        per prompt (vLLM's; the engine must schedule by priority)."""
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
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority: got {len(priorities)} for {len(prompts)} prompts")
        return self._run_batch(prompts, params_list, use_tqdm, loras, priorities)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter now (vLLM's add_lora), so its first request does not wait for the read;
        ValueError says why it cannot serve this model."""
        self.parts.input_processor.load_lora(lora_request)
        return True

    def list_loras(self) -> set[int]:
        """The ids of the adapters read into host memory (vLLM's list_loras)."""
        loader = self.parts.input_processor.lora
        return set() if loader is None else loader.ids()

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter read into host memory (vLLM's remove_lora): a later request with its id
        reads it again. Requests that use it run on."""
        loader = self.parts.input_processor.lora
        if loader is None or lora_id not in loader:
            return False
        loader.forget(lora_id)
        return True

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
            text = self.parts.input_processor.render_chat(conv, chat_template=chat_template,  # type: ignore[arg-type]
                                                    add_generation_prompt=add_generation_prompt)
            prompts.append(self.parts.input_processor.tokenize(text, add_special_tokens=False, param="messages"))
        outs = self.generate(prompts, sampling_params, use_tqdm)
        for out in outs:
            out.prompt = self.parts.tokenizer.decode(out.prompt_token_ids)
        return outs

    def _run_batch(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool,
                   loras: list[LoRARequest | None] | None = None,
                   priorities: list[int] | None = None) -> list[RequestOutput]:
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        loras = loras or [None] * len(prompts)
        priorities = priorities or [0] * len(prompts)
        # Validate everything first, so a bad prompt anywhere in the list queues nothing.
        requests = [self.parts.input_processor.process(rid, prompt, replace(p, output_kind=RequestOutputKind.FINAL_ONLY),
                                                       lora_request=lora, priority=rank)
                    for rid, prompt, p, lora, rank in zip(ids, prompts, params, loras, priorities)]
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
        return self.parts.is_worker

    def run_worker(self) -> int:
        """On ranks 1..N-1: run rank 0's steps until rank 0 closes the engine; returns how many ran."""
        if not self.is_worker or self.parts.channel is None:
            raise ValueError("run_worker is for node ranks 1..N-1 of a multi-host engine (nnodes > 1, node_rank > 0)")
        from paxserve.distributed.worker_loop import run_worker

        speculator = self.parts.core._speculator
        return run_worker(self.parts.runner, self.parts.channel, None if speculator is None else speculator.drafter)

    def close(self) -> None:
        """On rank 0 of a multi-host engine: tell the workers this engine is done (they return from
        `run_worker`). Elsewhere, nothing to do."""
        parts = self.parts
        if parts.cluster is None or parts.is_worker or parts.channel is None or parts.cluster.lost:
            return
        try:
            parts.channel.send((STOP,))
        except Exception as e:  # noqa: BLE001 - the workers are gone already: nothing to tell
            logger.warning("multi-host: could not tell the workers to stop (%s)", e)
        parts.channel = None
