"""Where one user's decode step goes: a batch-1 engine step taken apart, host and device.

    python benchmarks/decode_breakdown.py [--model PATH | --llama-1b] [--prompt-tokens 256]
                                          [--tokens 128] [--runs 3] [--json PATH] [--plot PATH]

One greedy request (`ignore_eos`, a prompt of random token ids) decodes `--tokens` tokens through
`Engine` (the engine the server runs, without HTTP), once with synchronous scheduling and once with
async scheduling (the default). Each decode step's time is split by wrapping the engine's own methods
with timers (nothing in paxserve changes for this):

- schedule: `Scheduler.schedule` (and the persistent batch's `update_rows`);
- step inputs + dispatch: `ModelRunner.dispatch_model` (gathering the batch and sampling arrays, the
  host-to-device copies, launching the forward and sampler programs; returns before they finish);
- device wait: `ModelRunner.collect` (waits for the programs and copies the packed result back);
- bookkeeping: the rest of `EngineCore._complete` (tokens into requests, stop checks, outputs);
- output processing: `OutputProcessor.process` (detokenization, stop strings, RequestOutputs);
- the step's wall time, whose remainder is what no wrapper saw.

The device part is then split by running the step's two programs alone, each blocked on: the
forward program (embedding, the layers, final norm, logits) and the sampler program; and, beside
them, the logits matmul alone (one token times the vocabulary's embedding) and the layers' weight
read at the machine's memory bandwidth (`--bandwidth-gbs`, measured by benchmarks/roofline.py).
Medians over the decode steps of each run, then the median of `--runs` runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import timed  # noqa: E402 - a sibling script: the median of blocked runs

KV_BYTES = 64 * 2**20  # one request's cache with room to spare (CPU engines default to 4 GiB)
PARTS = ("schedule", "inputs+dispatch", "device wait", "bookkeeping", "output processing", "other")


class Timers:
    """Seconds spent in wrapped callables during the current step."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, name: str, part: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.step[part] += time.perf_counter() - start

        setattr(owner, name, timed)


LLAMA_1B = dict(hidden=2048, inter=8192, layers=16, heads=32, kv_heads=8)
SMOLLM2_SHAPES = dict(hidden=576, inter=1536, layers=30, heads=9, kv_heads=3)


def write_llama(directory: Path, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
                bf16: bool = True) -> None:
    """A random Llama of these shapes with SmolLM2's 49152-token vocabulary and tokenizer (tied
    embeddings), written with numpy: bfloat16 (1B-class shapes) or float32."""
    from safetensors.numpy import save_file

    from paxserve.models.bundled import default_model_path
    from paxserve.models.gguf_io import GGUFCheckpoint
    from paxserve.models.tokenizer import tokenizer_from_gguf

    vocab, dim = 49152, hidden // heads
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        x = rng.standard_normal(shape, dtype=np.float32) * 0.02
        # bfloat16 bits: the top half of each float32 word (numpy has no bfloat16).
        return (x.view(np.uint32) >> 16).astype(np.uint16) if bf16 else x

    def ones(n: int) -> np.ndarray:
        return np.full(n, 0x3F80, np.uint16) if bf16 else np.ones(n, np.float32)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(heads * dim, hidden), p + "self_attn.k_proj.weight": w(kv_heads * dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * dim, hidden), p + "self_attn.o_proj.weight": w(hidden, heads * dim),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": ones(hidden), p + "post_attention_layernorm.weight": ones(hidden),
        })
    path = directory / "model.safetensors"
    save_file(tensors, str(path))
    if bf16:  # safetensors' numpy writer has no bfloat16: relabel the header's uint16 entries
        raw = bytearray(path.read_bytes())
        size = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + size])
        for meta in header.values():
            if isinstance(meta, dict) and meta.get("dtype") == "U16":
                meta["dtype"] = "BF16"
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)  # offsets are relative to the data: only the length changes
        path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(raw[8 + size:]))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16" if bf16 else "float32", "bos_token_id": 1, "eos_token_id": 2}
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer_from_gguf(GGUFCheckpoint(default_model_path())).save_pretrained(str(directory))


def _median_parts(steps: list[dict[str, float]]) -> dict[str, float]:
    return {part: statistics.median(s.get(part, 0.0) for s in steps) for part in (*PARTS, "wall")}


