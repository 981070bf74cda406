"""The OpenAI and vLLM request bodies as pydantic models: every field's type, and the limits that
belong to HTTP rather than to the engine (OpenAI's `n` <= 128 and temperature <= 2).

A body that does not fit raises ProtocolError naming the field (`param`, from pydantic's error
location). Ranges the offline API shares (top_p, penalties, max_tokens, ...) are SamplingParams'
own checks, and what needs the tokenizer or the model's limits is the input processor's; both name
their field too, so nothing here repeats them.

A request body's unknown top-level field is a 400 naming it (OpenAI's API refuses them too): a
misspelt `max_token` must not silently generate 16 tokens. Known fields paxserve cannot honour are
a 400 that says so; tracking fields that ask nothing of generation (`user`, `metadata`,
`safety_identifier`, `prompt_cache_key`, `service_tier`) are accepted. Nested objects (messages,
tools, formats) keep ignoring extra keys: clients send back whole response objects as messages.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationError, field_validator, model_validator)

from paxserve.server.errors import ProtocolError


def _integral(value: Any) -> Any:
    """JSON has one number type: 2.0 is the integer 2 (as OpenAI accepts), 2.5 is not."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


Int = Annotated[StrictInt, BeforeValidator(_integral)]
Float = StrictFloat  # an int or a float, finite (allow_inf_nan=False below); never a string or a bool
TokenIds = list[Int]
MAX_N = 128  # OpenAI's limit on choices per request
MAX_TEMPERATURE = 2.0  # OpenAI's; the offline SamplingParams allows more
MAX_STOP_STRING_CHARS = 1024  # a stop string longer than this is a mistake, and costs every token a scan
UNSUPPORTED_CONTENT = ("image_url", "input_image", "input_audio", "audio_url", "video_url", "file", "image")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, frozen=True)


