"""`paxserve` command line: `serve` runs the OpenAI-compatible HTTP server, `generate` a one-off completion.

Nothing here imports JAX or aiohttp at module level, so `paxserve --help` is instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from paxserve.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS
from paxserve.server import huge_pages
from paxserve.server.parsers.reasoning import REASONING_PARSERS
from paxserve.server.parsers.tool_calls import TOOL_PARSERS

DESCRIPTION = "paxserve: a vLLM-class LLM serving engine on JAX (paged KV cache, continuous batching)."


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def _human_int(text: str) -> int:
    """vLLM's human-readable integers: 25600, 25.6k, 4g (decimal) or 1K, 4G, 4GiB (binary)."""
    t = text.strip()
    for unit in ("iB", "i", "B"):
        if t.endswith(unit) and len(t) > len(unit) and t[-len(unit) - 1].isalpha():
            binary = unit.startswith("i")
            t = t[: -len(unit)]
            break
    else:
        binary = False
    if t and t[-1].lower() in _SUFFIXES:
        base = 1024 ** ("kmgt".index(t[-1].lower()) + 1) if (binary or t[-1].isupper()) else _SUFFIXES[t[-1]]
        try:
            return int(float(t[:-1]) * base)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    try:
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r} (e.g. 4096, 4k, 4K, 8GiB)") from None


def _model_len(text: str) -> int | str:
    if text.strip().lower() in ("auto", "-1"):
        return "auto"
    value = _human_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 or 'auto', got {text!r}")
    return value


def _positive_human_int(text: str) -> int:
    value = _human_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return value


def _non_negative_seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text!r}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535] (0 picks a free port), got {value}")
    return value


def _max_logprobs(text: str) -> int:
    value = int(text)
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be >= 0, or -1 for no limit (vLLM's), got {value}")
    return value


_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def _dtype(text: str) -> str:
    value = _DTYPE_ALIASES.get(text, text)
    if value not in ("auto", "float32", "bfloat16", "float16"):
        raise argparse.ArgumentTypeError(f"must be one of auto, half, float16, bfloat16, float, float32; got {text!r}")
    return value


def _add_quantization_flags(group: argparse._ActionsContainer) -> None:
    group.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATION_METHODS),
                       help="quantize the linear weights of a float checkpoint at load, per output channel: fp8 "
                            "(fp8 x fp8 matmuls on GPUs with fp8 tensor cores, weight-only elsewhere) or int8 "
                            "(weight-only); embeddings, norms, the LM head and MoE routers keep their width. gguf, "
                            "compressed-tensors, awq, gptq: a quantized checkpoint's own method, always read as "
                            "stored (the flag is optional)")
    group.add_argument("--quantization-check", default="on", metavar="on|off|top1=F,kl=F",
                       help="at start, compare a quantized setting with the unquantized model on fixed prompts and "
                            "refuse to start below the thresholds (default on: top-1 agreement >= 0.90, mean KL "
                            "<= 0.10 nats)")
    group.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                       help="KV cache storage: auto (the model's dtype) or fp8 (= fp8_e4m3) / fp8_e5m2, one byte per "
                            "value with a scale per layer for K and V: twice the tokens of a bf16 cache")
    group.add_argument("--calculate-kv-scales", action="store_true",
                       help="compute the fp8 KV cache's per-layer scales at start from fixed prompts (default: 1.0)")


