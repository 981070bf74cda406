"""The settings and requests every rank of the multi-host engine test uses (test_multihost.py and
its probe). Four prompts admitted in one step and decoded together keep the programs to compile
few (each compiles on both ranks); the requests still cover the plan's parts: greedy rows, a
repetition penalty (sampler-state rows written on every rank), a seeded sample and logprobs of
the output and the prompt."""

from __future__ import annotations

from typing import Any

ENGINE_ARGS: dict[str, Any] = dict(warmup=False, log_stats_interval=0, compilation_cache_dir="",
                                   tensor_parallel_size=4, block_size=16, num_gpu_blocks_override=16,
                                   max_model_len=32, max_num_batched_tokens=64, max_num_seqs=4,
                                   compile_in_background=False,
                                   # As on a GPU: rank 0 publishes step N+1 while step N still runs.
                                   async_scheduling=True)
PROMPTS: list[list[int]] = [[5, 17, 99, 3, 42, 8, 61, 200, 13, 77], [31, 4, 250], [64, 65, 66, 67, 68, 69, 70],
                            [120, 7, 33, 201, 18]]
STEPS = 6
# The speculative run: proposals are verified whatever this machine's step times (its probe gives
# the plan a flat time), so that they are verified over both processes.
SPEC = {"method": "ngram", "num_speculative_tokens": 3}
GREEDY_ROWS = (0, 1)  # plain greedy: transformers' generate gives the same tokens


def sampling_params() -> list[Any]:
    from paxserve import SamplingParams

    common = dict(max_tokens=STEPS, ignore_eos=True)
    # Row 1 also asks for sampled and prompt logprobs (the all-positions forward and the scorer).
    return [SamplingParams(temperature=0.0, **common),
            SamplingParams(temperature=0.0, logprobs=2, prompt_logprobs=1, **common),
            SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, **common),
            SamplingParams(temperature=1.0, top_k=20, seed=7, **common)]


def logprob_rows(out: Any) -> list[list[float]]:
    """A request's sampled and prompt logprobs as plain numbers (the chosen tokens' first)."""
    rows = [[lp.logprob for lp in step.values()] for step in out.outputs[0].logprobs or []]
    return rows + [[lp.logprob for lp in step.values()] for step in out.prompt_logprobs or [] if step]
