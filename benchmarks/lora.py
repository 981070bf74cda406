"""Multi-LoRA serving on the real bundled model: a batch whose rows use 4 different adapters against
the same batch on the base model, side by side in one process.

    python benchmarks/lora.py [--runs 3] [--rank 16] [--batch 16] [--max-tokens 64]

SmolLM2-135M-Instruct (the bundled GGUF, as the CPU default serves it), greedy, `--batch` chat
prompts decoding `--max-tokens` tokens each (ignore_eos), all requests added at once. Three
settings, each a whole pass over the batch, in rotating order per round so drift hits all alike:

- `no LoRA`: an engine started without --enable-lora;
- `LoRA on, base rows`: an engine with 4 slots of `--rank`, every request on the base model;
- `4 adapters`: the same engine, the requests spread over 4 random adapters of that rank on every
  projection (q, k, v, o, gate, up, down), all resident.

Output tokens/s of the whole pass (median of `--runs` after a warm pass that compiles the buckets).
The base rows' tokens are checked equal to the engine without LoRA, and the adapters' rows checked
to differ from them (adapters that change nothing would measure nothing).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' adapter writer (PEFT's file layout, no torch)

TOPICS = ["a robot who learns to paint", "why the sky is blue", "ideas for a birthday party", "a forest in autumn",
          "what makes a good friend", "the sea at night", "how bees make honey", "the history of bread",
          "a trip to the mountains", "learning to play the piano", "a city in the rain", "the first day of school",
          "a cat that travels", "why we dream", "the life of a star", "an old lighthouse"]


def prompts(tokenizer: Any, n: int) -> list[list[int]]:
    texts = [f"Write a few sentences about {TOPICS[i % len(TOPICS)]}." for i in range(n)]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                           tokenize=False), add_special_tokens=False) for t in texts]


def one_pass(engine: Any, batch: list[list[int]], params: Any, loras: list[Any]) -> tuple[float, list[list[int]]]:
    engine.reset_prefix_cache()
    start = time.perf_counter()
    outs = engine.generate(batch, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    return seconds, [o.outputs[0].token_ids for o in outs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import jax

    from paxserve import Engine, LoRARequest, SamplingParams
    from tests.helpers import SMOLLM2_LORA_SHAPES, write_random_lora

    common = dict(max_model_len=512, max_num_seqs=args.batch, warmup=False, log_stats_interval=0,
                  compilation_cache_dir="", compile_in_background=False)
    plain = Engine(None, **common)
    lora = Engine(None, enable_lora=True, max_loras=4, max_lora_rank=args.rank, **common)
    batch = prompts(plain.tokenizer, args.batch)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"adapter{i}", i + 1, str(write_random_lora(
            Path(tmp) / f"a{i}", 30, SMOLLM2_LORA_SHAPES, args.rank, seed=i, scale=0.5))) for i in range(4)]
        mixed = [adapters[i % 4] for i in range(args.batch)]
        settings = {"no LoRA": (plain, [None] * args.batch), "LoRA on, base rows": (lora, [None] * args.batch),
                    "4 adapters": (lora, mixed)}
        tokens = {name: one_pass(engine, batch, params, loras)[1] for name, (engine, loras) in settings.items()}
        if tokens["LoRA on, base rows"] != tokens["no LoRA"]:
            raise RuntimeError("base rows on the LoRA engine differ from the engine without LoRA")
        changed = sum(a != b for a, b in zip(tokens["4 adapters"], tokens["no LoRA"]))
        if changed < args.batch // 2:
            raise RuntimeError(f"only {changed} of {args.batch} adapter rows differ from the base model's")
        times: dict[str, list[float]] = {name: [] for name in settings}
        names = list(settings)
        for run in range(args.runs):
            for name in names[run % 3:] + names[:run % 3]:
                engine, loras = settings[name]
                seconds, out = one_pass(engine, batch, params, loras)
                if out != tokens[name]:
                    raise RuntimeError(f"{name}: tokens changed between passes")
                times[name].append(seconds)
    output_tokens = args.batch * args.max_tokens
    rates = {name: output_tokens / statistics.median(t) for name, t in times.items()}
    base = rates["no LoRA"]
    print(f"SmolLM2-135M-Instruct, {jax.devices()[0].platform}, batch {args.batch} x {args.max_tokens} output tokens "
          f"(prompts {min(map(len, batch))}-{max(map(len, batch))} tokens), rank {args.rank}, median of {args.runs}; "
          f"{changed} of {args.batch} adapter rows differ from the base model's")
    print("| setting | output tok/s | vs no LoRA | passes (s) |")
    print("|---|---|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {', '.join(f'{t:.2f}' for t in times[name])} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"rates": rates, "times": times, "args": vars(args) | {"json": None}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
