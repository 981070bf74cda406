"""The cost of structured outputs: offline throughput with 0%, 50% and 100% of requests guided by a
JSON schema, side by side in one run (bundled SmolLM2 by default).

    python benchmarks/structured.py [--num-prompts 32] [--runs 3] [--max-num-seqs 32] [--json PATH]

Guided requests end when their JSON closes, so their lengths are the grammar's; to compare like
with like, one untimed guided run records every request's output length, and from then on each free
request is given exactly that many tokens (max_tokens = length, ignore_eos). So every mix produces
the same tokens per request and only the guidance differs. Requests are chat prompts asking for a
person; guided ones carry a JSON schema (name, age, city, hobbies) through
`SamplingParams.structured_outputs`. Greedy decoding.

Runs are interleaved (0%, 50%, 100%, 0%, ...) so drift on a shared machine hits all mixes alike;
the figures are medians of --runs. The reported cost is 1 - (guided tok/s / free tok/s).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 30},
                         "hobbies": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 20}}}}
SUBJECTS = ["a chef", "a pilot", "a painter", "a farmer", "a nurse", "a judge", "a miner", "a poet"]


def prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Describe {SUBJECTS[i % len(SUBJECTS)]} number {i} as JSON."}]
            for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96, help="cap on a guided answer's length")
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from paxserve import Engine, SamplingParams
    from paxserve.structured_outputs import StructuredOutputsParams

    engine = Engine(args.model, max_model_len=512, max_num_seqs=args.max_num_seqs, log_stats_interval=0)
    chats = prompts(args.num_prompts)
    guided = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    probe = engine.chat(chats, guided, use_tqdm=False)  # untimed: compiles, and fixes every request's length
    lengths = [len(o.outputs[0].token_ids) for o in probe]
    valid = sum(_valid(o.outputs[0].text) for o in probe)
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]

    def run(fraction: float) -> dict[str, float]:
        k = round(fraction * len(chats))
        params = [guided] * k + free[k:]
        engine.reset_prefix_cache()
        start = time.perf_counter()
        outs = engine.chat(chats, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert [len(o.outputs[0].token_ids) for o in outs] == lengths, "a mix produced different lengths"
        return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}

    fractions = (0.0, 0.5, 1.0)
    for f in fractions:  # one untimed pass of each mix: every bucket it reaches is compiled
        run(f)
    results: dict[float, list[dict[str, float]]] = {f: [] for f in fractions}
    for _ in range(args.runs):
        for f in fractions:
            results[f].append(run(f))
    free_rate = statistics.median(r["tok_s"] for r in results[0.0])
    rows = []
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {platform.python_version()}; "
          f"{args.num_prompts} chat requests, max_num_seqs {args.max_num_seqs}, greedy; guided answers valid: "
          f"{valid}/{len(probe)}; output tokens per run {sum(lengths)} (mean {sum(lengths) / len(lengths):.1f})")
    print("| json_schema requests | output tok/s (median) | runs | vs 0% |")
    print("|---|---|---|---|")
    for f in fractions:
        rate = statistics.median(r["tok_s"] for r in results[f])
        rows.append({"fraction": f, "tok_s": rate, "runs": [r["tok_s"] for r in results[f]],
                     "cost": 1 - rate / free_rate})
        each = ", ".join(f"{r['tok_s']:.1f}" for r in results[f])
        print(f"| {f:.0%} | {rate:.1f} | {each} | "
              f"{rate / free_rate:.3f}x ({1 - rate / free_rate:+.1%} cost) |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "lengths": lengths, "valid": valid,
                                               "rows": rows}, indent=2))


def _valid(text: str) -> bool:
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except Exception:  # noqa: BLE001 - counted, not raised
        return False


if __name__ == "__main__":
    main()
