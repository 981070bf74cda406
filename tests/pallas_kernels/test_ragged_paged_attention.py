"""`ragged_paged_attention` (Pallas) against `ragged_paged_attention_reference`.

Interpret mode: every case is a fresh random problem from `test_reference_attention.make_case`
(ragged decode tokens and prompt chunks on cached context, random page permutations, every unused
page and the null block full of NaN, layer 0 holding finite garbage), written with the engine's KV
write, then attended by the kernel (`interpret=True`) and by the reference. Relative error on the
real tokens: float32 < 1e-5, bfloat16/float16 < 1e-2; padding tokens must be exact zeros.

Lowering: every block size x head dim x dtype, every GQA ratio, the sliding-window (static and
traced), ALiBi and soft-cap variants and the tuning knobs are lowered for CUDA on this CPU machine, so a Triton lowering error
fails here without a GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tests.pallas_kernels.test_reference_attention as ref_tests
from tests.helpers import lower_for_cuda
from paxserve.kernels.metadata import AttentionMetadata
from paxserve.kernels.reference import ragged_paged_attention_reference
from paxserve.kernels.ragged_paged_attention import (
    RaggedPagedAttentionConfig,
    ragged_paged_attention,
    supports_ragged_paged_attention,
)
from tests.pallas_kernels.test_reference_attention import LAYER, Case, Seq, make_case

print(f"test_ragged_paged_attention: PAXSERVE_TEST_SEED={ref_tests.BASE_SEED}")

BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
_reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "soft_cap"))


def written_cache(case: Case) -> tuple[jax.Array, jax.Array]:
    md = case.metadata()
    return ref_tests._write(
        jnp.asarray(case.k_cache), jnp.asarray(case.v_cache), jnp.asarray(LAYER, jnp.int32),
        jnp.asarray(case.k_new), jnp.asarray(case.v_new), md.slot_mapping,
    )


def compare(
    case: Case,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    config: RaggedPagedAttentionConfig = RaggedPagedAttentionConfig(),
) -> tuple[np.ndarray, float]:
    """Kernel (interpret mode) vs reference on one case; returns the kernel output and the error."""
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(case.head_dim)
    k_cache, v_cache = written_cache(case)
    md, q, layer = case.metadata(), jnp.asarray(case.q), jnp.asarray(LAYER, jnp.int32)
    out = ragged_paged_attention(q, k_cache, v_cache, layer, md, sm_scale=sm_scale, sliding_window=sliding_window,
                                 soft_cap=soft_cap, config=config, interpret=True)
    ref = _reference(q, k_cache, v_cache, layer, md, sm_scale=sm_scale, sliding_window=sliding_window,
                     soft_cap=soft_cap)
    info = f"seed={case.seed} (PAXSERVE_TEST_SEED={ref_tests.BASE_SEED})"
    assert out.dtype == q.dtype and out.shape == q.shape, info
    out64, ref64 = np.asarray(out).astype(np.float64), np.asarray(ref).astype(np.float64)
    n = case.batch.num_tokens
    assert np.all(np.isfinite(out64[:n])), f"NaN/inf in real tokens' output (an unused page leaked); {info}"
    rel = float(np.max(np.abs(out64[:n] - ref64[:n])) / np.max(np.abs(ref64[:n])))
    tol = 1e-5 if case.dtype == F32 else 1e-2
    assert rel < tol, f"relative error {rel:.3g} >= {tol}; {info}"
    assert np.array_equal(out64[n:], np.zeros_like(out64[n:])), f"padding tokens are not zero; {info}"
    return out64[:n], rel


def mixed_seqs(bs: int, max_blocks: int) -> list[Seq]:
    """Context 1, exactly one block, a fresh prompt, a chunk ending on a block multiple, a decode at
    the longest length the block table allows, a chunk with an allocated but empty (NaN) block."""
    return ref_tests._mixed_seqs(bs, max_blocks)


@pytest.mark.parametrize(
    ("block_size", "group", "head_dim", "dtype"),
    [
        (8, 1, 32, F32),
        (16, 2, 64, F32),
        (32, 4, 32, F32),
        (16, 8, 16, F32),
        (16, 4, 64, BF16),
        (8, 8, 32, BF16),
        (32, 2, 32, F16),
    ],
    ids=lambda p: getattr(p, "name", str(p)),
)
def test_mixed_ragged_batch(block_size: int, group: int, head_dim: int, dtype: np.dtype, report) -> None:
    max_blocks = 4
    case = make_case(
        f"pallas-mixed-{block_size}-{group}-{head_dim}-{dtype.name}", mixed_seqs(block_size, max_blocks),
        block_size=block_size, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype,
        pad_tokens=5, pad_seqs=2, pad_blocks_to=max_blocks,
    )
    assert case.seqs[4].context_len == max_blocks * block_size
    _, rel = compare(case)
    report(f"rel err {rel:.2e}")


@pytest.mark.parametrize(
    "config",
    [
        RaggedPagedAttentionConfig(query_rows=16, kv_tokens=16),  # many query blocks, one page per step
        RaggedPagedAttentionConfig(query_rows=64, kv_tokens=32),
    ],
    ids=["rows16-kv16", "rows64-kv32"],
)
def test_long_chunks_span_query_blocks_and_key_steps(config: RaggedPagedAttentionConfig) -> None:
    """Prompt chunks longer than a work item's query block, on contexts many key steps long."""
    case = make_case(
        f"pallas-long-{config.query_rows}-{config.kv_tokens}", [Seq(0, 37), Seq(21, 30), Seq(70, 1), Seq(5, 2)],
        block_size=8, num_kv_heads=2, group=2, head_dim=32, pad_tokens=3, pad_seqs=1,
    )
    compare(case, config=config)


