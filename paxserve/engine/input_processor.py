"""The input processor: a user's prompt and SamplingParams -> a validated `EngineCoreRequest`.

Chat-template rendering, tokenization and every check on a request happen here, before anything
reaches the step loop, and raise `RequestError` (a ValueError naming the field) with vLLM's
wording. It holds no engine state, so several worker threads may use one InputProcessor at once:
the step loop never waits for a slow template or a huge prompt.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Mapping

import numpy as np

from paxserve.core.interface import EngineCoreRequest
from paxserve.engine.chat_template.pool import RenderPool
from paxserve.engine.chat_template.template import RenderLimits, render_chat_template
from paxserve.engine.generation_config import default_sampling_params
from paxserve.engine.grammar import DEFAULT_COMPILE_TIMEOUT_S, CompiledGrammar, GrammarCompiler, GrammarError
from paxserve.sampling_params import RequestError, SamplingParams
from paxserve.structured_outputs import StructuredOutputsParams

# vLLM's prompt forms: text, token ids, or a dict (TextPrompt / TokensPrompt) that may carry a cache salt.
Prompt = str | list[int] | Mapping[str, Any]
MIN_CHARS_PER_TOKEN_BOUND = 16


def context_length_error(max_model_len: int, num_tokens: int, param: str = "prompt") -> RequestError:
    # vLLM's wording, which clients and load balancers look for.
    return RequestError(
        f"This model's maximum context length is {max_model_len} tokens. However, your request has {num_tokens} "
        f"input tokens, which leaves no room for output. Please reduce the length of the "
        f"{'messages' if param == 'messages' else 'prompt'}.", param=param)


def max_token_chars(tokenizer: Any) -> int:
    """The longest vocabulary entry in characters: no token covers more text than that, so a text
    longer than max_model_len x this cannot fit the context, whatever it tokenizes to."""
    vocab = tokenizer.get_vocab()
    return max(MIN_CHARS_PER_TOKEN_BOUND, max((len(t) for t in vocab), default=0))


class InputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...], max_model_len: int,
                 seed: int, render_limits: RenderLimits | None = None,
                 sampling_defaults: Mapping[str, Any] | None = None,
                 grammar_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, renderer: RenderPool | None = None,
                 lora: Any = None, priority_scheduling: bool = False) -> None:
        """`lora`: the engine's `LoraLoader` when it serves LoRA adapters (requests may name one);
        `priority_scheduling`: the scheduler orders requests by their priority (else any but 0 is
        refused, as vLLM does)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # Engines render in killable worker processes; without a pool (unit tests, tools) templates
        # render in the calling thread under the sandbox's cooperative limits only. One budget
        # either way: a pool brings its own.
        if renderer is not None and render_limits is not None and render_limits != renderer.limits:
            raise ValueError("InputProcessor: render_limits differ from the renderer's; give the limits to the "
                             "RenderPool")
        self.renderer = renderer
        self.render_limits = renderer.limits if renderer is not None else render_limits or RenderLimits()
        # The model's default sampling settings (--generation-config), SamplingParams' names.
        self.sampling_defaults = dict(sampling_defaults or {})
        self.default_max_tokens: int | None = self.sampling_defaults.get("max_tokens")
        default_sampling_params(self.sampling_defaults)  # invalid defaults fail here, not per request
        # Text longer than this is refused before tokenizing: it cannot fit, and tokenizing a
        # megabyte just to say so would cost a worker a second.
        self.max_prompt_chars = max_model_len * max_token_chars(tokenizer) if tokenizer is not None else 0
        self._seed_lock = threading.Lock()
        self._seed_rng = np.random.default_rng(seed)
        self.grammar_timeout_s = grammar_timeout_s
        self._grammars: GrammarCompiler | None = None  # made on the first structured-output request
        self._grammars_lock = threading.Lock()
        self.lora = lora
        self.priority_scheduling = priority_scheduling

    def start(self) -> None:
        """Start the template workers (if any) now rather than on the first chat request: a server
        calls this before it listens, so no client waits for an interpreter to start."""
        if self.renderer is not None:
            self.renderer.start()

    def close(self) -> None:
        """Stop the template workers (if any)."""
        if self.renderer is not None:
            self.renderer.close()

    def default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams gets: the model's defaults, else paxserve's."""
        return default_sampling_params(self.sampling_defaults)

    # ---- text -> token ids ---------------------------------------------------------------------

    def require_tokenizer(self, param: str) -> Any:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: pass prompts as token ids", param=param)
        return self.tokenizer

    def tokenize(self, text: str, *, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        tok = self.require_tokenizer(param)
        if len(text) > self.max_prompt_chars:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your {param} has "
                f"{len(text)} characters, more than that many tokens can hold (at most "
                f"{self.max_prompt_chars // self.max_model_len} characters each). Please reduce the length of the "
                f"{param}.", param=param)
        return list(tok.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(self, messages: list[dict[str, Any]], *, chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """The conversation rendered by `chat_template` (default: the model's), sandboxed and
        time-limited. Raises RequestError(param="messages")."""
        tok = self.require_tokenizer("messages")
        template = chat_template or tok.chat_template
        if not template:
            raise RequestError("this model has no chat template; start the server with --chat-template",
                               param="messages")
        special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
        kwargs = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                      tools=tools, special_tokens=special, template_kwargs=template_kwargs)
        try:
            if self.renderer is not None:
                return self.renderer.render(template, messages, **kwargs)
            return render_chat_template(template, messages, limits=self.render_limits, **kwargs)
        except ValueError as e:
            raise RequestError(f"the chat template could not render these messages: {e}", param="messages") \
                from None

    def compile_grammar(self, constraint: StructuredOutputsParams,
                        param: str = "structured_outputs") -> CompiledGrammar:
        """The request's compiled constraint (cached by constraint). Raises RequestError(param)."""
        tok = self.require_tokenizer(param)
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(tok, self.vocab_size, timeout_s=self.grammar_timeout_s)
        try:
            return self._grammars.compile(constraint)
        except GrammarError as e:
            raise RequestError(f"{param}: {e}", param=param) from None

    # ---- checks --------------------------------------------------------------------------------

    def check_token_ids(self, ids: Any, param: str = "prompt") -> list[int]:
        if not isinstance(ids, (list, tuple)) or any(
                isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in ids):
            raise RequestError(f"{param}: token id prompts must be lists of integers", param=param)
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"{param}: Token id {max(bad, key=abs)} is out of vocabulary (token ids {bad[:5]} are "
                               f"outside the vocabulary [0, {self.vocab_size}))", param=param)
        return ids

    def check_prompt_length(self, num_tokens: int, param: str = "prompt") -> None:
        if num_tokens == 0:
            raise RequestError(f"{param}: the prompt must contain at least one token", param=param)
        if num_tokens >= self.max_model_len:
            raise context_length_error(self.max_model_len, num_tokens, param)

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams,
                           param: str = "max_tokens") -> int:
        """The request's max_tokens; when it has none, the model's default (generation_config's
        max_new_tokens) or the room left in the context, whichever is smaller (vLLM's rule). Asking
        for more than the room left is an error, as in vLLM and OpenAI (not silently clamped)."""
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            return room if self.default_max_tokens is None else min(room, self.default_max_tokens)
        if params.max_tokens > room:
            raise RequestError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {params.max_tokens}. This model's maximum "
                f"context length is {self.max_model_len} tokens and your request has {num_prompt_tokens} input "
                f"tokens ({params.max_tokens} > {self.max_model_len} - {num_prompt_tokens}).", param=param)
        return params.max_tokens

    # ---- the request ---------------------------------------------------------------------------

    def process(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *,
                cache_salt: str | None = None, arrival_time: float | None = None, add_special_tokens: bool = True,
                prompt_param: str = "prompt", lora_request: Any = None, priority: int = 0) -> EngineCoreRequest:
        """Tokenize and validate one request: the only check a request gets after its body's types
        (everything downstream trusts the result). Raises RequestError and changes nothing. A
        `lora_request` (paxserve.LoRARequest)'s adapter is read here when host memory lacks it.

        A rendered chat prompt already holds its special tokens (`add_special_tokens=False`);
        `prompt_param` is the field its errors blame (`messages` for chat)."""
        params = params or self.default_sampling_params()
        if not isinstance(request_id, str) or not request_id:
            raise RequestError("request_id must be a non-empty string", param="request_id")
        self.check_priority(priority)
        text, ids, cache_salt = self._prompt(prompt, cache_salt, add_special_tokens, prompt_param)
        self.check_prompt_length(len(ids), prompt_param)
        params.check_vocab(self.vocab_size)
        if params.stop_strings and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer, but this model was loaded without one", param="stop")
        max_tokens = self.resolve_max_tokens(len(ids), params)
        seeds = [self._sample_seed(params.seed, i, params.n) for i in range(params.n)]
        grammar = None if params.structured_outputs is None else self.compile_grammar(params.structured_outputs)
        adapter = None if lora_request is None else self.load_lora(lora_request)
        return EngineCoreRequest(
            request_id=request_id, prompt=text, prompt_token_ids=ids, sampling_params=params, max_tokens=max_tokens,
            eos_token_ids=() if params.ignore_eos else self.eos_token_ids, seeds=seeds, cache_salt=cache_salt,
            grammar=grammar, arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            lora_request=lora_request, lora_adapter=adapter, priority=priority)

    def check_priority(self, priority: Any) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int) or not -2**63 <= priority < 2**63:
            raise RequestError(f"priority must be an integer, got {priority!r}", param="priority")
        if priority != 0 and not self.priority_scheduling:
            raise RequestError(f"Got priority {priority} but Priority scheduling is not enabled (start the engine "
                               "with scheduling_policy='priority', --scheduling-policy priority).", param="priority")

    def load_lora(self, lora_request: Any) -> Any:
        """The adapter `lora_request` names, read for this model (RequestError if it cannot serve)."""
        if self.lora is None:
            raise RequestError("this engine serves no LoRA adapters: start it with enable_lora=True (--enable-lora)",
                               param="lora_request")
        try:
            return self.lora.load(lora_request)
        except ValueError as e:
            raise RequestError(str(e), param="lora_request") from None

    def _prompt(self, prompt: Prompt, cache_salt: str | None, add_special_tokens: bool,
                param: str) -> tuple[str | None, list[int], str | None]:
        if isinstance(prompt, Mapping):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise RequestError("a dict prompt holds exactly one of 'prompt' (text) or 'prompt_token_ids', and "
                                   f"optionally 'cache_salt'; got keys {sorted(prompt)}", param="prompt")
            if cache_salt is not None and prompt.get("cache_salt") not in (None, cache_salt):
                raise RequestError("cache_salt is given twice, with different values", param="cache_salt")
            if prompt.get("cache_salt") is not None:
                cache_salt = prompt["cache_salt"]
            prompt = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise RequestError("cache_salt must be a non-empty string if provided", param="cache_salt")
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt, add_special_tokens=add_special_tokens, param=param), cache_salt
        return None, self.check_token_ids(prompt, param), cache_salt

    def _sample_seed(self, seed: int | None, index: int, n: int) -> int:
        if seed is None:
            with self._seed_lock:  # numpy generators are not thread-safe
                return int(self._seed_rng.integers(0, 2**63))
        seed %= 2**64  # a negative seed (vLLM takes any signed 64-bit one) as the same 64 bits
        if n == 1:
            return seed
        # Distinct, reproducible streams for the n samples of one seeded request.
        return int(np.random.default_rng([seed, index]).integers(0, 2**63))

