"""A parsed /v1/completions or /v1/chat/completions body -> what the server runs: SamplingParams,
the prompts or messages, and how to answer (stream, usage, logprobs, output parsers).

Types were checked by the pydantic models (server/protocol.py); SamplingParams checks its ranges
and names the field; here only the limits this server's flags set (model names, --max-logprobs,
--max-stop-strings, trusted templates).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paxserve.sampling_params import RequestError, SamplingParams
from paxserve.server.errors import ProtocolError, from_value_error
from paxserve.server.protocol import ChatCompletionRequest, ChatFields, CompletionRequest, SamplingFields, parse_body
from paxserve.server.settings import ServerSettings
from paxserve.server.structured import parse_structured_outputs
from paxserve.server.tools import ChatOutputParsers, parse_tools, template_tool_calls
from paxserve.structured_outputs import StructuredOutputsParams

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
    lora_request: Any = None  # the LoRA adapter `model` names (paxserve.LoRARequest), if it names one
    priority: int = 0  # the request's place under --scheduling-policy priority (lower first)
    return_token_ids: bool = False  # vLLM's: choices carry `token_ids` (and the prompt's `prompt_token_ids`)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:{id}"
    logprob_token_ids: list[int] | None = None  # vLLM's: logprobs list these tokens, not the top ones
    add_special_tokens: bool = False  # chat: the template wrote them (vLLM's add_special_tokens); completions: True
    structured_param: str | None = None  # the field the output constraint came from (response_format, ...)
    max_tokens_param: str = "max_tokens"  # the field the client used (chat may say max_completion_tokens)

    @property
    def num_seqs(self) -> int:
        return max(1, len(self.prompts)) * self.params.n

    @property
    def prompt_param(self) -> str:
        """The field a prompt's errors blame."""
        return "messages" if self.kind == "chat" else "prompt"

    def renames(self) -> dict[str, str]:
        """Engine field names -> the names this request's client used."""
        return field_renames(self.kind, self.max_tokens_param, self.structured_param)


def field_renames(kind: str, max_tokens_param: str, structured_param: str | None = None) -> dict[str, str]:
    """Engine field names -> a request's own (max_tokens -> max_completion_tokens, prompt -> messages,
    chat's logprobs -> top_logprobs, structured_outputs -> the field the constraint came from)."""
    names = {"max_tokens": max_tokens_param, "prompt": "messages" if kind == "chat" else "prompt"}
    if kind == "chat":
        names["logprobs"] = "top_logprobs"
    if structured_param is not None:
        names["structured_outputs"] = structured_param
    return names


def check_model(model: str | None, settings: ServerSettings) -> str:
    """The served name to echo back; 404 for a model this server does not serve."""
    if model is None:
        return settings.model_name
    if model not in settings.served_model_names and settings.lora(model) is None:
        raise ProtocolError(f"The model `{model}` does not exist.", param="model", status=404)
    return model


def check_request_chat_template(req: ChatFields, settings: ServerSettings) -> str | None:
    """A request's own chat template, refused unless the operator trusts request templates: any
    Jinja a client sends runs on the server (vLLM: --trust-request-chat-template)."""
    if (req.chat_template is not None or "chat_template" in (req.chat_template_kwargs or {})) \
            and not settings.trust_request_chat_template:
        raise ProtocolError("Chat template is passed with request, but --trust-request-chat-template is not set. "
                            "Refused request with untrusted chat template.", param="chat_template")
    return req.chat_template


