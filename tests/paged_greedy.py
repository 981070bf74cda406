"""Batched greedy generation over the paged cache with a plain block list.

Used by the parity tests to drive the model through shuffled pages step by step; the Engine's
scheduler replaces its block bookkeeping with the block pool.
"""

from __future__ import annotations

import math
import random
from typing import Iterator

import numpy as np

from paxserve.worker.model_runner import ModelRunner
from paxserve.worker.step_inputs import SeqChunk, build_batch, next_power_of_2
from tests.helpers import compute_logits


def greedy_stream(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    stop_token_ids: tuple[int, ...] = (),
    shuffle_seed: int | None = None,
) -> Iterator[tuple[list[int | None], np.ndarray]]:
    """Yield, per step, each prompt's new token (None once finished) and the step's logits.

    Blocks come from a free list, shuffled when `shuffle_seed` is set, so sequences land on
    scattered, non-contiguous pages the way they do under a real scheduler.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    bs = runner.block_size
    need = sum(math.ceil((len(p) + max_new_tokens) / bs) for p in prompts)
    free = list(range(1, runner.num_blocks))
    if need > len(free):
        raise ValueError(f"prompts need {need} KV blocks but the cache has {len(free)}")
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(free)
    tables = [[free.pop() for _ in range(math.ceil((len(p) + max_new_tokens) / bs))] for p in prompts]
    chunks = [SeqChunk(list(p), 0, t) for p, t in zip(prompts, tables)]
    done = [False] * len(prompts)
    for _ in range(max_new_tokens):
        live = [i for i in range(len(prompts)) if not done[i]]
        batch = build_batch(
            [chunks[i] for i in live], bs,
            pad_tokens_to=next_power_of_2(sum(len(chunks[i].token_ids) for i in live), 8),
            pad_seqs_to=next_power_of_2(len(live)),
            pad_blocks_to=next_power_of_2(max(len(t) for t in tables)),
        )
        logits = compute_logits(runner, batch)
        out: list[int | None] = [None] * len(prompts)
        for row, i in enumerate(live):
            token = int(np.argmax(logits[row]))
            out[i] = token
            c = chunks[i]
            chunks[i] = SeqChunk([token], c.context_len, c.block_table)
            done[i] = token in stop_token_ids
        yield out, logits
        if all(done):
            return


def greedy_generate(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int, **kwargs) -> list[list[int]]:
    """Greedy continuations (stopping early at `stop_token_ids`)."""
    results: list[list[int]] = [[] for _ in prompts]
    for tokens, _ in greedy_stream(runner, prompts, max_new_tokens, **kwargs):
        for i, t in enumerate(tokens):
            if t is not None:
                results[i].append(t)
    return results


def greedy_tokens_and_logits(
    runner: ModelRunner, prompts: list[list[int]], steps: int, *, shuffle_seed: int | None = None
) -> tuple[list[list[int]], list[list[np.ndarray]]]:
    """Per prompt, its `steps` greedy tokens and each step's logits (no early stop, so every step
    can be compared with a reference even where a random model emits its EOS id)."""
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[np.ndarray]] = [[] for _ in prompts]
    for step_tokens, step_logits in greedy_stream(runner, prompts, steps, shuffle_seed=shuffle_seed):
        for i, t in enumerate(step_tokens):  # nothing stops, so row i is prompt i every step
            tokens[i].append(t)
            logits[i].append(step_logits[i])
    return tokens, logits
