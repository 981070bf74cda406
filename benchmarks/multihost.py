"""What spanning processes costs per step: one engine at tensor parallel 4 as one process with 4
devices, and as two processes with 2 devices each (JAX's multi-controller runtime over loopback,
gloo collectives, the step plan through the coordination service's key-value store).

    python benchmarks/multihost.py [--batch 8] [--steps 32] [--runs 3] [--json PATH]

Each configuration runs in fresh processes on this machine's CPU with simulated devices: a random
Llama (4 layers, hidden 256, 8 heads / 4 KV heads, vocabulary 4096) decodes `--batch` greedy
requests of `--steps` tokens each; after an untimed run that compiles every program, `--runs` timed
runs follow and the median wall time per engine step is reported, with (two processes) the time
rank 0 spends publishing each plan message and the messages' size. On a CPU the devices are the
host's own cores, so the collectives' cost here is gloo over loopback on shared cores: a bound on
the host-side overhead, not a GPU cluster's figure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=4096, hidden_size=256,
              intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
              max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, torch_dtype="float32")


def write_checkpoint(directory: Path) -> None:
    """The random Llama above, written with numpy (no torch needed)."""
    from safetensors.numpy import save_file

    c = CONFIG
    h, i, v, d = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d
    rng = np.random.default_rng(0)
    w = lambda *shape: (0.05 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": np.ones(h, np.float32),
               "lm_head.weight": w(v, h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors |= {p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
                    p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
                    p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                    p + "mlp.down_proj.weight": w(h, i), p + "input_layernorm.weight": np.ones(h, np.float32),
                    p + "post_attention_layernorm.weight": np.ones(h, np.float32)}
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(CONFIG))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict[str, str]:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    return {**os.environ, "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])}


def run_rank(args: argparse.Namespace) -> None:
    """One process of a configuration (rank 0 measures and writes `--json`)."""
    sys.path.insert(0, str(ROOT))
    from paxserve import Engine, SamplingParams

    hosts = {} if args.nnodes == 1 else dict(nnodes=args.nnodes, node_rank=args.rank, master_port=args.port)
    engine = Engine(args.model, tensor_parallel_size=4, max_model_len=512, num_gpu_blocks_override=512,
                    max_num_seqs=args.batch, warmup=False, log_stats_interval=0, compilation_cache_dir="",
                    compile_in_background=False, **hosts)
    if engine.is_worker:
        engine.run_worker()
        return
    sends: list[tuple[float, int]] = []
    if engine.parts.channel is not None:  # time rank 0's publishing of each plan message
        send = engine.parts.channel.send

        def timed_send(message: tuple) -> None:
            start = time.perf_counter()
            size = send(message)
            sends.append((time.perf_counter() - start, size))

        engine.runner._plan_sink = timed_send
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, CONFIG["vocab_size"], 16).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    engine.generate(prompts, params, use_tqdm=False)  # compiles every program
    per_step = []
    for _ in range(args.runs):
        engine.reset_prefix_cache()
        sends.clear()
        start = time.perf_counter()
        engine.generate(prompts, params, use_tqdm=False)
        per_step.append((time.perf_counter() - start) / (args.steps + 1))  # decode steps + the prefill
    result = {"processes": args.nnodes, "step_ms": 1e3 * statistics.median(per_step),
              "runs_ms": [1e3 * s for s in per_step]}
    if sends:
        result |= {"send_ms_per_message": 1e3 * statistics.median(s for s, _ in sends),
                   "messages_per_step": len(sends) / (args.steps + 1),
                   "message_bytes": statistics.median(b for _, b in sends)}
    Path(args.json).write_text(json.dumps(result))
    engine.close()


def measure(model: Path, nnodes: int, batch: int, steps: int, runs: int, out: Path) -> dict:
    port = _free_port()
    base = [sys.executable, __file__, "--model", str(model), "--batch", str(batch), "--steps", str(steps),
            "--runs", str(runs), "--json", str(out), "--nnodes", str(nnodes), "--port", str(port)]
    procs = [subprocess.Popen([*base, "--rank", str(rank)], env=_env(4 // nnodes), stdout=subprocess.DEVNULL)
             for rank in range(nnodes)]
    codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        raise RuntimeError(f"{nnodes}-process run failed: exit codes {codes}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=None)
    # One process of a configuration (the script starts these itself).
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--nnodes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        run_rank(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        write_checkpoint(model)
        results = [measure(model, nnodes, args.batch, args.steps, args.runs, Path(tmp) / f"{nnodes}.json")
                   for nnodes in (1, 2)]
    one, two = results
    print(f"TP 4, batch {args.batch}, {args.steps} decode steps, median of {args.runs} runs "
          f"({os.cpu_count()} CPU cores, simulated devices)")
    print("| processes x devices | ms / step | runs (ms / step) | plan publish ms / message | messages / step "
          "| bytes / message |")
    print("|---|---|---|---|---|---|")
    for r, label in ((one, "1 x 4"), (two, "2 x 2")):
        runs = ", ".join(f"{x:.1f}" for x in r["runs_ms"])
        extra = (f"{r['send_ms_per_message']:.2f} | {r['messages_per_step']:.2f} | {r['message_bytes']:.0f}"
                 if "send_ms_per_message" in r else "- | - | -")
        print(f"| {label} | {r['step_ms']:.1f} | {runs} | {extra} |")
    print(f"two processes / one: {two['step_ms'] / one['step_ms']:.2f}x per step")
    if args.json:
        Path(args.json).write_text(json.dumps({"single": one, "multi": two}, indent=2))


if __name__ == "__main__":
    main()
