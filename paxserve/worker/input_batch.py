"""The persistent batch (vLLM v1's InputBatch): the running requests' rows in preallocated arrays,
changed only where the scheduler's output says something changed.

A request takes a row when it starts running (the scheduler's `new_requests`: its first admission,
or again after a preemption) and gives it back when it stops (`left_running_ids`). The row holds
its token ids, its block table (extended by each step's `new_block_ids`), its sampling parameters
(`SamplingColumns`) and the index of its row of the device sampler state (the same number, or 0
when it needs none). A step's batch is then numpy gathers over the scheduled rows plus the new
tokens: host work proportional to the step, not to the total context.

Pure Python + numpy (no JAX).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Callable

import numpy as np

from paxserve.core.scheduler import NewRequestData, ScheduledRequest
from paxserve.worker.sampling.host_inputs import NO_DRAFT, SamplingColumns, SamplingInputs, SamplingRow, needs_state
from paxserve.worker.step_inputs import Batch, assemble_batch, verify_rows

# (tokens, sequences, widest block table) -> their padded sizes: the model runner's buckets.
Buckets = Callable[[int, int, int], tuple[int, int, int]]


# An output token whose id a step in flight has not returned yet (its value lives on the device).
PLACEHOLDER = -1


@dataclass(slots=True)
class PreparedStep:
    """A step's padded inputs, and where each row's sampled token goes."""

    batch: Batch
    sampling: SamplingInputs
    rows: list[int]  # the persistent row of each step row
    # Each row's token list as it was: a row handed to another request since has a new list, and
    # the step's token must not land there.
    token_lists: list[list[int]]
    token_index: list[int]  # where the row's sampled token goes in its token ids (-1: not kept)
    # A verifying step: each row's proposals (fed after its last token), and where each row's
    # sampler rows start (1 + its proposals of them, one row after another); a plain step has one
    # sampler row per step row and no proposals.
    drafts: list[list[int]] | None = None
    first_rows: list[int] | None = None

    def row_tokens(self, token_ids: list[int]) -> list[list[int]]:
        """Each row's kept tokens from the sampler's rows: its one token, or when it verified
        proposals the samples up to and including the first that differs from its proposal (the
        rule `sampling.verify` applies on the device)."""
        if self.drafts is None:
            return [[t] for t in token_ids[:len(self.rows)]]
        out = []
        for first, draft in zip(self.first_rows, self.drafts):
            samples = token_ids[first:first + len(draft) + 1]
            m = 0
            while m < len(draft) and samples[m] == draft[m]:
                m += 1
            out.append(samples[:m + 1])
        return out

    @property
    def keep(self) -> list[bool]:
        """Which rows sample their request's next token."""
        return [index >= 0 for index in self.token_index]


