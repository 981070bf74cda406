"""Quantized weights and KV cache on the real bundled model: memory, quality and speed side by side.

    python benchmarks/quantization.py [--runs 3] [--text-tokens 3000] [--dtype float32]

The bundled SmolLM2-135M GGUF is written out as a float checkpoint (`models/gguf_export.py`), then
served in each setting (unquantized, int8 and fp8 weights, an fp8 KV cache with computed scales,
int8 weights with an fp8 cache), one engine at a time, in this one run, beside the GGUF file itself
served kept quantized (its weights are the float export's exactly). Per setting:

- weight bytes from the engine's own params, KV tokens from its own plan for a fixed 1 GiB budget;
- the start-up check's top-1 agreement and mean KL against the unquantized model;
- perplexity of a fixed English text (`--text-tokens` of Python's own documentation,
  `pydoc_data.topics`) through prompt logprobs, and its change against the unquantized run;
- start-up seconds, the first time and again (the check's stored outcome read instead of rerun),
  and prefill and decode throughput (medians of `--runs` after one warm run).

Then two plans from abstract shapes (no weights): Llama-3-70B with fp8 weights on one H200 and
Llama-3-8B with an fp8 KV cache.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

GGUF = "the GGUF file itself"  # a setting served from the bundled file rather than its float export
SETTINGS = (
    ("unquantized", {}),
    ("GGUF kept quantized (Q4_1, Q8_0 embedding)", {"model": GGUF, "quantization": "gguf"}),
    ("int8 weights", {"quantization": "int8"}),
    ("fp8 weights", {"quantization": "fp8"}),
    ("fp8 KV cache", {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}),
    ("int8 weights + fp8 KV", {"quantization": "int8", "kv_cache_dtype": "fp8", "calculate_kv_scales": True}),
)
KV_BUDGET = 2**30


def fixed_text(tokenizer, num_tokens: int) -> list[int]:  # noqa: ANN001
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return tokenizer.encode(text)[:num_tokens]


def perplexity(engine, ids: list[int]) -> float:  # noqa: ANN001
    from paxserve import SamplingParams

    out = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    nll = [-entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])]
    return math.exp(float(np.mean(nll)))


def throughput(engine, runs: int) -> tuple[float, float]:  # noqa: ANN001
    """(prefill tokens/s of 4 x 512-token prompts, decode tokens/s of 16 sequences x 64 tokens)."""
    from paxserve import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, 512).tolist() for _ in range(4)]
    short = [rng.integers(100, 40000, 16).tolist() for _ in range(16)]
    decode = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    prefill_s, decode_s = [], []
    for run in range(runs + 1):
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        middle = time.perf_counter()
        engine.generate(short, decode, use_tqdm=False)
        end = time.perf_counter()
        if run:  # the first run compiles
            prefill_s.append(middle - start)
            decode_s.append(end - middle)
    return 4 * 512 / statistics.median(prefill_s), 16 * 64 / statistics.median(decode_s)


def abstract_plans() -> list[str]:
    """Plans from abstract shapes: what fits on one H200 (141 GB, NVIDIA's figure)."""
    import ml_dtypes

    from paxserve.config import EngineConfig
    from paxserve.models.config import model_config_from_hf
    from paxserve.models.quant_weights import WeightQuantization
    from paxserve.models.registry import get_architecture
    from paxserve.models.sharding import param_bytes
    from paxserve.worker.memory_plan import plan_kv_cache

    h200 = 141 * 10**9
    llama = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, num_key_value_heads=8,
                 max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    shapes = {"Llama-3-70B": dict(llama, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                  num_attention_heads=64),
              "Llama-3-8B": dict(llama, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32)}
    bf16 = np.dtype(ml_dtypes.bfloat16)
    lines = ["| model | weights | KV cache | weight GiB | KV tokens on one H200 (0.9 of 141 GB, 2 GiB activations) |",
             "|---|---|---|---|---|"]
    for name, kv_itemsize, quant in (("Llama-3-70B", 2, None), ("Llama-3-70B", 2, "fp8"), ("Llama-3-70B", 1, "fp8"),
                                     ("Llama-3-8B", 2, None), ("Llama-3-8B", 1, None)):
        cfg = model_config_from_hf(shapes[name])
        arch = get_architecture(cfg.architecture)
        weights = param_bytes(arch.abstract_params(cfg, bf16, None if quant is None else WeightQuantization(quant)))
        try:
            plan = plan_kv_cache(cfg, EngineConfig(max_model_len=8192), kv_itemsize, weights, h200, 2 * 2**30)
            tokens = f"{plan.num_blocks * 16:,}"
        except ValueError as e:
            tokens = f"does not fit ({str(e)[:60]}...)"
        lines.append(f"| {name} | {quant or 'bf16'} | {'fp8' if kv_itemsize == 1 else 'bf16'} | "
                     f"{weights / 2**30:.1f} | {tokens} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--text-tokens", type=int, default=3000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the exported checkpoint's dtype (float32: XLA's CPU bfloat16 matmuls are emulated)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import jax

    from paxserve import Engine
    from paxserve.models.bundled import default_model_path
    from paxserve.models.gguf_export import export_gguf_as_hf

    directory = export_gguf_as_hf(default_model_path(), Path(tempfile.mkdtemp()) / "smollm2", args.dtype)
    rows, base_ppl = [], None
    for label, settings in SETTINGS:
        model = str(default_model_path() if settings.get("model") == GGUF else directory)
        settings = {k: v for k, v in settings.items() if k != "model"}
        start = time.perf_counter()
        engine = Engine(model, dtype=args.dtype, kv_cache_memory_bytes=KV_BUDGET, log_stats_interval=0,
                        compilation_cache_dir="", **settings)
        startup = time.perf_counter() - start
        parts = engine.parts
        weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(parts.model.params))
        ids = fixed_text(parts.tokenizer, args.text_tokens)
        ppl = perplexity(engine, ids)
        base_ppl = ppl if base_ppl is None else base_ppl
        prefill, decode = throughput(engine, args.runs)
        check, kv_tokens = parts.numerics_check, parts.plan.num_tokens
        engine.close()
        del engine, parts
        start = time.perf_counter()  # the same setting again: its check's outcome is read, not rerun
        Engine(model, dtype=args.dtype, kv_cache_memory_bytes=KV_BUDGET, log_stats_interval=0,
               compilation_cache_dir="", **settings).close()
        restart = time.perf_counter() - start
        rows.append(f"| {label} | {weight_bytes / 2**20:.0f} | {kv_tokens:,} | "
                    + (f"{check.top1:.1%} / {check.mean_kl:.4f}" if check else "-")
                    + f" | {ppl:.3f} ({100 * (ppl / base_ppl - 1):+.2f}%) | {startup:.1f} / {restart:.1f} | "
                    f"{prefill:.0f} | {decode:.1f} |")
        print(rows[-1], flush=True)
    print(f"\nSmolLM2-135M-Instruct (bundled GGUF written as a {args.dtype} checkpoint), {jax.devices()[0]}, "
          f"{len(ids)} tokens of pydoc_data.topics, medians of {args.runs} runs")
    print("| setting | weight MiB | KV tokens in 1 GiB | check: top-1 / mean KL | perplexity (change) | start-up s, "
          "first / again | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("\n".join(abstract_plans()))


if __name__ == "__main__":
    main()
