"""`paxserve` command line. `generate` runs a one-off completion; `serve` arrives with the HTTP server."""

from __future__ import annotations

import argparse
import logging
import math
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
        help="complete one prompt greedily and print the text as it is produced",
        description="Complete one prompt with greedy decoding, streaming the text to stdout.",
    )
    gen.add_argument("--model", default=None,
                     help="Hugging Face checkpoint directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as a user message through the model's chat template")
    gen.add_argument("--max-tokens", type=_positive_int, default=64, help="maximum new tokens (default 64)")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="weight and activation dtype (default: auto = the checkpoint's; float32 for GGUF)")
    gen.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32],
                     help="tokens per KV-cache block (default 16)")
    gen.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                     help="logging verbosity on stderr (default info)")
    return parser


def _generate(args: argparse.Namespace) -> int:
    from models import load_model
    from paxserve.greedy import greedy_stream
    from paxserve.model_runner import ModelRunner

    log = logging.getLogger("paxserve")
    model = load_model(args.model, args.dtype)
    tok = model.tokenizer
    if tok is None:
        raise ValueError(f"{model.source} has no tokenizer, so text prompts cannot be encoded")
    if args.chat:
        if not tok.chat_template:
            raise ValueError(f"{model.source} has no chat template; drop --chat")
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(args.prompt)
    limit = model.config.max_position_embeddings
    if not ids:
        raise ValueError("prompt: the prompt encodes to no tokens")
    if len(ids) >= limit:
        raise ValueError(f"prompt: {len(ids)} tokens leave no room within the model's {limit}-token context")
    max_tokens = min(args.max_tokens, limit - len(ids))
    num_blocks = math.ceil((len(ids) + max_tokens) / args.block_size) + 1  # + the null block
    runner = ModelRunner(model, num_blocks, args.block_size)
    log.info("prompt: %d tokens; generating up to %d (the first step compiles the model)", len(ids), max_tokens)
    out: list[int] = []
    shown = ""
    start = time.perf_counter()
    first_token_at = None
    for tokens, _ in greedy_stream(runner, [ids], max_tokens, stop_token_ids=model.config.eos_token_ids):
        token = tokens[0]
        if token is None:
            break
        first_token_at = first_token_at or time.perf_counter()
        if token in model.config.eos_token_ids:
            break
        out.append(token)
        text = tok.decode(out, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # hold back an incomplete multi-byte character
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    sys.stdout.write(tok.decode(out, skip_special_tokens=True)[len(shown):] + "\n")
    elapsed = time.perf_counter() - start
    if out and first_token_at is not None:
        rate = (len(out) - 1) / max(time.perf_counter() - first_token_at, 1e-9)
        log.info("%d tokens in %.1fs (first token after %.1fs incl. compilation, then %.1f tokens/s)",
                 len(out), elapsed, first_token_at - start, rate)
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