def test_single_prompt_no_padding_and_pure_decode() -> None:
    prompt = make_case("pallas-prompt", [Seq(0, 45)], block_size=16, num_kv_heads=1, group=4, head_dim=64)
    compare(prompt)
    decode = make_case(
        "pallas-decode", [Seq(n, 1) for n in (0, 15, 16, 31, 47, 2)], block_size=16, num_kv_heads=2, group=4,
        head_dim=64, dtype=BF16, pad_tokens=2, pad_seqs=2, pad_blocks_to=3,
    )
    compare(decode)


def test_group_not_a_power_of_two() -> None:
    """A group of 3 heads is padded to 4 rows per token; the padding rows must not be stored."""
    case = make_case("pallas-group3", [Seq(9, 1), Seq(0, 13), Seq(17, 6)], block_size=8, num_kv_heads=2, group=3,
                     pad_tokens=2, pad_seqs=1)
    compare(case)


@pytest.mark.parametrize(("window", "kv_tokens"), [(7, None), (20, 16)])
def test_sliding_window(window: int, kv_tokens: int | None) -> None:
    """Windows shorter than a page and spanning several key steps (steps before the window skipped)."""
    case = make_case(
        f"pallas-window-{window}", [Seq(20, 1), Seq(3, 12), Seq(0, 9), Seq(30, 4), Seq(41, 25)], block_size=8,
        num_kv_heads=2, group=2, pad_tokens=3, pad_seqs=1,
    )
    compare(case, sliding_window=window, config=RaggedPagedAttentionConfig(kv_tokens=kv_tokens))


def test_soft_cap() -> None:
    case = make_case("pallas-softcap", [Seq(10, 1), Seq(0, 11), Seq(17, 6)], block_size=8, num_kv_heads=2, group=4,
                     pad_tokens=2, pad_seqs=1)
    capped, _ = compare(case, sm_scale=1.0, soft_cap=5.0)  # big scores, so tanh really bends them
    uncapped, _ = compare(case, sm_scale=1.0)
    assert np.max(np.abs(capped - uncapped)) > 1e-2, "soft_cap had no effect"


def test_layer_index_inside_scan() -> None:
    """As the model calls it: inside `lax.scan` over layers with the layer index traced."""
    case = make_case("pallas-scan", [Seq(6, 1), Seq(0, 9), Seq(12, 5)], block_size=8, num_kv_heads=2, group=2,
                     pad_tokens=1, pad_seqs=1)
    k_cache, v_cache = written_cache(case)
    md, q, scale = case.metadata(), jnp.asarray(case.q), case.head_dim**-0.5

    def per_layer(fn):  # noqa: ANN001, ANN202
        def body(carry, layer):  # noqa: ANN001, ANN202
            return carry, fn(q, k_cache, v_cache, layer, md, sm_scale=scale)
        return jax.lax.scan(body, 0, jnp.arange(2, dtype=jnp.int32))[1]

    kernel = functools.partial(ragged_paged_attention, interpret=True)
    ours = np.asarray(jax.jit(lambda: per_layer(kernel))())
    ref = np.asarray(jax.jit(lambda: per_layer(ragged_paged_attention_reference))())
    n = case.batch.num_tokens
    np.testing.assert_allclose(ours[:, :n], ref[:, :n], rtol=1e-5, atol=1e-5 * np.abs(ref[:, :n]).max())
    assert not np.allclose(ours[0, :n], ours[1, :n]), "both layers gave the same output"