def _speculative_config(text: str) -> object:
    from paxserve.spec_decode.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_speculative_flag(group: argparse._ActionsContainer) -> None:
    group.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                       help='speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": K, '
                            '"prompt_lookup_min": 1, "prompt_lookup_max": 5} proposes up to K tokens found after an '
                            "earlier occurrence of the last n tokens (prompt or output); {\"model\": PATH, "
                            "\"num_speculative_tokens\": K} has a smaller draft model of the same vocabulary propose "
                            "them; {\"method\": \"eagle3\", \"model\": DIR, \"num_speculative_tokens\": K} an EAGLE-3 "
                            "head (published format) reading the model's hidden states. The next step verifies them; "
                            "outputs stay those of plain decoding (greedy and seeded sampling alike)")


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (vLLM's flag names)",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics (Prometheus), /tokenize, /detokenize, /version. The flags "
                    "have vLLM's names and defaults. SIGINT/SIGTERM stop accepting, drain in-flight requests "
                    "for --shutdown-timeout seconds, abort the rest and exit. If the engine dies, /health "
                    "answers 503 and the process exits with status 1 within 5 s, for a supervisor to restart.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as a positional alternative to --model (vLLM's `serve MODEL`)")
    net = serve.add_argument_group("server")
    net.add_argument("--host", default=None,
                     help="address to bind; default: all IPv4 interfaces (0.0.0.0)")
    net.add_argument("--port", type=_port, default=8000, help="port to listen on; 0 picks a free one (see the log)")
    net.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     help="the model name(s) clients send as `model` and /v1/models lists; the first is the "
                          "default. Default: the --model string, or SmolLM2-135M-Instruct for the bundled model")
    net.add_argument("--api-key", default=None,
                     help="require `Authorization: Bearer <key>` on /v1/* (/health, /metrics and the tokenizer "
                          "endpoints stay open); also read from $PAXSERVE_API_KEY")
    net.add_argument("--chat-template", default=None,
                     help="a Jinja chat template (file path or the template itself) replacing the model's own")
    net.add_argument("--max-logprobs", type=_max_logprobs, default=20,
                     help="largest `logprobs` (completions) / `top_logprobs` (chat) a request may ask for; more "
                          "is a 400. -1: no limit (a request's -1 asks for the whole vocabulary); above 20, rows "
                          "copy their whole distribution to the host")
    net.add_argument("--max-num-queued-reqs", type=_non_negative_int, default=None,
                     help="admission control: answer 429 (Retry-After: 1) when accepting a request would leave "
                          "more than this many sequences waiting for a batch slot, i.e. when sequences in "
                          "flight (prompts x n of accepted, unfinished requests) plus the new request's exceed "
                          "--max-num-seqs + this. A request arriving at an idle server is always accepted. "
                          "Default: no limit (requests queue in the engine)")
    net.add_argument("--trust-request-chat-template", action="store_true",
                     help="accept a `chat_template` sent in a request (it runs arbitrary Jinja on the server, "
                          "sandboxed and time-limited); without this flag such requests get a 400")
    net.add_argument("--max-stop-strings", type=_non_negative_int, default=32,
                     help="most `stop` strings one request may send (each at most 1024 characters); more is a 400")
    net.add_argument("--shutdown-timeout", type=_non_negative_seconds, default=0,
                     help="on SIGTERM/SIGINT, refuse new requests (503) and let in-flight ones finish for up to "
                          "this many seconds before aborting them; 0 aborts them at once")
    net.add_argument("--timeout-keep-alive", type=_seconds, default=5.0,
                     help="seconds an idle keep-alive connection stays open")
    net.add_argument("--http-header-timeout", type=_seconds, default=10.0,
                     help="seconds a connection has to send a request's headers (slow or stalled clients are "
                          "disconnected)")
    net.add_argument("--http-body-timeout", type=_seconds, default=30.0,
                     help="seconds a request's body has, once its headers are in, to arrive in full (else 408)")
    tools = serve.add_argument_group("tool calling and reasoning")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='parse the tool calls a model writes on its own (tool_choice "auto", the default with '
                            "tools); needs --tool-call-parser. Forced calls (\"required\", a named function) are "
                            "always available: they are guided by the tools' JSON schemas")
    tools.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="the model's tool-call format: hermes (Hermes 2 Pro, Qwen 2.5/3), llama3_json (Llama "
                            "3.1+), mistral")
    tools.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="put the <think>...</think> text of reasoning models in the message's `reasoning` "
                            "field: deepseek_r1 (output starts inside <think>), qwen3")
    net.add_argument("--enable-prompt-tokens-details", action="store_true",
                     help="report usage.prompt_tokens_details.cached_tokens (prompt tokens served from the prefix "
                          "cache), as vLLM's flag; without it the field is null")
    net.add_argument("--return-tokens-as-token-ids", action="store_true",
                     help="name tokens in logprobs as 'token_id:{id}' (vLLM's flag; a request's "
                          "`return_tokens_as_token_ids` overrides it)")
    net.add_argument("--enable-response-store", action="store_true",
                     help="keep finished /v1/responses answers in memory (per API key) for `previous_response_id` "
                          "and GET /v1/responses/{id}; off by default, as vLLM's")
    net.add_argument("--response-store-size", type=_positive_int, default=1000,
                     help="most responses the store keeps; the least recently used goes first")
    net.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                     help="serve GET /tokenizer_info (special tokens, chat template, max length), which "
                          "lm-evaluation-harness uses to tokenize through the server")
    net.add_argument("--enable-log-requests", action="store_true", help="log every request's prompt sizes "
                     "and sampling parameters")
    net.add_argument("--disable-log-stats", action="store_true",
                     help="do not log the periodic throughput / running / waiting / KV-cache stats line")
    net.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"],
                     help="logging verbosity on stderr")
    eng = serve.add_argument_group("engine")
    eng.add_argument("--model", default=None,
                     help="Hugging Face checkpoint directory or .gguf file; default: the bundled "
                          "SmolLM2-135M-Instruct")
    eng.add_argument("--dtype", type=_dtype, default="auto",
                     help="weights and activations: auto (the checkpoint's; float32 for GGUF), half/float16, "
                          "bfloat16, float/float32")
    _add_quantization_flags(eng)
    _add_speculative_flag(eng)
    eng.add_argument("--max-model-len", type=_model_len, default=None,
                     help="longest prompt + output in tokens (e.g. 4096, 4k, 4K); 'auto' or -1 = the largest "
                          "that fits in the KV cache; default: the model's context length")
    eng.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                     help="fraction of accelerator memory for weights, activations and KV cache (ignored on "
                          "CPU, which uses a 4 GiB KV budget)")
    eng.add_argument("--kv-cache-memory-bytes", type=_positive_human_int, default=None,
                     help="KV-cache size in bytes (e.g. 2GiB, 500M), instead of --gpu-memory-utilization")
    eng.add_argument("--num-gpu-blocks-override", type=_positive_int, default=None,
                     help="number of KV-cache blocks, overriding the memory plan (testing and benchmarking)")
    eng.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32], help="tokens per KV-cache block")
    eng.add_argument("--max-num-seqs", type=_positive_int, default=256,
                     help="most sequences in one batch (running requests x n)")
    eng.add_argument("--max-num-batched-tokens", type=_positive_human_int, default=None,
                     help="token budget of one engine step (chunked prefill); default: max(2048, max-num-seqs)")
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                     help="reuse the KV blocks of shared prompt prefixes")
    eng.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                     help="local devices to split the model over (Megatron tensor parallelism); the attention "
                          "heads, KV heads (or the devices, when heads are fewer) and MLP widths must divide by it")
    eng.add_argument("--enable-expert-parallel", action="store_true",
                     help="MoE models: place whole routed experts on the tensor-parallel devices (num_experts / "
                          "tensor-parallel-size each) instead of splitting every expert's width")
    eng.add_argument("--seed", type=int, default=0, help="seed for requests that do not set one")
    eng.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                     help="the order waiting requests start in: arrival (fcfs), or each request's `priority` "
                          "(lower first, ties by arrival); under priority a waiting request of a better priority "
                          "preempts the worst running ones when the batch or the KV cache is full")
    from paxserve.server.lora import add_lora_flags

    add_lora_flags(serve.add_argument_group("LoRA adapters"))
    _add_multi_host_flags(serve)
    _add_attention_backend(eng)
    _add_model_source_flags(eng, defaults_in_help=True)
    eng.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                     help="load the stored step programs and compile the decode batch buckets at start-up "
                          "(--no-warmup starts faster and compiles on first use)")
    eng.add_argument("--enforce-eager", action="store_true",
                     help="keep each layer's weights in one stack that every step program scans: programs "
                          "compile about 3.5x faster on a 30-layer model, but each step copies the layers' "
                          "weights (small batches decode slower; vLLM's flag for trading speed for start-up)")
    eng.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                     help="schedule and build each step while the previous one runs on the device, so host work "
                          "hides under device work (outputs follow one step behind; --no-async-scheduling runs "
                          "each step to the end before the next). Default: on with an accelerator, off on CPU")
    eng.add_argument("--compilation-cache-dir", default=None, metavar="DIR",
                     help="where compiled step programs are stored, so later starts load them instead of "
                          "compiling (default $XDG_CACHE_HOME/paxserve/programs; '' stores nothing)")
    eng.add_argument("--compile-in-background", action=argparse.BooleanOptionalAction, default=True,
                     help="compile a step shape not seen yet off the step thread while a compiled one that covers "
                          "it (at most 4x the work) serves, and the shapes growing batches reach next before they "
                          "do (--no-compile-in-background: compile in the step that needs it)")


