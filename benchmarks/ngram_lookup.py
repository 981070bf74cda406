"""Host cost of n-gram prompt lookup per decoding request per step (it runs before every step).

    python benchmarks/ngram_lookup.py [--context 4000] [--calls 200]

A random context of `--context` tokens whose tail occurs nowhere earlier (every n is tried, the
worst case), and one whose tail repeats an earlier span; median microseconds per call of
`NgramProposer(1, 5).propose` on the engine's input (the prompt as a numpy array made once, the
output appended each step).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from paxserve.spec_decode.ngram import NgramProposer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    proposer = NgramProposer(1, 5)
    prompt_len = args.context * 7 // 8
    prompt = np.asarray(rng.integers(0, 49152, prompt_len), np.int32)
    outputs = {"no match": rng.integers(0, 49152, args.context - prompt_len).tolist(),
               "tail repeats the prompt": prompt[100:100 + args.context - prompt_len].tolist()}
    for name, output in outputs.items():
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            proposed = proposer.propose(np.concatenate([prompt, np.asarray(output, np.int32)]), 4)
            times.append(time.perf_counter() - start)
        print(f"{name:24} context {args.context}: {1e6 * statistics.median(times):7.1f} us per call, "
              f"proposed {len(proposed)} tokens")


if __name__ == "__main__":
    main()
