"""Where a JSON value ends, found incrementally: structure only (strings, escapes, nesting depth).

This is what lets a parser stream argument text the moment it arrives: every character from an
object's `{` to its matching `}` is part of the value, so nothing already sent can be contradicted
by what follows. Spelling of literals (`tru`) is left to json.loads once a value is whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_IN_STRING = re.compile(r'["\\]')
_IN_CONTAINER = re.compile(r'["{}\[\]]')
_SCALAR_END = re.compile(r'[\s,:{}\[\]"]')
_NOT_A_START = frozenset(",:}]") | frozenset(" \t\r\n")
WHITESPACE = re.compile(r"\s*")


class MalformedCall(Exception):
    """Text that opened a tool call and cannot be one. `pos` is where, in the chunk being fed, the
    reader gave up: text from there on is read afresh as content."""

    def __init__(self, pos: int, why: str) -> None:
        super().__init__(why)
        self.pos = pos


def skip_whitespace(text: str, pos: int) -> int:
    return WHITESPACE.match(text, pos).end()  # type: ignore[union-attr]  (\s* always matches)


@dataclass(slots=True)
class ValueScanner:
    """Reads one JSON value that starts at the first character fed (no leading whitespace)."""

    kind: str = ""  # "" until the first character, then "string", "container" or "scalar"
    depth: int = 0
    in_string: bool = False
    escape: bool = False
    done: bool = False

    def feed(self, text: str, pos: int) -> int:
        """Consume text from pos; return where the value ended (exclusive) or len(text) if it goes
        on. A scalar ends before the character that ends it, which is left unconsumed."""
        n = len(text)
        while pos < n and not self.done:
            if self.escape:
                self.escape = False
                pos += 1
            elif self.in_string:
                m = _IN_STRING.search(text, pos)
                if m is None:
                    return n
                pos = m.end()
                if m.group() == "\\":
                    self.escape = True
                else:
                    self.in_string = False
                    self.done = self.kind == "string"
            elif not self.kind:
                pos = self._start(text, pos)
            elif self.kind == "scalar":
                m = _SCALAR_END.search(text, pos)
                if m is None:
                    return n
                self.done = True
                return m.start()
            else:
                m = _IN_CONTAINER.search(text, pos)
                if m is None:
                    return n
                pos = m.end()
                c = m.group()
                if c == '"':
                    self.in_string = True
                elif c in "{[":
                    self.depth += 1
                else:
                    self.depth -= 1
                    self.done = self.depth == 0
        return pos

    def _start(self, text: str, pos: int) -> int:
        c = text[pos]
        if c == '"':
            self.kind, self.in_string = "string", True
        elif c in "{[":
            self.kind, self.depth = "container", 1
        elif c in _NOT_A_START:
            raise MalformedCall(pos, f"a JSON value cannot start with {c!r}")
        else:
            self.kind = "scalar"
        return pos + 1