def _add_multi_host_flags(serve: argparse.ArgumentParser) -> None:
    hosts = serve.add_argument_group(
        "multi-host (one model over several machines)",
        "Start the same command, with the same engine flags, on every host; only --node-rank differs. "
        "--tensor-parallel-size counts the devices of all hosts (each holds tensor-parallel-size / nnodes). "
        "Node rank 0 serves the API and schedules; the others run its steps (--headless).")
    hosts.add_argument("--nnodes", type=_positive_int, default=1, help="hosts the engine spans")
    hosts.add_argument("--node-rank", type=_non_negative_int, default=0,
                       help="this host's rank, 0..nnodes-1; rank 0 serves the API")
    hosts.add_argument("--master-addr", default="127.0.0.1",
                       help="node rank 0's address, as the other hosts reach it")
    hosts.add_argument("--master-port", type=_port, default=29501,
                       help="node rank 0's start-up port; JAX's coordination service takes the next one")
    hosts.add_argument("--headless", action="store_true",
                       help="run no API server: this host only runs rank 0's steps (node ranks 1..nnodes-1; "
                            "implied there)")
    hosts.add_argument("--distributed-init-timeout", type=_seconds, default=300.0,
                       help="seconds start-up waits for every rank to join before failing with the missing ranks")
    hosts.add_argument("--distributed-heartbeat-timeout", type=_seconds, default=10.0,
                       help="seconds a rank may go unheard (dead, stopped, unreachable) before the others stop: "
                            "rank 0 then fails its requests, answers 503 and exits with status 1")


