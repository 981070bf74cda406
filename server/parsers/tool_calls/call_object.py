"""One `{"name": ..., "arguments": {...}}` object, read incrementally in either key order."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from paxserve.server.parsers.tool_calls.calls import CallSink, PartialCall
from paxserve.server.parsers.tool_calls.json_scan import MalformedCall, ValueScanner, skip_whitespace

# Hermes and Mistral write "arguments", Llama 3 and vLLM's tool_choice="required" "parameters".
ARGUMENT_KEYS = ("arguments", "parameters")
# States where the next token may be preceded by whitespace.
_BETWEEN_TOKENS = frozenset(("open", "key_or_close", "colon", "value", "after_value"))


@dataclass(slots=True)
class CallObject:
    require_arguments: bool = False  # without a marker (Llama 3), a JSON object with only a "name" is not a call
    call: PartialCall = field(default_factory=PartialCall)
    state: str = "open"
    raw: list[str] = field(default_factory=list)  # the object's text, checked by json.loads once whole
    key_text: str = ""
    key: str = ""
    target: str = ""  # what the value being read is: "name", "args" or "other"
    name_text: str = ""
    seen_name: bool = False
    scanner: ValueScanner = field(default_factory=ValueScanner)

    @property
    def done(self) -> bool:
        return self.call.done

    def can_end(self) -> bool:
        return self.call.done

    def feed(self, text: str, pos: int, sink: CallSink) -> int:
        start = pos
        pos = self._read(text, pos)
        self.raw.append(text[start:pos])
        if self.call.done:
            self._check(pos)
        sink.collect(self.call)
        return pos

    def _check(self, pos: int) -> None:
        try:
            obj = json.loads("".join(self.raw))
        except ValueError as e:
            raise MalformedCall(pos, f"tool call is not valid JSON: {e}") from None
        if not isinstance(obj, dict) or self.call.name is None:
            raise MalformedCall(pos, "tool call has no name")
        if self.require_arguments and not self.call.args_started:
            raise MalformedCall(pos, "tool call has no arguments")

    def _read(self, text: str, pos: int) -> int:
        n = len(text)
        while pos < n and not self.call.done:
            state = self.state
            if state in _BETWEEN_TOKENS:
                pos = skip_whitespace(text, pos)
                if pos == n:
                    break
            c = text[pos]
            if state == "open":
                self._expect(c, "{", pos)
                self.state = "key_or_close"
                pos += 1
            elif state == "key_or_close":
                if c == "}":
                    self.call.done = True  # `{}` or a trailing comma: json.loads judges
                    pos += 1
                else:
                    self._expect(c, '"', pos)
                    self.scanner = ValueScanner()
                    self.state = "key"
            elif state == "key":
                end = self.scanner.feed(text, pos)
                self.key_text += text[pos:end]
                pos = end
                if self.scanner.done:
                    self.key = _decode(self.key_text, pos)
                    self.key_text = ""
                    self.state = "colon"
            elif state == "colon":
                self._expect(c, ":", pos)
                self.state = "value"
                pos += 1
            elif state == "value":
                self._start_value(c, pos)
            elif state == "in_value":
                pos = self._read_value(text, pos)
            else:  # after_value
                if c == "}":
                    self.call.done = True
                else:
                    self._expect(c, ",", pos)
                    self.state = "key_or_close"
                pos += 1
        return pos

    def _start_value(self, c: str, pos: int) -> None:
        if self.key == "name" and not self.seen_name:
            self._expect(c, '"', pos)
            self.target, self.seen_name = "name", True
        elif self.key in ARGUMENT_KEYS and not self.call.args_started:
            self._expect(c, "{", pos)
            self.target, self.call.args_started = "args", True
        else:
            self.target = "other"
        self.scanner = ValueScanner()
        self.state = "in_value"

    def _read_value(self, text: str, pos: int) -> int:
        end = self.scanner.feed(text, pos)
        if self.target == "name":
            self.name_text += text[pos:end]
        elif self.target == "args" and end > pos:
            self.call.args.append(text[pos:end])
        if self.scanner.done:
            if self.target == "name":
                name = _decode(self.name_text, end)
                if not name:
                    raise MalformedCall(end, "tool call name is empty")
                self.call.name = name
            self.state = "after_value"
        return end

    @staticmethod
    def _expect(c: str, wanted: str, pos: int) -> None:
        if c != wanted:
            raise MalformedCall(pos, f"expected {wanted!r} in a tool call, got {c!r}")


def _decode(string_text: str, pos: int) -> str:
    try:
        return json.loads(string_text)
    except ValueError as e:
        raise MalformedCall(pos, f"bad JSON string in a tool call: {e}") from None
