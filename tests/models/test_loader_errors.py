"""`models.load_model`: bad input fails with a ValueError that names the problem; good variants
(sharded, bfloat16, stray rotary buffers) load the same weights."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from paxserve.models import load_model
from paxserve.models.loader import LoadedModel
from tests.helpers import TINY_BASE, make_tiny_llama

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """One tiny random checkpoint for the whole module, plus its torch weights as numpy."""
    directory = tmp_path_factory.mktemp("tiny_llama")
    model = make_tiny_llama(directory, seed=3)
    weights = {name: p.detach().numpy().copy() for name, p in model.state_dict().items()}
    return directory, weights


@pytest.fixture
def checkpoint(tiny_checkpoint: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    directory = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint[0], directory)
    return directory


def load(path: Path | str, tmp_path: Path, **kwargs: Any) -> LoadedModel:
    return load_model(path, cache_dir=tmp_path / "cache", **kwargs)


def load_error(path: Path | str, tmp_path: Path, **kwargs: Any) -> str:
    with pytest.raises(ValueError) as info:
        load(path, tmp_path, **kwargs)
    return str(info.value)


def rewrite_weights(directory: Path, change: Callable[[dict[str, np.ndarray]], None]) -> None:
    tensors = load_file(str(directory / WEIGHTS))
    change(tensors)
    save_file(tensors, str(directory / WEIGHTS))


def assert_same_params(a: Any, b: Any) -> None:
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- where the model comes from ------------------------------------------------------------------


def test_directory_without_config(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    message = load_error(empty, tmp_path)
    assert "config.json" in message and "empty" in message


def test_directory_with_weights_but_no_config(checkpoint: Path, tmp_path: Path) -> None:
    (checkpoint / "config.json").unlink()
    assert "config.json" in load_error(checkpoint, tmp_path)


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.2-1B-Instruct", "does/not/exist", "./nowhere"])
def test_missing_path_or_hub_id_says_there_is_no_hub_access(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    message = load_error(name, tmp_path)
    assert name in message
    assert "hub" in message.lower()


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"\0" * 64)
    message = load_error(path, tmp_path)
    assert "pytorch_model.bin" in message and ".gguf" in message


# --- config.json ---------------------------------------------------------------------------------


def test_unsupported_architecture_lists_supported_ones(checkpoint: Path, tmp_path: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    message = load_error(checkpoint, tmp_path)
    assert "GPT2LMHeadModel" in message
    assert "LlamaForCausalLM" in message


def test_invalid_json_config(checkpoint: Path, tmp_path: Path) -> None:
    (checkpoint / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,')
    message = load_error(checkpoint, tmp_path)
    assert "config.json" in message and "JSON" in message


def test_config_without_architectures_or_required_field(checkpoint: Path, tmp_path: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "architectures"}))
    assert "architectures" in load_error(checkpoint, tmp_path)
    (checkpoint / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "hidden_size"}))
    assert "hidden_size" in load_error(checkpoint, tmp_path)


# --- weights -------------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [4, 100, 0.5, 0.999])
def test_truncated_safetensors(checkpoint: Path, tmp_path: Path, keep: float) -> None:
    """Cut just after the length prefix, inside the header, inside the data and just short of the end."""
    path = checkpoint / WEIGHTS
    data = path.read_bytes()
    size = keep if isinstance(keep, int) else int(len(data) * keep)
    path.write_bytes(data[:size])
    message = load_error(checkpoint, tmp_path)
    assert WEIGHTS in message
    assert re.search(r"truncated|only \d+ bytes|corrupt", message), message


def test_tensor_with_wrong_shape(checkpoint: Path, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    hidden = TINY_BASE["hidden_size"]

    def change(tensors: dict[str, np.ndarray]) -> None:
        assert tensors[name].shape == (hidden, hidden)
        tensors[name] = np.zeros((hidden // 2, hidden), np.float32)

    rewrite_weights(checkpoint, change)
    message = load_error(checkpoint, tmp_path)
    assert name in message
    assert str((hidden // 2, hidden)) in message and str((hidden, hidden)) in message


def test_missing_tensor(checkpoint: Path, tmp_path: Path) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_weights(checkpoint, lambda t: t.pop(name))
    message = load_error(checkpoint, tmp_path)
    assert "missing" in message and name in message


def test_unexpected_tensor(checkpoint: Path, tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.mystery_proj.weight"
    rewrite_weights(checkpoint, lambda t: t.__setitem__(name, np.ones((4, 4), np.float32)))
    message = load_error(checkpoint, tmp_path)
    assert "unexpected" in message and name in message


def test_no_weights_at_all(checkpoint: Path, tmp_path: Path) -> None:
    (checkpoint / WEIGHTS).unlink()
    assert "safetensors" in load_error(checkpoint, tmp_path)


def test_unsupported_dtype_names_allowed_values(checkpoint: Path, tmp_path: Path) -> None:
    message = load_error(checkpoint, tmp_path, dtype="int8")
    assert "int8" in message
    for allowed in ("auto", "float32", "bfloat16", "float16"):
        assert allowed in message


# --- checkpoints that must load ------------------------------------------------------------------


def test_loads_the_checkpoint_weights(tiny_checkpoint: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    directory, weights = tiny_checkpoint
    loaded = load(directory, tmp_path)
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert loaded.config.num_layers == TINY_BASE["num_hidden_layers"]
    assert loaded.dtype == np.float32
    assert loaded.tokenizer is None  # the tiny checkpoint has no tokenizer files
    np.testing.assert_array_equal(np.asarray(loaded.params.embed), weights["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(loaded.params.final_norm), weights["model.norm.weight"])
    np.testing.assert_array_equal(np.asarray(loaded.params.lm_head), weights["lm_head.weight"].T)
    np.testing.assert_array_equal(
        np.asarray(loaded.params.layers.down_w[1]), weights["model.layers.1.mlp.down_proj.weight"].T
    )


def test_sharded_checkpoint_loads_like_the_single_file(
    tiny_checkpoint: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    sharded = tmp_path / "sharded"
    make_tiny_llama(sharded, seed=3, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert not (sharded / WEIGHTS).exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    single = load(tiny_checkpoint[0], tmp_path)
    split = load(sharded, tmp_path)
    assert split.config == single.config
    assert_same_params(split.params, single.params)


def test_bfloat16_params(tiny_checkpoint: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    directory, weights = tiny_checkpoint
    loaded = load(directory, tmp_path, dtype="bfloat16")
    assert loaded.dtype == np.dtype(ml_dtypes.bfloat16)
    leaves = jax.tree_util.tree_leaves(loaded.params)
    assert leaves and all(leaf.dtype == ml_dtypes.bfloat16 for leaf in leaves)
    expected = weights["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(loaded.params.embed), expected)


def test_rotary_inv_freq_buffers_are_ignored(
    tiny_checkpoint: tuple[Path, dict[str, np.ndarray]], checkpoint: Path, tmp_path: Path
) -> None:
    """Older checkpoints saved `rotary_emb.inv_freq` buffers; they are not weights."""

    def add(tensors: dict[str, np.ndarray]) -> None:
        for i in range(TINY_BASE["num_hidden_layers"]):
            tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)

    rewrite_weights(checkpoint, add)
    with_buffers = load(checkpoint, tmp_path)
    assert_same_params(with_buffers.params, load(tiny_checkpoint[0], tmp_path).params)
