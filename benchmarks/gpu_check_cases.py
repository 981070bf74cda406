"""What gpu_check runs, as plain data: its orchestrator (`gpu_check.py`) reads this without importing
JAX, and the parts (`gpu_check_kernels.py`, `gpu_check_e2e.py`) build their problems from it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelCase:
    """One kernel against the XLA reference on a random ragged batch (part a)."""

    name: str
    kernel: str  # "triton", "mosaic", "triton-decode" or "mosaic-decode" (the decode-only entries)
    dtype: str
    block_size: int
    kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    window: int | None = None
    traced_window: bool = False  # the window as a traced scalar, as the one-scan decoder passes it
    soft_cap: float | None = None
    alibi: bool = False
    num_splits: int | None = None  # decode-only kernels: split-K pieces (None: the kernel's choice)


# Full size: every variant the engine can dispatch on a GPU. The f32 rows are Triton only (Mosaic GPU
# takes 16-bit floats). Smoke: one case per entry point, at tiny shapes (the CPU suites test the rest).
KERNEL_CASES = (
    KernelCase("ragged f32 gqa4 b16", "triton", "float32", 16, 2, 4, 128),
    KernelCase("ragged bf16 gqa8 b32", "triton", "bfloat16", 32, 2, 8, 128),
    KernelCase("ragged bf16 gqa1 b8 d64", "triton", "bfloat16", 8, 4, 1, 64),
    KernelCase("ragged f16 gqa2 d256", "triton", "float16", 16, 2, 2, 256),
    KernelCase("ragged bf16 window+softcap", "triton", "bfloat16", 16, 2, 4, 128, window=37, soft_cap=20.0),
    KernelCase("ragged bf16 alibi mha b16", "triton", "bfloat16", 16, 4, 1, 128, alibi=True),
    KernelCase("ragged f32 traced window+alibi", "triton", "float32", 16, 2, 4, 128, window=53, traced_window=True,
               alibi=True),
    KernelCase("decode-only f32 auto splits", "triton-decode", "float32", 16, 2, 4, 128),
    KernelCase("decode-only bf16 4 splits", "triton-decode", "bfloat16", 16, 2, 4, 128, num_splits=4),
    KernelCase("mosaic ragged bf16 gqa8 b32", "mosaic", "bfloat16", 32, 2, 8, 128),
    KernelCase("mosaic ragged bf16 gqa1 b8 d64", "mosaic", "bfloat16", 8, 4, 1, 64),
    KernelCase("mosaic ragged f16 gqa2 d256", "mosaic", "float16", 16, 2, 2, 256),
    KernelCase("mosaic ragged bf16 window+softcap", "mosaic", "bfloat16", 16, 2, 4, 128, window=37, soft_cap=20.0),
    KernelCase("mosaic ragged bf16 traced window+alibi", "mosaic", "bfloat16", 16, 4, 1, 128, window=53,
               traced_window=True, alibi=True),
    KernelCase("mosaic decode-only f16 gqa8 b32 3 splits", "mosaic-decode", "float16", 32, 2, 8, 64, num_splits=3),
)
SMOKE_KERNEL_CASES = (
    KernelCase("ragged f32 traced window+alibi", "triton", "float32", 16, 2, 4, 32, window=13, traced_window=True,
               alibi=True),
    KernelCase("decode-only bf16 4 splits", "triton-decode", "bfloat16", 16, 2, 4, 32, num_splits=4),
    KernelCase("mosaic ragged bf16 gqa4 b16 d64", "mosaic", "bfloat16", 16, 2, 4, 64),
)

# Part b's kernel families, each timed in its own process at Llama-3-8B attention shapes.
TIMING_FAMILIES = ("xla", "triton", "mosaic")
# Part c: the end-to-end engine on each attention backend, side by side.
E2E_BACKENDS = ("mosaic", "triton", "reference")
# Interpreted on a CPU, a Mosaic GPU engine step takes about a second: the smoke run leaves it to the
# Mosaic lane's own engine test (tests/mosaic_gpu) and runs the same script on the other two.
SMOKE_E2E_BACKENDS = ("triton", "reference")
