"""Models and tokenizers named by Hugging Face Hub id (`org/name`, or `org/name:FILE.gguf` for one
GGUF file of a repository), resolved to local files through `huggingface_hub`: its cache (HF_HOME,
HF_HUB_CACHE, or vLLM's --download-dir), a revision (a branch, tag or commit), HF_HUB_OFFLINE (the
cache alone) and HF_TOKEN (gated and private repositories). Only what paxserve reads is downloaded:
the config, tokenizer and generation-config files and the safetensors weights, or the one GGUF
file. The environment is read when a model is resolved, not at import.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

# What paxserve reads from a Hugging Face checkpoint (weights: safetensors only, never pickles).
CHECKPOINT_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                    "chat_template.json", "chat_template.jinja", "*.safetensors", "model.safetensors.index.json"]
TOKENIZER_FILES = [f for f in CHECKPOINT_FILES if "safetensors" not in f and f != "config.json"] + ["config.json"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+\.gguf)?")


def is_hub_id(name: str | None) -> bool:
    """Whether `name` reads as a hub id and names no local file or directory."""
    return bool(name) and _HUB_ID.fullmatch(name) is not None and not Path(name).expanduser().exists()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache_dir(download_dir: str | None = None) -> Path:
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    return Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub"


def resolve_hub_id(name: str, revision: str | None = None, download_dir: str | None = None,
                   what: str = "model", tokenizer_only: bool = False) -> str:
    """The local path of a hub id's checkpoint directory (or its one GGUF file), downloaded into the
    cache unless there already (or HF_HUB_OFFLINE is set). Raises ValueError saying what is
    missing and how to get it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, _, gguf = name.partition(":")
    offline = _offline()
    cache = hub_cache_dir(download_dir)
    patterns = [gguf] if gguf else TOKENIZER_FILES if tokenizer_only else CHECKPOINT_FILES
    where = f"{what} {name!r}" + (f" at revision {revision!r}" if revision else "")
    logger.info("%s: %s the Hugging Face Hub cache %s%s", where, "reading (HF_HUB_OFFLINE)" if offline else
                "fetching what paxserve reads into", cache, "" if gguf else " (config, tokenizer, safetensors)")
    try:
        local = Path(snapshot_download(repo, revision=revision, cache_dir=str(cache), allow_patterns=patterns,
                                       local_files_only=offline))
    except GatedRepoError:
        raise ValueError(f"{where} is gated: accept its terms on huggingface.co with your account and set HF_TOKEN "
                         "to a token of that account") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{where}: no such repository on the Hugging Face Hub (a private one needs HF_TOKEN)") \
            from None
    except RevisionNotFoundError:
        raise ValueError(f"{where}: the repository has no such revision (a branch, tag or commit)") from None
    except LocalEntryNotFoundError:
        raise ValueError(f"{where} is not in the Hugging Face Hub cache {cache} and " + (
            "HF_HUB_OFFLINE is set: download it first (`huggingface-cli download "
            f"{repo}{' --revision ' + revision if revision else ''}`) or unset HF_HUB_OFFLINE" if offline else
            "the hub cannot be reached: check the network, or download it elsewhere and copy the cache")) from None
    if gguf:
        path = local / gguf
        if not path.is_file():
            raise ValueError(f"{where}: the repository has no file {gguf!r}")
        return str(path)
    if not (local / "config.json").is_file():
        raise ValueError(f"{where}: the repository has no config.json (paxserve reads a Hugging Face checkpoint's "
                         f"config.json and safetensors, or one GGUF file named as {repo}:FILE.gguf)")
    if not tokenizer_only and not any(local.glob("*.safetensors")):
        raise ValueError(f"{where}: the repository has no safetensors weights (paxserve never loads pickled .bin "
                         f"weights; a GGUF file is named as {repo}:FILE.gguf)")
    return str(local)
