"""Tokenizers: Hugging Face tokenizer files, or the one a GGUF file describes, built by transformers.

A GGUF file has no tokenizer.json: its vocabulary, merges, scores, token types, special ids and
pre-tokenizer name (`tokenizer.ggml.pre`) are metadata. transformers turns those into a fast
tokenizer (`integrations.gguf.convert_gguf_tokenizer`: byte-level BPE with the split regex named by
`tokenizer.ggml.pre`, Gemma's sentencepiece BPE with its merges rebuilt, control and user-defined
tokens kept whole). We hand it the metadata read with the `gguf` package, since transformers' own
GGUF reader imports torch, which paxserve does not have at run time.

For the bundled SmolLM2 file (`tokenizer.ggml.pre == "smollm"`, which transformers has no split regex
for) this gives exactly what the hand-built byte-level BPE it replaced gave. Both differ from the real
SmolLM2 tokenizer.json, which splits digits off first (so "  12" is 'ĠĠ' '1' '2' there, 'Ġ' 'Ġ' '1'
'2' here); transformers' behaviour is kept since tests and the HF reference compare against it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from paxserve.models.gguf_io import GGUFCheckpoint, model_type_of

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_MODEL_SETTINGS = ("unk_token", "fuse_unk", "byte_fallback", "continuing_subword_prefix", "end_of_word_suffix",
                   "dropout", "ignore_merges")
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                   "pad_token": "padding_token_id"}


def _gguf_tokenizer_parts(ckpt: GGUFCheckpoint) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer_dict, tokenizer_config) as `transformers.integrations.gguf.get_gguf_tokenizer`
    builds them, from the metadata `ckpt` already read."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    if "tokenizer.ggml.tokens" not in ckpt.reader.fields:
        raise ValueError(f"{ckpt.path}: the GGUF file holds no tokenizer (no tokenizer.ggml.tokens)")

    def value(key: str) -> Any:
        return ckpt.metadata[key] if key in ckpt.metadata else ckpt.field(key)

    grouped = {
        group: {name: value(f"tokenizer.{key}") for key, name in renames.items()
                if f"tokenizer.{key}" in ckpt.reader.fields}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    kind = tokenizer.get("tokenizer_type")
    if kind == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp adds BOS to sentencepiece vocabularies by default
    elif kind == "gemma4":
        config["add_bos_token"] = False  # as transformers: its chat template writes <bos> itself
    tokens = tokenizer["tokens"]
    for name, key in _SPECIAL_TOKENS.items():
        idx = ckpt.metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None
    return tokenizer, config


def _reloads_as_saved(cls: type, backend: Any) -> bool:
    """Whether `cls` reloads this backend unchanged from `save_pretrained`'s files (the loader's
    param cache). A class with its own `__init__` rebuilds the backend on reload from the saved
    vocabulary and merges with its own normalizer, pre-tokenizer, decoder and model settings (the
    rule in `TokenizersBackend.convert_to_native_format`): fine for GemmaTokenizer, whose own
    pieces the GGUF conversion uses, not for Qwen2Tokenizer, which would add an NFC normalizer."""
    from transformers import TokenizersBackend

    if cls is TokenizersBackend or "__init__" not in cls.__dict__:
        return True
    fresh = cls().backend_tokenizer

    def state(tok: Any, part: str) -> bytes | None:
        piece = getattr(tok, part)
        return None if piece is None else piece.__getstate__()

    return (all(state(fresh, p) == state(backend, p) for p in ("normalizer", "pre_tokenizer", "decoder"))
            and type(fresh.model) is type(backend.model)
            and all(getattr(fresh.model, a, None) == getattr(backend.model, a, None) for a in _MODEL_SETTINGS))


def tokenizer_from_gguf(ckpt: GGUFCheckpoint) -> PreTrainedTokenizerBase:
    """The tokenizer `AutoTokenizer.from_pretrained(directory, gguf_file=name)` builds for the file:
    the same conversion, wrapped in the class AutoTokenizer picks by model type where that class
    reloads it unchanged, else in the plain `TokenizersBackend` (same encoding, exact reload)."""
    from transformers import AutoConfig, TokenizersBackend
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    tokenizer_dict, tokenizer_config = _gguf_tokenizer_parts(ckpt)
    try:
        backend, extra = convert_gguf_tokenizer(ckpt.arch, tokenizer_dict)
    except ValueError as e:  # an unknown `tokenizer.ggml.model`
        raise ValueError(f"{ckpt.path}: {e}") from None
    model_type = model_type_of(ckpt.arch)
    cls = TOKENIZER_MAPPING.get(type(AutoConfig.for_model(model_type)), None) if model_type else None
    if cls is None or not _reloads_as_saved(cls, backend):
        cls = TokenizersBackend
    return cls(tokenizer_object=backend, **tokenizer_config, **extra)


def tokenizer_from_directory(directory: Path) -> PreTrainedTokenizerBase | None:
    """The checkpoint's own tokenizer files, or None (token-id prompts still work) when it has none."""
    if not any((directory / f).exists() for f in _TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files; only token-id prompts can be served", directory)
        return None
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
