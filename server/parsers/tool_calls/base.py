"""Tool calls read out of model text: the data the server turns into OpenAI `tool_calls`, and the two
faces of every parser (the whole output at once, and an incremental stream per choice).

`ToolParser.extract` runs the parser's own stream over the whole text, so a streamed response and a
non-streamed one of the same output can never disagree about what is a call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Iterable
from uuid import uuid4


def default_call_id() -> str:
    return "chatcmpl-tool-" + uuid4().hex


@dataclass(slots=True)
class ToolCall:
    """One complete call."""

    name: str
    arguments: str  # JSON text of the arguments object, as the model wrote it
    id: str = field(default_factory=default_call_id)


@dataclass(slots=True)
class ExtractedToolCalls:
    content: str | None  # text outside tool calls (None if empty or whitespace only)
    tool_calls: list[ToolCall]


@dataclass(slots=True)
class ToolCallDelta:
    """One streaming fragment, in OpenAI's shape."""

    index: int  # the call's index in this choice, 0-based
    id: str | None = None  # set only on the first fragment of a call
    name: str | None = None  # set only on the first fragment of a call
    arguments: str = ""  # concatenating every fragment of one index gives the call's arguments


@dataclass(slots=True)
class StreamDelta:
    content: str = ""  # plain text to send as delta.content
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallStream(ABC):
    """Incremental parsing of one choice's output. `malformed` turns true once some text that
    opened a call could not be read as one (what was held back of it has become content)."""

    __slots__ = ()
    malformed: bool

    @abstractmethod
    def feed(self, delta_text: str) -> StreamDelta: ...

    @abstractmethod
    def finish(self) -> StreamDelta:
        """Flush at the end of generation: held-back text that is not a call becomes content."""


class ToolParser(ABC):
    """One model family's way of writing tool calls."""

    # Whether the format's markers are special tokens, so the server must decode with them kept.
    keep_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh incremental parser for one choice."""

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole output. Text that opens a call but cannot be read as one makes the
        whole output plain content with no calls (never raises)."""
        stream = self.stream()
        parts = [stream.feed(text), stream.finish()]
        if stream.malformed:
            return ExtractedToolCalls(content_or_none(text), [])
        return assemble(parts)


def content_or_none(text: str) -> str | None:
    return text if text.strip() else None


def assemble(deltas: Iterable[StreamDelta]) -> ExtractedToolCalls:
    """What a client rebuilds from a stream: the content joined, each call's fragments joined."""
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        content.append(delta.content)
        for fragment in delta.tool_calls:
            call = calls.get(fragment.index)
            if call is None:
                calls[fragment.index] = ToolCall(fragment.name or "", fragment.arguments, fragment.id or default_call_id())
            else:
                call.arguments += fragment.arguments
    return ExtractedToolCalls(content_or_none("".join(content)), [calls[i] for i in sorted(calls)])
