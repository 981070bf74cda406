"""An Anthropic Messages API message built from a turn's pieces, with the stream events that build it.

Events in Anthropic's order: message_start (the message with no content yet), ping, then per content
block content_block_start, its deltas (text_delta, thinking_delta, input_json_delta) and
content_block_stop, then message_delta (stop_reason, stop_sequence, the output token count) and
message_stop. The message a non-streamed request gets is what those events build.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from paxserve.server.chat_turn import CallDraft, TurnPiece, TurnUsage, call_updates
from paxserve.server.errors import ProtocolError, anthropic_envelope

def anthropic_usage(usage: TurnUsage) -> dict[str, Any]:
    """Anthropic counts prompt tokens read from the cache apart from the rest."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.output_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the `input` object; arguments cut short (max_tokens) or not an object
    give {} (the stream's input_json_delta carried the text as it was)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageBuilder:
    def __init__(self, model: str, usage: TurnUsage) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.usage = usage
        self.content: list[dict[str, Any]] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self._open: int | None = None
        self._calls: dict[int, CallDraft] = {}
        self._call_blocks: dict[int, int] = {}

    def final(self) -> dict[str, Any]:
        """The whole message."""
        content = []
        for block in self.content:
            block = dict(block)
            if block["type"] == "tool_use":
                block["input"] = _tool_input(block.pop("_arguments"))
            content.append(block)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                "usage": anthropic_usage(self.usage)}

    def start(self) -> list[dict[str, Any]]:
        message = self.final()
        message["usage"] = {**message["usage"], "output_tokens": 0}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _stop(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [{"type": "content_block_stop", "index": index}]

    def _block(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._stop()
        self.content.append(block)
        self._open = len(self.content) - 1
        shown = {k: v for k, v in block.items() if not k.startswith("_")}
        return events + [{"type": "content_block_start", "index": self._open, "content_block": shown}]

    def _text(self, kind: str, key: str, delta_type: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self.content[self._open]["type"] != kind:
            events += self._block({"type": kind, key: "", **({"signature": ""} if kind == "thinking" else {})})
        self.content[self._open][key] += text
        return events + [{"type": "content_block_delta", "index": self._open, "delta": {"type": delta_type, key: text}}]

    def feed(self, piece: TurnPiece) -> list[dict[str, Any]]:
        self.usage.add(piece)
        events = []
        if piece.reasoning:
            events += self._text("thinking", "thinking", "thinking_delta", piece.reasoning)
        if piece.content:
            events += self._text("text", "text", "text_delta", piece.content)
        for call_index, call, args, new in call_updates(piece, self._calls):
            if new:
                events += self._block({"type": "tool_use", "id": call.call_id, "name": call.name, "input": {},
                                       "_arguments": ""})
                self._call_blocks[call_index] = self._open
            index = self._call_blocks[call_index]
            self.content[index]["_arguments"] = call.arguments
            if args:
                events.append({"type": "content_block_delta", "index": index,
                               "delta": {"type": "input_json_delta", "partial_json": args}})
        return events

    def fail(self, err: ProtocolError) -> list[dict[str, Any]]:
        """Anthropic's error event ends a stream that failed."""
        return [anthropic_envelope(err)]

    def finish(self, finish_reason: str | None, stop_reason: int | str | None) -> list[dict[str, Any]]:
        if finish_reason == "length":
            self.stop_reason = "max_tokens"
        elif any(block["type"] == "tool_use" for block in self.content):
            self.stop_reason = "tool_use"
        elif isinstance(stop_reason, str):
            self.stop_reason, self.stop_sequence = "stop_sequence", stop_reason
        else:
            self.stop_reason = "end_turn"
        usage = anthropic_usage(self.usage)
        return self._stop() + [
            {"type": "message_delta", "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
             "usage": {"output_tokens": usage["output_tokens"], "input_tokens": usage["input_tokens"],
                       "cache_read_input_tokens": usage["cache_read_input_tokens"],
                       "cache_creation_input_tokens": 0}},
            {"type": "message_stop"}]