def engine_run(model: str, prompt_tokens: int, tokens: int, async_scheduling: bool, dtype: str) -> dict[str, float]:
    """Median per-step seconds of each part over the decode steps of one request."""
    from paxserve import Engine, SamplingParams

    engine = Engine(model, max_model_len=prompt_tokens + tokens + 16, max_num_seqs=4, seed=0, dtype=dtype,
                    async_scheduling=async_scheduling, kv_cache_memory_bytes=KV_BYTES)
    core = engine.parts.core
    timers = Timers()
    timers.wrap(core.scheduler, "schedule", "schedule")
    timers.wrap(core.runner, "update_rows", "schedule")
    timers.wrap(core.runner, "dispatch_model", "inputs+dispatch")
    timers.wrap(core.runner, "collect", "device wait")
    complete = Timers()
    complete.wrap(core, "_complete", "complete")
    timers.wrap(engine.parts.output_processor, "process", "output processing")
    prompt = np.random.default_rng(1).integers(100, 40000, prompt_tokens).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for warm in range(2):  # the first run compiles every program the request meets
        engine.add_request(f"r{warm}", prompt, params)
        steps = []
        while engine.has_unfinished_requests():
            timers.step.clear()
            complete.step.clear()
            start = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - start
            part = dict(timers.step)
            part["bookkeeping"] = max(0.0, complete.step.get("complete", 0.0) - part.get("device wait", 0.0))
            part["wall"] = wall
            part["other"] = max(0.0, wall - sum(part.get(p, 0.0) for p in PARTS if p != "other"))
            steps.append(part)
    engine.close()
    # Decode steps only: the prefill step(s) first, and the last (finishing) one, left out.
    decode = steps[2:-1]
    return _median_parts(decode)


def device_parts(model: str, prompt_tokens: int, tokens: int, dtype: str) -> dict[str, float]:
    """The batch-1 decode step's two programs, each blocked on as it runs in a synchronous engine
    (median seconds over the decode steps), and the logits matmul alone."""
    import jax
    import jax.numpy as jnp

    from paxserve import Engine, SamplingParams

    engine = Engine(model, max_model_len=prompt_tokens + tokens + 16, max_num_seqs=4, seed=0, dtype=dtype,
                    async_scheduling=False, kv_cache_memory_bytes=KV_BYTES)
    runner = engine.parts.core.runner
    times: dict[str, list[float]] = defaultdict(list)
    original_forward, original_run = runner._forward, runner._run

    def forward(key: tuple, args: tuple) -> Any:
        start = time.perf_counter()
        out = jax.block_until_ready(original_forward(key, args))
        times[f"forward {key[0]} {key[1:]}"].append(time.perf_counter() - start)
        return out

    def run(key: tuple, *args: Any) -> Any:
        if key[0] != "sample":
            return original_run(key, *args)
        start = time.perf_counter()
        out = jax.block_until_ready(original_run(key, *args))
        times["sampler"].append(time.perf_counter() - start)
        return out

    prompt = np.random.default_rng(1).integers(100, 40000, prompt_tokens).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.generate([prompt], params, use_tqdm=False)  # compiles
    runner._forward, runner._run = forward, run
    engine.generate([prompt], params, use_tqdm=False)
    runner._forward, runner._run = original_forward, original_run
    decode = max((k for k in times if k.startswith("forward")), key=lambda k: len(times[k]))
    cfg = runner.model.config
    embed = jnp.asarray(np.random.default_rng(0).standard_normal((cfg.vocab_size, cfg.hidden_size)), jnp.float32)
    x = jnp.ones((1, cfg.hidden_size), jnp.float32)
    matmul = timed(jax.jit(lambda x, e: x @ e.T), x, embed, runs=20)
    weight_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(runner.model.params))
    engine.close()
    return {"forward": statistics.median(times[decode]), "sampler": statistics.median(times["sampler"]),
            "logits matmul (f32)": matmul, "weight_bytes": float(weight_bytes)}


