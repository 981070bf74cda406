"""`paxserve` command line. `generate` runs a one-off completion; `serve` arrives with the HTTP server."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

DESCRIPTION = "paxserve: a vLLM-class LLM serving engine on JAX (paged KV cache, continuous batching)."


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paxserve", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser(
        "generate",
        help="complete one prompt and print the text as it is produced",
        description="Complete one prompt (greedy unless --temperature is set), streaming the text to stdout.",
    )
    gen.add_argument("--model", default=None,
                     help="Hugging Face checkpoint directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as a user message through the model's chat template")
    gen.add_argument("--max-tokens", type=_positive_int, default=64, help="maximum new tokens (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default 0)")
    gen.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    gen.add_argument("--max-model-len", type=_positive_int, default=None,
                     help="longest prompt + output in tokens (default: the model's context length)")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="weight and activation dtype (default: auto = the checkpoint's; float32 for GGUF)")
    gen.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32],
                     help="tokens per KV-cache block (default 16)")
    gen.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                     help="logging verbosity on stderr (default info)")
    return parser


def _generate(args: argparse.Namespace) -> int:
    from paxserve.engine import Engine
    from paxserve.sampling_params import SamplingParams

    log = logging.getLogger("paxserve")
    engine = Engine(args.model, dtype=args.dtype, block_size=args.block_size, max_model_len=args.max_model_len,
                    max_num_seqs=1, warmup=False, log_stats_interval=0)
    if engine.tokenizer is None:
        raise ValueError(f"{engine.model.source} has no tokenizer, so text prompts cannot be encoded")
    prompt: str | list[int] = args.prompt
    if args.chat:
        if not engine.tokenizer.chat_template:
            raise ValueError(f"{engine.model.source} has no chat template; drop --chat")
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                                    add_generation_prompt=True)
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens)
    engine.add_request("cli", prompt, params)
    log.info("generating up to %d tokens (the first steps compile the model)", args.max_tokens)
    start = time.perf_counter()
    first_token_at = None
    num_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            first_token_at = first_token_at or time.perf_counter()
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
            num_tokens = len(out.outputs[0].token_ids)
    sys.stdout.write("\n")
    if first_token_at is not None:
        rate = (num_tokens - 1) / max(time.perf_counter() - first_token_at, 1e-9)
        log.info("%d tokens in %.1fs (first token after %.1fs incl. compilation, then %.1f tokens/s)",
                 num_tokens, time.perf_counter() - start, first_token_at - start, rate)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # paxserve never uses torch; transformers' import-time advice that it is missing only confuses.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for noisy in ("absl", "jax._src.xla_bridge", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        if args.command == "generate":
            return _generate(args)
    except ValueError as e:
        print(f"paxserve: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