def test_input_validation() -> None:
    q = jnp.zeros((4, 4, 32), jnp.float32)
    cache = jnp.zeros((1, 3, 8, 2, 32), jnp.float32)
    md = AttentionMetadata(
        slot_mapping=jnp.zeros((4,), jnp.int32), block_tables=jnp.zeros((2, 2), jnp.int32),
        context_lens=jnp.zeros((2,), jnp.int32), query_start_loc=jnp.zeros((3,), jnp.int32),
        logits_indices=jnp.zeros((2,), jnp.int32),
    )
    with pytest.raises(ValueError, match="share a dtype"):
        ragged_paged_attention(q, cache.astype(jnp.bfloat16), cache.astype(jnp.bfloat16), 0, md, sm_scale=0.1)
    with pytest.raises(ValueError, match="head_dim"):
        ragged_paged_attention(q[..., :24], cache[..., :24], cache[..., :24], 0, md, sm_scale=0.1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ragged_paged_attention(q[:, :3], cache, cache, 0, md, sm_scale=0.1)
    with pytest.raises(ValueError, match="sliding_window"):
        ragged_paged_attention(q, cache, cache, 0, md, sm_scale=0.1, sliding_window=0)
    with pytest.raises(ValueError, match="query_rows"):
        RaggedPagedAttentionConfig(query_rows=24)
    assert supports_ragged_paged_attention(32, 8, 128, 16, jnp.bfloat16) is None
    assert "head_dim" in supports_ragged_paged_attention(32, 8, 96, 16, jnp.bfloat16)


# ---- CUDA lowering on CPU ------------------------------------------------------------------------


def abstract_args(num_tokens: int, num_seqs: int, width: int, block_size: int, num_kv_heads: int, group: int,
                  head_dim: int, dtype: jnp.dtype, num_layers: int = 2, num_blocks: int = 97):
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    md = AttentionMetadata(slot_mapping=i32(num_tokens), block_tables=i32(num_seqs, width), context_lens=i32(num_seqs),
                           query_start_loc=i32(num_seqs + 1), logits_indices=i32(num_seqs))
    q = jax.ShapeDtypeStruct((num_tokens, num_kv_heads * group, head_dim), dtype)
    cache = jax.ShapeDtypeStruct((num_layers, num_blocks, block_size, num_kv_heads, head_dim), dtype)
    return q, cache, cache, i32(), md


def assert_lowers(num_tokens: int, num_seqs: int, width: int, block_size: int, num_kv_heads: int, group: int,
                  head_dim: int, dtype: jnp.dtype, **kwargs) -> None:
    args = abstract_args(num_tokens, num_seqs, width, block_size, num_kv_heads, group, head_dim, dtype)
    text = lower_for_cuda(lambda q, k, v, layer, md: ragged_paged_attention(q, k, v, layer, md, **kwargs), *args)
    assert "__gpu$xla.gpu.triton" in text, "no Triton kernel in the CUDA lowering"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_lowers_for_cuda(block_size: int, head_dim: int, dtype: jnp.dtype) -> None:
    group = {8: 1, 16: 4, 32: 8}[block_size]
    assert_lowers(256, 32, 64, block_size, 8 // group if group < 8 else 1, group, head_dim, dtype, sm_scale=0.125)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16])
def test_lowers_for_cuda_every_group(group: int) -> None:
    assert_lowers(64, 8, 16, 16, 2, group, 128, jnp.bfloat16, sm_scale=0.1)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(sliding_window=4096),
        dict(soft_cap=30.0),
        dict(sliding_window=128, soft_cap=50.0),
        dict(config=RaggedPagedAttentionConfig(query_rows=16, kv_tokens=16, num_warps=2, num_stages=1)),
        dict(config=RaggedPagedAttentionConfig(query_rows=128, kv_tokens=128, num_warps=8, num_stages=3)),
    ],
    ids=["window", "softcap", "window-softcap", "small-tiles", "big-tiles"],
)
def test_lowers_for_cuda_variants(kwargs: dict) -> None:
    assert_lowers(128, 16, 32, 16, 8, 4, 128, jnp.bfloat16, sm_scale=0.0883, **kwargs)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize(
    ("traced_window", "alibi", "soft_cap"),
    [(True, False, None), (False, True, None), (True, True, 30.0)],
    ids=["traced-window", "alibi", "traced-window-alibi-softcap"],
)
def test_lowers_for_cuda_traced_window_and_alibi(traced_window: bool, alibi: bool, soft_cap: float | None,
                                                 group: int) -> None:
    """The window as a traced int32 scalar (a scanned per-layer window) and ALiBi slopes as an
    [H] input reach the Triton kernel as run-time inputs."""
    q, k, v, layer, md = abstract_args(96, 8, 16, 16, 2, group, 128, jnp.bfloat16)
    extra = ([jax.ShapeDtypeStruct((), jnp.int32)] if traced_window else []) + (
        [jax.ShapeDtypeStruct((2 * group,), jnp.float32)] if alibi else [])

    def fn(q, k, v, layer, md, *extra):  # noqa: ANN001, ANN002, ANN202
        extra = list(extra)
        window = extra.pop(0) if traced_window else None
        slopes = extra.pop(0) if alibi else None
        return ragged_paged_attention(q, k, v, layer, md, sm_scale=0.0883, sliding_window=window, soft_cap=soft_cap,
                                      alibi_slopes=slopes)

    text = lower_for_cuda(fn, q, k, v, layer, md, *extra)
    assert "__gpu$xla.gpu.triton" in text, "no Triton kernel in the CUDA lowering"


