"""Tiny checkpoints for the --generation-config / --tokenizer tests: a random Llama with a small
vocabulary (fast to compile and sample) and a byte-level tokenizer that fits it."""

from __future__ import annotations

import json
from pathlib import Path

MODEL_VOCAB = 320  # >= the byte tokenizer's 257 tokens
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def write_json(directory: Path, data: object, name: str = "generation_config.json") -> Path:
    """Write `data` (JSON, or a str as-is) to directory/name; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(data if isinstance(data, str) else json.dumps(data))
    return directory


def save_byte_tokenizer(directory: Path) -> Path:
    """A byte-level BPE without merges (one token per byte, 256 + <eos>) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", chat_template=CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(directory))
    return directory


def make_model(directory: Path, vocab_size: int = MODEL_VOCAB, generation_config: dict | None = None) -> Path:
    """A tiny random Llama without tokenizer files; `generation_config` replaces the one HF writes."""
    from tests.helpers import make_tiny_llama

    make_tiny_llama(directory, seed=5, vocab_size=vocab_size, max_position_embeddings=256)
    if generation_config is not None:
        write_json(directory, generation_config)
    return directory
