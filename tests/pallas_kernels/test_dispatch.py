"""Attention backend dispatch: option resolution, and the model on the Pallas kernel (interpret mode)
giving the same logits and greedy tokens as on the XLA reference, through the runner and the Engine."""

from __future__ import annotations

import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import paxserve.kernels.paged_attention  # noqa: F401 - the submodule must not shadow a package-level name
from paxserve import Engine, SamplingParams
from paxserve.config import EngineConfig
from paxserve.kernels import REFERENCE, AttentionBackend, resolve_attention_backend
from paxserve.models import load_model
from paxserve.worker.model_runner import ModelRunner
from paxserve.worker.step_inputs import SeqChunk, build_batch, next_power_of_2
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
        resolve_attention_backend("cuda", "gpu", **LLAMA8B_SHAPES)
    with pytest.raises(ValueError, match="'mosaic', 'triton' or 'reference'"):
        AttentionBackend("xla")
    # "pallas" is the earlier name of the Triton kernel.
    assert AttentionBackend("pallas") == AttentionBackend("triton")
    assert resolve_attention_backend("triton", "gpu", **LLAMA8B_SHAPES, self_check=None) == AttentionBackend("triton")


def test_auto_picks_mosaic_on_hopper_and_falls_back_in_order(caplog: pytest.LogCaptureFixture) -> None:
    """Compute capability 9.0+ tries Mosaic GPU first; older GPUs and ROCm start at Triton; a kernel
    failing its self-check hands over to the next, and the reference serves when none is left."""
    mosaic, triton = AttentionBackend("mosaic"), AttentionBackend("triton")
    resolve = lambda platform, cc, check: resolve_attention_backend(  # noqa: E731
        "auto", platform, **LLAMA8B_SHAPES, self_check=check, compute_capability=cc)
    tried: list[str] = []

    def failing(*names: str):  # noqa: ANN202
        def check(backend: AttentionBackend, **shapes) -> str | None:  # noqa: ANN003
            tried.append(backend.name)
            return "wrong numbers" if backend.name in names else None
        return check

    assert resolve("gpu", "9.0", failing()) == mosaic and tried == ["mosaic"]
    assert resolve("gpu", "10.0", failing()) == mosaic
    tried.clear()
    assert resolve("gpu", "8.9", failing()) == triton and tried == ["triton"]
    assert resolve("gpu", None, failing()) == triton
    assert resolve("rocm", "9.0", failing()) == triton
    tried.clear()
    caplog.set_level(logging.INFO, logger="paxserve.kernels.dispatch")
    assert resolve("gpu", "9.0", failing("mosaic")) == triton and tried == ["mosaic", "triton"]
    assert any("Mosaic GPU kernel failed its start-up self-check on gpu (wrong numbers)" in r.getMessage()
               for r in caplog.records)
    assert resolve("gpu", "9.0", failing("mosaic", "triton")) == REFERENCE
    # Shapes Mosaic GPU does not serve (float32: wgmma takes 16-bit inputs) go straight to Triton.
    tried.clear()
    f32 = {**LLAMA8B_SHAPES, "dtype": jnp.float32}
    assert resolve_attention_backend("auto", "gpu", **f32, self_check=failing(), compute_capability="9.0") == triton
    assert tried == ["triton"]
    with pytest.raises(ValueError, match="not bfloat16 or float16"):
        resolve_attention_backend("mosaic", "gpu", **f32, self_check=None)


def test_mosaic_on_cpu_needs_the_interpret_mode_of_jax_0_11_2() -> None:
    import jax
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if hasattr(plgpu, "InterpretGPUParams"):  # the Mosaic GPU lane's JAX (tests/mosaic_gpu/lane.sh)
        assert resolve_attention_backend("mosaic", "cpu", **LLAMA8B_SHAPES) == AttentionBackend("mosaic", interpret=True)
    else:
        with pytest.raises(ValueError, match=f"needs JAX >= 0.11.2 \\(this is JAX {jax.__version__}\\)"):
            resolve_attention_backend("mosaic", "cpu", **LLAMA8B_SHAPES)


def test_engine_config_validates_the_option() -> None:
    assert EngineConfig().attention_backend == "auto"
    for option in ("auto", "mosaic", "triton", "pallas", "reference"):
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
