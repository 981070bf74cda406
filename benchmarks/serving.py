"""Serving load test: streaming completions against a running server, vLLM's metric definitions.

    paxserve serve --port 8000 &
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-prompts 64 --concurrency 64
    python benchmarks/serving.py --request-rate 4 ...    # Poisson arrivals instead of fixed concurrency

TTFT = first streamed chunk with text - send time; TPOT = (latency - TTFT) / (output tokens - 1);
ITL = gaps between successive token-bearing chunks; E2E = last chunk - send time. Prompts are seeded
random token ids with mixed lengths; every request generates exactly --output-len tokens (ignore_eos).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import aiohttp


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], output_len: int,
                      headers: dict[str, str]) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last, ttft, itl, usage = None, None, [], None
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                return Result(False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(False, error=str(chunk["error"])[:200])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return Result(False, error=repr(e))
    if ttft is None or usage is None:
        return Result(False, error="stream ended without text or usage")
    return Result(True, ttft=ttft, latency=last - start, output_tokens=usage["completion_tokens"],
                  prompt_tokens=usage["prompt_tokens"], itl=itl)


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"mean": statistics.fmean(values), "p50": statistics.median(values), "p90": pick(0.9), "p99": pick(0.99)}


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, args.vocab_size) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
               for _ in range(args.num_prompts)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        model = args.model
        if model is None:
            async with session.get(args.base_url + "/v1/models", headers=headers) as resp:
                model = (await resp.json())["data"][0]["id"]
        url = args.base_url + "/v1/completions"
        limit = asyncio.Semaphore(args.concurrency or len(prompts))

        async def bounded(p: list[int]) -> Result:
            async with limit:
                return await one_request(session, url, model, p, args.output_len, headers)

        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(bounded(p)))
            if args.request_rate:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    report = {
        "model": model, "num_prompts": len(prompts), "completed": len(ok), "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if not r.ok})[:5], "duration_s": duration,
        "concurrency": args.concurrency, "request_rate": args.request_rate, "output_len": args.output_len,
        "request_throughput": len(ok) / duration, "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_s": summary([r.ttft for r in ok]),
        "tpot_s": summary([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "itl_s": summary([x for r in ok for x in r.itl]),
        "e2e_s": summary([r.latency for r in ok]),
        "wrong_token_counts": sum(1 for r in ok if r.output_tokens != args.output_len),
    }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the first in /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight (0 = all at once)")
    parser.add_argument("--request-rate", type=float, default=0.0, help="Poisson arrivals per second (0 = no delay)")
    parser.add_argument("--min-input-len", type=int, default=16)
    parser.add_argument("--max-input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the report to this file")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
