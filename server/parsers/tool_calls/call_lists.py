"""Several call objects in one body: a JSON array (Mistral, tool_choice="required") or objects
separated by ';' (Llama 3)."""

from __future__ import annotations

from dataclasses import dataclass, field

from paxserve.server.parsers.tool_calls.call_object import CallObject
from paxserve.server.parsers.tool_calls.calls import CallSink
from paxserve.server.parsers.tool_calls.json_scan import MalformedCall, skip_whitespace


@dataclass(slots=True)
class CallArray:
    """`[{...}, {...}]`, leading whitespace allowed."""

    require_arguments: bool = False
    state: str = "open"  # open, first (an item or `]`), next (an item), item, after
    item: CallObject = field(default_factory=CallObject)
    done: bool = False

    def can_end(self) -> bool:
        return self.done

    def feed(self, text: str, pos: int, sink: CallSink) -> int:
        n = len(text)
        while pos < n and not self.done:
            if self.state == "item":
                pos = self.item.feed(text, pos, sink)
                if self.item.done:
                    self.state = "after"
                continue
            pos = skip_whitespace(text, pos)
            if pos == n:
                break
            c = text[pos]
            if self.state == "open" and c == "[":
                self.state = "first"
                pos += 1
            elif self.state == "first" and c == "]":
                self.done = True
                pos += 1
            elif self.state in ("first", "next") and c == "{":
                self.item = CallObject(self.require_arguments)
                self.state = "item"
            elif self.state == "after" and c in ",]":
                self.state = "next"
                self.done = c == "]"
                pos += 1
            else:
                raise MalformedCall(pos, f"unexpected {c!r} in a list of tool calls")
        return pos


@dataclass(slots=True)
class CallSequence:
    """`{...}; {...}`: the first character that cannot continue the sequence ends it (unconsumed)."""

    require_arguments: bool = True
    state: str = "first"  # first (an object must open the output), item, between
    item: CallObject = field(default_factory=CallObject)
    done: bool = False

    def can_end(self) -> bool:
        return self.state == "between"

    def feed(self, text: str, pos: int, sink: CallSink) -> int:
        n = len(text)
        while pos < n and not self.done:
            if self.state == "item":
                pos = self.item.feed(text, pos, sink)
                if self.item.done:
                    self.state = "between"
                continue
            pos = skip_whitespace(text, pos)
            if pos == n:
                break
            c = text[pos]
            if c == "{":
                self.item = CallObject(self.require_arguments)
                self.state = "item"
            elif self.state == "first":
                raise MalformedCall(pos, "not a JSON tool call")
            elif c == ";":
                pos += 1
            else:
                self.done = True
        return pos
