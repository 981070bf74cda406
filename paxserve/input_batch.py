"""The persistent batch's rows (vLLM v1's InputBatch): a running request keeps one row from the step
it starts running until it stops (finishes, is aborted or preempted).

A row indexes what lives across steps for that request, such as its row of the device sampler
state (counts, prompt set, bias, held-back ids). A request that needs no sampler state still holds
a row but reads state row 0, which stays all zeros. Rows are given back by the scheduler's report of
requests that left the running set, so the work per step is proportional to what changed.

Pure Python (no JAX).
"""

from __future__ import annotations


class InputBatch:
    """Rows 1..max_num_seqs; row 0 is never handed out."""

    def __init__(self, max_num_seqs: int) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"InputBatch: max_num_seqs must be >= 1, got {max_num_seqs}")
        self.num_rows = max_num_seqs + 1
        self._free = list(range(max_num_seqs, 0, -1))  # pop() hands out the lowest row first
        self._rows: dict[str, int] = {}
        self._state_rows: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def add(self, request_id: str, needs_state: bool) -> int:
        """Give a request that starts running its row; returns the row."""
        if request_id in self._rows:
            raise ValueError(f"InputBatch: request {request_id!r} already holds row {self._rows[request_id]}")
        if not self._free:
            raise RuntimeError(f"InputBatch: all {self.num_rows - 1} rows are taken; the scheduler runs at most "
                               "max_num_seqs requests at once, so a row was not given back")
        row = self._free.pop()
        self._rows[request_id] = row
        if needs_state:
            self._state_rows[request_id] = row
        return row

    def remove(self, request_id: str) -> None:
        """Give the row back (a request that holds none is ignored)."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._state_rows.pop(request_id, None)
            self._free.append(row)

    def state_row(self, request_id: str) -> int:
        """The request's sampler-state row, or 0 when it needs none."""
        return self._state_rows.get(request_id, 0)

    def clear(self) -> None:
        for request_id in list(self._rows):
            self.remove(request_id)
