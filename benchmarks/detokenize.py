"""Incremental detokenization: `IncrementalDetokenizer` on `tokenizers.DecodeStream`, on its window
decode (what a tokenizer without a Rust backend gets; before issue 30, every tokenizer), and a bare
DecodeStream, side by side.

    python benchmarks/detokenize.py [--tokens 2000] [--runs 5]

On the bundled SmolLM2 tokenizer: the host time per generated token of each (one token per step, as
the engine feeds them; medians of --runs), and where each text is not what `tokenizer.decode` gives
for the same ids: random token ids (what a sampler at high temperature emits), and an answer cut off
inside a multi-byte character (what `max_tokens` does), which a bare stream never renders: it has no
flush.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenizers.decoders import DecodeStream  # noqa: E402

from paxserve.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from paxserve.models.bundled import default_model_path  # noqa: E402
from paxserve.models.gguf_io import GGUFCheckpoint  # noqa: E402
from paxserve.models.tokenizer import tokenizer_from_gguf  # noqa: E402
from paxserve.sampling_params import SamplingParams  # noqa: E402

TEXT = ("The sea, the sky and the mountains in spring: 中文测试，你好世界。 emoji 👍🏽 café naïve. "
        "def f(x: int) -> int:\n    return x ** 2\n")


class _PythonOnly:
    """The tokenizer without its Rust backend: the detokenizer decodes a window per step."""

    backend_tokenizer = None

    def __init__(self, tok) -> None:
        self.decode = tok.decode


def detokenizer(tok, ids: list[int], params: SamplingParams) -> str:
    detok = IncrementalDetokenizer(tok, [], params)
    for token in ids:
        detok.update([token])
        detok.get_delta()
    detok.finish()
    return detok.output_text


def window(tok, ids: list[int], params: SamplingParams) -> str:
    return detokenizer(_PythonOnly(tok), ids, params)


def decode_stream(tok, ids: list[int], params: SamplingParams) -> str:
    stream, backend, pieces = DecodeStream(skip_special_tokens=params.skip_special_tokens), tok.backend_tokenizer, []
    for token in ids:
        piece = stream.step(backend, token)
        if piece is not None:
            pieces.append(piece)
    return "".join(pieces)


def per_token_us(fn, tok, ids: list[int], params: SamplingParams, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn(tok, ids, params)
        times.append((time.perf_counter() - start) / len(ids) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    tok = tokenizer_from_gguf(GGUFCheckpoint(default_model_path()))
    ids = (tok.encode(TEXT, add_special_tokens=False) * (args.tokens // 20 + 1))[:args.tokens]
    plain = SamplingParams(max_tokens=16)
    stops = SamplingParams(max_tokens=16, stop=["</answer>", "\n\nUser:"])
    print(f"{len(ids)} tokens of mixed text, one per step; host µs per token, median of {args.runs} runs")
    print("| decoder | no stop strings | 2 stop strings |\n|---|---|---|")
    decoders = (("IncrementalDetokenizer (DecodeStream)", detokenizer),
                ("IncrementalDetokenizer (window decode)", window),
                ("bare DecodeStream (no stop strings)", decode_stream))
    for name, fn in decoders:
        cells = [f"{per_token_us(fn, tok, ids, p, args.runs):.1f}" for p in (plain, stops)]
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    rng = random.Random(0)
    samples = [[rng.randrange(tok.vocab_size) for _ in range(24)] for _ in range(200)]
    full = [tok.decode(sample, skip_special_tokens=True) for sample in samples]
    for name, fn in decoders:
        differ = sum(fn(tok, sample, plain) != text for sample, text in zip(samples, full))
        print(f"random ids: {name}'s text differs from tokenizer.decode in {differ} of 200 answers of 24 tokens")
    emoji = tok.encode("ok 👍🏽", add_special_tokens=False)
    cut = emoji[:-1]
    print(f"an answer cut inside a character: tokenizer.decode {tok.decode(cut)!r}, IncrementalDetokenizer "
          f"{detokenizer(tok, cut, plain)!r}, bare DecodeStream {decode_stream(tok, cut, plain)!r}")


if __name__ == "__main__":
    main()
