"""OpenAI request JSON -> validated prompts and SamplingParams, before anything reaches the engine.

Every problem raises ProtocolError naming the field (`param`). Unknown fields are ignored; known
OpenAI/vLLM features that paxserve does not implement get a 400 that names them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from paxserve.sampling_params import SamplingParams
from paxserve.server.errors import ProtocolError, from_value_error
from paxserve.server.settings import ServerSettings
from paxserve.server.structured import parse_structured_outputs
from paxserve.server.tools import ChatOutputParsers, parse_tools, template_tool_calls
from paxserve.structured_outputs import StructuredOutputsParams

MAX_N = 128  # OpenAI's limit on choices per request
MAX_STOP_STRING_CHARS = 1024  # a stop string longer than this is a mistake, and costs every token a scan
_MISSING = object()
Prompt = str | list[int]


@dataclass(slots=True)
class GenerationSpec:
    """A validated /v1/completions or /v1/chat/completions request."""

    kind: str  # "completion" or "chat"
    model: str
    params: SamplingParams
    prompts: list[Prompt] = field(default_factory=list)  # completions
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat, contents flattened to text
    tools: list[dict[str, Any]] | None = None  # chat: rendered by the chat template
    output: ChatOutputParsers = field(default_factory=ChatOutputParsers)  # chat: reasoning / tool-call parsing
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # top alternatives per token (None: no logprobs)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    structured_param: str | None = None  # the field the output constraint came from (response_format, ...)
    max_tokens_param: str = "max_tokens"  # the field the client used (chat may say max_completion_tokens)

    @property
    def num_seqs(self) -> int:
        return max(1, len(self.prompts)) * self.params.n


# ---- JSON body and typed fields ---------------------------------------------------------------

def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise ProtocolError("The request body is empty; expected a JSON object.")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"The request body must be a JSON object, not a JSON {type(body).__name__}.")
    return body


def _type_error(name: str, value: Any, expected: str) -> ProtocolError:
    return ProtocolError(f"`{name}` must be {expected}, got {json.dumps(value)[:100]}", param=name)


def get_bool(body: dict, name: str, default: bool | None) -> bool | None:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, value, "a boolean")
    return value


def get_int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, value, "an integer")
    if lo is not None and value < lo:
        raise ProtocolError(f"`{name}` must be >= {lo}, got {value}", param=name)
    if hi is not None and value > hi:
        raise ProtocolError(f"`{name}` must be <= {hi}, got {value}", param=name)
    return value


def get_float(body: dict, name: str, default: float | None, lo: float | None = None,
              hi: float | None = None) -> float | None:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _type_error(name, value, "a finite number")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ProtocolError(f"`{name}` must be in [{lo}, {hi}], got {value}", param=name)
    return float(value)


def get_str(body: dict, name: str, default: str | None) -> str | None:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if not isinstance(value, str):
        raise _type_error(name, value, "a string")
    return value


def get_dict(body: dict, name: str) -> dict | None:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise _type_error(name, value, "an object")
    return value


def check_model(body: dict, settings: ServerSettings) -> str:
    """The served name to echo back; 404 for a model this server does not serve."""
    model = get_str(body, "model", None)
    if model is None:
        return settings.model_name
    if model not in settings.served_model_names:
        raise ProtocolError(f"The model `{model}` does not exist.", param="model", status=404)
    return model


def token_ids(value: Any, name: str, vocab_size: int | None, allow_empty: bool = False) -> list[int]:
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise _type_error(name, value, "a list of integer token ids")
    if not value and not allow_empty:
        raise ProtocolError(f"`{name}` must not be empty", param=name)
    bad = [t for t in value if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        limit = f"the vocabulary [0, {vocab_size})" if vocab_size is not None else "token ids >= 0"
        raise ProtocolError(f"`{name}` has token ids {bad[:5]} outside {limit}", param=name)
    return value


# ---- features paxserve does not implement (yet) ------------------------------------------------

def _unsupported(name: str, what: str | None = None) -> ProtocolError:
    return ProtocolError(f"`{name}` is not supported by paxserve yet" + (f": {what}" if what else ""), param=name)


def _check_unsupported(body: dict, chat: bool) -> None:
    for name in ("logits_processors", "prompt_embeds", "lora_request",
                 "functions", "function_call", "audio", "prediction", "web_search_options", "kv_transfer_params"):
        if body.get(name) not in (None, [], {}):
            raise _unsupported(name)
    if get_bool(body, "use_beam_search", False):
        raise _unsupported("use_beam_search", "beam search")
    backend = get_str(body, "guided_decoding_backend", None)
    if backend is not None and backend not in ("auto", "guidance", "llguidance"):
        raise ProtocolError(f"`guided_decoding_backend` {backend!r} is not available: paxserve guides decoding with "
                            "llguidance ('guidance')", param="guided_decoding_backend")
    if chat:
        modalities = body.get("modalities")
        if modalities is not None and modalities != ["text"]:
            raise _unsupported("modalities", "only ['text'] is produced")
        if get_bool(body, "echo", False):
            raise _unsupported("echo", "echoing the last message in chat completions")
    else:
        if get_str(body, "suffix", None):
            raise _unsupported("suffix", "insertion (fill-in-the-middle) completions")


# ---- sampling ---------------------------------------------------------------------------------

def _stream_flags(body: dict, spec: GenerationSpec) -> None:
    spec.stream = bool(get_bool(body, "stream", False))
    options = get_dict(body, "stream_options")
    if options is not None:
        if not spec.stream:
            raise ProtocolError("Stream options can only be defined when `stream=True`.", param="stream_options")
        spec.include_usage = bool(get_bool(options, "include_usage", False))
        spec.continuous_usage = bool(get_bool(options, "continuous_usage_stats", False))


def _stop_strings(body: dict, settings: ServerSettings) -> list[str] | str | None:
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and (
            not isinstance(stop, list) or any(not isinstance(s, str) for s in stop)):
        raise _type_error("stop", stop, "a string or a list of strings")
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if len(stops) > settings.max_stop_strings:
        raise ProtocolError(f"`stop` has {len(stops)} stop strings; at most {settings.max_stop_strings} are allowed "
                            "(--max-stop-strings)", param="stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise ProtocolError(f"`stop` strings must be at most {MAX_STOP_STRING_CHARS} characters long", param="stop")
    return stop


def get_cache_salt(body: dict) -> str | None:
    salt = get_str(body, "cache_salt", None)
    if salt is not None and not salt:
        raise ProtocolError("`cache_salt` must be a non-empty string if provided", param="cache_salt")
    return salt


def check_request_chat_template(body: dict, settings: ServerSettings) -> str | None:
    """A request's own chat template, refused unless the operator trusts request templates: any
    Jinja a client sends runs on the server (vLLM: --trust-request-chat-template)."""
    template = get_str(body, "chat_template", None)
    kwargs = get_dict(body, "chat_template_kwargs") or {}
    if (template is not None or "chat_template" in kwargs) and not settings.trust_request_chat_template:
        raise ProtocolError("Chat template is passed with request, but --trust-request-chat-template is not set. "
                            "Refused request with untrusted chat template.", param="chat_template")
    return template


def _sampling_params(body: dict, max_tokens: int | None, logprobs: int | None, renames: dict[str, str],
                     settings: ServerSettings, structured: StructuredOutputsParams | None = None) -> SamplingParams:
    vocab_size = settings.vocab_size
    n = get_int(body, "n", 1, lo=1, hi=MAX_N)
    best_of = get_int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise _unsupported("best_of", "only best_of == n")
    stop = _stop_strings(body, settings)
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None:
        stop_token_ids = token_ids(stop_token_ids, "stop_token_ids", vocab_size, allow_empty=True)
    logit_bias = get_dict(body, "logit_bias")
    if logit_bias is not None:
        try:
            logit_bias = {int(k): float(v) for k, v in logit_bias.items()}
        except (TypeError, ValueError):
            raise ProtocolError("`logit_bias` must map token ids to numbers in [-100, 100]", param="logit_bias") \
                from None
        if any(not math.isfinite(v) for v in logit_bias.values()):
            raise ProtocolError("`logit_bias` values must be finite numbers in [-100, 100]", param="logit_bias")
        bad = [t for t in logit_bias if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise ProtocolError(f"`logit_bias` has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})",
                                param="logit_bias")
    # Fields the body leaves out (or sends as null) take the model's defaults (--generation-config),
    # else paxserve's; max_tokens' default is applied by the input processor (max_tokens=None).
    defaults = settings.sampling_defaults or {}
    top_k = get_int(body, "top_k", defaults.get("top_k", 0))
    try:
        return SamplingParams(
            n=n,
            temperature=get_float(body, "temperature", defaults.get("temperature", 1.0), lo=0.0, hi=2.0),
            top_p=get_float(body, "top_p", defaults.get("top_p", 1.0)),
            top_k=top_k,
            min_p=get_float(body, "min_p", defaults.get("min_p", 0.0)),
            seed=get_int(body, "seed", None),
            presence_penalty=get_float(body, "presence_penalty", 0.0),
            frequency_penalty=get_float(body, "frequency_penalty", 0.0),
            repetition_penalty=get_float(body, "repetition_penalty", defaults.get("repetition_penalty", 1.0)),
            logit_bias=logit_bias or None,
            stop=stop or None,
            stop_token_ids=stop_token_ids or None,
            ignore_eos=bool(get_bool(body, "ignore_eos", False)),
            max_tokens=max_tokens,
            min_tokens=get_int(body, "min_tokens", 0),
            logprobs=logprobs,
            include_stop_str_in_output=bool(get_bool(body, "include_stop_str_in_output", False)),
            skip_special_tokens=bool(get_bool(body, "skip_special_tokens", True)),
            structured_outputs=structured,
            prompt_logprobs=_prompt_logprobs(body, settings),
        )
    except ValueError as e:
        raise from_value_error(e, renames=renames) from None


def _prompt_logprobs(body: dict, settings: ServerSettings) -> int | None:
    """vLLM's `prompt_logprobs`: the prompt's own tokens scored, with this many alternatives."""
    value = get_int(body, "prompt_logprobs", None, lo=0)
    _check_logprobs(value, "prompt_logprobs", settings)
    return value


def _check_logprobs(value: int | None, name: str, settings: ServerSettings) -> None:
    if value is not None and value > settings.max_logprobs:
        raise ProtocolError(f"Requested {name} of {value}, which is greater than max allowed: "
                            f"{settings.max_logprobs}", param=name)


# ---- the two generation endpoints -------------------------------------------------------------

def _completion_prompts(body: dict, vocab_size: int | None) -> list[Prompt]:
    if "prompt" not in body or body["prompt"] is None:
        raise ProtocolError("`prompt` is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        prompts: list[Prompt] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [token_ids(p, "prompt", vocab_size) for p in prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = [token_ids(prompt, "prompt", vocab_size)]
    elif isinstance(prompt, list):
        raise ProtocolError("`prompt` must not be empty", param="prompt")
    else:
        raise _type_error("prompt", prompt, "a string, a list of strings, a list of token ids or a list of those")
    if any(p == "" for p in prompts):
        raise ProtocolError("`prompt` must not be empty", param="prompt")
    return prompts


def parse_completion_request(body: dict, settings: ServerSettings) -> GenerationSpec:
    model = check_model(body, settings)
    _check_unsupported(body, chat=False)
    prompts = _completion_prompts(body, settings.vocab_size)
    logprobs = get_int(body, "logprobs", None, lo=0)
    _check_logprobs(logprobs, "logprobs", settings)
    echo = bool(get_bool(body, "echo", False))
    # OpenAI's newer name is accepted here too, so one client setting works on both endpoints.
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = get_int(body, max_name, 16)
    structured, structured_param = parse_structured_outputs(body)
    params = _sampling_params(body, max_tokens, logprobs, {"max_tokens": max_name}, settings, structured)
    if echo and logprobs is not None:  # OpenAI: the echoed prompt's tokens come with their logprobs too
        params.prompt_logprobs = max(logprobs, params.prompt_logprobs or 0)
    spec = GenerationSpec("completion", model, params, prompts=prompts, echo=echo, logprobs=logprobs,
                          cache_salt=get_cache_salt(body), structured_param=structured_param,
                          max_tokens_param=max_name)
    _stream_flags(body, spec)
    return spec


def _message_text(content: Any, index: int) -> str:
    param = "messages"
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ProtocolError(f"messages[{index}].content must be a string or a list of content parts", param=param)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image_url", "input_image", "input_audio", "audio_url", "video_url", "file", "image"):
            raise ProtocolError(f"messages[{index}]: {kind} content parts are not supported by paxserve yet "
                                "(text-only models)", param=param)
        else:
            raise ProtocolError(f"messages[{index}]: each content part must be {{'type': 'text', 'text': ...}}",
                                param=param)
    return "\n".join(texts)


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise ProtocolError("`messages` is required", param="messages")
    if not isinstance(value, list) or not value:
        raise ProtocolError("`messages` must be a non-empty list of messages", param="messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ProtocolError(f"messages[{i}] must be an object with a string `role`", param="messages")
        role = message["role"]
        if role == "function" or message.get("function_call"):
            raise ProtocolError(f"messages[{i}]: the deprecated `function` role and `function_call` are not "
                                "supported; use `tool_calls` and the `tool` role", param="messages")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ProtocolError(f"messages[{i}].role {role!r} is not one of system, developer, user, assistant, tool",
                                param="messages")
        if "content" not in message and role != "assistant":
            raise ProtocolError(f"messages[{i}] has no `content`", param="messages")
        out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _message_text(message.get("content"), i)}
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise ProtocolError(f"messages[{i}].tool_call_id must be a string", param="messages")
            out["tool_call_id"] = call_id
            if isinstance(message.get("name"), str):
                out["name"] = message["name"]
        if role == "assistant":
            if message.get("tool_calls"):
                out["tool_calls"] = template_tool_calls(message["tool_calls"], i)
            # vLLM's and DeepSeek's names for earlier thinking; templates read `reasoning_content`.
            thinking = message.get("reasoning_content", message.get("reasoning"))
            if isinstance(thinking, str) and thinking:
                out["reasoning_content"] = thinking
        messages.append(out)
    return messages


def parse_chat_request(body: dict, settings: ServerSettings) -> GenerationSpec:
    model = check_model(body, settings)
    _check_unsupported(body, chat=True)
    messages = parse_messages(body.get("messages"))
    want_logprobs = bool(get_bool(body, "logprobs", False))
    top_logprobs = get_int(body, "top_logprobs", None, lo=0)
    if top_logprobs and not want_logprobs:
        raise ProtocolError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    _check_logprobs(top_logprobs, "top_logprobs", settings)
    logprobs = (top_logprobs or 0) if want_logprobs else None
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = get_int(body, max_name, None)
    tool_spec = parse_tools(body, settings)
    structured, structured_param = parse_structured_outputs(body)
    if tool_spec.constraint is not None:
        if structured is not None:
            raise ProtocolError(f"`{structured_param}` cannot be combined with a tool_choice that forces a call (the "
                                "call's arguments schema already guides the output)", param=structured_param)
        structured, structured_param = tool_spec.constraint, "tool_choice"
    params = _sampling_params(body, max_tokens, logprobs, {"logprobs": "top_logprobs", "max_tokens": max_name},
                              settings, structured)
    if tool_spec.parser is not None and tool_spec.parser.keep_special_tokens:
        params.skip_special_tokens = False  # the format's markers are special tokens
    spec = GenerationSpec("chat", model, params, messages=messages, logprobs=logprobs,
                          cache_salt=get_cache_salt(body), max_tokens_param=max_name,
                          structured_param=structured_param)
    spec.tools = tool_spec.tools or None
    spec.output = ChatOutputParsers.for_request(settings, tool_spec, guided=structured is not None)
    spec.add_generation_prompt = bool(get_bool(body, "add_generation_prompt", True))
    spec.continue_final_message = bool(get_bool(body, "continue_final_message", False))
    if spec.add_generation_prompt and spec.continue_final_message:
        raise ProtocolError("`continue_final_message` needs `add_generation_prompt` set to false",
                            param="continue_final_message")
    spec.chat_template = check_request_chat_template(body, settings)
    spec.chat_template_kwargs = get_dict(body, "chat_template_kwargs") or {}
    _stream_flags(body, spec)
    return spec
