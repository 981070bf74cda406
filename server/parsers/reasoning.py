"""Reasoning ("thinking") text split from the answer, whole or streamed (vLLM's --reasoning-parser).

    parser = get_reasoning_parser("qwen3")
    reasoning, content = parser.extract(text)          # None for an empty part
    stream = parser.stream()                           # one per choice
    reasoning_delta, content_delta = stream.feed(delta_text); ... stream.finish()

- deepseek_r1: reasoning is the text up to `</think>` (a leading `<think>` is dropped: R1's template
  puts `<think>` in the prompt, so the output usually starts inside it); content follows `</think>`.
  Without `</think>` everything is reasoning: the model was cut off while thinking.
- qwen3: reasoning only when the output starts with `<think>` (with thinking disabled the template
  closes an empty think block in the prompt and the output has no tags): it runs to `</think>`, or to
  the end if the output was cut off while thinking. Content follows `</think>`, less its leading
  newlines (template noise). Output that does not start with `<think>` is all content.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


def _partial_tag_len(text: str, tag: str) -> int:
    """The longest tail of text that could be the start of tag (held back for the next delta)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _none_if_empty(text: str) -> str | None:
    return text or None


class ReasoningStream(ABC):
    __slots__ = ()

    @abstractmethod
    def feed(self, delta_text: str) -> tuple[str, str]:
        """(reasoning_delta, content_delta) for one more piece of output."""

    @abstractmethod
    def finish(self) -> tuple[str, str]:
        """Whatever was held back, at the end of generation."""


class ReasoningParser(ABC):
    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output."""

    @abstractmethod
    def stream(self) -> ReasoningStream: ...


@dataclass(slots=True)
class ThinkStream(ReasoningStream):
    """Both formats as one state machine: "start" (deciding whether a `<think>` opens the output),
    "reasoning" (up to `</think>`), "after_end" (skipping newlines, qwen3 only), "content"."""

    start_is_optional: bool  # deepseek_r1: the output may begin inside the think block
    strip_newlines: bool  # qwen3: newlines right after `</think>` are not content
    state: str = "start"
    buf: str = ""  # a possibly partial tag at the end of the last feed

    def feed(self, delta_text: str) -> tuple[str, str]:
        text, self.buf = self.buf + delta_text, ""
        reasoning = ""
        if self.state == "start":
            if text.startswith(THINK_START):
                text = text[len(THINK_START):]
                self.state = "reasoning"
            elif THINK_START.startswith(text):
                self.buf = text
                return "", ""
            else:
                self.state = "reasoning" if self.start_is_optional else "content"
        if self.state == "reasoning":
            i = text.find(THINK_END)
            if i < 0:
                keep = len(text) - _partial_tag_len(text, THINK_END)
                self.buf = text[keep:]
                return text[:keep], ""
            reasoning, text = text[:i], text[i + len(THINK_END):]
            self.state = "after_end" if self.strip_newlines else "content"
        if self.state == "after_end":
            text = text.lstrip("\n")
            if text:
                self.state = "content"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        held, self.buf = self.buf, ""
        if self.state == "reasoning" or (self.state == "start" and self.start_is_optional):
            return held, ""
        return "", held


class DeepSeekR1ReasoningParser(ReasoningParser):
    def extract(self, text: str) -> tuple[str | None, str | None]:
        if text.startswith(THINK_START):
            text = text[len(THINK_START):]
        reasoning, end, content = text.partition(THINK_END)
        if not end:
            return _none_if_empty(text), None
        return _none_if_empty(reasoning), _none_if_empty(content)

    def stream(self) -> ReasoningStream:
        return ThinkStream(start_is_optional=True, strip_newlines=False)


class Qwen3ReasoningParser(ReasoningParser):
    def extract(self, text: str) -> tuple[str | None, str | None]:
        if not text.startswith(THINK_START):
            return None, _none_if_empty(text)
        reasoning, _, content = text[len(THINK_START):].partition(THINK_END)
        return _none_if_empty(reasoning), _none_if_empty(content.lstrip("\n"))

    def stream(self) -> ReasoningStream:
        return ThinkStream(start_is_optional=False, strip_newlines=True)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known parsers: {', '.join(sorted(REASONING_PARSERS))}")
    return cls()
