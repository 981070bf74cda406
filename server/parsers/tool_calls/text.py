"""Plain-text helpers shared by the streams."""

from __future__ import annotations

from dataclasses import dataclass


def partial_marker_len(text: str, marker: str, start: int = 0) -> int:
    """Length of the longest tail of text[start:] that could be the beginning of marker: that much
    must be held back, since the next delta may complete it."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass(slots=True)
class ContentGate:
    """Plain text on its way out. Whitespace next to a tool call is the model's separator, not
    content: trailing whitespace waits until more text shows it is inside the content (and is
    dropped at the end if the output made calls), and whitespace right after a call is dropped."""

    pending: str = ""
    after_call: bool = False

    def add(self, text: str) -> str:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return ""
            self.after_call = False
        text = self.pending + text
        body = text.rstrip()
        self.pending = text[len(body):]
        return body

    def call_ended(self) -> None:
        self.after_call = True

    def flush(self, made_calls: bool) -> str:
        pending, self.pending = self.pending, ""
        return "" if made_calls else pending
