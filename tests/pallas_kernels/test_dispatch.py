"""Attention backend dispatch: option resolution, and the model on the Pallas kernel (interpret mode)
giving the same logits and greedy tokens as on the XLA reference, through the runner and the Engine."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.paged_attention  # noqa: F401 - the submodule must not shadow a package-level name
from models import load_model
from pallas_kernels import REFERENCE, AttentionBackend, resolve_attention_backend
from paxserve import Engine, SamplingParams
from paxserve.batch import SeqChunk, build_batch, next_power_of_2
from paxserve.config import EngineConfig
from paxserve.model_runner import ModelRunner
from tests.helpers import make_tiny_llama, rel_error

PALLAS_INTERPRET = AttentionBackend("pallas", interpret=True)
LLAMA8B_SHAPES = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=jnp.bfloat16)


def test_resolution_by_platform_and_shapes() -> None:
    # The choice itself: the start-up self-check (tests/pallas_kernels/test_self_check.py) is skipped,
    # since the GPU kernel cannot run on this CPU machine.
    assert resolve_attention_backend("auto", "cpu", **LLAMA8B_SHAPES) == REFERENCE
    assert resolve_attention_backend("auto", "gpu", **LLAMA8B_SHAPES, self_check=None) == AttentionBackend("pallas")
    assert resolve_attention_backend("auto", "cuda", **LLAMA8B_SHAPES, self_check=None) == AttentionBackend("pallas")
    assert resolve_attention_backend("pallas", "gpu", **LLAMA8B_SHAPES, self_check=None) == AttentionBackend("pallas")
    assert resolve_attention_backend("reference", "gpu", **LLAMA8B_SHAPES) == REFERENCE
    # On a CPU the kernel can only be interpreted.
    assert resolve_attention_backend("pallas", "cpu", **LLAMA8B_SHAPES) == PALLAS_INTERPRET
    # Shapes the kernel does not serve: auto falls back, an explicit request fails with the reason.
    odd = {**LLAMA8B_SHAPES, "head_dim": 80}
    assert resolve_attention_backend("auto", "gpu", **odd) == REFERENCE
    with pytest.raises(ValueError, match="head_dim=80"):
        resolve_attention_backend("pallas", "gpu", **odd)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_attention_backend("triton", "gpu", **LLAMA8B_SHAPES)
    with pytest.raises(ValueError, match="'pallas' or 'reference'"):
        AttentionBackend("xla")


def test_engine_config_validates_the_option() -> None:
    assert EngineConfig().attention_backend == "auto"
    for option in ("auto", "pallas", "reference"):
        assert EngineConfig(attention_backend=option).attention_backend == option
    with pytest.raises(ValueError, match="EngineConfig.attention_backend='cuda' is invalid"):
        EngineConfig(attention_backend="cuda")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers, 4 query heads on 2 KV heads (GQA 2), head_dim 16."""
    directory = tmp_path_factory.mktemp("tiny-dispatch")
    make_tiny_llama(directory, seed=11, num_attention_heads=4, num_key_value_heads=2)
    return directory


def _step(runner: ModelRunner, chunks: list[SeqChunk]) -> np.ndarray:
    num_tokens = sum(len(c.token_ids) for c in chunks)
    batch = build_batch(chunks, runner.block_size, pad_tokens_to=next_power_of_2(num_tokens, 8),
                        pad_seqs_to=next_power_of_2(len(chunks)), pad_blocks_to=8)
    return runner.compute_logits(batch)


def _greedy_mixed(runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]],
                  steps: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """Step 1: chunks of prompts 0 and 2. Step 2 mixes prompt 0's rest, prompt 1 whole and prompt
    2's second chunk; then decode steps for all three. Returns each step's greedy tokens and logits."""
    a, b, c = prompts
    _step(runner, [SeqChunk(a[:20], 0, tables[0]), SeqChunk(c[:10], 0, tables[2])])
    chunks = [SeqChunk(a[20:], 20, tables[0]), SeqChunk(b, 0, tables[1]), SeqChunk(c[10:], 10, tables[2])]
    tokens, logits = [], []
    for _ in range(steps):
        step_logits = _step(runner, chunks)
        step_tokens = [int(np.argmax(row)) for row in step_logits]
        tokens.append(step_tokens)
        logits.append(step_logits)
        chunks = [SeqChunk([t], ch.context_len, ch.block_table) for t, ch in zip(step_tokens, chunks)]
    return tokens, logits


def test_runner_mixed_batches_match_reference(tiny_dir: Path, report) -> None:
    """Chunked prefill, a whole prompt and decode tokens in the same steps, on shuffled pages."""
    model = load_model(tiny_dir)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, n).tolist() for n in (21, 9, 17)]
    tables = [[3, 12, 7, 9], [15, 4, 2], [1, 10, 6, 14]]
    ref_tokens, ref_logits = _greedy_mixed(ModelRunner(model, 16, 8), prompts, tables, 6)
    ours_tokens, ours_logits = _greedy_mixed(ModelRunner(model, 16, 8, attention_backend=PALLAS_INTERPRET),
                                             prompts, tables, 6)
    assert ours_tokens == ref_tokens
    worst = max(rel_error(o, r)[1] for o, r in zip(ours_logits, ref_logits))
    report(f"pallas (interpret) vs reference logits: max rel err {worst:.2e} over 6 mixed/decode steps")
    assert worst < 1e-5


def test_engine_generate_with_pallas_backend(tiny_dir: Path) -> None:
    """The whole Engine on `attention_backend='pallas'` (interpret mode on CPU) gives the reference's
    greedy tokens on mixed-length prompts (chunked prefill forced by a small token budget)."""
    args = dict(warmup=False, log_stats_interval=0, compilation_cache_dir="", max_model_len=128,
                kv_cache_memory_bytes=8 * 2**20, block_size=8, max_num_batched_tokens=32, max_num_seqs=4)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, 256, n).tolist() for n in (3, 40, 11, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = {}
    for option in ("reference", "pallas"):
        engine = Engine(str(tiny_dir), attention_backend=option, **args)
        assert engine.attention_backend == (REFERENCE if option == "reference" else PALLAS_INTERPRET)
        outs[option] = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    assert outs["pallas"] == outs["reference"]
