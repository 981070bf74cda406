"""Anthropic's POST /v1/messages bodies: the pydantic model, and their translation into a chat request.

`system` becomes a system message; a user turn's `tool_result` blocks become tool messages (before
the turn's text, as Anthropic orders them); an assistant turn's `text`, `tool_use` and `thinking`
blocks become one assistant message with content, tool calls and reasoning. `tools` (custom tools:
name, description, input_schema) and `tool_choice` (auto, any, tool, none) become chat's,
`stop_sequences` stop strings, `thinking` the chat template's `enable_thinking`. Images, documents
and Anthropic's server tools are refused naming the block.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictStr

from paxserve.server.errors import ProtocolError
from paxserve.server.protocol import Float, Int, _Body, _Request


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: StrictStr | list[dict[str, Any]]


class OutputConfig(_Body):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict[str, Any] | None = None


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: what the prompt holds, no sampling."""

    model: StrictStr
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's name for output_config.format
    # Prompt caching is automatic here (prefix caching); a cache_control marker asks for nothing more.
    cache_control: dict[str, Any] | None = None
    speed: Literal["standard", "fast"] | None = None  # one speed: the engine's
    user_profile_id: StrictStr | None = None  # tracking ids: they ask nothing of generation
    workspace_id: StrictStr | None = None
    # The context-management beta edits an over-long conversation on Anthropic's servers; here a
    # conversation past the context is a 400 instead, so the field changes nothing that runs.
    context_management: dict[str, Any] | None = None
    # Anthropic features that need Anthropic's servers: a 400 when sent.
    container: Any = None
    mcp_servers: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    compaction: Any = None
    fallbacks: Any = None
    fallback_credit_token: Any = None
    billing_policy: Any = None
    thread: Any = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[Int, Field(ge=1)]
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool | None = None
    # Sampling: Anthropic's current SDK no longer sends these, older clients and extra_body do.
    temperature: Annotated[Float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[Float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[Int, Field(ge=0)] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    priority: Int | None = None  # vLLM's, under --scheduling-policy priority (lower first)


def check_supported(req: CountTokensRequest) -> None:
    for name in ("container", "mcp_servers", "diagnostics", "inference_geo", "compaction", "fallbacks",
                 "fallback_credit_token", "billing_policy", "thread"):
        if getattr(req, name, None) not in (None, [], {}):
            raise ProtocolError(f"`{name}` is not supported by paxserve", param=name)


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind in ("image", "document", "search_result", "container_upload"):
            raise ProtocolError(f"{where}: {kind} blocks are not supported by paxserve (text-only models)",
                                param="messages")
        raise ProtocolError(f"{where}: expected a text block with a `text` string, got type {kind!r}",
                            param="messages")
    return block["text"]


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if not system:
        return []
    text = system if isinstance(system, str) else \
        "\n".join(_block_text(b, f"system[{j}]") for j, b in enumerate(system))
    return [{"role": "system", "content": text}]


def _user(content: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[dict[str, str]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if isinstance(block, dict) and block.get("type") == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise ProtocolError(f"{at}.tool_use_id must be a string", param="messages")
            result = block.get("content", "")
            text = result if isinstance(result, str) else \
                "\n".join(_block_text(b, f"{at}.content[{k}]") for k, b in enumerate(result or []))
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            texts.append({"type": "text", "text": _block_text(block, at)})
    if texts:
        out.append({"role": "user", "content": texts})
    return out


def _assistant(content: list[dict[str, Any]], where: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": None}
    texts, calls, thinking = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input", {}), dict):
                raise ProtocolError(f"{at}: a tool_use block needs an `id` and a `name` string and an `input` object",
                                    param="messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise ProtocolError(f"{at}.thinking must be a string", param="messages")
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a local model can read
        else:
            texts.append(_block_text(block, at))
    if texts:
        message["content"] = "".join(texts)
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning"] = "".join(thinking)
    return message


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    messages = _system(req.system)
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            messages += _user(m.content, where)
        else:
            messages.append(_assistant(m.content, where))
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise ProtocolError(f"tools[{i}].type {tool.get('type')!r} is not supported: paxserve runs custom tools "
                                "(name, description, input_schema); Anthropic's server tools need its servers",
                                param="tools")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise ProtocolError(f"tools[{i}] needs a `name` string and an `input_schema` object", param="tools")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise ProtocolError(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice")


def template_kwargs(req: CountTokensRequest, max_tokens: int | None) -> dict[str, Any] | None:
    """`thinking` for the chat template (Qwen3's `enable_thinking`). Anthropic's budget must be at
    least 1024 and below max_tokens; the model's thinking counts against max_tokens."""
    thinking = req.thinking
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind in ("adaptive", "between_tools"):
        return {"enable_thinking": True}
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
            raise ProtocolError("thinking.budget_tokens must be an integer >= 1024", param="thinking")
        if max_tokens is not None and budget >= max_tokens:
            raise ProtocolError("`max_tokens` must be greater than `thinking.budget_tokens`", param="max_tokens")
        return {"enable_thinking": True}
    raise ProtocolError(f"thinking.type must be enabled, adaptive or disabled, got {kind!r}", param="thinking")


def chat_body(req: CountTokensRequest) -> dict[str, Any]:
    max_tokens = getattr(req, "max_tokens", None)
    tool_choice, parallel = chat_tool_choice(req.tool_choice)
    body: dict[str, Any] = {
        "model": req.model, "messages": chat_messages(req), "tools": chat_tools(req.tools), "tool_choice": tool_choice,
        "parallel_tool_calls": parallel, "max_tokens": max_tokens, "chat_template_kwargs": template_kwargs(req, max_tokens),
    }
    if isinstance(req, MessagesRequest):
        body.update(stop=req.stop_sequences, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    priority=req.priority)
        config = req.output_config
        fmt = config.format if config is not None and config.format is not None else req.output_format
        if fmt is not None:
            if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise ProtocolError("output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                                    param="output_config")
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
        if config is not None and config.effort is not None:
            body["chat_template_kwargs"] = {**(body["chat_template_kwargs"] or {}), "reasoning_effort": config.effort}
    return {k: v for k, v in body.items() if v is not None}
