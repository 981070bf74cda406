"""Tensor-parallel memory plan: per-device weights, KV cache and 8k sequences for Llama-3 8B / 70B.

    python benchmarks/tp_memory.py [--device-gb 141] [--utilization 0.9] [--max-model-len 8192]
                                   [--sizes 1,2,4,8] [--max-num-batched-tokens 2048] [--max-num-seqs 256]

Computed from abstract params (shapes only: no weights, no devices), through the same calls the
engine makes at start-up: `split_config` for one device's share, `device_share` + `param_bytes`
for its weights, `plan_kv_cache` for the blocks. The one input the engine measures and this script
cannot is the activation peak (XLA's temp memory for the largest step, known only by compiling on
the device); it is replaced by the fixed estimate `activation_estimate` states.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paxserve.config import EngineConfig  # noqa: E402
from paxserve.models.config import ModelConfig, model_config_from_hf  # noqa: E402
from paxserve.models.registry import get_architecture  # noqa: E402
from paxserve.models.sharding import device_share, param_bytes, size_problems, split_config  # noqa: E402
from paxserve.worker.memory_plan import plan_kv_cache  # noqa: E402

GiB = 2**30
BF16 = np.dtype(ml_dtypes.bfloat16)
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64)
MODELS = {"Llama-3-8B": LLAMA3_8B, "Llama-3-70B": LLAMA3_70B}
ACTIVATION_FORMULA = ("4*T*hidden*4 + T*2*(intermediate/tp)*2 + S*(vocab/tp + 2*vocab)*4  "
                      "(T = next pow2 of max_num_batched_tokens, S = next pow2 of max_num_seqs)")


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def activation_estimate(cfg: ModelConfig, local: ModelConfig, tokens: int, seqs: int) -> int:
    """A stand-in for the measured peak, sized like the largest step bucket the engine compiles:
    four float32 hidden-state arrays (residual, normed input, attention and MLP outputs), the bf16
    gate|up product of this device's MLP slice, and float32 logits: the local vocabulary slice plus
    the all-gathered full vocabulary and one sampling copy of it (every device samples over all of it)."""
    t, s = next_pow2(tokens), next_pow2(seqs)
    return (4 * t * cfg.hidden_size * 4 + t * 2 * local.intermediate_size * BF16.itemsize
            + s * (local.vocab_size + 2 * cfg.vocab_size) * 4)


def plan_row(name: str, cfg: ModelConfig, size: int, args: argparse.Namespace, device_bytes: int,
             errors: list[str]) -> list[str]:
    problems = size_problems(cfg, size)
    if problems:
        return [name, str(size)] + ["-"] * 9 + ["invalid size: " + "; ".join(problems)]
    arch = get_architecture(cfg.architecture)
    local, _ = split_config(cfg, size)
    weights = param_bytes(device_share(cfg, size, lambda c: arch.abstract_params(c, BF16)))
    total = param_bytes(arch.abstract_params(cfg, BF16))
    activations = activation_estimate(cfg, local, args.max_num_batched_tokens, args.max_num_seqs)
    kv_per_token = local.kv_bytes_per_token * BF16.itemsize
    # The budget is recomputed only for display; plan_kv_cache decides the blocks on its own.
    budget = int(args.utilization * device_bytes) - weights - activations
    head = [name, str(size), f"{local.num_heads}/{local.num_kv_heads}",
            f"{weights / GiB:.2f} ({weights / 1e9:.2f})", f"{total / GiB:.2f}", f"{activations / GiB:.2f}", f"{kv_per_token:,}",
            f"{budget / GiB:.2f}"]
    engine = EngineConfig(model=None, max_model_len=args.max_model_len, gpu_memory_utilization=args.utilization,
                          block_size=16, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    try:
        plan = plan_kv_cache(local, engine, BF16.itemsize, weights, device_bytes, activation_bytes=activations,
                             num_devices=size)
    except ValueError as err:
        # The engine's message is long (it lists the flags to change): keep it for a footnote.
        errors.append(f"{name} TP {size}: {err}")
        usable = args.utilization * device_bytes
        reason = (f"weights {weights / GiB:.2f} GiB > {args.utilization} x device = {usable / GiB:.2f} GiB"
                  if weights > usable else f"one {args.max_model_len}-token sequence does not fit")
        return head + ["-", "-", "does not fit", reason + f" [{len(errors)}]"]
    return head + [f"{plan.num_blocks - 1:,}", f"{plan.num_tokens:,}", str(plan.num_tokens // args.max_model_len), ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device-gb", type=float, default=141.0, help="device memory in 1e9 bytes (H200: 141)")
    parser.add_argument("--utilization", type=float, default=0.9, help="gpu_memory_utilization")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--sizes", default="1,2,4,8", help="tensor-parallel sizes, comma-separated")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args()
    device_bytes = int(args.device_gb * 1e9)
    sizes = [int(s) for s in args.sizes.split(",")]

    print(f"Command: python {' '.join(sys.argv)}")
    print("Computed from abstract params (shapes only; no weights, no devices): the figures do not depend on "
          "the machine that runs this.")
    print(f"Device: {device_bytes:,} bytes = {device_bytes / GiB:.2f} GiB, gpu_memory_utilization "
          f"{args.utilization} -> {args.utilization * device_bytes / GiB:.2f} GiB per device; bfloat16 weights "
          f"and KV cache, block 16, max_model_len {args.max_model_len}.")
    print("Activations: an ESTIMATE, not measured (the engine measures them by compiling the largest step on "
          f"the device): {ACTIVATION_FORMULA}, with T={next_pow2(args.max_num_batched_tokens)}, "
          f"S={next_pow2(args.max_num_seqs)}.\n")
    columns = ["model", "TP", "q/KV heads per device", "weights per device GiB (GB)", "weights total GiB", "activations GiB (est.)",
               "KV bytes/token per device", "KV budget GiB per device", "KV blocks", "KV tokens",
               f"{args.max_model_len}-token seqs at once", "note"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    errors: list[str] = []
    for name, hf in MODELS.items():
        cfg = model_config_from_hf(hf)
        for size in sizes:
            print("| " + " | ".join(plan_row(name, cfg, size, args, device_bytes, errors)) + " |")
    for i, err in enumerate(errors, 1):
        print(f"\n[{i}] plan_kv_cache: {err}")


if __name__ == "__main__":
    main()
