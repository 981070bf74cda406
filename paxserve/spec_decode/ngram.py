"""Prompt lookup: propose what followed the last earlier occurrence of the sequence's tail.

Input-grounded work (rewriting, summarising, extracting, code edits) copies spans of its prompt;
when the last n tokens occurred before, the tokens after that occurrence are a cheap guess at what
comes next. Host-only numpy over the token ids, no model: a few tens of microseconds per sequence
of a few thousand tokens.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramProposer needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: np.ndarray | list[int], k: int) -> list[int]:
        """Up to `k` tokens: those after the latest earlier match of the longest tail (n from max_n
        down to min_n) that has a match; [] when none has."""
        tokens = np.asarray(token_ids, np.int64)
        length = tokens.shape[0]
        if k < 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            tail = tokens[length - n:]
            # Windows starting before the tail's own start: a match must have a token after it.
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []
