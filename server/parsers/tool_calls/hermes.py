"""Hermes 2 Pro / Qwen2.5 / Qwen3 tool calls:

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Any number of blocks anywhere in the text; the text around them is content. `<tool_call>` is an
ordinary added token in these tokenizers, so it survives decoding with special tokens skipped.
"""

from __future__ import annotations

from paxserve.server.parsers.tool_calls.base import ToolCallStream, ToolParser
from paxserve.server.parsers.tool_calls.call_object import CallObject
from paxserve.server.parsers.tool_calls.marked_stream import CallFormat, MarkedCallStream

HERMES_FORMAT = CallFormat(new_body=CallObject, opener="<tool_call>", closer="</tool_call>")


class HermesToolParser(ToolParser):
    def stream(self) -> ToolCallStream:
        return MarkedCallStream(HERMES_FORMAT)