class _Request(_Body):
    """A whole request body: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class SamplingFields(_Request):
    """The fields both generation endpoints share. None means "not sent": the model's default
    (--generation-config) or paxserve's applies."""

    model: StrictStr | None = None
    n: Annotated[Int, Field(ge=1, le=MAX_N)] | None = None
    best_of: Int | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=MAX_TEMPERATURE)] | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    seed: Annotated[Int, Field(ge=-2**63, le=2**63 - 1)] | None = None  # vLLM's range, and its pydantic wording
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool | None = None
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None  # OpenAI's newer name, accepted on both endpoints
    min_tokens: Int | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    prompt_logprobs: Annotated[Int, Field(ge=-1)] | None = None  # -1: vLLM's "the whole vocabulary"
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[StrictStr, Field(min_length=1)] | None = None
    priority: Int | None = None  # vLLM's: lower first, under --scheduling-policy priority
    return_token_ids: StrictBool | None = None  # vLLM's: the prompt's and the output's token ids too
    return_tokens_as_token_ids: StrictBool | None = None  # vLLM's: logprobs name tokens "token_id:{id}"
    allowed_token_ids: TokenIds | None = None  # vLLM's: sample only these
    # Tracking fields: they ask nothing of generation.
    user: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None  # prefix caching is automatic; any key shares it
    service_tier: Literal["auto", "default", "flex", "priority", "scale"] | None = None
    # Output constraints: their shapes are read by server/structured.py, which names its field.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: StrictStr | None = None
    # vLLM and OpenAI features paxserve does not implement: sent non-empty, they are a 400.
    use_beam_search: StrictBool | None = None
    logits_processors: Any = None
    prompt_embeds: Any = None
    lora_request: Any = None
    kv_transfer_params: Any = None
    logprob_token_ids: TokenIds | None = None  # vLLM's: these tokens' logprobs instead of the top ones
    bad_words: Any = None
    length_penalty: Any = None
    truncate_prompt_tokens: Any = None
    spaces_between_special_tokens: StrictBool | None = None
    request_id: Any = None
    vllm_xargs: Any = None
    structural_tag: Any = None
    guided_whitespace_pattern: Any = None
    store: StrictBool | None = None  # OpenAI keeps completions for its evals; nothing keeps them here

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str)
                                                                                         for s in value)):
            return value
        raise ValueError("must be a string or a list of strings")

    @model_validator(mode="after")
    def _supported(self) -> "SamplingFields":
        for name in ("logits_processors", "prompt_embeds", "lora_request", "kv_transfer_params", "bad_words", "truncate_prompt_tokens", "request_id", "vllm_xargs", "structural_tag",
                     "guided_whitespace_pattern"):
            if getattr(self, name) not in (None, [], {}):
                raise _unsupported(name)
        if self.length_penalty not in (None, 1, 1.0):
            raise _unsupported("length_penalty", "it applies to beam search")
        if self.spaces_between_special_tokens is False:
            raise _unsupported("spaces_between_special_tokens")
        if self.store:
            raise _unsupported("store", "stored completions (OpenAI's evals and distillation)")
        if self.use_beam_search:
            raise _unsupported("use_beam_search", "beam search")
        if self.guided_decoding_backend not in (None, "auto", "guidance", "llguidance"):
            raise ProtocolError(f"`guided_decoding_backend` {self.guided_decoding_backend!r} is not available: "
                                "paxserve guides decoding with llguidance ('guidance')", param="guided_decoding_backend")
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("Stream options can only be defined when `stream=True`.", param="stream_options")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise _unsupported("best_of", "only best_of == n")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise ProtocolError(f"`stop` strings must be at most {MAX_STOP_STRING_CHARS} characters long",
                                param="stop")
        return self

    @property
    def max_tokens_field(self) -> str:
        """The field the client used for the output limit (named in its errors)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def max_tokens_value(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logit_bias_ids(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bad = [k for k in self.logit_bias if not k.strip().lstrip("+-").isdigit()]
        if bad:
            raise ProtocolError(f"Found token_id(s) {bad[:5]} in logit_bias: token ids must be integers or strings "
                                "representing integers", param="logit_bias")
        return {int(k): v for k, v in self.logit_bias.items()}


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: StrictStr | list[StrictStr] | list[TokenIds] | TokenIds
    echo: StrictBool | None = None
    logprobs: Annotated[Int, Field(ge=-1)] | None = None  # -1: the whole vocabulary
    suffix: StrictStr | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if isinstance(value, str) or (isinstance(value, list) and (
                all(isinstance(p, str) for p in value) or all(isinstance(p, list) for p in value)
                or all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in value))):
            return value  # pydantic checks the items
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of those")

    @model_validator(mode="after")
    def _prompts(self) -> "CompletionRequest":
        if self.prompt == "" or self.prompt == [] or any(p in ("", []) for p in self.prompt_list()):
            raise ProtocolError("`prompt` must not be empty", param="prompt")
        if self.suffix:
            raise _unsupported("suffix", "insertion (fill-in-the-middle) completions")
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """One entry per prompt: a batch is a list of strings or a list of token-id lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    # OpenAI's roles, or any other: as vLLM, a custom role goes to the chat template as it is.
    role: Annotated[StrictStr, Field(min_length=1)]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None  # DeepSeek's name for earlier thinking
    reasoning: StrictStr | None = None  # vLLM's

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_we_cannot_read(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("role") == "function" or data.get("function_call"):
                raise ValueError("the deprecated `function` role and `function_call` are not supported; use "
                                 "`tool_calls` and the `tool` role")
            content = data.get("content")
            for part in content if isinstance(content, list) else ():
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in UNSUPPORTED_CONTENT:
                    raise ValueError(f"{kind} content parts are not supported by paxserve yet (text-only models)")
            if "content" not in data and data.get("role") != "assistant":
                raise ValueError("a message needs `content` (only an assistant's may leave it out)")
        return data

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatFields(_Body):
    """What chat and vLLM's chat-form /tokenize share: the conversation and its template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None  # read by server/tools.py (parsers.tool_calls.validate_tools), which names the field

    @model_validator(mode="after")
    def _generation_prompt(self) -> "ChatFields":
        if self.add_generation_prompt and self.continue_final_message:
            raise ProtocolError("`continue_final_message` needs `add_generation_prompt` set to false",
                                param="continue_final_message")
        return self


class ChatCompletionRequest(ChatFields, SamplingFields):
    """POST /v1/chat/completions."""

    logprobs: StrictBool | None = None
    top_logprobs: Annotated[Int, Field(ge=-1)] | None = None  # -1: the whole vocabulary
    tool_choice: Any = None
    parallel_tool_calls: StrictBool = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None  # the template's
    include_reasoning: StrictBool = True  # vLLM's: false leaves the reasoning out of the answer
    add_special_tokens: StrictBool = False  # vLLM's: the template already wrote the special tokens
    documents: Any = None
    mm_processor_kwargs: Any = None
    verbosity: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Literal["in_memory"] | None = None  # the prefix cache lives in memory
    modalities: list[StrictStr] | None = None
    echo: StrictBool | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None

    @model_validator(mode="after")
    def _chat_supported(self) -> "ChatCompletionRequest":
        for name in ("functions", "function_call", "audio", "prediction", "web_search_options", "documents",
                     "mm_processor_kwargs", "verbosity", "moderation", "prompt_cache_options"):
            if getattr(self, name) not in (None, [], {}):
                raise _unsupported(name)
        if self.modalities is not None and self.modalities != ["text"]:
            raise _unsupported("modalities", "only ['text'] is produced")
        if self.echo:
            raise _unsupported("echo", "echoing the last message in chat completions")
        if self.top_logprobs and not self.logprobs:
            raise ProtocolError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
        return self


class TokenizeRequest(_Request):
    """vLLM's POST /tokenize with a `prompt`."""

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(ChatFields, _Request):
    """vLLM's POST /tokenize with `messages`: the conversation as the chat template renders it."""

    model: StrictStr | None = None
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Request):
    model: StrictStr | None = None
    tokens: TokenIds


