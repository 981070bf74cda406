"""ALiBi and per-layer (traced) sliding windows in the reference and both Pallas kernels.

The reference is proven against a dense float64 numpy attention over each sequence's true K/V
(no pages involved), written straight from the contract: score = (q.k + slope[h] * (kp - qp)) *
sm_scale, then soft-cap, then mask and softmax; the kernels (interpret mode) are compared with the
reference. Windows are passed traced (inside `jax.jit`, and scanned per layer as the model will),
and compared with the same calls given a Python int. Cases are random every run (see
`test_reference_attention.make_case`: shuffled pages, unused pages and the null block NaN).
"""

from __future__ import annotations

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tests.pallas_kernels.test_reference_attention as ref_tests
from paxserve.kernels import NO_WINDOW, REFERENCE, alibi_slopes, attention
from paxserve.kernels.decode_attention import paged_decode_attention, paged_decode_attention_reference
from paxserve.kernels.reference import ragged_paged_attention_reference
from paxserve.kernels.ragged_paged_attention import _ragged_paged_attention, ragged_paged_attention
from tests.pallas_kernels.test_reference_attention import LAYER, Case, Seq, make_case

print(f"test_attention_variants: PAXSERVE_TEST_SEED={ref_tests.BASE_SEED}")

BF16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
# A Python-int window must stay an int up to the entry point, so these jits keep it static.
_static_reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
_static_decode_reference = jax.jit(paged_decode_attention_reference,
                                   static_argnames=("sm_scale", "sliding_window", "soft_cap"))


def written(case: Case) -> tuple[jax.Array, jax.Array]:
    md = case.metadata()
    return ref_tests._write(jnp.asarray(case.k_cache), jnp.asarray(case.v_cache), jnp.asarray(LAYER, jnp.int32),
                            jnp.asarray(case.k_new), jnp.asarray(case.v_new), md.slot_mapping)


