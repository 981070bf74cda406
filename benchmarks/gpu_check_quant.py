"""Part (q) of gpu_check: quantization on the GPU.

- The linear layers of one decode step at Llama-3-8B shapes (32 layers of q/k/v, o, gate/up and down
  projections, random weights made on the device), for a batch of 1, 16 and 64 tokens: bfloat16,
  int8 weight-only, fp8 weight-only, fp8 x fp8 with per-token activation scales (the path
  `--quantization fp8` takes on Hopper) and 4-bit groups (a GGUF Q4_K file kept quantized), int8
  and 4-bit each twice: XLA dequantizing inside the step, and the Mosaic GPU weight-only kernel
  (pallas_kernels/mosaic_matmul.py, codes widened in registers) after its start-up self-check; each
  next to the time its weight bytes take at the measured copy bandwidth; the difference of each from
  the bfloat16 product, and of each kernel row from the XLA row of the same weights.
- The Triton and the Mosaic GPU decode-only kernels on an fp8 KV cache (uint8 bits, 64 sequences x
  4k context, 32 query and 8 KV heads of 128) against the same kernel on a bfloat16 cache, and
  against the XLA reference on the same fp8 pages.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

# Last, for `benchmarks.*`: paxserve comes from gpu_check.sh's PYTHONPATH (benchmarks/checkout.py).
sys.path.append(str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np

from paxserve.kernels.decode_attention import paged_decode_attention, paged_decode_attention_reference
from paxserve.kernels.kv_cache import fp8_bits
from paxserve.kernels.mosaic_attention import mosaic_paged_decode_attention
from paxserve.kernels.matmul_dispatch import MatmulKernel, self_check_matmul
from paxserve.models.layers import dense
from paxserve.models.quant_weights import GroupQuantizedWeight, WeightQuantization, with_matmul_kernel

Row = Callable[..., None]
FP8 = "float8_e4m3fn"


@jax.jit
def four_bit(w: jax.Array) -> GroupQuantizedWeight:
    """[L, in, out] as a GGUF Q4_K weight is kept: unsigned 4-bit codes two to a byte, a float32
    scale and offset per 32 inputs (min/max per group, as llama.cpp's Q4_1 rounds)."""
    layers, n_in, n_out = w.shape
    g = w.astype(jnp.float32).reshape(layers, n_in // 32, 32, n_out)
    low, high = g.min(axis=2), g.max(axis=2)
    scale = jnp.maximum((high - low) / 15, 1e-12)
    c = jnp.clip(jnp.round((g - low[:, :, None]) / scale[:, :, None]), 0, 15).astype(jnp.uint8)
    c = c.reshape(layers, n_in, n_out)
    return GroupQuantizedWeight(codes=c[:, 0::2] | (c[:, 1::2] << 4), scale=scale, offset=low, bits=4)


def linear_step(smoke: bool, row: Row, timed: Callable[..., float], bw: float | None) -> None:
    # Smoke: the smallest widths the Mosaic GPU kernel serves (inputs a multiple of 128).
    hidden, inter, layers = (128, 128, 1) if smoke else (4096, 14336, 32)
    q_out = hidden + 2 * (hidden // 4)  # 32 query heads, 8 KV heads
    shapes = {"qkv": (hidden, q_out), "o": (hidden, hidden), "up": (hidden, 2 * inter), "down": (inter, hidden)}
    key = jax.random.key(1)
    weights = {name: (jax.random.normal(jax.random.fold_in(key, i), (layers, *s), jnp.float32) / np.sqrt(s[0])
                      ).astype(jnp.bfloat16) for i, (name, s) in enumerate(shapes.items())}

    def step(ws: dict[str, Any], x: jax.Array) -> jax.Array:
        def layer(h: jax.Array, w: dict[str, Any]) -> tuple[jax.Array, None]:
            # The four products of a layer in sequence (the attention and the activation left out).
            a = dense(h, w["qkv"])[:, :hidden]
            h = h + dense(a, w["o"])
            u = dense(h, w["up"])[:, :inter]
            return h + dense(u, w["down"]) * 0.1, None

        return jax.lax.scan(layer, x, ws)[0]

    run = jax.jit(step)
    settings = {"bfloat16": weights}
    for label, method, act in (("int8 weight-only", "int8", False), ("fp8 weight-only", "fp8", False),
                               ("fp8 x fp8", "fp8", True)):
        quantize = jax.jit(functools.partial(WeightQuantization(method, act).quantize, xp=jnp))
        settings[label] = {n: quantize(w) for n, w in weights.items()}
    four = "4-bit groups of 32 (GGUF Q4_K's storage)"
    settings[four] = {n: four_bit(w) for n, w in weights.items()}
    kernel = MatmulKernel(interpret=smoke)
    failure = self_check_matmul(kernel, jnp.bfloat16)
    row("q", "Mosaic GPU weight-only matmul: start-up self-check (5 kinds of weight vs XLA's)",
        "PASS" if failure is None else "FAIL", failure or "")
    same_weights = {}
    if failure is None:
        for label in ("int8 weight-only", four):
            same_weights[f"{label}, Mosaic GPU kernel"] = label
            settings[f"{label}, Mosaic GPU kernel"] = with_matmul_kernel(settings[label], kernel)
        # Split-K (the default fills the GPU with a decode batch's few output tiles) against none.
        whole = "int8 weight-only, Mosaic GPU kernel without split-K"
        same_weights[whole] = "int8 weight-only"
        settings[whole] = with_matmul_kernel(settings["int8 weight-only"], replace(kernel, num_splits=1))
    nbytes = {label: sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(ws)) for label, ws in settings.items()}
    for tokens in (4,) if smoke else (1, 16, 64):
        x = (jax.random.normal(jax.random.fold_in(key, 100 + tokens), (tokens, hidden)) * 0.5).astype(jnp.bfloat16)
        base = np.asarray(run(settings["bfloat16"], x), np.float32)
        for label, ws in settings.items():
            quick = smoke and label in same_weights  # an interpreted kernel: one timed call
            t = timed(lambda ws=ws: run(ws, x), min_time=0.0 if quick else 0.05 if smoke else 0.2,
                      reps=1 if quick else 2 if smoke else 5)
            note = f"{nbytes[label] / 2**30:.2f} GiB of weights"
            if bw:
                note += f", bound {1e3 * nbytes[label] / bw:.3f} ms ({100 * nbytes[label] / t / bw:.0f}% of copy BW)"
            if label != "bfloat16":
                out = np.asarray(run(ws, x), np.float32)
                note += f"; vs bfloat16 max rel diff {float(np.max(np.abs(out - base)) / np.max(np.abs(base))):.1e}"
                if label in same_weights:
                    xla = np.asarray(run(settings[same_weights[label]], x), np.float32)
                    note += f", vs XLA on the same weights {float(np.max(np.abs(out - xla)) / np.max(np.abs(xla))):.1e}"
            row("q", f"decode-step linears x{layers} layers, {tokens} tokens, {label}", f"{1e3 * t:.3f} ms", note)


def fp8_kv_kernel(smoke: bool, row: Row, timed: Callable[..., float], bw: float | None) -> None:
    # Smoke: head_dim 64, the smallest the Mosaic GPU kernel takes.
    seqs, context, heads, kv_heads, head_dim, bs = (4, 64, 8, 2, 64, 16) if smoke else (64, 4096, 32, 8, 128, 16)
    blocks = seqs * context // bs + 1
    key = jax.random.key(2)
    shape = (1, blocks, bs, kv_heads, head_dim)
    k = jax.random.normal(jax.random.fold_in(key, 1), shape).astype(jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 2), shape).astype(jnp.bfloat16)
    q = jax.random.normal(jax.random.fold_in(key, 3), (seqs, heads, head_dim)).astype(jnp.bfloat16)
    tables = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1, blocks)).reshape(seqs, -1), jnp.int32)
    lens = jnp.full((seqs,), context, jnp.int32)
    layer, scale = jnp.int32(0), head_dim ** -0.5
    k8, v8 = fp8_bits(k, FP8), fp8_bits(v, FP8)
    ref = np.asarray(paged_decode_attention_reference(q, k8, v8, layer, tables, lens, sm_scale=scale, fp8=FP8),
                     np.float64)
    families = {"Triton": paged_decode_attention, "Mosaic GPU": mosaic_paged_decode_attention}
    for family, attend in families.items():
        kernel = jax.jit(lambda q, k, v, fp8=None, attend=attend: attend(
            q, k, v, layer, tables, lens, sm_scale=scale, interpret=smoke, fp8=fp8), static_argnames=("fp8",))
        try:
            got = np.asarray(kernel(q, k8, v8, fp8=FP8), np.float64)
        except Exception as error:  # noqa: BLE001 - one family failing must not hide the other's rows
            row("q", f"{family} decode kernel on an fp8 KV cache", "FAIL", f"{type(error).__name__}: {error}"[:300])
            continue
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        row("q", f"{family} decode kernel on an fp8 KV cache vs the XLA reference (same pages)",
            "PASS" if err < 2e-2 else "FAIL", f"max rel err {err:.1e} (tol 2e-2)")
        times = {}
        for label, (kc, vc, fp8) in {"bfloat16": (k, v, None), "fp8": (k8, v8, FP8)}.items():
            # Interpreted (smoke), the Mosaic GPU kernel takes seconds a call: one timed call.
            quick = smoke and family == "Mosaic GPU"
            times[label] = timed(lambda kc=kc, vc=vc, fp8=fp8: kernel(q, kc, vc, fp8=fp8),
                                 min_time=0.0 if quick else 0.05 if smoke else 0.2, reps=1 if quick else 2 if smoke else 5)
            kv_bytes = 2 * seqs * context * kv_heads * head_dim * (1 if fp8 else 2)
            note = f"{kv_bytes / 2**20:.0f} MiB of K/V read"
            if bw:
                note += f" = {100 * kv_bytes / times[label] / bw:.0f}% of copy BW"
            row("q", f"{family} decode kernel, {seqs} seqs x {context} tokens, {label} cache",
                f"{1e6 * times[label]:.0f} us", note)
        row("q", f"{family}: fp8 cache / bfloat16 cache decode kernel time", f"{times['fp8'] / times['bfloat16']:.2f}x")


def main() -> None:
    """One gpu_check process: part (q) with its rows in the run's rows file."""
    from benchmarks.gpu_check_common import run_part

    run_part("q", __doc__, [linear_step, fp8_kv_kernel])


if __name__ == "__main__":
    main()
