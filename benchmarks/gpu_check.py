"""GPU check: kernels vs references, decode-kernel bandwidth, end-to-end throughput, in one table.

    python benchmarks/gpu_check.py            # one H200: finishes in about 6 minutes or less
    python benchmarks/gpu_check.py --smoke    # tiny shapes, any machine (kernels interpreted on CPU)

(a) every Pallas kernel, Mosaic GPU and Triton, (and JAX's own paged attention) against the XLA reference on random
    ragged inputs (shuffled pages, NaN in unused pages), reference at highest matmul precision;
(b) decode attention at Llama-3-8B shapes (32 q heads, 8 KV heads, head_dim 128, block 16,
    bfloat16, one layer) at batch x context 64x1k, 64x4k, 256x1k: time and achieved bandwidth of
    our Mosaic GPU and Triton decode and ragged kernels on the same batch, JAX's
    `jax.experimental.pallas.ops.gpu.paged_attention` (cache laid out as [kv_heads, pages, page, dim])
    and the XLA reference, next to a measured device-to-device copy bandwidth;
(c) offline generation with the Engine on a random-weight Llama-3-8B-shaped model (bfloat16, 256
    prompts x 512 tokens, 128 output tokens each) next to the memory-bandwidth bound of its decode;
(m) GPU memory: JAX's pool sized from --gpu-memory-utilization and the device total planned from,
    next to nvidia-smi's;
(d) the MoE layer at Mixtral-8x7B shapes: tiled expert products vs all experts, and its time next
    to `jax.lax.ragged_dot` and a dense MLP of the active size (benchmarks/gpu_check_moe.py).

Needs nothing outside the repository. Each part runs under a shared time budget (`--budget`) and a
failure in one part is reported in the table without stopping the others.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# As the Engine does before JAX's backend starts: the GPU pool is --gpu-memory-utilization (0.9) of
# the device, so part (m) can check the planned total against nvidia-smi's.
from paxserve.gpu_memory import configure_allocator  # noqa: E402

ALLOCATOR = configure_allocator(0.9, backend_started=False)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.gpu_check_moe import part_d  # noqa: E402
from pallas_kernels.alibi import alibi_slopes  # noqa: E402
from pallas_kernels.metadata import AttentionMetadata  # noqa: E402
from pallas_kernels.paged_attention import (  # noqa: E402
    decode_metadata,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from pallas_kernels.mosaic_attention import (  # noqa: E402
    MosaicAttentionConfig,
    mosaic_paged_decode_attention,
    mosaic_ragged_paged_attention,
    supports_mosaic_attention,
)
from pallas_kernels.paged_attention_reference import ragged_paged_attention_reference  # noqa: E402
from pallas_kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402

ROWS: list[tuple[str, str, str, str]] = []  # (part, what, result, note)
H200_SPEC_BANDWIDTH = 4.8e12  # bytes/s, for the note next to the measured copy bandwidth


def row(part: str, what: str, result: str, note: str = "") -> None:
    ROWS.append((part, what, result, note))
    print(f"[{part}] {what}: {result}  {note}", flush=True)


def print_table() -> None:
    widths = [max(len(r[i]) for r in ROWS + [("part", "check", "result", "note")]) for i in range(4)]
    line = "  ".join("{:<" + str(w) + "}" for w in widths)
    print("\n" + "=" * 30 + " gpu_check summary " + "=" * 30)
    print(line.format("part", "check", "result", "note"))
    print(line.format(*("-" * w for w in widths)))
    for r in ROWS:
        print(line.format(*r))


def timed(fn: Callable[[], Any], *, min_time: float, reps: int) -> float:
    """Best seconds per call of `fn` after a compile call (several calls per sample when fast)."""
    jax.block_until_ready(fn())
    start = time.perf_counter()
    jax.block_until_ready(fn())
    once = time.perf_counter() - start
    n = max(1, int(min_time / max(once, 1e-7)))
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        out = None
        for _ in range(n):
            out = fn()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / n)
    return best


# ---- random ragged problems ----------------------------------------------------------------------


def ragged_problem(rng: np.random.Generator, *, num_seqs: int, block_size: int, num_kv_heads: int, group: int,
                   head_dim: int, dtype: Any, max_ctx: int, decode_only: bool = False) -> dict[str, Any]:
    """A step's inputs after its K/V write: 2 layers (layer 0 finite garbage), shuffled pages, every
    unused page and the null block NaN, one padding sequence and three padding tokens."""
    ctx = rng.integers(1, max_ctx + 1, num_seqs)
    q_lens = np.ones(num_seqs, int) if decode_only else np.where(
        rng.random(num_seqs) < 0.5, 1, [int(rng.integers(1, c + 1)) for c in ctx])
    blocks = [-(-int(c) // block_size) + int(rng.integers(0, 2)) for c in ctx]
    width = 1 << max(0, (max(blocks) - 1).bit_length())
    num_blocks = 1 + sum(blocks) + 2
    ids = rng.permutation(np.arange(1, num_blocks))
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    k[0], v[0] = rng.standard_normal(shape[1:]), rng.standard_normal(shape[1:])
    tables = np.zeros((num_seqs + 1, width), np.int32)
    start = 0
    for s, (c, n) in enumerate(zip(ctx, blocks)):
        tables[s, :n] = ids[start:start + n]
        start += n
        for pos in range(int(c)):
            k[1, tables[s, pos // block_size], pos % block_size] = rng.standard_normal((num_kv_heads, head_dim))
            v[1, tables[s, pos // block_size], pos % block_size] = rng.standard_normal((num_kv_heads, head_dim))
    num_tokens = int(q_lens.sum())
    t_pad = num_seqs if decode_only else num_tokens + 3
    s_pad = num_seqs if decode_only else num_seqs + 1
    qsl = np.zeros(s_pad + 1, np.int32)
    qsl[1:num_seqs + 1] = np.cumsum(q_lens)
    qsl[num_seqs + 1:] = num_tokens
    ctx_lens = np.zeros(s_pad, np.int32)
    ctx_lens[:num_seqs] = ctx
    q = rng.standard_normal((t_pad, num_kv_heads * group, head_dim)).astype(np.float32)
    md = AttentionMetadata(slot_mapping=jnp.zeros((t_pad,), jnp.int32), block_tables=jnp.asarray(tables[:s_pad]),
                           context_lens=jnp.asarray(ctx_lens), query_start_loc=jnp.asarray(qsl),
                           logits_indices=jnp.zeros((s_pad,), jnp.int32))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return dict(q=cast(q), k=cast(k), v=cast(v), md=md, num_tokens=num_tokens)


def rel_error(out: jax.Array, ref: jax.Array, n: int) -> tuple[float, bool]:
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    ok = bool(np.all(np.isfinite(o[:n])) and np.all(o[n:] == 0))
    return float(np.max(np.abs(o[:n] - r[:n])) / np.max(np.abs(r[:n]))), ok


def part_a(smoke: bool, interpret: bool) -> None:
    rng = np.random.default_rng(int(time.time()))
    d = 32 if smoke else 128
    cases = [  # (label, dtype, block, kv heads, group, head_dim, window, cap, alibi)
        ("ragged f32 gqa4 b16", jnp.float32, 16, 2, 4, d, None, None, False),
        ("ragged bf16 gqa8 b32", jnp.bfloat16, 32, 2, 8, d, None, None, False),
        ("ragged bf16 gqa1 b8 d64", jnp.bfloat16, 8, 4, 1, 64, None, None, False),
        ("ragged f16 gqa2 d256", jnp.float16, 16, 2, 2, 32 if smoke else 256, None, None, False),
        ("ragged bf16 window+softcap", jnp.bfloat16, 16, 2, 4, d, 37, 20.0, False),
        # Falcon-RW's ALiBi (per-head slopes) and a traced window, as the one-scan decoder passes it.
        ("ragged bf16 alibi mha b16", jnp.bfloat16, 16, 4, 1, d, None, None, True),
        ("ragged f32 traced window+alibi", jnp.float32, 16, 2, 4, d, jnp.int32(53), None, True),
    ]
    max_ctx = 40 if smoke else 700
    num_seqs = 4 if smoke else 24
    if smoke:  # the script's every path, not every variant: tests/pallas_kernels checks those on CPU
        cases = [cases[-1]]
    for label, dtype, bs, kvh, group, hd, window, cap, alibi in cases:
        p = ragged_problem(rng, num_seqs=num_seqs, block_size=bs, num_kv_heads=kvh, group=group, head_dim=hd,
                           dtype=dtype, max_ctx=max_ctx)
        kw = dict(sm_scale=hd**-0.5, sliding_window=window, soft_cap=cap,
                  alibi_slopes=jnp.asarray(alibi_slopes(kvh * group)) if alibi else None)
        out = ragged_paged_attention(p["q"], p["k"], p["v"], 1, p["md"], interpret=interpret, **kw)
        with jax.default_matmul_precision("highest"):
            ref = ragged_paged_attention_reference(p["q"], p["k"], p["v"], 1, p["md"], **kw)
        check(label, out, ref, p["num_tokens"], dtype)
        if not smoke:
            mosaic_check(f"{label} [mosaic]", lambda p=p, kw=kw: mosaic_ragged_paged_attention(
                p["q"], p["k"], p["v"], 1, p["md"], interpret=interpret, **kw), ref, p, kvh * group, kvh, hd, bs, dtype)
    # Mosaic GPU (16-bit only, head_dim a multiple of 64): the ragged step and split-K decode.
    for label, dtype, group, bs, splits in (("mosaic ragged bf16 gqa4 b16", jnp.bfloat16, 4, 16, None),
                                            ("mosaic decode f16 gqa8 b32 3 splits", jnp.float16, 8, 32, 3)):
        hd = 64
        p = ragged_problem(rng, num_seqs=num_seqs, block_size=bs, num_kv_heads=2, group=group, head_dim=hd,
                           dtype=dtype, max_ctx=max_ctx, decode_only=splits is not None)
        md = p["md"]
        if splits is None:
            with jax.default_matmul_precision("highest"):
                ref = ragged_paged_attention_reference(p["q"], p["k"], p["v"], 1, md, sm_scale=hd**-0.5)
            run = lambda p=p, md=md: mosaic_ragged_paged_attention(p["q"], p["k"], p["v"], 1, md, sm_scale=hd**-0.5,  # noqa: E731
                                                                   interpret=interpret)
        else:
            with jax.default_matmul_precision("highest"):
                ref = paged_decode_attention_reference(p["q"], p["k"], p["v"], 1, md.block_tables, md.context_lens,
                                                       sm_scale=hd**-0.5)
            run = lambda p=p, md=md, splits=splits: mosaic_paged_decode_attention(  # noqa: E731
                p["q"], p["k"], p["v"], 1, md.block_tables, md.context_lens, sm_scale=hd**-0.5,
                config=MosaicAttentionConfig(num_splits=splits), interpret=interpret)
        mosaic_check(label, run, ref, p, 2 * group, 2, hd, bs, dtype)
    decode_cases = (("decode f32 auto splits", jnp.float32, None), ("decode bf16 4 splits", jnp.bfloat16, 4))
    for label, dtype, splits in decode_cases[1:] if smoke else decode_cases:
        from pallas_kernels.paged_attention import PagedDecodeAttentionConfig

        p = ragged_problem(rng, num_seqs=num_seqs, block_size=16, num_kv_heads=2, group=4, head_dim=d, dtype=dtype,
                           max_ctx=max_ctx, decode_only=True)
        md = p["md"]
        out = paged_decode_attention(p["q"], p["k"], p["v"], 1, md.block_tables, md.context_lens, sm_scale=d**-0.5,
                                     config=PagedDecodeAttentionConfig(num_splits=splits), interpret=interpret)
        with jax.default_matmul_precision("highest"):
            ref = paged_decode_attention_reference(p["q"], p["k"], p["v"], 1, md.block_tables, md.context_lens,
                                                   sm_scale=d**-0.5)
        check(label, out, ref, p["num_tokens"], dtype)


def mosaic_runs_here() -> str | None:
    """None if the Mosaic GPU kernel can run here, else why not (on a CPU it needs JAX 0.11.2's
    GPU interpret mode)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if jax.devices()[0].platform != "cpu" or hasattr(plgpu, "InterpretGPUParams"):
        return None
    return f"Mosaic GPU interpret mode needs JAX >= 0.11.2 (this is {jax.__version__}): tests/mosaic_gpu/lane.sh"