def _generation_config(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must be 'auto', 'vllm' or a directory holding generation_config.json")
    return text


def _add_model_source_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, defaults_in_help: bool) -> None:
    """vLLM's model-source flags: --tokenizer, --generation-config, --trust-remote-code, --revision."""
    shown = "" if defaults_in_help else " (default: auto)"
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="load the tokenizer from this local directory (Hugging Face tokenizer files), .gguf "
                             "file or hub id (org/name) instead of the model's own")
    parser.add_argument("--generation-config", type=_generation_config, default="auto", metavar="auto|vllm|DIR",
                        help="where the sampling defaults of requests come from, as in vLLM. auto: the "
                             "checkpoint's generation_config.json - its temperature, top_p, top_k, min_p and "
                             "repetition_penalty become the defaults of requests that do not set them, and its "
                             "max_new_tokens the output limit of chat requests that send no max_tokens (completions "
                             "keep OpenAI's default of 16); its do_sample is ignored (send temperature=0 for "
                             "greedy). vllm: ignore the file and use paxserve's own defaults (temperature 1, top_p 1, "
                             "top_k and min_p off, no repetition penalty). DIR: read generation_config.json from "
                             "that directory instead. Invalid values stop the start with an error" + shown)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="accepted for vLLM compatibility, with a warning: paxserve never runs code shipped "
                             "with a checkpoint and loads only the architectures it implements")
    for flag, what in (("--revision", "model"), ("--tokenizer-revision", "tokenizer")):
        parser.add_argument(flag, default=None, metavar="REV",
                            help=f"the {what}'s revision on the Hugging Face Hub (a branch, tag or commit) when it is "
                                 "given as a hub id; default: main")
    parser.add_argument("--download-dir", default=None, metavar="DIR",
                        help="the Hugging Face Hub cache models given as hub ids are fetched into and read from "
                             "(default: HF_HUB_CACHE, else $HF_HOME/hub); HF_HUB_OFFLINE=1 reads the cache alone, "
                             "HF_TOKEN opens gated and private repositories")
    parser.add_argument("--code-revision", default=None, metavar="REV",
                        help="refused: paxserve never runs code shipped with a checkpoint")


def check_model_source_flags(args: argparse.Namespace) -> None:
    """Fail before loading anything on flags that cannot be honoured (vLLM's --code-revision)."""
    from paxserve.config import no_code_revision_message

    if getattr(args, "code_revision", None) is not None:
        raise ValueError(no_code_revision_message("--code-revision", args.code_revision))


