"""Llama 3.1 / 3.2 JSON tool calling: the whole output is the calls,

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

(the tag is optional, "arguments" is accepted for "parameters"). An output that does not start with
`{` after whitespace and the tag is plain content, and so is a leading JSON object without both a
name and arguments: without a marker, that is more likely an answer than a call. Text after the
calls is content. `<|python_tag|>` is a special token: decoded without it the text starts with `{`,
which reads the same.
"""

from __future__ import annotations

from paxserve.server.parsers.tool_calls.base import ToolCallStream, ToolParser
from paxserve.server.parsers.tool_calls.call_lists import CallSequence
from paxserve.server.parsers.tool_calls.marked_stream import CallFormat, MarkedCallStream

LLAMA3_JSON_FORMAT = CallFormat(new_body=CallSequence, prefix="<|python_tag|>")


class Llama3JsonToolParser(ToolParser):
    def stream(self) -> ToolCallStream:
        return MarkedCallStream(LLAMA3_JSON_FORMAT)
