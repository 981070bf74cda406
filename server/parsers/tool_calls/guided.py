"""The two formats the server gets when it constrains the output with a JSON schema (see schemas.py),
so no model-specific markers are involved:

- NamedToolParser: tool_choice names one function; the whole output is its arguments object.
- RequiredToolParser: tool_choice="required"; the output is `[{"name": ..., "parameters": {...}}, ...]`
  (vLLM's format).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from paxserve.server.parsers.tool_calls.base import (ExtractedToolCalls, StreamDelta, ToolCall, ToolCallDelta, ToolCallStream,
                                      ToolParser, default_call_id)
from paxserve.server.parsers.tool_calls.call_lists import CallArray
from paxserve.server.parsers.tool_calls.marked_stream import CallFormat, MarkedCallStream


@dataclass(slots=True)
class NamedCallStream(ToolCallStream):
    name: str
    call_id: str = field(default_factory=default_call_id)
    started: bool = False
    seen_text: bool = False
    pending: str = ""  # trailing whitespace: inside a string it is arguments, at the end it is not
    malformed: bool = False

    def feed(self, delta_text: str) -> StreamDelta:
        calls: list[ToolCallDelta] = []
        if not self.started:
            self.started = True
            calls.append(ToolCallDelta(0, self.call_id, self.name))
        text = delta_text
        if not self.seen_text:
            text = text.lstrip()
            self.seen_text = bool(text)
        text = self.pending + text
        body = text.rstrip()
        self.pending = text[len(body):]
        if body:
            if calls:
                calls[0].arguments = body
            else:
                calls.append(ToolCallDelta(0, arguments=body))
        return StreamDelta(tool_calls=calls)

    def finish(self) -> StreamDelta:
        self.pending = ""
        return self.feed("") if not self.started else StreamDelta()


class NamedToolParser(ToolParser):
    """The output is the arguments of `name`, as generated (no validation: the schema guided it)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def stream(self) -> ToolCallStream:
        return NamedCallStream(self.name)

    def extract(self, text: str) -> ExtractedToolCalls:
        """The call, or none when the arguments were cut short (max_tokens): a truncated call is not a
        call (vLLM and OpenAI send no tool_calls then; the text stays the content)."""
        try:
            json.loads(text)
        except ValueError:
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(None, [ToolCall(self.name, text.strip())])


REQUIRED_FORMAT = CallFormat(new_body=CallArray)


class RequiredToolParser(ToolParser):
    def stream(self) -> ToolCallStream:
        return MarkedCallStream(REQUIRED_FORMAT)