def dense_attention(case: Case, *, sm_scale: float, window: int | None = None, slopes: np.ndarray | None = None,
                    soft_cap: float | None = None, absolute: bool = False, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> np.ndarray:
    """[T_pad, H, D] float64 from each sequence's true K/V (times k_scale / v_scale), one dense score
    matrix per sequence. `absolute` adds Hugging Face's `slope * kp` instead of `slope * (kp - qp)`."""
    heads = np.arange(case.num_heads) // case.group
    out = np.zeros(case.q.shape, np.float64)
    t = 0
    for s, k_true, v_true in zip(case.seqs, case.k_true, case.v_true):
        q = case.q[t : t + s.query_len].astype(np.float64)  # [n, H, D]
        k = k_true.astype(np.float64)[:, heads] * k_scale  # [ctx, H, D]
        v = v_true.astype(np.float64)[:, heads] * v_scale
        qp = s.num_computed + np.arange(s.query_len)
        kp = np.arange(s.context_len)
        scores = np.einsum("qhd,khd->hqk", q, k)
        if slopes is not None:
            dist = kp[None, :] if absolute else kp[None, :] - qp[:, None]
            scores = scores + slopes.astype(np.float64)[:, None, None] * dist[None]
        scores = scores * sm_scale
        if soft_cap is not None:
            scores = soft_cap * np.tanh(scores / soft_cap)
        allowed = kp[None, :] <= qp[:, None]
        if window is not None:
            allowed &= kp[None, :] > qp[:, None] - window
        scores = np.where(allowed[None], scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[t : t + s.query_len] = np.einsum("hqk,khd->qhd", p / p.sum(axis=-1, keepdims=True), v)
        t += s.query_len
    return out


def assert_close(out: jax.Array | np.ndarray, expected: jax.Array | np.ndarray, case: Case, what: str,
                 tol: float | None = None) -> float:
    """Relative error on the real tokens below the dtype's tolerance, no NaN, padding exactly zero."""
    n = case.batch.num_tokens
    out64, exp64 = np.asarray(out).astype(np.float64), np.asarray(expected).astype(np.float64)
    info = f"{what}; seed={case.seed} (PAXSERVE_TEST_SEED={ref_tests.BASE_SEED})"
    assert np.all(np.isfinite(out64[:n])), f"NaN/inf in real tokens' output (an unused page leaked); {info}"
    rel = float(np.max(np.abs(out64[:n] - exp64[:n])) / np.max(np.abs(exp64[:n])))
    tol = tol if tol is not None else (1e-5 if case.dtype == F32 else 1e-2)
    assert rel < tol, f"relative error {rel:.3g} >= {tol}; {info}"
    assert np.array_equal(out64[n:], np.zeros_like(out64[n:])), f"padding tokens are not zero; {info}"
    return rel


def random_slopes(case: Case) -> np.ndarray:
    """Distinct slopes per head, big enough to matter: a query head read with another's slope shows."""
    rng = np.random.default_rng(case.seed + 1)
    return rng.uniform(0.02, 0.5, case.num_heads).astype(np.float32)


def decode_case(label: str, lens: tuple[int, ...], *, block_size: int, num_kv_heads: int, group: int,
                dtype: np.dtype = F32, pad_blocks_to: int | None = None) -> Case:
    """One decode token per sequence (context lengths `lens`) plus two padding sequences."""
    return make_case(label, [Seq(n - 1, 1) for n in lens], block_size=block_size, num_kv_heads=num_kv_heads,
                     group=group, dtype=dtype, pad_tokens=2, pad_seqs=2, pad_blocks_to=pad_blocks_to)


# ---- ALiBi ---------------------------------------------------------------------------------------


def test_alibi_slopes_match_hugging_face_falcon() -> None:
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor
    import torch

    mask = torch.ones(1, 2, dtype=torch.long)  # key positions 0 and 1: position 1 holds the slope itself
    for num_heads in (1, 2, 3, 4, 5, 6, 8, 12, 16, 20, 32, 64, 71, 128):
        ours = alibi_slopes(num_heads)
        assert ours.dtype == np.float32 and ours.shape == (num_heads,)
        # HF rounds the slopes to bfloat16 before use; the float32 slopes themselves show with that
        # cast made a no-op (torch's vectorised float32 pow may differ by one ulp).
        with mock.patch.object(torch.Tensor, "bfloat16", lambda self: self):
            hf = build_alibi_tensor(mask, num_heads, torch.float32).reshape(num_heads, 2)[:, 1].numpy()
        np.testing.assert_array_max_ulp(ours, hf, maxulp=1)
        hf_used = build_alibi_tensor(mask, num_heads, torch.float32).reshape(num_heads, 2)[:, 1].numpy()
        np.testing.assert_array_equal(ours.astype(ml_dtypes.bfloat16).astype(np.float32), hf_used)
    np.testing.assert_array_equal(alibi_slopes(8), 2.0 ** -np.arange(1, 9, dtype=np.float32))
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)


ALIBI_CASES = [  # block size, KV heads, group (1: MHA, 4: GQA, KV heads 1: MQA), dtype, window
    (8, 2, 1, F32, None),
    (16, 2, 4, F32, 13),
    (32, 1, 4, F32, None),
    (16, 1, 8, BF16, None),
    (8, 2, 4, BF16, 11),
    (32, 2, 1, BF16, 40),
]
ALIBI_IDS = [f"bs{b}-kv{k}-g{g}-{d.name}-w{w}" for b, k, g, d, w in ALIBI_CASES]


@pytest.mark.parametrize(("block_size", "num_kv_heads", "group", "dtype", "window"), ALIBI_CASES, ids=ALIBI_IDS)
def test_alibi_ragged(block_size: int, num_kv_heads: int, group: int, dtype: np.dtype, window: int | None,
                      report) -> None:
    case = make_case(f"alibi-ragged-{block_size}-{num_kv_heads}-{group}-{dtype.name}-{window}",
                     ref_tests._mixed_seqs(block_size, 4), block_size=block_size, num_kv_heads=num_kv_heads,
                     group=group, dtype=dtype, pad_tokens=3, pad_seqs=1, pad_blocks_to=4)
    k_cache, v_cache = written(case)
    md, q, scale = case.metadata(), jnp.asarray(case.q), case.head_dim**-0.5
    slopes = random_slopes(case)
    args = (q, k_cache, v_cache, LAYER, md)
    ref = _static_reference(*args, sm_scale=scale, sliding_window=window, alibi_slopes=jnp.asarray(slopes))
    assert_close(ref, dense_attention(case, sm_scale=scale, window=window, slopes=slopes), case, "reference vs dense")
    # Hugging Face's absolute bias (slope * kp) differs by a per-row constant: same softmax.
    assert_close(ref, dense_attention(case, sm_scale=scale, window=window, slopes=slopes, absolute=True), case,
                 "reference vs dense with HF's absolute bias")
    out = ragged_paged_attention(*args, sm_scale=scale, sliding_window=window, alibi_slopes=jnp.asarray(slopes),
                                 interpret=True)
    assert out.dtype == q.dtype
    rel = assert_close(out, ref, case, "kernel vs reference")
    report(f"rel err {rel:.2e}")

    flat = _static_reference(*args, sm_scale=scale, sliding_window=window, alibi_slopes=jnp.zeros(case.num_heads))
    plain = _static_reference(*args, sm_scale=scale, sliding_window=window)
    assert_close(flat, plain, case, "slopes 0 vs no ALiBi", tol=1e-6)
    n = case.batch.num_tokens
    assert np.max(np.abs(np.asarray(ref, np.float32)[:n] - np.asarray(flat, np.float32)[:n])) > 5e-2, "no ALiBi effect"


@pytest.mark.parametrize(("block_size", "num_kv_heads", "group", "dtype", "window"),
                         [c for c in ALIBI_CASES if c[0] != 32] + [(32, 1, 8, F32, 9)],
                         ids=[i for c, i in zip(ALIBI_CASES, ALIBI_IDS) if c[0] != 32] + ["bs32-kv1-g8-float32-w9"])
def test_alibi_decode(block_size: int, num_kv_heads: int, group: int, dtype: np.dtype, window: int | None) -> None:
    bs = block_size
    case = decode_case(f"alibi-decode-{bs}-{num_kv_heads}-{group}-{dtype.name}-{window}",
                       (1, bs, bs + 1, 3 * bs - 5, 4 * bs, 7), block_size=bs, num_kv_heads=num_kv_heads,
                       group=group, dtype=dtype, pad_blocks_to=4)
    k_cache, v_cache = written(case)
    md, q, scale = case.metadata(), jnp.asarray(case.q), case.head_dim**-0.5
    slopes = jnp.asarray(random_slopes(case))
    args = (q, k_cache, v_cache, LAYER, md.block_tables, md.context_lens)
    ref = _static_decode_reference(*args, sm_scale=scale, sliding_window=window, alibi_slopes=slopes)
    assert_close(ref, dense_attention(case, sm_scale=scale, window=window, slopes=np.asarray(slopes)), case,
                 "decode reference vs dense")
    out = paged_decode_attention(*args, sm_scale=scale, sliding_window=window, alibi_slopes=slopes, interpret=True)
    assert_close(out, ref, case, "decode kernel vs reference")
    flat = _static_decode_reference(*args, sm_scale=scale, sliding_window=window, alibi_slopes=jnp.zeros_like(slopes))
    n = case.batch.num_tokens
    assert np.max(np.abs(np.asarray(out, np.float32)[:n] - np.asarray(flat, np.float32)[:n])) > 5e-2, "no ALiBi effect"


def test_alibi_with_soft_cap_and_real_slopes() -> None:
    """The bias goes in before the scale and the cap: with a cap that bends, the order shows."""
    case = make_case("alibi-softcap", [Seq(40, 1), Seq(0, 23), Seq(17, 6)], block_size=8, num_kv_heads=2, group=2,
                     pad_tokens=2, pad_seqs=1)
    k_cache, v_cache = written(case)
    md, q = case.metadata(), jnp.asarray(case.q)
    slopes = alibi_slopes(case.num_heads)
    kwargs = dict(sm_scale=0.5, soft_cap=3.0, alibi_slopes=jnp.asarray(slopes))
    ref = _static_reference(q, k_cache, v_cache, LAYER, md, **kwargs)
    assert_close(ref, dense_attention(case, sm_scale=0.5, soft_cap=3.0, slopes=slopes), case, "reference vs dense")
    out = jax.jit(functools.partial(attention, backend=REFERENCE, sm_scale=0.5, soft_cap=3.0))(
        q, k_cache, v_cache, LAYER, md, alibi_slopes=jnp.asarray(slopes))
    assert_close(out, ref, case, "attention(reference backend)", tol=1e-6)
    out = ragged_paged_attention(q, k_cache, v_cache, LAYER, md, interpret=True, **kwargs)
    assert_close(out, ref, case, "kernel vs reference")


# ---- traced windows --------------------------------------------------------------------------------


def test_traced_window_inside_jit_one_compilation() -> None:
    """Prompts longer than the window and decode tokens far past it; windows from 1 to past any
    context (NO_WINDOW and int32's max, which must not overflow), all from one compiled kernel."""
    case = make_case("traced-window", [Seq(150, 1), Seq(0, 40), Seq(37, 20), Seq(9, 1), Seq(70, 3)], block_size=8,
                     num_kv_heads=2, group=2, pad_tokens=3, pad_seqs=1)
    k_cache, v_cache = written(case)
    md, q, scale = case.metadata(), jnp.asarray(case.q), case.head_dim**-0.5
    kernel = jax.jit(lambda q, k, v, md, w: ragged_paged_attention(q, k, v, LAYER, md, sm_scale=scale,
                                                                   sliding_window=w, interpret=True))
    reference = jax.jit(lambda q, k, v, md, w: ragged_paged_attention_reference(q, k, v, LAYER, md, sm_scale=scale,
                                                                                sliding_window=w))
    compiled_before = _ragged_paged_attention._cache_size()
    for w in (1, 5, 17, 64, NO_WINDOW, 2**31 - 1):
        traced_w = jnp.asarray(w, jnp.int32)
        static = _static_reference(q, k_cache, v_cache, LAYER, md, sm_scale=scale, sliding_window=w)
        expect_w = None if w >= NO_WINDOW else w
        assert_close(static, dense_attention(case, sm_scale=scale, window=expect_w), case, f"static window {w}")
        assert_close(reference(q, k_cache, v_cache, md, traced_w), static, case, f"reference, traced window {w}",
                     tol=1e-6)
        assert_close(kernel(q, k_cache, v_cache, md, traced_w), static, case, f"kernel, traced window {w}")
    assert kernel._cache_size() == 1 and reference._cache_size() == 1
    assert _ragged_paged_attention._cache_size() - compiled_before <= 1, "a new window recompiled the kernel"
    # A Python int goes to the same kernel as a traced value (no static window in its signature).
    out = ragged_paged_attention(q, k_cache, v_cache, LAYER, md, sm_scale=scale, sliding_window=5, interpret=True)
    assert_close(out, dense_attention(case, sm_scale=scale, window=5), case, "kernel, int window 5")


def _layer_caches(case: Case, k_scales: tuple[float, ...], v_scales: tuple[float, ...]) -> tuple[jax.Array, jax.Array]:
    """A cache with one layer per scale, each the written layer times its scale (NaN stays NaN)."""
    k_cache, v_cache = written(case)
    k = jnp.stack([k_cache[LAYER] * s for s in k_scales]).astype(k_cache.dtype)
    v = jnp.stack([v_cache[LAYER] * s for s in v_scales]).astype(v_cache.dtype)
    return k, v


WINDOWS = (5, NO_WINDOW, 17, 1)
K_SCALES, V_SCALES = (1.0, 0.6, 1.4, 0.8), (1.0, -1.0, 0.5, 2.0)


def _scan_layers(fn, *args, windows: jax.Array, extra_xs: jax.Array | None = None, **kwargs):  # noqa: ANN001, ANN202
    """`fn(*args[:3], layer, *args[3:], sliding_window=w, ...)` for each layer in one `lax.scan`, the
    window (and, if given, the ALiBi slopes) scanned as the model scans its per-layer attributes."""
    def body(carry, xs):  # noqa: ANN001, ANN202
        layer, w, *slopes = xs
        extra = {"alibi_slopes": slopes[0]} if slopes else {}
        return carry, fn(*args[:3], layer, *args[3:], sliding_window=w, **extra, **kwargs)

    xs = (jnp.arange(windows.shape[0], dtype=jnp.int32), windows) + (() if extra_xs is None else (extra_xs,))
    return jax.lax.scan(body, 0, xs)[1]


def test_ragged_windows_scanned_over_layers() -> None:
    case = make_case("scan-windows", [Seq(90, 1), Seq(0, 30), Seq(25, 9), Seq(3, 1)], block_size=8, num_kv_heads=2,
                     group=2, pad_tokens=2, pad_seqs=1)
    k4, v4 = _layer_caches(case, K_SCALES, V_SCALES)
    md, q, scale = case.metadata(), jnp.asarray(case.q), case.head_dim**-0.5
    windows = jnp.asarray(WINDOWS, jnp.int32)
    kernel = functools.partial(ragged_paged_attention, interpret=True)
    ours = jax.jit(lambda: _scan_layers(kernel, q, k4, v4, md, windows=windows, sm_scale=scale))()
    ref = jax.jit(lambda: _scan_layers(ragged_paged_attention_reference, q, k4, v4, md, windows=windows,
                                       sm_scale=scale))()
    for layer, w in enumerate(WINDOWS):
        static = _static_reference(q, k4, v4, layer, md, sm_scale=scale, sliding_window=w)
        expect_w = None if w == NO_WINDOW else w
        dense = dense_attention(case, sm_scale=scale, window=expect_w, k_scale=K_SCALES[layer],
                                v_scale=V_SCALES[layer])
        assert_close(static, dense, case, f"layer {layer}: static window {w} vs dense")
        assert_close(ref[layer], static, case, f"layer {layer}: scanned reference", tol=1e-6)
        assert_close(ours[layer], static, case, f"layer {layer}: scanned kernel")
    unwindowed = _static_reference(q, k4, v4, 1, md, sm_scale=scale)
    assert_close(ref[1], unwindowed, case, "NO_WINDOW vs None", tol=1e-6)


def test_decode_windows_and_slopes_scanned_over_layers() -> None:
    """Decode tokens far past the window; the ALiBi slopes are scanned per layer too."""
    case = decode_case("scan-decode", (1, 9, 40, 130, 23), block_size=8, num_kv_heads=1, group=4)
    k4, v4 = _layer_caches(case, K_SCALES, V_SCALES)
    md, q, scale = case.metadata(), jnp.asarray(case.q), case.head_dim**-0.5
    windows = jnp.asarray(WINDOWS, jnp.int32)
    slopes = np.stack([random_slopes(case) * f for f in (1.0, 0.0, 2.0, 0.5)]).astype(np.float32)
    args = (q, k4, v4, md.block_tables, md.context_lens)
    kernel = functools.partial(paged_decode_attention, interpret=True)
    ours = jax.jit(lambda: _scan_layers(kernel, *args, windows=windows, extra_xs=jnp.asarray(slopes),
                                        sm_scale=scale))()
    for layer, w in enumerate(WINDOWS):
        static = _static_decode_reference(q, k4, v4, layer, md.block_tables, md.context_lens, sm_scale=scale,
                                          sliding_window=w, alibi_slopes=jnp.asarray(slopes[layer]))
        dense = dense_attention(case, sm_scale=scale, window=None if w == NO_WINDOW else w, slopes=slopes[layer],
                                k_scale=K_SCALES[layer], v_scale=V_SCALES[layer])
        assert_close(static, dense, case, f"layer {layer}: decode reference vs dense")
        assert_close(ours[layer], static, case, f"layer {layer}: scanned decode kernel")


# ---- pages outside every window --------------------------------------------------------------------


def _nan_outside_windows(case: Case, k_cache: jax.Array, v_cache: jax.Array,
                         window: int) -> tuple[jax.Array, jax.Array, int]:
    """NaN in every page of the read layer that no query of its sequence can see; returns the count."""
    k, v = np.array(k_cache), np.array(v_cache)
    hidden = 0
    for s, table in zip(case.seqs, case.block_tables):
        first_seen = max(s.num_computed - window + 1, 0)  # the earliest query sits at num_computed
        for i, block in enumerate(table):
            if (i + 1) * case.block_size <= first_seen:
                k[LAYER, block] = np.nan
                v[LAYER, block] = np.nan
                hidden += 1
    return jnp.asarray(k), jnp.asarray(v), hidden


def test_pages_outside_every_window_stay_unread() -> None:
    """A traced window (ALiBi with windows: `test_alibi_ragged` / `test_alibi_decode`)."""
    window = 6
    case = make_case("nan-pages", [Seq(120, 1), Seq(50, 20), Seq(0, 30), Seq(33, 1), Seq(64, 2)],
                     block_size=8, num_kv_heads=2, group=2, pad_tokens=2, pad_seqs=1)
    k_cache, v_cache, hidden = _nan_outside_windows(case, *written(case), window)
    assert hidden >= 20
    md, q, scale = case.metadata(), jnp.asarray(case.q), case.head_dim**-0.5
    dense = dense_attention(case, sm_scale=scale, window=window)
    traced_w = jnp.asarray(window, jnp.int32)
    ref = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=scale))(q, k_cache, v_cache, LAYER, md,
                                                                                       sliding_window=traced_w)
    assert_close(ref, dense, case, "reference with NaN pages outside the window")
    out = ragged_paged_attention(q, k_cache, v_cache, LAYER, md, sm_scale=scale, sliding_window=traced_w,
                                 interpret=True)
    assert_close(out, dense, case, "kernel with NaN pages outside the window")

    dcase = decode_case("nan-pages-decode", (150, 7, 64, 33), block_size=8, num_kv_heads=2, group=2)
    k_cache, v_cache, hidden = _nan_outside_windows(dcase, *written(dcase), window)
    assert hidden >= 20
    md, q = dcase.metadata(), jnp.asarray(dcase.q)
    dense = dense_attention(dcase, sm_scale=scale, window=window)
    args = (q, k_cache, v_cache, LAYER, md.block_tables, md.context_lens)
    reference = jax.jit(functools.partial(paged_decode_attention_reference, sm_scale=scale))
    assert_close(reference(*args, sliding_window=traced_w), dense, dcase,
                 "decode reference with NaN pages outside the window")
    assert_close(paged_decode_attention(*args, sm_scale=scale, sliding_window=traced_w, interpret=True), dense,
                 dcase, "decode kernel with NaN pages outside the window")


