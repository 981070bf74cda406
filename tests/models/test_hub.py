"""Models by Hugging Face Hub id, from a real hub cache (huggingface_hub's layout: blobs, refs and
snapshots of symlinks, which its own `scan_cache_dir` reads back) in a temp dir, offline: the id
resolves to its snapshot, a revision (tag or commit) picks another, the engine serves it, and a
missing repository, file or revision is a clear error. No network is used."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from paxserve import Engine, SamplingParams
from paxserve.models.hub import is_hub_id, resolve_hub_id
from tests.helpers import make_tiny_llama


def add_snapshot(cache: Path, repo: str, source: Path, refs: list[str]) -> str:
    """`source`'s files as one commit of `repo` in the hub cache (content-addressed blobs, the
    snapshot's files symlinked to them), named by `refs`; returns the commit hash."""
    root = cache / f"models--{repo.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo}{sorted(p.name for p in source.iterdir())}{refs}".encode()).hexdigest()
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    for f in source.iterdir():
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return commit


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("hub")
    cache = tmp / "cache"
    models = {}
    for name, seed in (("main", 1), ("v2", 2)):
        models[name] = make_tiny_llama(tmp / name, seed=seed, num_key_value_heads=2)
    commits = {"main": add_snapshot(cache, "org/tiny", tmp / "main", ["main"])}
    commits["v2"] = add_snapshot(cache, "org/tiny", tmp / "v2", ["v2"])
    weightless = tmp / "weightless"
    weightless.mkdir()
    shutil.copy(tmp / "main" / "config.json", weightless / "config.json")
    add_snapshot(cache, "org/weightless", weightless, ["main"])
    return {"cache": cache, "models": models, "commits": commits}


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_the_cache_is_huggingface_hubs_own_layout(hub: dict) -> None:
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hub["cache"])
    assert not info.warnings
    repos = {r.repo_id: r for r in info.repos}
    assert set(repos) == {"org/tiny", "org/weightless"}
    assert {ref for rev in repos["org/tiny"].revisions for ref in rev.refs} == {"main", "v2"}


def test_an_id_resolves_to_its_snapshot_at_the_revision_asked(hub: dict) -> None:
    cache, commits = str(hub["cache"]), hub["commits"]
    assert is_hub_id("org/tiny") and is_hub_id("org/tiny:file.gguf") and not is_hub_id("/abs/path")
    assert resolve_hub_id("org/tiny", None, cache).endswith(commits["main"])
    assert resolve_hub_id("org/tiny", "v2", cache).endswith(commits["v2"])
    assert resolve_hub_id("org/tiny", commits["v2"], cache).endswith(commits["v2"])


def test_the_engine_serves_a_hub_id_at_a_revision(hub: dict) -> None:
    engine = Engine("org/tiny", revision="v2", download_dir=str(hub["cache"]), warmup=False, log_stats_interval=0,
                    compilation_cache_dir="", max_model_len=64, kv_cache_memory_bytes=4 * 2**20)
    assert engine.model.source.endswith(hub["commits"]["v2"])
    prompt = [5, 9, 23, 7]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = hub["models"]["v2"].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                            do_sample=False, eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
    assert out[0].outputs[0].token_ids == want


@pytest.mark.parametrize("name,revision,words", [
    ("org/absent", None, "is not in the Hugging Face Hub cache"),
    ("org/tiny", "v9", "is not in the Hugging Face Hub cache"),
    ("org/weightless", None, "has no safetensors weights"),
    ("org/tiny:model-q4.gguf", None, "has no file 'model-q4.gguf'"),
])
def test_what_is_missing_is_named(hub: dict, name: str, revision: str | None, words: str) -> None:
    with pytest.raises(ValueError, match=words) as exc:
        resolve_hub_id(name, revision, str(hub["cache"]))
    assert name.split(":")[0] in str(exc.value)
    if "cache" in words:
        assert "HF_HUB_OFFLINE is set" in str(exc.value)
