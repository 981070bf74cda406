"""Speculative decoding (n-gram prompt lookup) on the real bundled model, off and on side by side.

    python benchmarks/spec_decode.py [--runs 3] [--max-tokens 128] [--k 2 4] [--eagle3-k 3] [--async-scheduling]

SmolLM2-135M-Instruct (the bundled GGUF, served as the CPU default serves it), greedy, at batch 1
and 8, with n-gram lookup, with the model as its own draft and with an EAGLE-3 head, on two
workloads (no EAGLE-3 head is trained for SmolLM2, and none can be fetched here: the head is random,
in the published format with a 32000-token draft vocabulary, so its row is what a head costs when
nothing it proposes is accepted):

- grounded: "repeat this passage with its typos fixed" over passages of Python's own documentation
  (`pydoc_data.topics`, ~300 tokens each): the answer copies its prompt, which prompt lookup finds;
- open-ended: short creative prompts whose answers copy nothing.

Per setting and workload: output tokens/s of the whole batch (median of `--runs` after a warm run),
mean acceptance length (tokens per verified draft, the bonus token included), and the time per
output token as a client sees it (the gap between two outputs of a request divided by the tokens
the later one brought), p50 and p99. Every setting's tokens are checked equal to the run without
speculation.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import numpy as np

OPEN_PROMPTS = ["Write a short story about a robot who learns to paint.", "Why is the sky blue? Explain simply.",
                "Give me three ideas for a birthday party.", "Describe a walk through a forest in autumn.",
                "What makes a good friend?", "Write a poem about the sea.", "How do bees make honey?",
                "Tell me about the history of bread."]


def passages(n: int) -> list[str]:
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        text = " ".join(topics[name].split())
        if len(text) > 1400:
            out.append(text[:1200].rsplit(" ", 1)[0])
        if len(out) == n:
            return out
    raise RuntimeError("pydoc_data.topics has too few long topics")


def prompts(tokenizer, workload: str, n: int) -> list[list[int]]:  # noqa: ANN001
    if workload == "grounded":
        texts = [f"Repeat the following passage word for word, fixing any typos:\n\n{p}" for p in passages(n)]
    else:
        texts = OPEN_PROMPTS[:n]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                           tokenize=False), add_special_tokens=False) for t in texts]


def run(engine, batch: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], list[float]]:  # noqa: ANN001
    from paxserve import SamplingParams
    from paxserve.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)
    start = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(str(i), p, params)
    tokens: list[list[int]] = [[] for _ in batch]
    last: list[float | None] = [None] * len(batch)
    per_token: list[float] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            i = int(out.request_id)
            new = out.outputs[0].token_ids
            if new and last[i] is not None:
                per_token += [(now - last[i]) / len(new)] * len(new)
            if new:
                last[i] = now
            tokens[i] += new
    seconds = time.perf_counter() - start
    return sum(map(len, tokens)) / seconds, tokens, per_token


def random_eagle3_head(folder: Path, draft_vocab: int = 32000, seed: int = 0) -> Path:
    """An EAGLE-3 head for the bundled model in the published format, every weight random."""
    from safetensors.numpy import save_file

    from paxserve.models.loader import inspect_model

    cfg = inspect_model(None, "float32").config
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    rng = np.random.default_rng(seed)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": h, "intermediate_size": i,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": d,
              "num_hidden_layers": 1, "vocab_size": cfg.vocab_size, "draft_vocab_size": draft_vocab,
              "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
              "max_position_embeddings": cfg.max_position_embeddings}
    shapes = {"fc.weight": (h, 3 * h), "midlayer.self_attn.q_proj.weight": (q, 2 * h),
              "midlayer.self_attn.k_proj.weight": (kv, 2 * h), "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, q), "midlayer.mlp.gate_proj.weight": (i, h),
              "midlayer.mlp.up_proj.weight": (i, h), "midlayer.mlp.down_proj.weight": (h, i),
              "lm_head.weight": (draft_vocab, h)}
    tensors = {name: (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
               for name, shape in shapes.items()}
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[name + ".weight"] = np.ones(h, np.float32)
    tensors["d2t"] = np.zeros(draft_vocab, np.int64)  # the draft vocabulary is the target's first ids
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, nargs="*", default=[2, 4], help="n-gram lookup with these k (none: skip)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--draft-k", type=int, nargs="*", default=[4],
                        help="the model as its own draft with these k (none: skip)")
    parser.add_argument("--eagle3-k", type=int, nargs="*", default=[3],
                        help="a random EAGLE-3 head with these k (none: skip)")
    parser.add_argument("--workloads", nargs="+", default=["grounded", "open-ended"],
                        choices=["grounded", "open-ended"])
    parser.add_argument("--async-scheduling", action="store_true",
                        help="every engine (the one without speculation too) schedules asynchronously, as on a GPU")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from paxserve import Engine

    from paxserve.models.bundled import default_model_path

    settings = [("off", None)] + [(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k}) for k in args.k]
    # The model as its own draft: the acceptance a draft model could reach at best (not a speed-up
    # on a CPU, where the draft's passes cost what the target's do).
    settings += [(f"self k={k}", {"model": str(default_model_path()), "num_speculative_tokens": k})
                 for k in args.draft_k]
    if args.eagle3_k:
        import tempfile

        head = random_eagle3_head(Path(tempfile.mkdtemp(prefix="eagle3-")))
        settings += [(f"eagle3 k={k}", {"method": "eagle3", "model": str(head), "num_speculative_tokens": k})
                     for k in args.eagle3_k]
    engines = {name: Engine(speculative_config=spec, log_stats_interval=0, max_num_seqs=8,
                            async_scheduling=args.async_scheduling or None) for name, spec in settings}
    tokenizer = engines["off"].tokenizer
    print(f"{'workload':10} {'batch':>5} {'setting':>10} {'tok/s':>8} {'x off':>6} {'accept len':>10} "
          f"{'ms/tok p50':>10} {'p99':>7} {'same tokens':>11}")
    for workload in args.workloads:
        for n in args.batches:
            batch = prompts(tokenizer, workload, n)
            reference = None
            base = None
            for name, _ in settings:
                engine = engines[name]
                core = engine.parts.core
                run(engine, batch, args.max_tokens)  # warm: every bucket this batch needs is compiled
                for other in engines.values():  # no engine's background compiles run beside the timed runs
                    other.runner.programs.wait()
                before = (core.spec_stats.num_drafts, core.spec_stats.num_accepted_tokens)
                rates, gaps = [], []
                for _ in range(args.runs):
                    rate, tokens, per_token = run(engine, batch, args.max_tokens)
                    rates.append(rate)
                    gaps += per_token
                drafts = core.spec_stats.num_drafts - before[0]
                accepted = core.spec_stats.num_accepted_tokens - before[1]
                reference = tokens if reference is None else reference
                rate = statistics.median(rates)
                base = rate if base is None else base
                accept = f"{1 + accepted / drafts:.2f}" if drafts else "-"
                print(f"{workload:10} {n:5d} {name:>10} {rate:8.1f} {rate / base:6.2f} {accept:>10} "
                      f"{1000 * np.percentile(gaps, 50):10.1f} {1000 * np.percentile(gaps, 99):7.1f} "
                      f"{str(tokens == reference):>11}", flush=True)


if __name__ == "__main__":
    main()
