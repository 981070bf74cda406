"""A call being read, and the sink that turns what is known of it into ToolCallDeltas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from paxserve.server.parsers.tool_calls.base import ToolCallDelta, default_call_id


@dataclass(slots=True)
class PartialCall:
    """What has been read of one call so far."""

    name: str | None = None
    args: list[str] = field(default_factory=list)  # arguments text read so far, in pieces as fed
    args_started: bool = False
    done: bool = False  # the whole call has been read (not only its arguments)
    index: int | None = None  # set when its first fragment went out
    num_sent: int = 0  # pieces of args already sent

    def ready(self) -> bool:
        """Whether the first fragment may go out. It waits for the arguments to start (not only the
        name) so that a call whose arguments turn out not to be an object was never announced."""
        return self.name is not None and (self.args_started or self.done)


@dataclass(slots=True)
class CallSink:
    """Numbers calls in the order they become ready and collects their fragments for one feed."""

    new_id: Callable[[], str] = default_call_id
    num_calls: int = 0
    deltas: list[ToolCallDelta] = field(default_factory=list)

    def collect(self, call: PartialCall) -> None:
        if call.index is None:
            if not call.ready():
                return
            call.index = self.num_calls
            self.num_calls += 1
            # A call written without arguments takes none, as OpenAI clients expect an object.
            arguments = "".join(call.args) if call.args_started else "{}"
            call.num_sent = len(call.args)
            self.deltas.append(ToolCallDelta(call.index, self.new_id(), call.name, arguments))
            return
        if call.num_sent == len(call.args):
            return
        piece = "".join(call.args[call.num_sent:])
        call.num_sent = len(call.args)
        last = self.deltas[-1] if self.deltas else None
        if last is not None and last.index == call.index:
            last.arguments += piece  # one fragment per call per feed is enough
        else:
            self.deltas.append(ToolCallDelta(call.index, arguments=piece))

    def take(self) -> list[ToolCallDelta]:
        deltas, self.deltas = self.deltas, []
        return deltas


class CallBody(Protocol):
    """The part of a format after its opening marker: one or more calls, read incrementally."""

    @property
    def done(self) -> bool: ...

    def can_end(self) -> bool:
        """Whether the output may end here with every call in the body complete."""
        ...

    def feed(self, text: str, pos: int, sink: CallSink) -> int:
        """Consume text from pos, telling sink what became known; return where the body ended, or
        len(text) if it goes on. Raises MalformedCall."""
        ...
