"""Host work per engine step, against batch size and context length, with the device taken out.

    python benchmarks/host_overhead.py [--batches 1,16,64,256] [--contexts 128,1024,2048,8192]
                                       [--steps 30] [--runs 3] [--json PATH] [--plot PATH]

What is timed: `Engine.step()` end to end (schedule and block allocation, the step's batch and
sampling inputs, the sampled tokens' bookkeeping, detokenization and stop checks in the output
processor) with the runner's device call (`ModelRunner.dispatch`) replaced by a stub that returns
random tokens at once, so what remains is exactly the host's share of a step. The model is a one-layer random Llama with the
bundled SmolLM2 vocabulary and tokenizer (its weights never run); every request is greedy with
`ignore_eos`, prompts are random token ids, and each request is first brought to its context length
(prefilled through the stub) before the timed decode steps: the median step over `--steps` decode
steps, the median over `--runs` runs.

The device side is a model, not a measurement: an H200 decode step of Llama-3-8B in bfloat16 at
its memory-bandwidth bound (16.1 GB of weights plus 128 KiB of KV per context token, read at
4.8 TB/s), the shortest step the device could take. The device would idle host / (host + device) of
the time with the host's work serial with the device's (synchronous scheduling), and
max(0, host - device) / max(host, device) with the next step's host work overlapped (async
scheduling, the default since issue 15).

The same script runs against earlier commits (it stubs whichever device method the version has): for
a "before" run, `git worktree add /tmp/before <commit>`, copy this file (and plotting.py) into its
benchmarks/ folder and run it from there; `--compare before.json after.json --plot out.png` then
prints both side by side and plots them together.
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

VOCAB = 49152
H200_BYTES_PER_S = 4.8e12
LLAMA3_8B_WEIGHT_BYTES = 16.06e9
LLAMA3_8B_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, d 128, bf16


def write_tiny_checkpoint(directory: Path) -> None:
    """A one-layer Llama with SmolLM2's vocabulary, written with numpy (no torch needed), and the
    bundled tokenizer beside it."""
    from safetensors.numpy import save_file

    from paxserve.models.bundled import default_model_path
    from paxserve.models.gguf_io import GGUFCheckpoint
    from paxserve.models.tokenizer import tokenizer_from_gguf

    hidden, inter, heads, kv_heads, dim = 16, 32, 2, 1, 8
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=hidden,
                  intermediate_size=inter, num_hidden_layers=1, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=dim, max_position_embeddings=16384, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, dtype="float32")
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    p = "model.layers.0."
    save_file({"model.embed_tokens.weight": w(VOCAB, hidden), "model.norm.weight": np.ones(hidden, np.float32),
               p + "input_layernorm.weight": np.ones(hidden, np.float32),
               p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
               p + "self_attn.q_proj.weight": w(heads * dim, hidden), p + "self_attn.k_proj.weight": w(kv_heads * dim, hidden),
               p + "self_attn.v_proj.weight": w(kv_heads * dim, hidden), p + "self_attn.o_proj.weight": w(hidden, heads * dim),
               p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
               p + "mlp.down_proj.weight": w(hidden, inter)}, str(directory / "model.safetensors"))
    tokenizer_from_gguf(GGUFCheckpoint(default_model_path())).save_pretrained(str(directory))


def stub_device(runner: Any) -> None:
    """Replace the device's part of a step with random tokens in the sampler's packed layout: the
    runner's `dispatch` where it has one (its `collect` then copies nothing), else its `execute`
    (before issue 15, whose `unpack` also took the logprob width)."""
    from paxserve.worker.sampling import host_inputs as sm

    rng = np.random.default_rng(1)
    if hasattr(runner, "dispatch"):
        from paxserve.worker.model_runner import DeviceStep

        def dispatch(batch: Any, sampling: Any, prompt: Any = None) -> Any:
            s = batch.context_lens.shape[0]
            packed = np.zeros((s, sm.PACKED_WIDTH), np.float32)
            packed[:, 0] = rng.integers(3, VOCAB, s)
            return DeviceStep(packed, batch.num_seqs, s, None)

        runner.dispatch = dispatch
        return

    def execute(batch: Any, sampling: Any) -> Any:
        s = batch.context_lens.shape[0]
        packed = np.zeros((s, sm.packed_width(sampling.num_logprobs)), np.float32)
        packed[:, 0] = rng.integers(3, VOCAB, s)
        return sm.unpack(packed, batch.num_seqs, sampling.num_logprobs)

    runner.execute = execute


def measure(directory: Path, batch: int, context: int, steps: int) -> float:
    """Median host seconds per decode step at `batch` sequences of about `context` tokens."""
    from paxserve import Engine, SamplingParams

    block, budget = 16, 8192
    # Requests prefilled first decode while the rest prefill: give every request room for those
    # tokens too, so all `batch` of them are still decoding through the timed steps.
    max_tokens = steps + 8 + 2 * -(-batch * context // budget)
    blocks_per_seq = -(-(context + max_tokens) // block)
    # No background compiles: the stubbed steps run no program, and a compiling thread would take the
    # host's time (its GIL) away from the steps being timed.
    from paxserve.config import EngineConfig

    kwargs = {"compile_in_background": False} if "compile_in_background" in EngineConfig.__dataclass_fields__ else {}
    engine = Engine(str(directory), warmup=False, log_stats_interval=0, compilation_cache_dir="", **kwargs,
                    max_model_len=blocks_per_seq * block, max_num_seqs=batch, max_num_batched_tokens=budget,
                    num_gpu_blocks_override=batch * blocks_per_seq + 1, block_size=block, enable_prefix_caching=True)
    stub_device(engine.runner)
    rng = np.random.default_rng(batch * 100003 + context)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", rng.integers(3, VOCAB, context).tolist(), params)
    running = engine.scheduler.running
    while len(running) < batch or not all(r.output_token_ids for r in running):
        engine.step()  # prefill (through the stub) until every request decodes
        if not engine.has_unfinished_requests():
            raise RuntimeError("every request ended before decoding: the stubbed step failed (see the log)")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        if engine.core.last_num_scheduled != batch or len(running) != batch:
            raise RuntimeError(f"a timed step ran {engine.core.last_num_scheduled} sequences, not {batch}")
    return statistics.median(times)


def device_model_seconds(batch: int, context: int) -> float:
    return (LLAMA3_8B_WEIGHT_BYTES + batch * context * LLAMA3_8B_KV_BYTES_PER_TOKEN) / H200_BYTES_PER_S


def idle_fractions(host: float, device: float) -> tuple[float, float]:
    """Device idle fraction with the host's work serial with the device's (step = host + device),
    and with it overlapped (step = max(host, device))."""
    return host / (host + device), max(0.0, host - device) / max(host, device)


def compare(paths: list[Path], plot: Path | None) -> None:
    """Side-by-side table (and plot) of earlier runs' JSON files: host ms per step of each, and the
    device-idle fraction each engine would leave (the first serial, the later ones as labelled)."""
    runs = [json.loads(p.read_text()) for p in paths]
    keys = [(r["batch"], r["context"]) for r in runs[0]["rows"]]
    by = [{(r["batch"], r["context"]): r for r in run["rows"]} for run in runs]
    labels = [run["label"] or str(p) for run, p in zip(runs, paths)]
    print("| batch | context | " + " | ".join(f"host ms/step, {lab}" for lab in labels) + " | ratio | "
          "H200 step ms (model) | device idle: first serial / last overlapped |")
    print("|---|---|" + "---|" * len(runs) + "---|---|---|")
    for key in keys:
        hosts = [b[key]["host_s"] for b in by if key in b]
        if len(hosts) != len(runs):
            continue
        dev = by[0][key]["device_model_s"]
        print(f"| {key[0]} | {key[1]} | " + " | ".join(f"{h * 1e3:.2f}" for h in hosts) +
              f" | {hosts[0] / hosts[-1]:.1f}x | {dev * 1e3:.2f} | {idle_fractions(hosts[0], dev)[0]:.0%} / "
              f"{idle_fractions(hosts[-1], dev)[1]:.0%} |")
    if plot is None:
        return
    from plotting import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    batches = sorted({k[0] for k in keys})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (b_rows, label) in enumerate(zip(by, labels)):
        for j, b in enumerate(batches):
            pts = sorted((k[1], r["host_s"]) for k, r in b_rows.items() if k[0] == b)
            ax.plot([c for c, _ in pts], [h * 1e3 for _, h in pts], marker="o", color=colors[j % len(colors)],
                    linestyle=("-", "--", ":")[i % 3], label=f"batch {b}, {label}")
    dev_pts = sorted((k[1], r["device_model_s"]) for k, r in by[0].items() if k[0] == batches[-1])
    ax.plot([c for c, _ in dev_pts], [d * 1e3 for _, d in dev_pts], color="black", linewidth=0.8,
            label=f"H200 Llama-3-8B step, batch {batches[-1]} (model)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens per sequence")
    ax.set_ylabel("host ms per decode step (device stubbed)")
    ax.set_title("host work per engine step")
    ax.legend(fontsize=6)
    print(save_figure(plt, fig, plot))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--contexts", default="128,1024,2048,8192")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="PNG of host ms per step against context, one line per batch")
    ap.add_argument("--label", default="", help="a name for this run in the table and the JSON")
    ap.add_argument("--compare", type=Path, nargs="+", metavar="JSON",
                    help="measure nothing: print earlier runs' JSON side by side (and --plot them together)")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare, args.plot)
        return
    logging.basicConfig(level=logging.WARNING)
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        write_tiny_checkpoint(directory)
        print(f"{args.label or 'host overhead'}: median of {args.runs} runs of the median of {args.steps} decode steps")
        print("| batch | context | host ms/step | H200 Llama-3-8B step ms (bandwidth bound) | device idle, serial | "
              "device idle, overlapped |")
        print("|---|---|---|---|---|---|")
        for b in batches:
            for c in contexts:
                host = statistics.median(measure(directory, b, c, args.steps) for _ in range(args.runs))
                dev = device_model_seconds(b, c)
                rows.append(dict(batch=b, context=c, host_s=host, device_model_s=dev))
                serial, overlapped = idle_fractions(host, dev)
                print(f"| {b} | {c} | {host * 1e3:.2f} | {dev * 1e3:.2f} | {serial:.0%} | {overlapped:.0%} |",
                      flush=True)
    if args.json:
        args.json.write_text(json.dumps({"label": args.label, "rows": rows}, indent=1))
    if args.plot:
        compare([args.json], args.plot) if args.json else None


if __name__ == "__main__":
    main()