def template_messages(req: ChatFields) -> list[dict[str, Any]]:
    """The conversation as chat templates read it: text contents, `developer` as `system`, tool
    calls with their arguments as objects, earlier thinking as `reasoning_content`."""
    messages = []
    for i, m in enumerate(req.messages):
        out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text}
        if m.role == "tool":
            out["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                out["name"] = m.name
        if m.role == "assistant":
            if m.tool_calls:
                out["tool_calls"] = template_tool_calls(m.tool_calls, i)
            thinking = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if thinking:
                out["reasoning_content"] = thinking
        messages.append(out)
    return messages


def _check_logprobs(value: int | None, name: str, settings: ServerSettings) -> None:
    """vLLM's --max-logprobs: -1 there lifts the cap; -1 here asks for the whole vocabulary."""
    if value is None or settings.max_logprobs < 0:
        return
    wanted = (settings.vocab_size or 0) if value < 0 else value
    if wanted > settings.max_logprobs:
        asked = f"{value} (the whole vocabulary, {settings.vocab_size} tokens)" if value < 0 else str(value)
        raise ProtocolError(f"Requested {name} of {asked}, which is greater than max allowed: "
                            f"{settings.max_logprobs}", param=name)


def _sampling_params(req: SamplingFields, settings: ServerSettings, *, logprobs: int | None,
                     prompt_logprobs: int | None, max_tokens: int | None, renames: dict[str, str],
                     structured: StructuredOutputsParams | None, skip_special_tokens: bool) -> SamplingParams:
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > settings.max_stop_strings:
        raise ProtocolError(f"`stop` has {len(stops)} stop strings; at most {settings.max_stop_strings} are allowed "
                            "(--max-stop-strings)", param="stop")
    _check_logprobs(prompt_logprobs, "prompt_logprobs", settings)
    _check_logprobs(len(req.logprob_token_ids) if req.logprob_token_ids else None, "logprob_token_ids", settings)
    # Fields the body leaves out (or sends as null) take the model's defaults (--generation-config),
    # else paxserve's; max_tokens' default is applied by the input processor (max_tokens=None).
    defaults = settings.sampling_defaults or {}

    def pick(value: Any, name: str, default: Any) -> Any:
        return value if value is not None else defaults.get(name, default)

    try:
        return SamplingParams(
            n=req.n or 1, temperature=pick(req.temperature, "temperature", 1.0), top_p=pick(req.top_p, "top_p", 1.0),
            top_k=pick(req.top_k, "top_k", 0), min_p=pick(req.min_p, "min_p", 0.0), seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
            logit_bias=req.logit_bias_ids(), stop=req.stop or None, stop_token_ids=req.stop_token_ids or None,
            allowed_token_ids=None if req.allowed_token_ids is None else list(req.allowed_token_ids),
            logprob_token_ids=None if req.logprob_token_ids is None else list(req.logprob_token_ids),
            ignore_eos=bool(req.ignore_eos), max_tokens=max_tokens, min_tokens=req.min_tokens or 0,
            logprobs=logprobs, include_stop_str_in_output=bool(req.include_stop_str_in_output),
            skip_special_tokens=skip_special_tokens, structured_outputs=structured, prompt_logprobs=prompt_logprobs)
    except RequestError as e:
        raise from_value_error(e, renames=renames) from None


def _stream_flags(req: SamplingFields, spec: GenerationSpec, settings: ServerSettings) -> GenerationSpec:
    spec.stream = bool(req.stream)
    spec.return_token_ids = bool(req.return_token_ids)
    spec.tokens_as_ids = req.return_tokens_as_token_ids if req.return_tokens_as_token_ids is not None else \
        settings.return_tokens_as_token_ids
    spec.logprob_token_ids = spec.params.logprob_token_ids
    if req.stream_options is not None:
        spec.include_usage = bool(req.stream_options.include_usage)
        spec.continuous_usage = bool(req.stream_options.continuous_usage_stats)
    return spec


def completion_spec(req: CompletionRequest, settings: ServerSettings) -> GenerationSpec:
    model = check_model(req.model, settings)
    _check_logprobs(req.logprobs, "logprobs", settings)
    # vLLM's: with logprob_token_ids, the chosen tokens' logprobs are the output's even without `logprobs`.
    logprobs = 0 if req.logprob_token_ids and req.logprobs is None else req.logprobs
    echo = bool(req.echo)
    max_name = req.max_tokens_field
    max_tokens = req.max_tokens_value if req.max_tokens_value is not None else 16
    structured, structured_param = parse_structured_outputs(req)
    prompt_logprobs = req.prompt_logprobs
    if echo and logprobs is not None:  # OpenAI: the echoed prompt's tokens come with their logprobs too
        prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    params = _sampling_params(req, settings, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              max_tokens=max_tokens, renames=field_renames("completion", max_name),
                              structured=structured, skip_special_tokens=req.skip_special_tokens is not False)
    spec = GenerationSpec("completion", model, params, prompts=req.prompt_list(), echo=echo, logprobs=logprobs,
                          cache_salt=req.cache_salt, structured_param=structured_param, max_tokens_param=max_name,
                          lora_request=settings.lora(model), priority=req.priority or 0, add_special_tokens=True)
    return _stream_flags(req, spec, settings)


def _template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """chat_template_kwargs, with OpenAI's `reasoning_effort` as the template's variable of that name
    (what gpt-oss style templates read; a request's own kwargs win)."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    return kwargs


def chat_spec(req: ChatCompletionRequest, settings: ServerSettings) -> GenerationSpec:
    model = check_model(req.model, settings)
    messages = template_messages(req)
    _check_logprobs(req.top_logprobs, "top_logprobs", settings)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.logprob_token_ids and not req.logprobs:
        raise ProtocolError("`logprob_token_ids` needs `logprobs: true` (they are the logprobs the response lists)",
                            param="logprob_token_ids")
    max_name = req.max_tokens_field
    tool_spec = parse_tools(req, settings)
    structured, structured_param = parse_structured_outputs(req)
    if tool_spec.constraint is not None:
        if structured is not None:
            raise ProtocolError(f"`{structured_param}` cannot be combined with a tool_choice that forces a call (the "
                                "call's arguments schema already guides the output)", param=structured_param)
        structured, structured_param = tool_spec.constraint, "tool_choice"
    # A tool-call format's markers are special tokens: the parser must see them.
    keep_special = tool_spec.parser is not None and tool_spec.parser.keep_special_tokens
    params = _sampling_params(req, settings, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs,
                              max_tokens=req.max_tokens_value,
                              renames=field_renames("chat", max_name), structured=structured,
                              skip_special_tokens=req.skip_special_tokens is not False and not keep_special)
    spec = GenerationSpec("chat", model, params, messages=messages, logprobs=logprobs, cache_salt=req.cache_salt,
                          lora_request=settings.lora(model), priority=req.priority or 0,
                          max_tokens_param=max_name, structured_param=structured_param,
                          tools=tool_spec.tools or None,
                          output=ChatOutputParsers.for_request(settings, tool_spec, guided=structured is not None,
                                                               include_reasoning=req.include_reasoning),
                          add_generation_prompt=req.add_generation_prompt,
                          continue_final_message=req.continue_final_message,
                          chat_template=check_request_chat_template(req, settings),
                          chat_template_kwargs=_template_kwargs(req), add_special_tokens=req.add_special_tokens)
    return _stream_flags(req, spec, settings)



def parse_completion_request(body: dict[str, Any], settings: ServerSettings) -> GenerationSpec:
    """A /v1/completions JSON body -> its spec (ProtocolError naming the field)."""
    return completion_spec(parse_body(CompletionRequest, body), settings)


def parse_chat_request(body: dict[str, Any], settings: ServerSettings) -> GenerationSpec:
    """A /v1/chat/completions JSON body -> its spec (ProtocolError naming the field)."""
    return chat_spec(parse_body(ChatCompletionRequest, body), settings)