def mosaic_check(label: str, run: Callable[[], jax.Array], ref: jax.Array, p: dict, heads: int, kv_heads: int,
                 hd: int, bs: int, dtype: Any) -> None:
    reason = mosaic_runs_here() or supports_mosaic_attention(heads, kv_heads, hd, bs, dtype)
    if reason:
        row("a", f"{label} vs reference", "n/a", reason)
        return
    check(label, run(), ref, p["num_tokens"], dtype)


def check(label: str, out: jax.Array, ref: jax.Array, n: int, dtype: Any) -> None:
    err, ok = rel_error(out, ref, n)
    tol = 1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-2
    verdict = "PASS" if ok and err < tol else "FAIL"
    row("a", f"{label} vs reference", f"{verdict} rel err {err:.2e}", f"tol {tol:g}" + ("" if ok else "; NaN or non-zero padding"))


# ---- (b) decode bandwidth --------------------------------------------------------------------------


def copy_bandwidth(smoke: bool) -> float:
    n = (1 << 20) if smoke else (1 << 30)  # elements of bfloat16: 2 GiB on the GPU
    x = jnp.ones((n,), jnp.bfloat16)
    add = jax.jit(lambda a: a + jnp.asarray(1, a.dtype))  # reads and writes every byte once
    seconds = timed(lambda: add(x), min_time=0.05 if smoke else 0.5, reps=3)
    bw = 2 * x.nbytes / seconds
    row("b", "device copy bandwidth (read+write)", f"{bw / 1e9:.0f} GB/s",
        "" if smoke else f"H200 spec {H200_SPEC_BANDWIDTH / 1e12:.1f} TB/s")
    return bw