# ---- validation ------------------------------------------------------------------------------------


def test_window_and_slopes_are_validated() -> None:
    case = make_case("validate", [Seq(3, 1), Seq(0, 4)], block_size=8, num_kv_heads=1, group=2, head_dim=16)
    md, q = case.metadata(), jnp.asarray(case.q)
    k, v = jnp.asarray(case.k_cache), jnp.asarray(case.v_cache)
    entries = {
        "ragged_paged_attention_reference": lambda **kw: ragged_paged_attention_reference(q, k, v, 1, md, **kw),
        "ragged_paged_attention": lambda **kw: ragged_paged_attention(q, k, v, 1, md, interpret=True, **kw),
        "paged_decode_attention": lambda **kw: paged_decode_attention(q[:2], k, v, 1, md.block_tables,
                                                                      md.context_lens, interpret=True, **kw),
        "paged_decode_attention_reference": lambda **kw: paged_decode_attention_reference(
            q[:2], k, v, 1, md.block_tables, md.context_lens, **kw),
        "attention": lambda **kw: attention(q, k, v, 1, md, **kw),
    }
    for name, call in entries.items():
        for bad in (0, -3, True, 2.5, jnp.zeros((2,), jnp.int32), jnp.float32(4.0)):
            with pytest.raises(ValueError, match="sliding_window"):
                call(sm_scale=0.25, sliding_window=bad)
        with pytest.raises(ValueError, match=r"alibi_slopes must be \[num_heads=2\]"):
            call(sm_scale=0.25, alibi_slopes=jnp.zeros((3,), jnp.float32))
        with pytest.raises(ValueError, match="alibi_slopes"):
            call(sm_scale=0.25, alibi_slopes=jnp.zeros((2,), jnp.bool_))
    # A Python int past int32 means "no window" (it is clamped to NO_WINDOW, no overflow).
    k, v = written(case)
    huge = _static_reference(q, k, v, LAYER, md, sm_scale=0.25, sliding_window=2**40)
    none = _static_reference(q, k, v, LAYER, md, sm_scale=0.25)
    assert np.all(np.isfinite(np.asarray(huge)))
    np.testing.assert_array_equal(np.asarray(huge), np.asarray(none))
