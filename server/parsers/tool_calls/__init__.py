"""Tool calls read out of model text (pure Python; no engine, no aiohttp).

    parser = get_tool_parser("hermes")
    parser.extract(text)                       # whole output -> ExtractedToolCalls
    stream = parser.stream()                   # one per choice
    stream.feed(delta_text); stream.finish()   # -> StreamDelta (content, tool call fragments)

The names are vLLM's `--tool-call-parser` names. NamedToolParser and RequiredToolParser read the
output of schema-guided generation for a forced tool_choice (schemas.py builds those schemas).
"""

from __future__ import annotations

from paxserve.server.parsers.tool_calls.base import (ExtractedToolCalls, StreamDelta, ToolCall, ToolCallDelta, ToolCallStream,
                                      ToolParser, assemble)
from paxserve.server.parsers.tool_calls.guided import NamedToolParser, RequiredToolParser
from paxserve.server.parsers.tool_calls.hermes import HermesToolParser
from paxserve.server.parsers.tool_calls.llama3_json import Llama3JsonToolParser
from paxserve.server.parsers.tool_calls.mistral import MistralToolParser
from paxserve.server.parsers.tool_calls.schemas import (named_tool_schema, required_tools_schema, validate_tool_choice,
                                         validate_tools)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool call parser {name!r}; known parsers: {', '.join(sorted(TOOL_PARSERS))}")
    return cls()


__all__ = [
    "ExtractedToolCalls", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "NamedToolParser",
    "RequiredToolParser", "StreamDelta", "TOOL_PARSERS", "ToolCall", "ToolCallDelta", "ToolCallStream",
    "ToolParser", "assemble", "get_tool_parser", "named_tool_schema", "required_tools_schema",
    "validate_tool_choice", "validate_tools",
]