def _add_attention_backend(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--attention-backend", default="auto",
                        choices=["auto", "mosaic", "triton", "pallas", "reference"],
                        help="paged-attention implementation: auto = the Mosaic GPU kernel on Hopper (compute "
                             "capability 9.0+), the Triton kernel on older GPUs and ROCm, each checked at start "
                             "with a fallback, the XLA reference on CPU; mosaic or triton (pallas: the earlier "
                             "name of triton) force a kernel (interpret mode on CPU, slow: for testing); reference")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paxserve", description=DESCRIPTION,
                                     epilog="Run `paxserve COMMAND --help` for a command's flags.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_parser(sub)
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
    _add_quantization_flags(gen)
    _add_speculative_flag(gen)
    gen.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32],
                     help="tokens per KV-cache block (default 16)")
    gen.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                     help="local devices to split the model over (default 1)")
    _add_attention_backend(gen)
    _add_model_source_flags(gen, defaults_in_help=False)
    gen.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                     help="logging verbosity on stderr (default info)")
    return parser


def _generate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from paxserve.engine.llm_engine import Engine
    from paxserve.sampling_params import RequestOutputKind

    log = logging.getLogger("paxserve")
    engine = Engine(args.model, dtype=args.dtype, block_size=args.block_size, max_model_len=args.max_model_len,
                    attention_backend=args.attention_backend, tokenizer=args.tokenizer, revision=args.revision,
                    tokenizer_revision=args.tokenizer_revision, download_dir=args.download_dir,
                    generation_config=args.generation_config, trust_remote_code=args.trust_remote_code,
                    tensor_parallel_size=args.tensor_parallel_size, max_num_seqs=1, warmup=False,
                    quantization=args.quantization, quantization_check=args.quantization_check,
                    kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
                    speculative_config=args.speculative_config, log_stats_interval=0)
    if engine.tokenizer is None:
        raise ValueError(f"{engine.model.source} has no tokenizer, so text prompts cannot be encoded")
    prompt: str | list[int] = args.prompt
    if args.chat:
        if not engine.tokenizer.chat_template:
            raise ValueError(f"{engine.model.source} has no chat template; drop --chat")
        text = engine.input_processor.render_chat([{"role": "user", "content": args.prompt}])
        prompt = engine.input_processor.tokenize(text, add_special_tokens=False)
    # The flags win; the model's generation_config fills the rest (top_p, top_k, ... when sampling).
    params = replace(engine.get_default_sampling_params(), temperature=args.temperature, seed=args.seed,
                     max_tokens=args.max_tokens, output_kind=RequestOutputKind.DELTA)
    engine.add_request("cli", prompt, params)
    log.info("generating up to %d tokens (the first steps compile the model)", args.max_tokens)
    start = time.perf_counter()
    first_token_at = None
    num_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            first_token_at = first_token_at or time.perf_counter()
            sys.stdout.write(out.outputs[0].text)  # delta outputs: only the new text
            sys.stdout.flush()
            num_tokens += len(out.outputs[0].token_ids)
    sys.stdout.write("\n")
    if first_token_at is not None:
        rate = (num_tokens - 1) / max(time.perf_counter() - first_token_at, 1e-9)
        log.info("%d tokens in %.1fs (first token after %.1fs incl. compilation, then %.1f tokens/s)",
                 num_tokens, time.perf_counter() - start, first_token_at - start, rate)
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    from paxserve.server.serve import run_server  # aiohttp and JAX load only when serving

    return run_server(args)


def main(argv: list[str] | None = None) -> int:
    """The `paxserve` command (`argv`: this process's own command line when None)."""
    args = build_parser().parse_args(argv)
    runs_an_engine = args.command in ("serve", "generate")
    # paxserve never uses torch; transformers' import-time advice that it is missing only confuses.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for noisy in ("absl", "jax._src.xla_bridge", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if runs_an_engine:
        logging.getLogger(huge_pages.__name__).info("%s", huge_pages.describe())
    try:
        check_model_source_flags(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
    except ValueError as e:
        print(f"paxserve: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from paxserve.distributed.cluster import WorkerLostError
        from paxserve.distributed.rendezvous import RendezvousError

        if not isinstance(e, (RendezvousError, WorkerLostError)):
            raise
        # Multi-host start-up: the ranks did not all come, or one was lost; the message names it.
        print(f"paxserve: error: {e}", file=sys.stderr)
        return 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
