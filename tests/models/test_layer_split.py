"""The engine serves with one array per layer (models/layer_split.py): the unrolled layers must give
exactly what the scan over the loaded stack gives, and the split must keep every placement."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from paxserve.models import load_model
from paxserve.models.decoder import UNROLL_MAX_TOKENS
from paxserve.models.layer_split import split_layers
from paxserve.worker.model_runner import ModelRunner
from paxserve.worker.step_functions import jitted_logits
from paxserve.worker.step_inputs import SeqChunk, build_batch
from tests.models.family_checkpoints import make_family_checkpoint


# Gemma 3: per-layer windows and RoPE tables; Qwen2-MoE: each layer's slot into the expert stacks and
# the shared expert; Falcon: parallel attention and MLP with ALiBi. A pass of 32 tokens runs the split
# layers unrolled, one of 128 scans them, picking each layer's weights (UNROLL_MAX_TOKENS).
@pytest.mark.parametrize("tokens", [32, 128])
@pytest.mark.parametrize("family", ["gemma3", "qwen2-moe", "falcon-rw-alibi"])
def test_split_layers_give_the_scans_logits_and_cache_bit_for_bit(family: str, tokens: int, tmp_path: Path,
                                                                   report) -> None:
    make_family_checkpoint(family, tmp_path, seed=3)
    model = load_model(tmp_path)
    stacked = model.params
    runner = ModelRunner(model, num_blocks=16, block_size=8)
    layers = runner.model.params.layers
    assert isinstance(layers, tuple) and len(layers) == model.config.num_layers
    assert 32 <= UNROLL_MAX_TOKENS < 128
    assert isinstance(stacked.layers.qkv_w, jax.Array) and stacked.layers.qkv_w.shape[1:] == layers[0].qkv_w.shape

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, n).tolist() for n in (13, 5)]
    chunks = [SeqChunk(p, 0, [1 + 2 * i, 2 + 2 * i]) for i, p in enumerate(prompts)]
    batch = build_batch(chunks, 8, pad_tokens_to=tokens, pad_seqs_to=4, pad_blocks_to=2)
    args = runner.forward_args(batch)
    cache_copy = jax.tree.map(lambda a: a.copy(), args[1])  # the program takes the cache over (donated)
    fn = jitted_logits(model.architecture.forward)
    unrolled, unrolled_cache = fn(*args, **runner.shapes.statics())
    scanned, scanned_cache = fn(stacked, cache_copy, *args[2:], **runner.shapes.statics())
    np.testing.assert_array_equal(np.asarray(unrolled), np.asarray(scanned))
    np.testing.assert_array_equal(np.asarray(unrolled_cache.k), np.asarray(scanned_cache.k))
    np.testing.assert_array_equal(np.asarray(unrolled_cache.v), np.asarray(scanned_cache.v))
    how = "unrolled" if tokens <= UNROLL_MAX_TOKENS else "scanned with a switch"
    report(f"{family}, {tokens} tokens: {len(layers)} split layers {how} = the stacked scan, logits and cache "
           "bit for bit")


def test_the_abstract_split_matches_the_placed_split_at_tp_2(tmp_path: Path) -> None:
    """What the step programs are lowered for (StepShapes.params) is what the runner passes: same
    tree, shapes, dtypes and shardings, each layer's split field split on the stacked field's axis."""
    from tests.helpers import make_tiny_llama

    make_tiny_llama(tmp_path, seed=5, num_key_value_heads=2)
    model = load_model(tmp_path, tensor_parallel_size=2)
    runner = ModelRunner(model, num_blocks=8, block_size=8)
    placed, abstract = runner.model.params, runner.shapes.params()
    assert jax.tree.structure(placed) == jax.tree.structure(abstract)
    for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(abstract)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype) and a.sharding.is_equivalent_to(b.sharding, a.ndim)
    specs = model.tp.param_specs(placed)
    assert specs.layers[1].qkv_w == jax.sharding.PartitionSpec(None, "tp")  # stacked: (None, None, "tp")
    assert specs.layers[1].o_w == jax.sharding.PartitionSpec("tp", None)
    assert split_layers(placed) is placed  # already split: nothing to do


def test_enforce_eager_keeps_the_stack_and_gives_the_same_tokens(tmp_path: Path) -> None:
    """--enforce-eager (vLLM's flag for a faster start): the layers stay stacked and every program scans
    them; the tokens are the split engine's, and the two engines' programs are stored apart."""
    from paxserve import Engine, SamplingParams
    from tests.helpers import make_tiny_llama
    from tests.paxserve.test_engine import TEST_ENGINE_ARGS

    make_tiny_llama(tmp_path / "m", seed=9, num_key_value_heads=2)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 200, n).tolist() for n in (7, 90, 3)]  # 90: a pass past UNROLL_MAX_TOKENS
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        engine = Engine(str(tmp_path / "m"), **{**TEST_ENGINE_ARGS, "enforce_eager": eager})
        assert isinstance(engine.model.params.layers, tuple) is not eager
        assert ("|stacked|" in engine.runner.shapes.fingerprint("forward")) is eager
        outs[eager] = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        engine.close()
    assert outs[True] == outs[False]
