"""The stream every marker-based format shares: content, an opening marker, a body of calls, an
optional closing marker, content again.

A body's text is held back until its first call is announced; if the body turns out not to be
calls before that, the held text (marker included) goes out as content and reading resumes where
the body gave up. After a call has been announced nothing can be taken back: a later problem only
marks the stream malformed and the rest of that body is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from paxserve.server.parsers.tool_calls.base import StreamDelta, ToolCallStream, default_call_id
from paxserve.server.parsers.tool_calls.calls import CallBody, CallSink
from paxserve.server.parsers.tool_calls.json_scan import MalformedCall, skip_whitespace
from paxserve.server.parsers.tool_calls.text import ContentGate, partial_marker_len


@dataclass(frozen=True, slots=True)
class CallFormat:
    new_body: Callable[[], CallBody]
    opener: str | None = None  # None: calls may only open the output (after prefix), no marker
    closer: str | None = None  # ends a body; tolerated when missing
    prefix: str | None = None  # a tag the output may start with before its calls (never content if calls follow)
    new_id: Callable[[], str] = default_call_id


@dataclass(slots=True)
class MarkedCallStream(ToolCallStream):
    fmt: CallFormat
    sink: CallSink = field(init=False)
    gate: ContentGate = field(default_factory=ContentGate)
    mode: str = field(init=False)  # prefix, content, body, close, skip
    buf: str = ""  # the tail of the last feed that might be the start of a marker
    held: list[str] = field(default_factory=list)  # the current body's text while nothing of it went out
    body: CallBody | None = None
    calls_before_body: int = 0
    malformed: bool = False

    def __post_init__(self) -> None:
        self.sink = CallSink(self.fmt.new_id)
        self.mode = "content"
        if self.fmt.opener is None:
            if self.fmt.prefix is None:
                self._start_body("")
            else:
                self.mode = "prefix"

    def feed(self, delta_text: str) -> StreamDelta:
        text, self.buf = self.buf + delta_text, ""
        content: list[str] = []
        pos = 0
        while pos < len(text):
            if self.mode == "content":
                pos = self._content(text, pos, content)
            elif self.mode == "body":
                pos = self._body(text, pos, content)
            elif self.mode == "close":
                pos = self._close(text, pos)
            elif self.mode == "skip":
                pos = self._skip(text, pos)
            else:
                pos = self._prefix(text, pos)
        return StreamDelta("".join(content), self.sink.take())

    def finish(self) -> StreamDelta:
        content: list[str] = []
        if self.mode in ("content", "prefix"):
            content.append(self.gate.add(self.buf))  # a marker that never completed is text
        elif self.mode == "body" and self.body is not None and not self.body.can_end():
            held = "".join(self.held)
            if self._committed():
                self.malformed = True  # cut off inside a call that already went out
            else:
                self.malformed = bool(held.strip())
                content.append(self.gate.add(held))
        # In "close" a cut-off closing marker is dropped; in "skip" the rest belonged to a broken call.
        self.buf = ""
        content.append(self.gate.flush(self.sink.num_calls > 0))
        return StreamDelta("".join(content), self.sink.take())

    def _committed(self) -> bool:
        return self.sink.num_calls > self.calls_before_body

    def _start_body(self, held: str) -> None:
        self.body = self.fmt.new_body()
        self.held = [held]
        self.calls_before_body = self.sink.num_calls
        self.mode = "body"

    def _end_body(self) -> None:
        self.held = []
        self.gate.call_ended()
        self.mode = "close" if self.fmt.closer is not None else "content"

    def _prefix(self, text: str, pos: int) -> int:
        prefix = self.fmt.prefix or ""
        rest = text[pos:]
        stripped = rest.lstrip()
        if stripped.startswith(prefix):
            cut = len(rest) - len(stripped) + len(prefix)
            self._start_body(rest[:cut])
            return pos + cut
        if prefix.startswith(stripped):
            self.buf = rest
            return len(text)
        self._start_body("")
        return pos

    def _content(self, text: str, pos: int, content: list[str]) -> int:
        opener = self.fmt.opener
        if opener is None:
            content.append(self.gate.add(text[pos:]))
            return len(text)
        i = text.find(opener, pos)
        if i < 0:
            keep = len(text) - partial_marker_len(text, opener, pos)
            content.append(self.gate.add(text[pos:keep]))
            self.buf = text[keep:]
            return len(text)
        content.append(self.gate.add(text[pos:i]))
        self._start_body(opener)
        return i + len(opener)

    def _body(self, text: str, pos: int, content: list[str]) -> int:
        assert self.body is not None
        try:
            end = self.body.feed(text, pos, self.sink)
        except MalformedCall as e:
            self.malformed = True
            if self._committed():
                self.mode = "skip"
            else:
                self.held.append(text[pos:e.pos])
                content.append(self.gate.add("".join(self.held)))
                self.held = []
                self.mode = "content"
            return max(e.pos, pos)
        if self.held:
            self.held.append(text[pos:end])
        if self._committed():
            self.held = []
        if self.body.done:
            self._end_body()
        return end

    def _close(self, text: str, pos: int) -> int:
        closer = self.fmt.closer or ""
        pos = skip_whitespace(text, pos)
        if pos == len(text):
            return pos
        if text.startswith(closer, pos):
            self.mode = "content"
            return pos + len(closer)
        if closer.startswith(text[pos:]):
            self.buf = text[pos:]
            return len(text)
        self.mode = "content"  # the model left the closing marker out
        return pos

    def _skip(self, text: str, pos: int) -> int:
        closer, opener = self.fmt.closer, self.fmt.opener
        target = closer or opener
        if target is None:
            return len(text)
        i = text.find(target, pos)
        if i < 0:
            keep = len(text) - partial_marker_len(text, target, pos)
            self.buf = text[keep:]
            return len(text)
        self.gate.call_ended()
        self.mode = "content"
        return i + len(target) if target == closer else i
