"""The Responses API's store (--enable-response-store): finished responses kept in memory, so a
request can continue one (`previous_response_id`) and a client can read it back (GET
/v1/responses/{id}).

Bounded: the least recently used response goes once more than `max_entries` are kept. Each response
belongs to the API key that made it (the key's hash; one namespace when the server has no key): a
client never reads or continues another key's responses, and a wrong key sees a 404, not a 403.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as the client got it
    conversation: list[dict[str, Any]]  # chat messages before this response's output, without instructions


def owner_of(token: str | None) -> str:
    return hashlib.sha256((token or "").encode("utf-8", "surrogateescape")).hexdigest()


class ResponseStore:
    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"the response store must hold at least 1 response, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, owner: str, stored: StoredResponse) -> None:
        key = (owner, stored.response["id"])
        self._entries[key] = stored
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        stored = self._entries.get((owner, response_id))
        if stored is not None:
            self._entries.move_to_end((owner, response_id))
        return stored

    def delete(self, owner: str, response_id: str) -> bool:
        return self._entries.pop((owner, response_id), None) is not None
