"""One assistant turn of a chat-shaped request, as the APIs that are not Chat Completions read it: the
Responses API and Anthropic's Messages API each translate their body into a chat request (one prompt,
n = 1), run it like /v1/chat/completions, and build their own objects from these pieces.

Each piece is what one engine output added, already through the request's reasoning and tool-call
parsers (the same ChoiceStream a streamed chat completion uses). Both APIs build their answer from
the pieces whether or not the client streams, so a non-streamed answer is the streamed one's final
object by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from paxserve.outputs import RequestOutput
from paxserve.server import responses as R
from paxserve.server.errors import ProtocolError
from paxserve.server.generation import GenerationRun, ServerShutdown
from paxserve.server.generation_spec import GenerationSpec


@dataclass(slots=True)
class TurnPiece:
    reasoning: str = ""  # text the reasoning parser split off
    content: str = ""  # answer text
    calls: list[dict[str, Any]] = field(default_factory=list)  # chat tool-call deltas (index, id, function)
    num_tokens: int = 0  # tokens this output added
    finish_reason: str | None = None  # "stop", "length", "abort" (None: more to come)
    stop_reason: int | str | None = None  # the stop string or token that ended it
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # chat's logprobs content entries, if asked


@dataclass(slots=True)
class TurnUsage:
    """Token counts of one turn. `reasoning_tokens` counts the tokens of outputs that added only
    reasoning text (a step that ends the thinking and starts the answer counts as answer)."""

    prompt_tokens: int
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0

    def add(self, piece: TurnPiece) -> None:
        self.output_tokens += piece.num_tokens
        self.cached_tokens = piece.cached_tokens
        if piece.reasoning and not piece.content and not piece.calls:
            self.reasoning_tokens += piece.num_tokens


async def turn_pieces(spec: GenerationSpec, run: GenerationRun,
                      first: tuple[int, RequestOutput]) -> AsyncIterator[TurnPiece]:
    """The pieces of the run's one choice, until it finishes (ProtocolError 503 on shutdown)."""
    parsed = spec.output.stream() if spec.output.active else None
    item = first
    while True:
        _, out = item
        for o in out.outputs:
            final = o.finish_reason is not None
            if parsed is not None:
                delta = parsed.feed(o.text, final=final)
            else:
                delta = {"content": o.text} if o.text else {}
            logprobs = R.chat_logprobs(o.logprobs, o.token_ids, spec.logprobs, spec.tokens_as_ids,
                                       spec.logprob_token_ids)["content"] \
                if spec.logprobs is not None and o.logprobs else []
            yield TurnPiece(delta.get("reasoning", ""), delta.get("content", ""), list(delta.get("tool_calls", ())),
                            len(o.token_ids), o.finish_reason, o.stop_reason, out.num_cached_tokens, logprobs)
        if out.finished:
            return
        try:
            item = await run.next()
        except ServerShutdown as e:
            raise ProtocolError(str(e), status=503) from None


@dataclass(slots=True)
class CallDraft:
    """A tool call as its fragments arrive."""

    call_id: str
    name: str
    arguments: str = ""


def call_updates(piece: TurnPiece, calls: dict[int, CallDraft]) -> list[tuple[int, CallDraft, str, bool]]:
    """(index, call, new argument text, whether the call is new) for each fragment in `piece`, with
    `calls` updated."""
    updates = []
    for fragment in piece.calls:
        index = fragment["index"]
        function = fragment.get("function", {})
        args = function.get("arguments") or ""
        new = index not in calls
        if new:
            calls[index] = CallDraft(fragment.get("id") or f"call_{index}", function.get("name") or "")
        calls[index].arguments += args
        updates.append((index, calls[index], args, new))
    return updates
