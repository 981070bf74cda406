"""The settings and requests every rank of the multi-host engine test uses (test_multihost.py and
its probe). Four prompts admitted in one step and decoded together keep the programs to compile
few (each compiles on both ranks); the requests still cover the plan's parts: greedy rows, a
repetition penalty (sampler-state rows written on every rank) and a seeded sample."""

from __future__ import annotations

from typing import Any

ENGINE_ARGS: dict[str, Any] = dict(warmup=False, log_stats_interval=0, compilation_cache_dir="",
                                   tensor_parallel_size=4, block_size=16, num_gpu_blocks_override=16,
                                   max_model_len=32, max_num_batched_tokens=64, max_num_seqs=4,
                                   compile_in_background=False)
PROMPTS: list[list[int]] = [[5, 17, 99, 3, 42, 8, 61, 200, 13, 77], [31, 4, 250], [64, 65, 66, 67, 68, 69, 70],
                            [120, 7, 33, 201, 18]]
STEPS = 6
GREEDY_ROWS = (0, 1)  # plain greedy: transformers' generate gives the same tokens


def sampling_params() -> list[Any]:
    from paxserve import SamplingParams

    common = dict(max_tokens=STEPS, ignore_eos=True)
    return [SamplingParams(temperature=0.0, **common), SamplingParams(temperature=0.0, **common),
            SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, **common),
            SamplingParams(temperature=1.0, top_k=20, seed=7, **common)]
