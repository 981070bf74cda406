"""Synthetic request lengths shared by the benchmarks: ShareGPT-like lognormal lengths or fixed ones.

ShareGPT conversations average about 160 prompt tokens and 340 completion tokens, with long tails.
`lognormal_lengths` draws lengths with a given mean from a lognormal distribution (sigma 1: the median
is about 60% of the mean, the 99th percentile about 6x it); `clip_lengths` makes each request fit a
context: input <= room - 1, then output <= room - input, so input + output <= room and both >= 1.
No JAX, no model: numpy only.
"""

from __future__ import annotations

import math

import numpy as np

SHAREGPT_MEAN_INPUT = 160.0
SHAREGPT_MEAN_OUTPUT = 340.0
SHAREGPT_SIGMA = 1.0


def lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float = SHAREGPT_SIGMA) -> np.ndarray:
    """`n` integer lengths >= 1 from a lognormal with the given mean (mean = exp(mu + sigma^2 / 2))."""
    mu = math.log(mean) - sigma * sigma / 2
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(int)


def clip_lengths(inputs, outputs, room: int) -> list[tuple[int, int]]:  # noqa: ANN001
    """(input, output) pairs clipped so that input + output <= room: input first (leaving one token
    of output), then output."""
    if room < 2:
        raise ValueError(f"no room for a prompt and an output token: room {room}")
    pairs = []
    for i, o in zip(inputs, outputs):
        i = min(int(i), room - 1)
        pairs.append((i, min(int(o), room - i)))
    return pairs


def sharegpt_lengths(n: int, *, max_model_len: int, seed: int, mean_input: float = SHAREGPT_MEAN_INPUT,
                     mean_output: float = SHAREGPT_MEAN_OUTPUT, sigma: float = SHAREGPT_SIGMA) -> list[tuple[int, int]]:
    """`n` seeded (input, output) lengths, lognormal with the given means, clipped to max_model_len.
    The same draws as `benchmarks/memory.py`'s trace for the same seed and request count."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = np.random.default_rng(seed)
    inputs = lognormal_lengths(rng, n, mean_input, sigma)
    outputs = lognormal_lengths(rng, n, mean_output, sigma)
    return clip_lengths(inputs, outputs, max_model_len)


def random_prompts(input_lens: list[int], vocab_size: int, seed: int, low: int = 3) -> list[list[int]]:
    """One prompt of random token ids in [low, vocab_size) per length (ids below `low` are left out:
    special tokens such as BOS/EOS)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(low, vocab_size, int(n)).tolist() for n in input_lens]


def sharegpt_requests(n: int, *, max_model_len: int, seed: int,
                      vocab_size: int) -> tuple[list[list[int]], list[int], list[int]]:
    """ShareGPT-like requests: random token-id prompts of `sharegpt_lengths` input lengths (drawn with
    seed + 1), as (prompts, input lengths, output lengths)."""
    lengths = sharegpt_lengths(n, max_model_len=max_model_len, seed=seed)
    input_lens = [i for i, _ in lengths]
    return random_prompts(input_lens, vocab_size, seed + 1), input_lens, [o for _, o in lengths]


def check_fixed_lengths(min_input_len: int, max_input_len: int, output_len: int, max_model_len: int) -> None:
    """The fixed dataset's flags must describe requests that fit max_model_len."""
    if not 1 <= min_input_len <= max_input_len or output_len < 1:
        raise ValueError("fixed dataset: need 1 <= --min-input-len <= --max-input-len and --output-len >= 1")
    if max_input_len + output_len > max_model_len:
        raise ValueError(f"fixed dataset: --max-input-len {max_input_len} + --output-len {output_len} exceeds "
                         f"--max-model-len {max_model_len}")


def length_summary(values: list[int]) -> dict[str, float]:
    a = np.asarray(values)
    return {"mean": float(a.mean()), "p50": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "min": int(a.min()), "max": int(a.max()), "total": int(a.sum())}


def describe_lengths(input_lens: list[int], output_lens: list[int]) -> str:
    i, o = length_summary(input_lens), length_summary(output_lens)
    return (f"{len(input_lens)} requests; input tokens mean {i['mean']:.0f} / p50 {i['p50']:.0f} / p99 "
            f"{i['p99']:.0f} / max {i['max']} ({i['total']} in all); output tokens mean {o['mean']:.0f} / p50 "
            f"{o['p50']:.0f} / p99 {o['p99']:.0f} / max {o['max']} ({o['total']} in all)")
