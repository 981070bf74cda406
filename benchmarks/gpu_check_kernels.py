"""gpu_check's device parts that need no engine, one per process (`gpu_check.py` runs them):

    toolchain   (t) versions, device, compute capability, ptxas and the CUDA root Mosaic GPU will
                use, a first computation, GPU memory (pool and planned total next to nvidia-smi's)
    ceilings    (p) measured copy bandwidth (read + write) and bf16 matmul rate: what (b) and (c)
                are judged against
    case NAME   (a) one kernel case of gpu_check_cases against the XLA reference (float64 compare,
                reference at "highest" precision; tolerance `self_check.tolerance_for`, as at start)
    timing FAM  (b) one kernel family at Llama-3-8B attention shapes (32 query heads, 8 KV heads,
                head_dim 128, block 16, bf16, one layer): decode batches 64x1k, 64x4k, 256x1k and a
                mixed step, time and achieved bandwidth next to the copy bandwidth

    python benchmarks/gpu_check_kernels.py PART [ARG] [--smoke] [--rows FILE]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

# Last, for `benchmarks.*`: paxserve comes from gpu_check.sh's PYTHONPATH (benchmarks/checkout.py).
sys.path.append(str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_check_cases import KERNEL_CASES, SMOKE_KERNEL_CASES, KernelCase  # noqa: E402
from benchmarks.gpu_check_common import Rows, one_line, ragged_problem, rel_error, timed  # noqa: E402

# Llama-3-8B attention: 32 query heads, 8 KV heads, head_dim 128, block 16.
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


# ---- (t) toolchain and memory ----------------------------------------------------------------------


def _ptxas_version(root: str) -> str | None:
    path = Path(root) / "bin" / "ptxas"
    if not path.is_file():
        return None
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"found, but `ptxas --version` failed: {e}"
    return (out.strip().splitlines() or ["?"])[-1]


def cuda_roots() -> list[tuple[str, str]]:
    """Candidate CUDA roots, in the order JAX and Mosaic GPU look (then the usual places)."""
    roots: list[tuple[str, str]] = []
    if os.environ.get("CUDA_ROOT"):
        roots.append(("CUDA_ROOT", os.environ["CUDA_ROOT"]))
    try:
        from jax._src import lib as jax_lib

        if jax_lib.cuda_path:
            roots.append(("jax's cuda_path", jax_lib.cuda_path))
    except ImportError:
        pass
    roots.append(("/usr/local/cuda", "/usr/local/cuda"))
    which = shutil.which("ptxas")
    if which:
        roots.append(("ptxas on PATH", str(Path(which).resolve().parent.parent)))
    return roots


def part_toolchain(rows: Rows, smoke: bool) -> int:
    # As the Engine does before JAX's backend starts: the pool is --gpu-memory-utilization (0.9) of
    # the device, so the planned total can be checked against nvidia-smi's.
    from paxserve.worker.memory_plan import configure_allocator

    allocator = configure_allocator(0.9, backend_started=False)
    start = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import jaxlib

    versions = [f"jax {jax.__version__}", f"jaxlib {jaxlib.__version__}"]
    for dist in ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt", "triton", "flax"):
        try:
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    rows("versions", ", ".join(versions), f"python {sys.version.split()[0]}")
    try:
        devices = jax.devices()
    except RuntimeError as e:
        rows("JAX backend", "ERROR", one_line(e), status="error")
        return 3
    device = devices[0]
    capability = getattr(device, "compute_capability", None)
    rows("device", f"{device.device_kind} ({device.platform})",
         f"{len(devices)} device(s); compute capability {capability}; backend up in "
         f"{time.perf_counter() - start:.1f}s; JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}")
    if device.platform != "gpu" and not smoke:
        rows("GPU", "ERROR", "JAX did not start a GPU backend: nothing below would measure a GPU", status="error")
        return 3
    x = jnp.arange(1024, dtype=jnp.int32)
    total = int(jax.block_until_ready((x * x).sum()))
    expected = sum(i * i for i in range(1024))
    rows("first computation", "PASS" if total == expected else "FAIL", f"sum of squares {total} (expected {expected})",
         status="pass" if total == expected else "fail")
    mosaic_root = None
    for label, root in cuda_roots():
        version = _ptxas_version(root)
        rows(f"ptxas under {label}", version or "not found", root)
        if version and mosaic_root is None:
            mosaic_root = root
    try:
        from jax._src import lib as jax_lib

        jax_choice = jax_lib.cuda_path or "/usr/local/cuda"
    except ImportError:
        jax_choice = "/usr/local/cuda"
    if _ptxas_version(jax_choice):
        rows("CUDA root for Mosaic GPU", jax_choice, "JAX's own choice has bin/ptxas: kept", key="cuda_root")
    elif mosaic_root:
        rows("CUDA root for Mosaic GPU", mosaic_root, f"JAX would use {jax_choice}, which has no bin/ptxas: the "
             "later parts get CUDA_ROOT set to this", key="cuda_root")
    else:
        rows("CUDA root for Mosaic GPU", "none", "no bin/ptxas anywhere: Mosaic GPU cannot compile",
             status="error" if device.platform == "gpu" else "n/a")
    part_memory(rows, allocator)
    return 0


def part_memory(rows: Rows, allocator: str) -> None:
    import jax

    from paxserve.worker.memory_plan import device_memory

    rows("allocator", "configured", allocator)
    stats = jax.devices()[0].memory_stats()
    memory = device_memory(stats)
    if memory is None:
        rows("device memory", "n/a", "no device memory statistics (CPU)", status="n/a")
        return
    smi = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        smi = int(out.splitlines()[0]) * 2**20 if out else None
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    note = "" if smi is None else f"nvidia-smi says {smi / 2**30:.1f} GiB ({100 * memory.total_bytes / smi:.1f}%)"
    rows("device total (pool / fraction)", f"{memory.total_bytes / 2**30:.1f} GiB", note)
    rows("JAX pool (bytes_limit)", f"{memory.pool_bytes / 2**30:.1f} GiB",
         f"usable at 0.9: {memory.usable(0.9) / 2**30:.1f} GiB")


# ---- (p) ceilings ----------------------------------------------------------------------------------


def part_ceilings(rows: Rows, smoke: bool) -> int:
    import jax
    import jax.numpy as jnp

    n = (1 << 20) if smoke else (1 << 30)  # bf16 elements: 2 GiB on the GPU, several times the L2
    x = jax.random.normal(jax.random.key(1), (n,), jnp.bfloat16)
    add = jax.jit(lambda a: a + jnp.asarray(1, a.dtype))  # reads and writes every byte once
    seconds = timed(lambda: add(x), min_time=0.05 if smoke else 0.3, reps=5)
    bw = 2 * x.nbytes / seconds
    rows("device copy bandwidth (read + write)", f"{bw / 1e9:.0f} GB/s", "median of 5; H200 datasheet 4.8 TB/s",
         value=bw, key="copy_bw")
    del x
    m = 256 if smoke else 8192
    a, b = (jax.random.normal(k, (m, m), jnp.bfloat16) for k in jax.random.split(jax.random.key(2)))
    matmul = jax.jit(lambda a, b: a @ b)
    seconds = timed(lambda: matmul(a, b), min_time=0.05 if smoke else 0.3, reps=5)
    flops = 2 * m**3 / seconds
    rows(f"bf16 matmul {m}^3 on random data", f"{flops / 1e12:.0f} TFLOP/s", "median of 5; H200 datasheet ~990 dense",
         value=flops, key="matmul_peak")
    return 0


# ---- (a) one kernel case ---------------------------------------------------------------------------


def mosaic_unavailable(platform: str) -> str | None:
    """None if the Mosaic GPU kernel can run here, else why not (on a CPU it needs JAX 0.11.2's
    GPU interpret mode)."""
    import jax
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if platform != "cpu" or hasattr(plgpu, "InterpretGPUParams"):
        return None
    return f"Mosaic GPU interpret mode needs JAX >= 0.11.2 (this is {jax.__version__}): tests/mosaic_gpu/lane.sh"


def part_case(rows: Rows, smoke: bool, name: str) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from paxserve.kernels.alibi import alibi_slopes
    from paxserve.kernels.mosaic_attention import (
        MosaicAttentionConfig,
        mosaic_paged_decode_attention,
        mosaic_ragged_paged_attention,
        supports_mosaic_attention,
    )
    from paxserve.kernels.decode_attention import (
        PagedDecodeAttentionConfig,
        paged_decode_attention,
        paged_decode_attention_reference,
    )
    from paxserve.kernels.reference import ragged_paged_attention_reference
    from paxserve.kernels.ragged_paged_attention import ragged_paged_attention
    from paxserve.kernels.self_check import tolerance_for

    case: KernelCase = {c.name: c for c in (SMOKE_KERNEL_CASES if smoke else KERNEL_CASES)}[name]
    platform = jax.devices()[0].platform
    interpret = platform == "cpu"
    dtype = jnp.dtype(case.dtype)
    heads = case.kv_heads * case.group
    if case.kernel.startswith("mosaic"):
        reason = mosaic_unavailable(platform) or supports_mosaic_attention(heads, case.kv_heads, case.head_dim,
                                                                           case.block_size, dtype)
        if reason:
            rows(f"{name} vs reference", "n/a", reason, status="n/a")
            return 0
    decode = case.kernel.endswith("decode")
    p = ragged_problem(np.random.default_rng(int(time.time())), num_seqs=4 if smoke else 24,
                       block_size=case.block_size, num_kv_heads=case.kv_heads, group=case.group,
                       head_dim=case.head_dim, dtype=dtype, max_ctx=40 if smoke else 700, decode_only=decode)
    q, k, v, md = p["q"], p["k"], p["v"], p["md"]
    scale = case.head_dim**-0.5
    window = None if case.window is None else (jnp.int32(case.window) if case.traced_window else case.window)
    kw: dict[str, Any] = dict(sm_scale=scale, sliding_window=window, soft_cap=case.soft_cap,
                              alibi_slopes=jnp.asarray(alibi_slopes(heads)) if case.alibi else None)
    if decode:
        with jax.default_matmul_precision("highest"):
            ref = paged_decode_attention_reference(q, k, v, 1, md.block_tables, md.context_lens, sm_scale=scale)
        if case.kernel == "mosaic-decode":
            run: Callable[[], Any] = lambda: mosaic_paged_decode_attention(  # noqa: E731
                q, k, v, 1, md.block_tables, md.context_lens, sm_scale=scale,
                config=MosaicAttentionConfig(num_splits=case.num_splits), interpret=interpret)
        else:
            run = lambda: paged_decode_attention(  # noqa: E731
                q, k, v, 1, md.block_tables, md.context_lens, sm_scale=scale,
                config=PagedDecodeAttentionConfig(num_splits=case.num_splits), interpret=interpret)
    else:
        with jax.default_matmul_precision("highest"):
            ref = ragged_paged_attention_reference(q, k, v, 1, md, **kw)
        entry = mosaic_ragged_paged_attention if case.kernel == "mosaic" else ragged_paged_attention
        run = lambda: entry(q, k, v, 1, md, interpret=interpret, **kw)  # noqa: E731
    start = time.perf_counter()
    out = jax.block_until_ready(run())
    seconds = time.perf_counter() - start
    err, ok = rel_error(out, ref, p["num_tokens"])
    tol = tolerance_for(dtype)
    verdict = ok and err < tol
    rows(f"{name} vs reference", f"{'PASS' if verdict else 'FAIL'} rel err {err:.2e}",
         f"tol {tol:g} ({'IEEE float32' if dtype == jnp.float32 else '16-bit'}); compile + run {seconds:.1f}s"
         + ("" if ok else "; NaN or non-zero padding"), status="pass" if verdict else "fail")
    return 0 if verdict else 1


# ---- (b) one kernel family's timings ---------------------------------------------------------------


def part_timing(rows: Rows, smoke: bool, family: str) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from paxserve.kernels.metadata import AttentionMetadata
    from paxserve.kernels.mosaic_attention import mosaic_paged_decode_attention, mosaic_ragged_paged_attention
    from paxserve.kernels.decode_attention import decode_metadata, paged_decode_attention
    from paxserve.kernels.reference import ragged_paged_attention_reference
    from paxserve.kernels.ragged_paged_attention import ragged_paged_attention

    platform = jax.devices()[0].platform
    interpret = platform == "cpu"
    if family == "mosaic" and mosaic_unavailable(platform):
        rows("mosaic timings", "n/a", mosaic_unavailable(platform), status="n/a")
        return 0
    bw = rows.value("copy_bw")
    heads, kv_heads, hd, bs = (8, 2, 64, 16) if smoke else (HEADS, KV_HEADS, HEAD_DIM, BLOCK)
    min_time, reps = (0.01, 1) if smoke else (0.1, 5)
    scale = hd**-0.5
    failures = 0

    def kernels(md: AttentionMetadata, tables: Any, lens: Any) -> list[tuple[str, Callable[..., Any], bool]]:
        """(name, fn(q, k, v), judged: the engine dispatches it) of this family."""
        if family == "mosaic":
            return [("mosaic ragged", jax.jit(lambda q, k, v: mosaic_ragged_paged_attention(
                        q, k, v, 0, md, sm_scale=scale, interpret=interpret)), True),
                    ("mosaic decode-only", jax.jit(lambda q, k, v: mosaic_paged_decode_attention(
                        q, k, v, 0, tables, lens, sm_scale=scale, interpret=interpret)), True)]
        if family == "triton":
            found = [("triton ragged", jax.jit(lambda q, k, v: ragged_paged_attention(
                         q, k, v, 0, md, sm_scale=scale, interpret=interpret)), True)]
            if tables is not None:
                found.append(("triton decode-only", jax.jit(lambda q, k, v: paged_decode_attention(
                    q, k, v, 0, tables, lens, sm_scale=scale, interpret=interpret)), True))
                found.append(("jax pallas paged_attention", _jax_paged_attention(tables, lens, scale, interpret),
                              False))
            return found
        return [("XLA reference", jax.jit(lambda q, k, v: ragged_paged_attention_reference(
            q, k, v, 0, md, sm_scale=scale)), True)]

    def measure(label: str, q: Any, k: Any, v: Any, ref: Any, n: int, kv_bytes: int,
                fns: list[tuple[str, Callable[..., Any], bool]]) -> None:
        nonlocal failures
        for name, fn, judged in fns:
            what = f"{label} {name}"
            try:
                err, ok = rel_error(fn(q, k, v), ref, n)
                seconds = timed(lambda fn=fn: fn(q, k, v), min_time=min_time, reps=reps)
            except Exception as e:  # noqa: BLE001 - one failing kernel must not hide the others
                failures += 1
                rows(what, "ERROR", one_line(e), status="error")
                continue
            share = f"{100 * kv_bytes / seconds / bw:.0f}% of copy BW" if bw else "no copy BW measured"
            bad = not ok or err > 2e-2
            failures += bad
            rows(what, f"{seconds * 1e6:.0f} us, {kv_bytes / seconds / 1e9:.0f} GB/s",
                 f"KV read once = {share}; rel err {err:.1e}{' WRONG' if bad else ''}"
                 + ("" if judged else " (not dispatched by the engine)"),
                 status="fail" if bad else "info", value=seconds, key=f"b:{label}:{name}")

    shapes = ((4, 64),) if smoke else ((64, 1024), (64, 4096), (256, 1024))
    for batch, ctx in shapes:
        pages = ctx // bs
        num_blocks = batch * pages + 1
        kk, kv, kq = jax.random.split(jax.random.key(ctx + batch), 3)
        k = jax.random.normal(kk, (1, num_blocks, bs, kv_heads, hd), jnp.bfloat16)
        v = jax.random.normal(kv, (1, num_blocks, bs, kv_heads, hd), jnp.bfloat16)
        q = jax.random.normal(kq, (batch, heads, hd), jnp.bfloat16)
        tables = jnp.asarray(np.random.default_rng(ctx).permutation(np.arange(1, num_blocks)).reshape(batch, pages),
                             jnp.int32)
        lens = jnp.full((batch,), ctx, jnp.int32)
        md = decode_metadata(tables, lens)
        with jax.default_matmul_precision("highest"):
            ref = jax.jit(lambda q, k, v: ragged_paged_attention_reference(q, k, v, 0, md, sm_scale=scale))(q, k, v)
        measure(f"decode {batch}x{ctx}", q, k, v, ref, batch, 2 * batch * ctx * kv_heads * hd * 2,
                kernels(md, tables, lens))
        del k, v
    q, k, v, md, n, kv_bytes, label = _mixed_step(smoke, heads, kv_heads, hd, bs)
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(lambda q, k, v: ragged_paged_attention_reference(q, k, v, 0, md, sm_scale=scale))(q, k, v)
    measure(label, q, k, v, ref, n, kv_bytes, kernels(md, None, None)[:1])
    return 1 if failures else 0


def _jax_paged_attention(tables: Any, lens: Any, scale: float, interpret: bool) -> Callable[..., Any]:
    """JAX's own Pallas (Triton) paged attention, on our cache re-laid as [kv heads, pages, page, dim]."""
    import jax
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    pages = tables.shape[1]
    splits = min(16, pages)

    def run(q: Any, k: Any, v: Any) -> Any:
        k_pages, v_pages = k[0].transpose(2, 0, 1, 3), v[0].transpose(2, 0, 1, 3)
        return paged_attention(q * scale, k_pages, v_pages, tables, lens, k_splits=splits,
                               pages_per_compute_block=max(1, min(8, pages // splits)), interpret=interpret)

    return jax.jit(run)


def _mixed_step(smoke: bool, heads: int, kv_heads: int, hd: int, bs: int) -> tuple[Any, ...]:
    """The engine's ragged step on a mixed batch: decode tokens on 1k-4k contexts beside prompt
    chunks of 256 tokens on 256-2k contexts."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from paxserve.kernels.metadata import AttentionMetadata

    rng = np.random.default_rng(5)
    num_decode, num_prefill, chunk = (3, 1, 16) if smoke else (48, 16, 256)
    ctx = np.concatenate([rng.integers(16 if smoke else 1024, (64 if smoke else 4096) + 1, num_decode),
                          rng.integers(chunk, (64 if smoke else 2048) + 1, num_prefill)]).astype(np.int32)
    q_lens = np.concatenate([np.ones(num_decode, np.int32), np.full(num_prefill, chunk, np.int32)])
    pages = -(-ctx // bs)
    num_blocks = int(pages.sum()) + 1
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables = np.zeros((len(ctx), int(pages.max())), np.int32)
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
    k = jax.random.normal(kk, (1, num_blocks, bs, kv_heads, hd), jnp.bfloat16)
    v = jax.random.normal(kv, (1, num_blocks, bs, kv_heads, hd), jnp.bfloat16)
    q = jax.random.normal(kq, (num_tokens, heads, hd), jnp.bfloat16)
    kv_bytes = 2 * int(ctx.sum()) * kv_heads * hd * 2
    return q, k, v, md, num_tokens, kv_bytes, f"mixed {num_decode} decode + {num_prefill}x{chunk} prefill"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("toolchain", "ceilings", "case", "timing"))
    ap.add_argument("arg", nargs="?", help="case: the case's name; timing: xla, triton or mosaic")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rows", type=Path)
    args = ap.parse_args()
    rows = Rows(args.rows, {"toolchain": "t", "ceilings": "p", "case": "a", "timing": "b"}[args.part])
    if args.part == "toolchain":
        sys.exit(part_toolchain(rows, args.smoke))
    if args.part == "ceilings":
        sys.exit(part_ceilings(rows, args.smoke))
    if args.part == "case":
        sys.exit(part_case(rows, args.smoke, args.arg))
    sys.exit(part_timing(rows, args.smoke, args.arg))


if __name__ == "__main__":
    main()
