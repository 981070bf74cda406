"""POST /v1/responses bodies: the pydantic model, and their translation into a chat request.

`input` (a string or a list of items: messages, `function_call`, `function_call_output`,
`reasoning`) becomes chat messages, `instructions` a system message first, function `tools` and
`tool_choice` chat's, `text.format` a `response_format`, `max_output_tokens` the output limit and
`reasoning.effort` the chat template's `reasoning_effort`. The chat request then goes through the
one input path (chat_spec). Hosted tools, files and images are refused naming the item.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictStr

from paxserve.server.errors import ProtocolError
from paxserve.server.protocol import Float, Int, _Body, _Request

# Includes that ask for nothing paxserve would leave out: accepted as no-ops.
HARMLESS_INCLUDES = ("reasoning.encrypted_content", "message.output_text.logprobs")


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextConfig(_Body):
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Request):
    """The fields of OpenAI's responses.create that a self-hosted model can honour."""

    model: StrictStr | None = None
    input: StrictStr | list[Any]
    instructions: StrictStr | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Float | None = None
    top_logprobs: Annotated[Int, Field(ge=0, le=20)] | None = None
    reasoning: ReasoningConfig | None = None
    stream: StrictBool | None = None
    stream_options: dict[str, Any] | None = None
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    include: list[StrictStr] | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    service_tier: StrictStr | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # vLLM's extras on this endpoint.
    priority: Int | None = None
    seed: Int | None = None
    top_k: Int | None = None
    cache_salt: Annotated[StrictStr, Field(min_length=1)] | None = None
    # OpenAI features that need OpenAI's servers: a 400 when sent.
    background: StrictBool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None


def check_supported(req: ResponsesRequest) -> None:
    if req.background:
        raise _unsupported("background", "background responses (run the request in the foreground)")
    for name in ("conversation", "prompt", "max_tool_calls"):
        if getattr(req, name) is not None:
            raise _unsupported(name)
    if req.truncation == "auto":
        raise _unsupported("truncation", "'auto' truncation (an input too long for the context is a 400)")
    for value in req.include or ():
        if value not in HARMLESS_INCLUDES:
            raise _unsupported("include", f"{value!r}")


def _unsupported(name: str, what: str | None = None) -> ProtocolError:
    return ProtocolError(f"`{name}` is not supported by paxserve" + (f": {what}" if what else ""), param=name)


# ---- input items -> chat messages ------------------------------------------------------------------

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _text(content: Any, where: str) -> str:
    """A message's content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ProtocolError(f"`{where}` must be a string or a list of content parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise ProtocolError(f"`{where}[{j}]`: {kind} content is not supported by paxserve (text-only models)",
                                param="input")
        else:
            raise ProtocolError(f"`{where}[{j}]` must be a text part (input_text or output_text with a `text` "
                                f"string), got type {kind!r}", param="input")
    return "".join(texts)


def _assistant(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message the next output item belongs to: the last one, or a new one (a tool
    result or a user turn in between starts a new one)."""
    if messages and messages[-1]["role"] == "assistant":
        return messages[-1]
    message: dict[str, Any] = {"role": "assistant", "content": None}
    messages.append(message)
    return message


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """Chat messages for `input`. An assistant turn's output items (reasoning, a message, function
    calls) fold into one assistant message, as the chat template expects."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    pending_reasoning: list[str] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ProtocolError(f"`{where}` must be an object (an input item)", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ProtocolError(f"`{where}.role` must be user, system, developer or assistant, got {role!r}",
                                    param="input")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                message = _assistant(messages)
                message["content"] = (message["content"] or "") + text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", ""), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise ProtocolError(f"`{where}`: a function_call needs `call_id`, `name` and `arguments` strings",
                                    param="input")
            message = _assistant(messages)
            message.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise ProtocolError(f"`{where}.call_id` must be a string", param="input")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append({"role": "tool", "content": text, "tool_call_id": call_id})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            pending_reasoning.append(_text(parts, f"{where}.content"))
            message = _assistant(messages)
            message["reasoning"] = "".join(pending_reasoning)
        elif kind == "item_reference":
            raise ProtocolError(f"`{where}`: item references need the response store; send the item itself, or "
                                "use `previous_response_id` on a server started with --enable-response-store",
                                param="input")
        else:
            raise ProtocolError(f"`{where}.type` {kind!r} is not supported: paxserve reads message, function_call, "
                                "function_call_output and reasoning items", param="input")
        if kind != "reasoning":
            pending_reasoning = []
    return messages


# ---- tools and output format -------------------------------------------------------------------------

def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ProtocolError(f"`tools[{i}].type` {kind!r} is not supported: paxserve runs function tools only "
                                "(hosted tools such as web_search or file_search need OpenAI's servers)",
                                param="tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else type(choice).__name__
    raise ProtocolError(f"`tool_choice` {kind!r} is not supported: use 'auto', 'none', 'required' or "
                        "{'type': 'function', 'name': ...}", param="tool_choice")


def response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """text.format -> chat's response_format."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ProtocolError("`text.format.schema` must be a JSON schema object", param="text.format")
        schema = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise ProtocolError(f"`text.format.type` must be text, json_object or json_schema, got {fmt.get('type')!r}",
                        param="text.format")


def chat_body(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request that runs `req`: its instructions, then `conversation` (the earlier turns
    previous_response_id names, then this request's input)."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += conversation
    if not messages:
        raise ProtocolError("`input` must not be empty", param="input")
    kwargs: dict[str, Any] = {}
    if req.reasoning is not None and req.reasoning.effort is not None:
        kwargs["reasoning_effort"] = req.reasoning.effort  # gpt-oss style templates read it
        if req.reasoning.effort == "none":
            kwargs["enable_thinking"] = False  # Qwen3 style templates read this one
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice), "response_format": response_format(req.text),
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k, "seed": req.seed, "priority": req.priority, "cache_salt": req.cache_salt,
        "chat_template_kwargs": kwargs or None,
    }
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.top_logprobs is not None or "message.output_text.logprobs" in (req.include or ()):
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    return {k: v for k, v in body.items() if v is not None}


# Chat's field names in errors -> this endpoint's.
CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                     "response_format": "text.format", "prompt": "input"}


def renamed(err: ProtocolError) -> ProtocolError:
    if err.param in CHAT_TO_RESPONSES:
        new = CHAT_TO_RESPONSES[err.param]
        message = err.message.replace(f"`{err.param}`", f"`{new}`")
        return ProtocolError(message, param=new, status=err.status, type=err.type, code=err.code, headers=err.headers)
    return err


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a follow-up turn replays."""
    return input_messages([{k: v for k, v in item.items() if k != "status"} for item in output]) if output else []