def test_lowers_for_cuda_decode_shapes_and_odd_sizes() -> None:
    """A pure-decode bucket (tokens == sequences), a single token, and sizes that are not powers of two."""
    assert_lowers(256, 256, 64, 16, 8, 4, 128, jnp.bfloat16, sm_scale=0.0883)
    assert_lowers(1, 1, 1, 16, 8, 4, 128, jnp.bfloat16, sm_scale=0.0883)
    assert_lowers(37, 5, 7, 8, 3, 2, 64, jnp.float16, sm_scale=0.125)


def _kernel_dots(jaxpr: jax.extend.core.Jaxpr) -> list[jax.extend.core.JaxprEqn]:
    """Every dot_general inside the pallas_call bodies of `jaxpr` (recursively)."""
    dots = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            dots.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    dots.extend(_kernel_dots(inner))
    return dots


@pytest.mark.parametrize("decode_only", [False, True])
def test_float32_dots_ask_for_ieee_precision_not_tf32(decode_only: bool) -> None:
    """Pallas' Triton lowering runs a float32 dot with DEFAULT precision as TF32 (error ~3e-4, above
    the 1e-5 float32 tolerance of the self-check and gpu_check); HIGHEST lowers to IEEE. Checked on
    the kernels' own jaxprs, since the Triton IR is opaque in the lowered text."""
    from paxserve.kernels.decode_attention import paged_decode_attention

    q = jax.ShapeDtypeStruct((8, 8, 64), jnp.float32)
    cache = jax.ShapeDtypeStruct((1, 16, 16, 2, 64), jnp.float32)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    if decode_only:
        fn = lambda q, k, v, bt, cl: paged_decode_attention(q, k, v, 0, bt, cl, sm_scale=0.1)  # noqa: E731
        jaxpr = jax.make_jaxpr(fn)(q, cache, cache, i32(8, 4), i32(8)).jaxpr
    else:
        md = AttentionMetadata(i32(8), i32(4, 4), i32(4), i32(5), i32(4))
        fn = lambda q, k, v, md: ragged_paged_attention(q, k, v, 0, md, sm_scale=0.1)  # noqa: E731
        jaxpr = jax.make_jaxpr(fn)(q, cache, cache, md).jaxpr
    dots = _kernel_dots(jaxpr)
    assert len(dots) >= 2, "expected the QK and PV dots inside the kernel"
    for eqn in dots:
        precision = eqn.params["precision"]
        assert precision is not None and all(p == jax.lax.Precision.HIGHEST for p in precision), precision