class InputBatch:
    """Rows 1..max_num_seqs; row 0 is never handed out (padding reads it: neutral sampling, state
    row 0)."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, vocab_size: int,
                 num_spec_tokens: int = 0, lora: bool = False) -> None:
        """`num_spec_tokens`: speculative decoding's k (a verifying sequence has at most 1 + k
        logits rows); 0 without speculation. `lora`: the steps carry each token's LoRA slot."""
        if max_num_seqs < 1:
            raise ValueError(f"InputBatch: max_num_seqs must be >= 1, got {max_num_seqs}")
        if num_spec_tokens < 0:
            raise ValueError(f"InputBatch: num_spec_tokens must be >= 0, got {num_spec_tokens}")
        self.verify_width = 1 + num_spec_tokens
        self.num_rows = max_num_seqs + 1
        self.block_size = block_size
        self._free = list(range(max_num_seqs, 0, -1))  # pop() hands out the lowest row first
        self._rows: dict[str, int] = {}
        self.block_table = np.zeros((self.num_rows, max_blocks_per_seq), np.int32)
        self.num_blocks = np.zeros(self.num_rows, np.int32)
        self.token_ids: list[list[int]] = [[] for _ in range(self.num_rows)]  # prompt + output so far
        self.num_tokens = np.zeros(self.num_rows, np.int32)
        self.num_prompt_tokens = np.zeros(self.num_rows, np.int32)
        self.sampling = SamplingColumns(self.num_rows, vocab_size)
        self.lora_slot = np.full(self.num_rows, -1, np.int32) if lora else None

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    # ---- what changed ---------------------------------------------------------------------------

    def add(self, new: NewRequestData) -> SamplingRow | None:
        """Give a request that starts running its row. Returns the sampling row whose device state
        must be written before the step (None when it needs no state)."""
        assert new.request_id not in self._rows, new.request_id  # the scheduler starts a request once
        if not self._free:
            raise RuntimeError(f"InputBatch: all {self.num_rows - 1} rows are taken; the scheduler runs at most "
                               "max_num_seqs requests at once, so a row was not given back")
        if len(new.block_ids) > self.block_table.shape[1]:
            raise ValueError(f"InputBatch: request {new.request_id!r} has {len(new.block_ids)} blocks, more than the "
                             f"{self.block_table.shape[1]} a sequence may hold")
        row = self._free.pop()
        self._rows[new.request_id] = row
        self.token_ids[row] = new.prompt_token_ids + new.output_token_ids
        self.num_tokens[row] = len(self.token_ids[row])
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_blocks[row] = 0
        self.append_blocks(new.request_id, new.block_ids)
        state_row = row if needs_state(new.sampling_params, new.eos_token_ids) else 0
        self.sampling.set_row(row, new.sampling_params, new.seed, state_row)
        if self.lora_slot is not None:
            self.lora_slot[row] = new.lora_slot
        elif new.lora_slot >= 0:
            raise ValueError(f"InputBatch: request {new.request_id!r} runs a LoRA adapter, but this batch was made "
                             "without LoRA slots")
        if not state_row:
            return None
        return SamplingRow(new.sampling_params, new.prompt_token_ids, new.output_token_ids, new.seed,
                           new.eos_token_ids, state_row=state_row)

    def append_blocks(self, request_id: str, block_ids: list[int]) -> None:
        row = self._rows[request_id]
        start = int(self.num_blocks[row])
        if start + len(block_ids) > self.block_table.shape[1]:
            raise ValueError(f"InputBatch: request {request_id!r} would hold {start + len(block_ids)} blocks, more "
                             f"than the {self.block_table.shape[1]} a sequence may hold")
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove(self, request_id: str) -> None:
        """Give the row back (a request that holds none is ignored)."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self.token_ids[row] = []
            self._free.append(row)

    # ---- one step -------------------------------------------------------------------------------

    def prepare(self, scheduled: list[ScheduledRequest], buckets: Buckets) -> PreparedStep:
        """The step's padded batch and sampling inputs, gathered from the scheduled rows. A sampling
        row gets a placeholder for the token it will sample, so the next step can be built before
        this one's results are back: an input token still a placeholder is read on the device from
        its row's last kept token."""
        if not scheduled:
            raise ValueError("InputBatch.prepare needs at least one scheduled request")
        n = len(scheduled)
        rows = [self._rows[s.request_id] for s in scheduled]
        row_array = np.array(rows, np.int32)
        num_computed = np.fromiter((s.num_computed_tokens for s in scheduled), np.int32, n)
        num_new = np.fromiter((s.num_new_tokens for s in scheduled), np.int32, n)
        token_ids = self.token_ids
        verifying = any(s.spec_token_ids for s in scheduled)
        # A row's proposals follow its own tokens (they are not in its token ids: most get rejected).
        input_ids = np.fromiter((t for s, r in zip(scheduled, rows) for t in chain(
            token_ids[r][s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids)],
            s.spec_token_ids)), np.int32, int(num_new.sum()))
        pending = input_ids == PLACEHOLDER
        source = None
        if pending.any():
            source = np.where(pending, np.repeat(row_array, num_new), -1).astype(np.int32)
            input_ids[pending] = 0
        num_blocks = self.num_blocks[row_array]
        t_pad, s_pad, b_pad = buckets(len(input_ids), n, int(num_blocks.max()))
        batch = assemble_batch(input_ids, num_computed, num_new, self.block_table[row_array, :b_pad], num_blocks,
                               self.block_size, pad_tokens_to=t_pad, pad_seqs_to=s_pad, pad_blocks_to=b_pad,
                               token_source=source,
                               lora_slots=None if self.lora_slot is None else self.lora_slot[row_array])
        index = np.zeros(s_pad, np.int32)
        index[:n] = row_array
        keep = [s.samples for s in scheduled]
        keep_padded = np.zeros(s_pad, bool)
        keep_padded[:n] = keep
        step = self.num_tokens[index] - self.num_prompt_tokens[index]
        drafts = first_rows = None
        if verifying:
            drafts = [list(s.spec_token_ids) for s in scheduled]
            sampling, first_rows = self._verify_inputs(batch, drafts, index[:n], step[:n], keep_padded[:n])
        else:
            sampling = self.sampling.gather(index, step, keep_padded, n)
        token_index = []
        for row, kept in zip(rows, keep):
            token_index.append(len(token_ids[row]) if kept else -1)
            if kept:
                token_ids[row].append(PLACEHOLDER)
                self.num_tokens[row] += 1
        return PreparedStep(batch, sampling, rows, [token_ids[row] for row in rows], token_index, drafts, first_rows)

    def _verify_inputs(self, batch: Batch, drafts: list[list[int]], index: np.ndarray, step: np.ndarray,
                       keep: np.ndarray) -> tuple[SamplingInputs, list[int]]:
        """A verifying step's sampler inputs and each sequence's first sampler row: a sequence with d
        proposals has 1 + d rows, row j at the position after its j-th fed token (its last real token,
        then its proposals), one sequence after another. The rows are padded to min(tokens, sequences
        x (1 + k)), the bucket's (never fewer than the rows: each row is a fed token). The batch's
        logits indices become those rows'."""
        num_rows = verify_rows(batch.input_ids.shape[0], batch.context_lens.shape[0], self.verify_width)
        num_drafts = np.fromiter(map(len, drafts), np.int32, len(drafts))
        starts = np.concatenate([[0], np.cumsum(1 + num_drafts)]).astype(np.int32)
        real = int(starts[-1])
        seq = np.repeat(np.arange(len(drafts)), 1 + num_drafts)
        position = np.arange(real, dtype=np.int32) - starts[seq]
        logits_indices = np.zeros(num_rows, np.int32)
        # The sequence's last real token's row: its logits index minus its proposals.
        logits_indices[:real] = batch.logits_indices[seq] - num_drafts[seq] + position
        batch.logits_indices = logits_indices
        batch.program = "verify"
        draft_rows = np.full(num_rows, NO_DRAFT, np.int32)
        proposed = position < num_drafts[seq]
        draft_rows[:real][proposed] = [t for d in drafts for t in d]
        rows, steps, keeps = np.zeros(num_rows, np.int32), np.zeros(num_rows, np.int32), np.zeros(num_rows, bool)
        rows[:real], steps[:real], keeps[:real] = index[seq], step[seq] + position, keep[seq]
        sampling = self.sampling.gather(rows, steps, keeps, real)
        sampling.draft_tokens = draft_rows
        earlier = np.full((num_rows, self.verify_width - 1), -1, np.int32)
        for first, draft in zip(starts, drafts):
            for j in range(1, len(draft) + 1):
                earlier[first + j, :j] = draft[:j]
        sampling.earlier_drafts = earlier
        return sampling, starts[:-1].tolist()

    def record(self, step: PreparedStep, sampled: list[list[int]] | list[int]) -> None:
        """Put each kept row's sampled tokens in place of its placeholder (rows whose request has
        left the batch meanwhile are skipped: their tokens are dropped). Only a verifying step keeps
        more than one, and it never runs behind another step (its successor's inputs depend on how
        many it kept)."""
        for row, tokens, index, new in zip(step.rows, step.token_lists, step.token_index, sampled):
            if index >= 0 and self.token_ids[row] is tokens:
                new = new if isinstance(new, list) else [new]
                tokens[index] = new[0]
                if len(new) > 1:
                    assert len(tokens) == index + 1, "a verifying step ran behind another"
                    tokens.extend(new[1:])
                    self.num_tokens[row] += len(new) - 1

    def unrecord(self, step: PreparedStep) -> None:
        """Take back the placeholders of a step whose results will never come (it was abandoned)."""
        for row, tokens, index in zip(step.rows, step.token_lists, step.token_index):
            if index >= 0 and self.token_ids[row] is tokens and len(tokens) == index + 1:
                tokens.pop()
                self.num_tokens[row] -= 1