def part_b(smoke: bool, interpret: bool, deadline: float) -> None:
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_paged_attention

    bw = copy_bandwidth(smoke)
    heads, kv_heads, hd, bs = (8, 2, 64, 16) if smoke else (32, 8, 128, 16)
    shapes = [(2, 64)] if smoke else [(64, 1024), (64, 4096), (256, 1024)]
    min_time, reps = (0.0, 1) if smoke else (0.3, 3)
    for batch, ctx in shapes:
        if time.monotonic() > deadline:
            row("b", f"decode {batch}x{ctx}", "skipped", "time budget spent")
            continue
        key = jax.random.key(batch * 7919 + ctx)
        pages = ctx // bs
        num_blocks = batch * pages + 1
        kq, kk, kv = jax.random.split(key, 3)
        shape = (1, num_blocks, bs, kv_heads, hd)
        k = jax.random.normal(kk, shape, jnp.bfloat16).at[:, 0].set(jnp.nan)  # the null block is never read
        v = jax.random.normal(kv, shape, jnp.bfloat16).at[:, 0].set(jnp.nan)
        q = jax.random.normal(kq, (batch, heads, hd), jnp.bfloat16)
        tables = jnp.asarray(np.random.default_rng(ctx).permutation(np.arange(1, num_blocks)).reshape(batch, pages),
                             jnp.int32)
        lens = jnp.full((batch,), ctx, jnp.int32)
        kv_bytes = 2 * batch * ctx * kv_heads * hd * 2
        scale = hd**-0.5
        ours = jax.jit(lambda q, k, v: paged_decode_attention(q, k, v, 0, tables, lens, sm_scale=scale,
                                                              interpret=interpret))
        md = decode_metadata(tables, lens)
        ragged = jax.jit(lambda q, k, v: ragged_paged_attention(q, k, v, 0, md, sm_scale=scale, interpret=interpret))
        reference = jax.jit(lambda q, k, v: paged_decode_attention_reference(q, k, v, 0, tables, lens, sm_scale=scale))
        k_pages, v_pages = k[0].transpose(2, 0, 1, 3), v[0].transpose(2, 0, 1, 3)  # [kv heads, pages, page, dim]
        splits = min(16, pages)
        theirs = jax.jit(lambda q, kp, vp: jax_paged_attention(q * scale, kp, vp, tables, lens, k_splits=splits,
                                                               pages_per_compute_block=min(8, pages // splits),
                                                               interpret=interpret))
        mosaic = jax.jit(lambda q, k, v: mosaic_paged_decode_attention(q, k, v, 0, tables, lens, sm_scale=scale,
                                                                       interpret=interpret))
        mosaic_ragged = jax.jit(lambda q, k, v: mosaic_ragged_paged_attention(q, k, v, 0, md, sm_scale=scale,
                                                                              interpret=interpret))
        ref_out = reference(q, k, v)
        times: dict[str, float] = {}
        kernels = [("mosaic decode kernel", mosaic, (q, k, v)), ("mosaic ragged kernel", mosaic_ragged, (q, k, v)),
                   ("triton decode kernel", ours, (q, k, v)), ("triton ragged kernel", ragged, (q, k, v)),
                   ("jax pallas paged_attention", theirs, (q, k_pages, v_pages)),
                   ("XLA reference", reference, (q, k, v))]
        for name, fn, args in kernels:
            what = f"decode {batch}x{ctx} {name}"
            if name.startswith("mosaic") and mosaic_runs_here():
                row("b", what, "n/a", mosaic_runs_here())
                continue
            try:
                err, ok = rel_error(fn(*args), ref_out, batch)
                seconds = timed(lambda: fn(*args), min_time=min_time, reps=reps)
                times[name] = seconds
                achieved = kv_bytes / seconds
                row("b", what, f"{seconds * 1e6:.0f} us, {achieved / 1e9:.0f} GB/s",
                    f"{100 * achieved / bw:.0f}% of copy BW; rel err {err:.1e}{'' if ok else ' NaN!'}")
            except Exception as e:  # noqa: BLE001 - one failing kernel must not hide the others
                row("b", what, "ERROR", f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
        if not smoke and "mosaic decode kernel" in times:
            share = kv_bytes / times["mosaic decode kernel"] / bw
            vs_jax = times.get("jax pallas paged_attention", math.nan) / times["mosaic decode kernel"]
            met = share >= 0.7 and vs_jax >= 1.0
            row("b", f"decode {batch}x{ctx} targets (>= 70% copy BW, >= 1.0x JAX)", "met" if met else "not met",
                f"mosaic decode at {100 * share:.0f}% of copy BW, {vs_jax:.2f}x JAX's kernel")
        del k, v, k_pages, v_pages
        gc.collect()
    if time.monotonic() < deadline:
        mixed_step(smoke, interpret, bw, heads, kv_heads, hd, bs, min_time, reps)


def mixed_step(smoke: bool, interpret: bool, bw: float, heads: int, kv_heads: int, hd: int, bs: int,
               min_time: float, reps: int) -> None:
    """The engine's ragged step on a mixed batch: decode tokens on 1k-4k contexts beside prompt
    chunks of 256 tokens (Llama-3-8B shapes, one layer), every ragged kernel and the reference."""
    rng = np.random.default_rng(5)
    num_decode, num_prefill, chunk = (3, 1, 16) if smoke else (48, 16, 256)
    ctx = np.concatenate([rng.integers(16 if smoke else 1024, (64 if smoke else 4096) + 1, num_decode),
                          rng.integers(chunk, (64 if smoke else 2048) + 1, num_prefill)]).astype(np.int32)
    q_lens = np.concatenate([np.ones(num_decode, np.int32), np.full(num_prefill, chunk, np.int32)])
    pages = -(-ctx // bs)
    width = int(pages.max())
    num_blocks = int(pages.sum()) + 1
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables = np.zeros((len(ctx), width), np.int32)
    start = 0
    for s, n in enumerate(pages):
        tables[s, :n] = ids[start:start + n]
        start += n
    num_tokens = int(q_lens.sum())
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    md = AttentionMetadata(slot_mapping=jnp.zeros((num_tokens,), jnp.int32), block_tables=jnp.asarray(tables),
                           context_lens=jnp.asarray(ctx), query_start_loc=jnp.asarray(qsl),
                           logits_indices=jnp.asarray(qsl[1:] - 1))
    kk, kv, kq = jax.random.split(jax.random.key(11), 3)
    shape = (1, num_blocks, bs, kv_heads, hd)
    k = jax.random.normal(kk, shape, jnp.bfloat16)
    v = jax.random.normal(kv, shape, jnp.bfloat16)
    q = jax.random.normal(kq, (num_tokens, heads, hd), jnp.bfloat16)
    scale = hd**-0.5
    kv_bytes = 2 * int(ctx.sum()) * kv_heads * hd * 2
    label = f"mixed step {num_decode} decode + {num_prefill} x {chunk} prefill"
    reference = jax.jit(lambda q, k, v: ragged_paged_attention_reference(q, k, v, 0, md, sm_scale=scale))
    kernels = [("mosaic ragged kernel", jax.jit(lambda q, k, v: mosaic_ragged_paged_attention(
                    q, k, v, 0, md, sm_scale=scale, interpret=interpret))),
               ("triton ragged kernel", jax.jit(lambda q, k, v: ragged_paged_attention(
                    q, k, v, 0, md, sm_scale=scale, interpret=interpret))),
               ("XLA reference", reference)]
    ref_out = reference(q, k, v)
    for name, fn in kernels:
        what = f"{label} {name}"
        if name.startswith("mosaic") and mosaic_runs_here():
            row("b", what, "n/a", mosaic_runs_here())
            continue
        try:
            err, ok = rel_error(fn(q, k, v), ref_out, num_tokens)
            seconds = timed(lambda fn=fn: fn(q, k, v), min_time=min_time, reps=reps)
            row("b", what, f"{seconds * 1e6:.0f} us", f"KV read once = {100 * kv_bytes / seconds / bw:.0f}% of copy "
                f"BW; rel err {err:.1e}{'' if ok else ' NaN!'}")
        except Exception as e:  # noqa: BLE001 - one failing kernel must not hide the others
            row("b", what, "ERROR", f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")


# ---- (c) end-to-end --------------------------------------------------------------------------------

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    bos_token_id=128000, eos_token_id=128001,
)
TINY = dict(LLAMA3_8B, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def random_model_loader(directory: Path):  # noqa: ANN201
    """A stand-in for `load_model`: the config from `directory`, random weights made on the device."""
    from models.loader import LoadedModel, _model_spec, _read_hf_config

    def load(model: Any, dtype: str = "auto", **_: Any) -> LoadedModel:
        cfg, arch, np_dtype = _model_spec(_read_hf_config(directory), dtype, "hf")
        abstract = arch.abstract_params(cfg, np_dtype)
        leaves, treedef = jax.tree_util.tree_flatten(abstract)
        keys = jax.random.split(jax.random.key(0), len(leaves))
        make = jax.jit(lambda key, shape, dt: 0.02 * jax.random.normal(key, shape, dt), static_argnums=(1, 2))
        params = jax.tree_util.tree_unflatten(treedef, [make(key, x.shape, x.dtype) for key, x in zip(keys, leaves)])
        return LoadedModel(config=cfg, params=jax.block_until_ready(params), architecture=arch, tokenizer=None,
                           dtype=np_dtype, source=f"random:{directory}")

    return load


def part_m() -> None:
    """The allocator pool and the device total the Engine plans from, next to nvidia-smi's total."""
    import subprocess

    from paxserve.gpu_memory import device_memory

    row("m", "allocator", "configured", ALLOCATOR)
    stats = jax.devices()[0].memory_stats()
    memory = device_memory(stats)
    if memory is None:
        row("m", "device memory", "n/a", "no device memory statistics (CPU)")
        return
    row("m", "memory_stats keys", ", ".join(sorted(stats)), "")
    smi = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        smi = int(out.splitlines()[0]) * 2**20 if out else None
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    note = "" if smi is None else f"nvidia-smi says {smi / 2**30:.1f} GiB ({100 * memory.total_bytes / smi:.1f}%)"
    row("m", "device total (pool / fraction)", f"{memory.total_bytes / 2**30:.1f} GiB", note)
    row("m", "JAX pool (bytes_limit)", f"{memory.pool_bytes / 2**30:.1f} GiB",
        f"usable at 0.9: {memory.usable(0.9) / 2**30:.1f} GiB")


def part_c(smoke: bool, deadline: float, bw: float | None) -> None:
    import paxserve.engine as engine_module
    from paxserve import Engine, SamplingParams

    num_prompts, prompt_len, output_len = (4, 16, 4) if smoke else (256, 512, 128)
    config = TINY if smoke else LLAMA3_8B
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        original = engine_module.load_model
        engine_module.load_model = random_model_loader(Path(tmp))
        try:
            engine = Engine(tmp, dtype="bfloat16", max_model_len=1024 if not smoke else 64, max_num_seqs=num_prompts,
                            max_num_batched_tokens=64 if smoke else 8192,
                            # On the GPU the cache is planned (0.9 of the device, minus weights and the
                            # measured activation peak): part of what this check shows.
                            kv_cache_memory_bytes=None if not smoke else 8 * 2**20, warmup=False,
                            log_stats_interval=0, compilation_cache_dir="",
                            attention_backend="auto" if not smoke else "triton")
        finally:
            engine_module.load_model = original
    row("c", "engine attention backend", engine.attention_backend.name
        + (" (interpret)" if engine.attention_backend.interpret else ""))
    plan = engine.plan
    row("c", "KV cache plan", f"{plan.num_blocks} blocks = {plan.num_blocks * plan.bytes_per_block / 2**30:.1f} GiB",
        f"activation peak reserved {engine.activation_bytes / 2**30:.2f} GiB (heavier of plain / prompt-logprob "
        f"steps); max_model_len {plan.max_model_len}")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config["vocab_size"], prompt_len).tolist() for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    def run(tag: str, stop_at: float) -> tuple[float, int]:
        """All prompts through the engine, stepping until done or `stop_at`; (seconds, output tokens)."""
        engine.reset_prefix_cache()
        ids = [f"{tag}{i}" for i in range(num_prompts)]
        for request_id, p in zip(ids, prompts):
            engine.add_request(request_id, p, params)
        done: dict[str, int] = {}
        start = time.perf_counter()
        while engine.has_unfinished_requests() and time.monotonic() < stop_at:
            for out in engine.step():
                done[out.request_id] = len(out.outputs[0].token_ids)
        seconds = time.perf_counter() - start
        for request_id in ids:  # out of time: drop what is left
            engine.abort(request_id)
        return seconds, sum(done.values())

    first, first_tokens = run("warm", deadline)  # compiles every bucket this workload uses
    complete = first_tokens == num_prompts * output_len
    row("c", "first pass (with compilation)", f"{first:.1f} s" + ("" if complete else " INCOMPLETE"),
        f"{len(engine.runner.compiled)} buckets compiled; {first_tokens} output tokens")
    if not complete or (time.monotonic() + 1.2 * first > deadline and not smoke):
        row("c", "timed pass", "skipped", "time budget spent; the first pass includes compilation")
        return
    seconds, tokens = run("timed", deadline)
    if tokens != num_prompts * output_len:
        row("c", "timed pass", "INCOMPLETE", f"{tokens} output tokens in {seconds:.1f} s before the budget ran out")
        return
    out_tokens = num_prompts * output_len
    row("c", f"offline {num_prompts} x {prompt_len} -> {output_len}", f"{out_tokens / seconds:.0f} output tok/s",
        f"{num_prompts * (prompt_len + output_len) / seconds:.0f} total tok/s; {seconds:.1f} s")
    if bw:
        cfg = engine.model_config
        weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(engine.model.params))
        kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
        decode_bytes = sum(weight_bytes + num_prompts * (prompt_len + i) * kv_per_token for i in range(output_len))
        bound = out_tokens / (decode_bytes / bw)
        row("c", "memory-bandwidth bound (decode only)", f"{bound:.0f} output tok/s",
            f"measured = {100 * out_tokens / seconds / bound:.0f}% of it; bound: weights + KV read once per decode "
            "step at the copy BW, prefill not counted")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; on CPU the kernels run interpreted")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check")
    args = parser.parse_args()
    start = time.monotonic()
    deadline = start + args.budget
    platform = jax.devices()[0].platform
    interpret = platform == "cpu"
    row("-", "device", f"{jax.devices()[0].device_kind} ({platform})", f"jax {jax.__version__}")
    if not args.smoke and platform == "cpu":
        print("no GPU: run with --smoke on CPU", file=sys.stderr)
    bw = None
    parts = (("m", part_m), ("a", lambda: part_a(args.smoke, interpret)),
             ("b", lambda: part_b(args.smoke, interpret, deadline - (0 if args.smoke else 150))),
             ("c", lambda: part_c(args.smoke, deadline - (0 if args.smoke else 30), bw)),
             ("d", lambda: part_d(args.smoke, row, timed, bw)))
    try:
        for name, part in parts:
            if time.monotonic() > deadline:
                row(name, "part", "skipped", "time budget spent")
                continue
            try:
                part()
            except Exception as e:  # noqa: BLE001 - report and go on to the next part
                traceback.print_exc()
                row(name, "part", "ERROR", f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
            if name == "b":
                bw = next((parse_bw(r[2]) for r in ROWS if r[1].startswith("device copy bandwidth")), None)
            gc.collect()
    except KeyboardInterrupt:  # the shell script's hard time limit: still print what was measured
        row("-", "interrupted", "ERROR", "hard time limit reached")
    row("-", "wall time", f"{time.monotonic() - start:.0f} s", f"budget {args.budget:.0f} s")
    print_table()
    if any("FAIL" in r[2] or "ERROR" in r[2] for r in ROWS):
        sys.exit(1)


def parse_bw(text: str) -> float:
    return float(text.split()[0]) * 1e9


if __name__ == "__main__":
    main()