def profile_ops(model: str, prompt_tokens: int, tokens: int, dtype: str, top: int = 12) -> list[dict[str, Any]]:
    """The decode steps' device ops by XLA name, from a JAX profiler trace of a synchronous engine
    (the request's programs compiled before it): milliseconds and runs per decode step, and the op's
    result shape from the decode program's HLO."""
    import gzip
    import re

    import jax

    from paxserve import Engine, SamplingParams

    engine = Engine(model, max_model_len=prompt_tokens + tokens + 16, max_num_seqs=4, seed=0, dtype=dtype,
                    async_scheduling=False, kv_cache_memory_bytes=KV_BYTES)
    runner = engine.parts.core.runner
    keys: list[tuple] = []
    original_run = runner._run

    def run(key: tuple, *args: Any) -> Any:
        keys.append(key)
        return original_run(key, *args)

    runner._run = run
    prompt = np.random.default_rng(1).integers(100, 40000, prompt_tokens).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.generate([prompt], params, use_tqdm=False)
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        engine.generate([prompt], params, use_tqdm=False)
        jax.profiler.stop_trace()
        trace = json.load(gzip.open(next(Path(trace_dir).rglob("*.trace.json.gz"))))
    runner._run = original_run
    hlo = runner.programs.get([k for k in keys if k[0] == runner.decode_kind][-1]).as_text()
    engine.close()
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in trace["traceEvents"]:
        thread = names.get((e.get("pid"), e.get("tid")), "")
        if e.get("ph") == "X" and thread.startswith("tf_XLA") and not e["name"].startswith(("ThunkExecutor", "Slinky")):
            total[e["name"]] += e["dur"] / 1e3
            count[e["name"]] += 1
    steps = tokens - 1  # the decode steps (the first token comes from the prefill)
    rows = []
    for name in sorted(total, key=total.get, reverse=True)[:top]:
        shape = re.search(rf"%{re.escape(name)} = (\S+)", hlo)
        rows.append({"op": name, "ms_per_step": total[name] / steps, "runs_per_step": count[name] / steps,
                     "result": shape.group(1) if shape else "?"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint or GGUF (default: the bundled SmolLM2)")
    parser.add_argument("--llama-1b", action="store_true", help="a random Llama with 1B-class shapes instead")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--bandwidth-gbs", type=float, default=63.0,
                        help="the machine's memory bandwidth (benchmarks/roofline.py measures it)")
    parser.add_argument("--layer-split", action="store_true",
                        help="also time the forward of SmolLM2-shaped random models with 1 and 30 layers")
    parser.add_argument("--profile", action="store_true",
                        help="also list the decode step's costliest device ops (a JAX profiler trace)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from paxserve.models.bundled import default_model_path

    tmp = tempfile.TemporaryDirectory()
    model = args.model or str(default_model_path())
    label = Path(model).name
    if args.llama_1b:
        print("writing a random 1B-class Llama ...", flush=True)
        write_llama(Path(tmp.name), **LLAMA_1B)
        model, label = tmp.name, "random Llama 1B-class (bf16)"
    result: dict[str, Any] = {"model": label, "prompt_tokens": args.prompt_tokens, "tokens": args.tokens}
    for mode, flag in (("sync", False), ("async", True)):
        runs = [engine_run(model, args.prompt_tokens, args.tokens, flag, args.dtype) for _ in range(args.runs)]
        result[mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{mode}: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in result[mode].items()), flush=True)
    device = [device_parts(model, args.prompt_tokens, args.tokens, args.dtype) for _ in range(args.runs)]
    result["device"] = {k: statistics.median(d[k] for d in device) for k in device[0]}
    result["device"]["weight read bound"] = result["device"]["weight_bytes"] / (args.bandwidth_gbs * 1e9)
    print("device alone: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in result["device"].items()
                                       if k != "weight_bytes")
          + f" (weights {result['device']['weight_bytes'] / 1e6:.0f} MB)", flush=True)
    if args.layer_split:
        # The forward split into the per-layer cost and the rest (embedding, final norm, logits):
        # random float32 models of SmolLM2's shapes with 1 and with all 30 layers.
        forward = {}
        for layers in (1, SMOLLM2_SHAPES["layers"]):
            directory = Path(tmp.name) / f"layers{layers}"
            directory.mkdir()
            write_llama(directory, **{**SMOLLM2_SHAPES, "layers": layers}, bf16=False)
            forward[layers] = statistics.median(device_parts(str(directory), args.prompt_tokens, 32, "float32")["forward"]
                                                for _ in range(args.runs))
        per_layer = (forward[30] - forward[1]) / 29
        result["layer_split"] = {"forward 1 layer": forward[1], "forward 30 layers": forward[30],
                                 "per layer": per_layer, "outside the layers": forward[1] - per_layer}
        print("layer split (SmolLM2 shapes, float32): " + ", ".join(
            f"{k} {1e3 * v:.2f} ms" for k, v in result["layer_split"].items()), flush=True)
    if args.profile:
        result["ops"] = profile_ops(model, args.prompt_tokens, 16, args.dtype)
        print("device ops per decode step:")
        for row in result["ops"]:
            print(f"  {row['ms_per_step']:7.2f} ms  x{row['runs_per_step']:5.1f}  {row['op']}  {row['result']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)


def replot(json_path: str, plot_path: str) -> None:
    plot(json.loads(Path(json_path).read_text()), plot_path)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(PARTS, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")))
    fig, ax = plt.subplots(figsize=(9, 3.6))
    labels = []
    for y, mode in enumerate(("sync", "async")):
        left = 0.0
        for part in PARTS:
            width = 1e3 * result[mode].get(part, 0.0)
            ax.barh(y, width, left=left, color=colors[part], label=part if y == 0 else None)
            left += width
        labels.append(f"{mode} engine step")
    device = result["device"]
    y = len(labels)
    ax.barh(y, 1e3 * device["forward"], color="#2f4b7c", label="forward program")
    ax.barh(y, 1e3 * device["sampler"], left=1e3 * device["forward"], color="#ffa600", label="sampler program")
    labels.append("programs, blocked on")
    split = result.get("layer_split")
    if split:
        layers = 1e3 * split["per layer"] * 30
        ax.barh(y + 1, 1e3 * split["outside the layers"], color="#a05195", label="embedding, norm, logits")
        ax.barh(y + 1, layers, left=1e3 * split["outside the layers"], color="#665191", label="30 layers")
        labels.append("forward, split")
    ax.barh(len(labels), 1e3 * device["weight read bound"], color="#999999", label="weights read at bandwidth")
    labels.append("bound")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("ms per decode step (batch 1)")
    ax.set_title(f"{result['model']}: where a batch-1 decode step goes")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
