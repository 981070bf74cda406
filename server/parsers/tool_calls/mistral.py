"""Mistral tool calls, after content:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]     (older tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...                  (v11 and later)

`[TOOL_CALLS]` (and `[ARGS]`) are special tokens, so the server must decode with special tokens kept
for this parser (`keep_special_tokens`). Mistral's chat templates reject tool call ids that are not
9 alphanumeric characters when the conversation comes back, so this parser makes such ids.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from uuid import uuid4

from paxserve.server.parsers.tool_calls.base import ToolCallStream, ToolParser
from paxserve.server.parsers.tool_calls.call_lists import CallArray
from paxserve.server.parsers.tool_calls.calls import CallSink, PartialCall
from paxserve.server.parsers.tool_calls.json_scan import MalformedCall, ValueScanner, skip_whitespace
from paxserve.server.parsers.tool_calls.marked_stream import CallFormat, MarkedCallStream
from paxserve.server.parsers.tool_calls.text import partial_marker_len

ARGS_MARKER = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.-]*")
MAX_NAME_CHARS = 64


def mistral_call_id() -> str:
    return uuid4().hex[:9]


@dataclass(slots=True)
class MistralNamedCall:
    """`name[ARGS]{...}`: one call, ending with its arguments object."""

    call: PartialCall = field(default_factory=PartialCall)
    state: str = "name"  # name, args_start, args
    name_text: str = ""  # the name so far, with any partial `[ARGS]` after it
    scanner: ValueScanner = field(default_factory=ValueScanner)

    @property
    def done(self) -> bool:
        return self.call.done

    def can_end(self) -> bool:
        return self.call.done

    def feed(self, text: str, pos: int, sink: CallSink) -> int:
        n = len(text)
        while pos < n and not self.call.done:
            if self.state == "name":
                pos = self._read_name(text, pos)
            elif self.state == "args_start":
                pos = skip_whitespace(text, pos)
                if pos < n:
                    if text[pos] != "{":
                        raise MalformedCall(pos, "Mistral tool call arguments must be a JSON object")
                    self.call.args_started = True
                    self.state = "args"
            else:
                end = self.scanner.feed(text, pos)
                if end > pos:
                    self.call.args.append(text[pos:end])
                pos = end
                if self.scanner.done:
                    self._check(pos)
                    self.call.done = True
        sink.collect(self.call)
        return pos

    def _read_name(self, text: str, pos: int) -> int:
        seen = self.name_text + text[pos:]
        i = seen.find(ARGS_MARKER)
        name = seen[:i] if i >= 0 else seen[:len(seen) - partial_marker_len(seen, ARGS_MARKER)]
        if not _NAME.fullmatch(name) or len(name) > MAX_NAME_CHARS or (i >= 0 and not name):
            raise MalformedCall(pos, "not a Mistral tool call name")
        if i < 0:
            self.name_text = seen
            return len(text)
        self.call.name = name
        self.state = "args_start"
        return pos + i + len(ARGS_MARKER) - len(self.name_text)

    def _check(self, pos: int) -> None:
        try:
            json.loads("".join(self.call.args))
        except ValueError as e:
            raise MalformedCall(pos, f"tool call arguments are not valid JSON: {e}") from None


@dataclass(slots=True)
class MistralBody:
    """Whatever follows one `[TOOL_CALLS]`: an array of calls or a `name[ARGS]` call."""

    inner: CallArray | MistralNamedCall | None = None

    @property
    def done(self) -> bool:
        return self.inner is not None and self.inner.done

    def can_end(self) -> bool:
        return self.inner is not None and self.inner.can_end()

    def feed(self, text: str, pos: int, sink: CallSink) -> int:
        if self.inner is None:
            pos = skip_whitespace(text, pos)
            if pos == len(text):
                return pos
            self.inner = CallArray() if text[pos] == "[" else MistralNamedCall()
        return self.inner.feed(text, pos, sink)


MISTRAL_FORMAT = CallFormat(new_body=MistralBody, opener="[TOOL_CALLS]", new_id=mistral_call_id)


class MistralToolParser(ToolParser):
    keep_special_tokens = True

    def stream(self) -> ToolCallStream:
        return MarkedCallStream(MISTRAL_FORMAT)
