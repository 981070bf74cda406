"""Tokenizers: Hugging Face tokenizer files, or rebuilt from GGUF metadata with `tokenizers`."""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from models.gguf_io import GGUFCheckpoint

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def tokenizer_from_gguf(ckpt: GGUFCheckpoint) -> PreTrainedTokenizerBase:
    """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) from the vocabulary and merges in the file."""
    kind = ckpt.metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{ckpt.path}: GGUF tokenizer type {kind!r} is not supported yet (supported: 'gpt2' byte-level BPE); "
            "load the Hugging Face checkpoint directory instead"
        )
    tokens: list[str] = list(ckpt.field("tokenizer.ggml.tokens"))
    token_types = list(ckpt.field("tokenizer.ggml.token_type") or [])
    merges = [tuple(m.split(" ", 1)) for m in ckpt.field("tokenizer.ggml.merges") or []]
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Tokens already written in the byte alphabet stay; any other spelling is re-encoded into it.
    vocab = {
        (t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i for i, t in enumerate(tokens)
    }
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|> ...) must match whole in text; a control token spelled outside the
    # byte alphabet would not be a real vocabulary entry, so it is left out.
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, token_type in zip(tokens, token_types) if token_type == _CONTROL and set(t) <= spelled
    ])
    tok.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, token_type in zip(tokens, token_types) if token_type == _USER_DEFINED and t in vocab
    ])

    def special(key: str) -> str | None:
        idx = ckpt.metadata.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    bos, eos = special("bos_token_id"), special("eos_token_id")
    if ckpt.metadata.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=special("unknown_token_id"),
        pad_token=special("padding_token_id"),
        chat_template=ckpt.metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def tokenizer_from_directory(directory: Path) -> PreTrainedTokenizerBase | None:
    """The checkpoint's own tokenizer files, or None (token-id prompts still work) when it has none."""
    if not any((directory / f).exists() for f in _TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files; only token-id prompts can be served", directory)
        return None
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