# ---- parsing --------------------------------------------------------------------------------------

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


Model = TypeVar("Model", bound=BaseModel)


def parse_body(model: type[Model], body: dict[str, Any]) -> Model:
    """The body as `model`; a body that does not fit is a 400 naming the first field at fault."""
    try:
        return model.model_validate(body)
    except ProtocolError:
        raise
    except ValidationError as e:
        raise _field_error(e) from None


def _field_error(e: ValidationError) -> ProtocolError:
    error = e.errors(include_url=False)[0]
    loc = error["loc"]
    # A union reports one error per member; the location names the member (`str`, `list[int]`...),
    # which the client never wrote: keep the path through its own fields and list indices.
    path = [str(part) for part in loc if isinstance(part, int) or not _is_type_name(part)]
    where = path[0] + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path[1:]) if path else "body"
    message = error["msg"].removeprefix("Value error, ")
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, ProtocolError):
        return cause
    if error["type"] == "extra_forbidden" and len(path) == 1:
        return ProtocolError(f"Unknown field `{where}`: not a field of this endpoint that paxserve knows (unknown "
                             "fields are refused, never ignored; check its spelling)", param=where)
    got = "" if error["type"] in ("missing", "value_error") else \
        f", got {json.dumps(error.get('input'), default=str)[:100]}"
    if error["type"] == "missing":
        message = "this field is required"
    return ProtocolError(f"`{where}`: {message}{got}", param=path[0] if path else None)


def _is_type_name(part: str) -> bool:
    return any(c in part for c in "[]") or part in ("str", "int", "float", "bool", "dict", "list") or \
        part.startswith(("constrained-", "function-", "literal")) or part[:1].isupper()


def _unsupported(name: str, what: str | None = None) -> ProtocolError:
    return ProtocolError(f"`{name}` is not supported by paxserve yet" + (f": {what}" if what else ""), param=name)
