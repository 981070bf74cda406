"""Chat requests with `tools`: which calls the model may or must make, how its output is guided, and
how the output becomes `tool_calls` (and `reasoning`), whole or streamed.

- tool_choice "none": tools are rendered for the model (as vLLM does) but its text is plain content.
- "auto": the model's own format is parsed by the server's --tool-call-parser (needs
  --enable-auto-tool-choice, as in vLLM).
- "required" / a named function: the output is guided by a JSON schema (an array of calls, or the
  named function's arguments), so it is always a valid call; guided.py reads it back.

The reasoning parser (--reasoning-parser) splits `<think>` text off first. It is not applied to
schema-guided output: the grammar starts at the first token, so there is no thinking to split.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from paxserve.server.errors import ProtocolError
from paxserve.server.protocol import ChatCompletionRequest
from paxserve.server.parsers.reasoning import ReasoningParser, ReasoningStream, get_reasoning_parser
from paxserve.server.settings import ServerSettings
from paxserve.server.parsers.tool_calls import (NamedToolParser, RequiredToolParser, ToolCallStream, ToolParser, get_tool_parser,
                                 named_tool_schema, required_tools_schema, validate_tool_choice, validate_tools)
from paxserve.structured_outputs import StructuredOutputsParams


@dataclass(slots=True)
class ToolSpec:
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parser: ToolParser | None  # None: the output is plain content
    constraint: StructuredOutputsParams | None  # the guiding schema of a forced choice


def parse_tools(req: ChatCompletionRequest, settings: ServerSettings) -> ToolSpec:
    try:
        tools = validate_tools(req.tools)
    except ValueError as e:
        raise ProtocolError(str(e), param="tools") from None
    try:
        choice = validate_tool_choice(req.tool_choice, tools)
    except ValueError as e:
        raise ProtocolError(str(e), param="tool_choice") from None
    parallel = req.parallel_tool_calls
    if choice == "none" or not tools:
        return ToolSpec(tools, choice, None, None)
    if choice == "auto":
        if not settings.enable_auto_tool_choice or settings.tool_call_parser is None:
            raise ProtocolError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                "set", param="tool_choice")
        return ToolSpec(tools, choice, get_tool_parser(settings.tool_call_parser), None)
    if choice == "required":
        return ToolSpec(tools, choice, RequiredToolParser(),
                        StructuredOutputsParams(json=required_tools_schema(tools, parallel)))
    name = choice["function"]["name"]
    tool = next(t for t in tools if t["function"]["name"] == name)
    return ToolSpec(tools, choice, NamedToolParser(name), StructuredOutputsParams(json=named_tool_schema(tool)))


def template_tool_calls(calls: Any, index: int) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` for the chat template: arguments as an object, which is
    what templates serialize (`tool_call.arguments | tojson`); OpenAI sends them as JSON text."""
    if not isinstance(calls, list):
        raise ProtocolError(f"messages[{index}].tool_calls must be a list", param="messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ProtocolError(f"messages[{index}].tool_calls[{j}] must have a function with a name",
                                param="messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass  # kept as the text the client sent
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


# ---- output ----------------------------------------------------------------------------------------

@dataclass(slots=True)
class ChatOutputParsers:
    """What a chat response's text goes through: the reasoning split, then tool-call parsing."""

    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None
    include_reasoning: bool = True  # vLLM's include_reasoning: false splits the reasoning off and drops it

    @classmethod
    def for_request(cls, settings: ServerSettings, tool_spec: ToolSpec | None, guided: bool,
                    include_reasoning: bool = True) -> "ChatOutputParsers":
        reasoning = get_reasoning_parser(settings.reasoning_parser) if settings.reasoning_parser and not guided \
            else None
        return cls(reasoning, tool_spec.parser if tool_spec is not None else None, include_reasoning)

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def message(self, text: str) -> dict[str, Any]:
        """The `message` of a finished choice."""
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.extract(text)
        message: dict[str, Any] = {"role": "assistant", "content": content or ""}
        calls = []
        if self.tools is not None and content is not None:
            extracted = self.tools.extract(content)
            calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                     for c in extracted.tool_calls]
            if calls:
                message["content"] = extracted.content  # null next to tool calls, as OpenAI sends it
        if self.reasoning is not None and self.include_reasoning:
            message["reasoning"] = reasoning
        message["refusal"] = None
        message["tool_calls"] = calls
        return message

    def stream(self) -> "ChoiceStream":
        return ChoiceStream(self.reasoning.stream() if self.reasoning is not None else None,
                            self.tools.stream() if self.tools is not None else None, self.include_reasoning)


class ChoiceStream:
    """One streamed choice: text deltas in, OpenAI delta objects out."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None,
                 include_reasoning: bool = True) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._include_reasoning = include_reasoning
        self.made_calls = False

    def feed(self, text: str, final: bool = False) -> dict[str, Any]:
        """The delta for `text`; `final` also flushes what was held back (the choice finished)."""
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text) if text else ("", "")
            if final:
                more_reasoning, more_content = self._reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[dict[str, Any]] = []
        if self._tools is not None:
            parts = [self._tools.feed(content)] if content else []
            if final:
                parts.append(self._tools.finish())
            content = "".join(p.content for p in parts)
            for part in parts:
                for d in part.tool_calls:
                    call: dict[str, Any] = {"index": d.index}
                    if d.id is not None:
                        call.update(id=d.id, type="function")
                        call["function"] = {"name": d.name, "arguments": d.arguments}
                    else:
                        call["function"] = {"arguments": d.arguments}
                    calls.append(call)
        if calls:
            self.made_calls = True
        delta: dict[str, Any] = {}
        if reasoning and self._include_reasoning:
            delta["reasoning"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta
