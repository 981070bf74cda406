"""A Responses API response built from a turn's pieces, with the stream events that build it.

Events follow OpenAI's order: response.created, response.in_progress; per output item
output_item.added, (content_part.added, the text deltas, the text's .done, content_part.done) or the
function call's argument deltas and .done, then output_item.done; last response.completed (or
response.incomplete when the output limit cut it, response.failed on an error). Every event has a
sequence_number. The final response in the last event is the object a non-streamed request gets.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from paxserve.server.chat_turn import CallDraft, TurnPiece, TurnUsage, call_updates
from paxserve.server.errors import ProtocolError


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(usage: TurnUsage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.output_tokens}


class ResponseBuilder:
    """One response. `base` holds the fields echoed from the request (model, instructions, tools,
    tool_choice, text, temperature, ...); output, status and usage are built here."""

    def __init__(self, response_id: str, base: dict[str, Any], usage: TurnUsage) -> None:
        self.id = response_id
        self.base = base
        self.usage = usage
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.incomplete_details: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self._seq = 0
        self._open: int | None = None  # the output index of the item receiving text
        self._calls: dict[int, CallDraft] = {}
        self._call_items: dict[int, int] = {}  # call index -> output index

    # ---- the response object ----------------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        done = self.status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "background": False, "error": self.error, "incomplete_details": self.incomplete_details,
            **self.base, "output": [dict(item) for item in self.output] if done else [],
            "usage": responses_usage(self.usage) if done else None,
            "completed_at": int(time.time()) if self.status == "completed" else None,
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    # ---- items ------------------------------------------------------------------------------------

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _close(self, index: int | None, status: str = "completed") -> list[dict[str, Any]]:
        if index is None or self.output[index]["status"] != "in_progress":
            return []
        item = self.output[index]
        item["status"] = status
        events: list[dict[str, Any]] = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
            events.append(self._event(kind, item_id=item["id"], output_index=index, content_index=0,
                                      text=part["text"], **extra))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(part)))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        if self._open == index:
            self._open = None
        return events

    def _text_item(self, kind: str) -> tuple[int, list[dict[str, Any]]]:
        """The open message or reasoning item, opened (and the one before closed) when needed."""
        if self._open is not None and self.output[self._open]["type"] == kind:
            return self._open, []
        events = self._close(self._open)
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress", "content": []}
            part = {"type": "reasoning_text", "text": ""}
        events += self._add(item)
        index = len(self.output) - 1
        item["content"] = [part]
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=dict(part)))
        self._open = index
        return index, events

    def feed(self, piece: TurnPiece) -> list[dict[str, Any]]:
        """The events of one piece (its logprobs go with its answer text)."""
        logprobs = piece.logprobs
        self.usage.add(piece)
        events: list[dict[str, Any]] = []
        if piece.reasoning:
            index, opened = self._text_item("reasoning")
            events += opened
            item = self.output[index]
            item["content"][0]["text"] += piece.reasoning
            events.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=piece.reasoning))
        if piece.content:
            index, opened = self._text_item("message")
            events += opened
            item = self.output[index]
            part = item["content"][0]
            part["text"] += piece.content
            part["logprobs"] = part["logprobs"] + list(logprobs or [])
            events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=piece.content, logprobs=list(logprobs or [])))
        for call_index, call, args, new in call_updates(piece, self._calls):
            if new:
                events += self._close(self._open)
                events += self._add({"id": new_id("fc"), "type": "function_call", "call_id": call.call_id,
                                     "name": call.name, "arguments": "", "status": "in_progress"})
                self._call_items[call_index] = len(self.output) - 1
                self._open = len(self.output) - 1
            index = self._call_items[call_index]
            item = self.output[index]
            item["arguments"] = call.arguments
            if args:
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=index, delta=args))
        return events

    # ---- the end ----------------------------------------------------------------------------------

    def final(self) -> dict[str, Any]:
        return self.response()

    def finish(self, finish_reason: str | None, stop_reason: int | str | None = None) -> list[dict[str, Any]]:
        """Close every item and end the response: completed, or incomplete when the output limit
        (max_output_tokens or the context) cut it. (What stopped it otherwise is not in a response.)"""
        cut = finish_reason == "length"
        events = []
        for index in range(len(self.output)):
            events += self._close(index, "incomplete" if cut and index == len(self.output) - 1 else "completed")
        if cut:
            self.status, self.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
            return events + [self._event("response.incomplete", response=self.response())]
        self.status = "completed"
        return events + [self._event("response.completed", response=self.response())]

    def fail(self, err: ProtocolError) -> list[dict[str, Any]]:
        self.status = "failed"
        self.error = {"code": "server_error", "message": err.message}
        for item in self.output:
            if item["status"] == "in_progress":
                item["status"] = "incomplete"
        return [self._event("response.failed", response=self.response())]
