"""Attention backend dispatch: option resolution, and the model on the Pallas kernel (interpret mode)
giving the same logits and greedy tokens as on the XLA reference, through the runner and the Engine."""

from __future__ import annotations

import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import paxserve.kernels.decode_attention  # noqa: F401 - the submodule must not shadow a package-level name
from paxserve import Engine, SamplingParams
from paxserve.config import EngineConfig
from paxserve.kernels import REFERENCE, AttentionBackend, resolve_attention_backend
from paxserve.models import load_model
from paxserve.worker.model_runner import ModelRunner
from paxserve.worker.step_inputs import SeqChunk, build_batch, next_power_of_2
from tests.helpers import compute_logits, make_tiny_llama, rel_error

PALLAS_INTERPRET = AttentionBackend("pallas", interpret=True)
LLAMA8B_SHAPES = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=jnp.bfloat16)


def test_resolution_by_platform_and_shapes() -> None:
    # The choice itself: the start-up self-check (tests/pallas_kernels/test_self_check.py) is skipped,
    # since the GPU kernel cannot run on this CPU machine.
    # On a CPU, the reference with the CPU kernel for decode steps (tests/pallas_kernels/test_cpu_attention.py).
    assert resolve_attention_backend("auto", "cpu", **LLAMA8B_SHAPES) == AttentionBackend("reference", cpu_kernel=True)
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


def test_auto_tries_triton_then_mosaic_on_hopper_and_falls_back_in_order(caplog: pytest.LogCaptureFixture) -> None:
    """On a GPU Triton comes first (it measured faster on an H200), then Mosaic GPU on compute
    capability 9.0+; a kernel failing its self-check hands over to the next, and the reference
    serves when none is left. Each kernel that passes has its decode-only kernel checked too."""
    mosaic, triton = AttentionBackend("mosaic"), AttentionBackend("triton")
    resolve = lambda platform, cc, check: resolve_attention_backend(  # noqa: E731
        "auto", platform, **LLAMA8B_SHAPES, self_check=check, compute_capability=cc)
    tried: list[str] = []

    def failing(*names: str):  # noqa: ANN202
        def check(backend: AttentionBackend, **shapes) -> str | None:  # noqa: ANN003
            name = backend.name + (" decode" if backend.pure_decode else "")
            tried.append(name)
            return "wrong numbers" if name in names else None
        return check

    assert resolve("gpu", "9.0", failing()) == triton and tried == ["triton", "triton decode"]
    assert triton.decode_kernel and not REFERENCE.decode_kernel
    tried.clear()
    assert resolve("gpu", "8.9", failing("mosaic")) == triton and tried == ["triton", "triton decode"]
    assert resolve("gpu", None, failing()) == triton
    assert resolve("rocm", "9.0", failing()) == triton
    tried.clear()
    caplog.set_level(logging.INFO, logger="paxserve.kernels.dispatch")
    assert resolve("gpu", "9.0", failing("triton")) == mosaic and tried == ["triton", "mosaic", "mosaic decode"]
    assert resolve("gpu", "10.0", failing("triton")) == mosaic
    assert any("Triton kernel failed its start-up self-check on gpu (wrong numbers)" in r.getMessage()
               for r in caplog.records)
    assert resolve("gpu", "8.9", failing("triton")) == REFERENCE
    assert resolve("gpu", "9.0", failing("mosaic", "triton")) == REFERENCE
    # A decode-only kernel that fails its check costs only the decode programs: pure-decode steps
    # then run the ragged kernel, which passed.
    caplog.clear()
    chosen = resolve("gpu", "9.0", failing("triton decode"))
    assert chosen.name == "triton" and not chosen.decode_kernel
    assert chosen.describe() == "Triton: mixed steps on the ragged kernel, pure-decode steps on the ragged kernel too"
    assert triton.describe() == "Triton: mixed steps on the ragged kernel, pure-decode steps on the Triton decode-only kernel"
    assert any("decode-only kernel failed its start-up self-check on gpu (wrong numbers); pure-decode steps run the "
               "ragged kernel" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="pure_decode needs a decode kernel"):
        AttentionBackend("reference", pure_decode=True)
    # Shapes Mosaic GPU does not serve (float32: wgmma takes 16-bit inputs) are never tried on it.
    tried.clear()
    f32 = {**LLAMA8B_SHAPES, "dtype": jnp.float32}
    assert resolve_attention_backend("auto", "gpu", **f32, self_check=failing("triton"),
                                     compute_capability="9.0") == REFERENCE
    assert tried == ["triton"]
    with pytest.raises(ValueError, match="not bfloat16 or float16"):
        resolve_attention_backend("mosaic", "gpu", **f32, self_check=None)


def test_the_decode_only_path_passes_the_self_check_in_interpret_mode() -> None:
    """`attention` on a pure-decode program (token s is sequence s's, padding tokens past the
    sequences) gives the reference's outputs through the Triton decode-only kernel: the self-check's
    pure-decode batch, interpreted here (GQA 2 and MQA, a window, ALiBi)."""
    from paxserve.kernels import self_check_attention

    decode = AttentionBackend("triton", interpret=True, pure_decode=True)
    shapes = dict(num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=jnp.float32)
    assert self_check_attention(decode, **shapes, sliding_window=5, alibi=True) is None
    assert self_check_attention(decode, **{**shapes, "num_kv_heads": 1}) is None


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
    return compute_logits(runner, batch)


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
        if option == "pallas":  # pure-decode steps ran on the decode-only kernel
            assert any(key[0] == "decode" for key in engine.runner.programs.keys())
        else:
            assert all(key[0] != "decode" for key in engine.runner.programs.keys())
    assert outs["pallas"] == outs["reference"]


def test_a_decode_step_asks_for_its_own_program_and_a_plain_forward_covers_it_meanwhile(tiny_dir: Path) -> None:
    """With a decode-only kernel, a step of one token per sequence is a "decode" program; while it
    compiles in the background, a compiled plain forward that covers it serves (any step may run
    there), and a step of several tokens never runs a decode program."""
    engine = Engine(str(tiny_dir), attention_backend="pallas", warmup=False, compile_in_background=True,
                    log_stats_interval=0, compilation_cache_dir="", max_model_len=128,
                    kv_cache_memory_bytes=8 * 2**20, block_size=8, max_num_seqs=4)
    runner = engine.runner
    try:
        runner.programs.get(("forward", 2, 2, 2))
        assert runner.program(1, 1, 2) == ("forward", 2, 2, 2)
        runner.programs.wait()
        assert runner.program(1, 1, 2) == ("decode", 1, 1, 2)
        # The decode step of one sequence had the next batch size's decode program compiled ahead.
        assert runner.program(2, 2, 2) == ("decode", 2, 2, 2)
        assert runner.program(3, 2, 2)[0] == "forward"
    finally:
        runner.programs.close()
