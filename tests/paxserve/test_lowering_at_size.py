"""The engine's step programs at real size, lowered for an H200 (sm90) on this GPU-less machine.

Issue 29, item 5: Llama-3-8B in bfloat16 with the KV-cache block count the engine would plan on a
141 GB H200, as abstract arrays (nothing is allocated: the cache alone is ~107 GB), so shape,
layout and memory-space errors at size show here instead of on a GPU. Lowering runs each Pallas
kernel's whole lowering (Mosaic GPU and Triton build their kernel module at lowering time); only
XLA's own GPU compilation, which needs the GPU, is left out.

At this size one K (or V) array holds 32 x ~50,000 x 16 x 8 x 128 ~= 2.6e10 elements, more than
2**31, so the tests also read each kernel's lowered module for the index arithmetic that would wrap
at this size: Triton's pointer offsets into the cache must be 64-bit, and Mosaic GPU's TMA
coordinates (int32 in the instruction) must stay below 2**31.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import pytest
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir, passmanager

from paxserve.config import EngineConfig
from paxserve.kernels import AttentionBackend
from paxserve.models.loader import _model_spec
from paxserve.models.sharding import param_bytes
from paxserve.worker.memory_plan import plan_kv_cache
from paxserve.worker.sampling.sampler import SamplerState
from paxserve.worker.step_functions import StepShapes, jitted_logits, sample_step
from tests.helpers import load_benchmark, lower_jitted_for_cuda

# Meta-Llama-3-8B's config.json (the fields the model reads): the one gpu_check's end-to-end part runs.
LLAMA3_8B: dict[str, Any] = load_benchmark("gpu_check_e2e").LLAMA3_8B

# The engine's plan on one H200, through its own `plan_kv_cache` (as benchmarks/tp_memory.py does):
#   usable       0.9 x 141e9 B                                        = 126.90e9 B
#   - weights    param_bytes of Llama-3-8B bf16                       =  16.06e9 B
#   - activations (a stand-in, see ACTIVATION_RESERVE)  4 GiB         =   4.29e9 B
#   - sampler state 257 rows x 4 x (2 x 128256 + 2 x 4008 + 1) B      =   0.27e9 B
#   = 106.28e9 B for the cache; a block holds 16 tokens x 128 KiB (K and V: 2 x 32 layers x 8 KV
#   heads x 128 dims x 2 B) = 2 MiB, so 106.28e9 / 2,097,152 = 50,6xx blocks (block 0 included).
H200_BYTES = 141 * 10**9  # the 141 GB of the spec sheet, the figure benchmarks/tp_memory.py plans with
GPU_MEMORY_UTILIZATION = 0.9
# The engine measures the largest step's activation peak by compiling it on the GPU, which this machine
# cannot do; a few GiB stands in for it (the [8192, 128256] float32 logits of a prompt-logprobs step
# alone are 3.9 GiB). One GiB more or less moves the plan by 512 blocks, not the conclusions.
ACTIVATION_RESERVE = 4 * 2**30
BLOCK_SIZE = 16
MAX_NUM_SEQS = 256
NUM_STATE_ROWS = MAX_NUM_SEQS + 1  # row 0 is the all-zero row, as the model runner has it
MAX_MODEL_LEN = 8192

# Forward buckets (tokens T, sequences S, block-table width B) a GPU engine runs at these limits:
# a full decode step (256 sequences, one token each, up to 4k context = 256 blocks of 16) and a
# mixed prefill step at the token budget (8k-token max_model_len = 512 blocks of 16).
# The decode step is lowered twice: as a plain forward (the ragged kernel) and as the "decode"
# program the engine gives pure-decode steps (the decode-only kernel).
DECODE = ("forward", 256, 256, 256)
PURE_DECODE = ("decode", 256, 256, 256)
PREFILL = ("forward", 8192, 64, 512)
BUCKETS = [pytest.param(DECODE, id="decode-T256-S256-B256"), pytest.param(PURE_DECODE, id="decode-program-T256-S256-B256"),
           pytest.param(PREFILL, id="prefill-T8192-S64-B512")]

# The custom call each Pallas backend lowers to, and where in its backend_config the kernel module is.
KERNEL_CALL = {"mosaic": "mosaic_gpu_v2", "triton": "__gpu$xla.gpu.triton"}
KERNEL_MODULE_KEY = {"mosaic": "module", "triton": "ir"}
INT32_LIMIT = 2**31


@pytest.fixture(scope="module")
def llama() -> tuple[Any, Any, np.dtype]:
    """(model config, architecture, numpy dtype) as the engine's loader derives them."""
    return _model_spec(LLAMA3_8B, "bfloat16", "hf")


@pytest.fixture(scope="module")
def num_blocks(llama: tuple[Any, Any, np.dtype]) -> int:
    cfg, arch, dtype = llama
    config = EngineConfig(model=None, max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
                          block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS)
    plan = plan_kv_cache(cfg, config, dtype.itemsize, param_bytes(arch.abstract_params(cfg, dtype)), H200_BYTES,
                         activation_bytes=ACTIVATION_RESERVE,
                         sampler_state_bytes=SamplerState.num_bytes(NUM_STATE_ROWS, cfg.vocab_size))
    return plan.num_blocks


def _shapes(llama: tuple[Any, Any, np.dtype], num_blocks: int, backend: str) -> StepShapes:
    cfg, arch, dtype = llama
    # AttentionBackend(name) with interpret=False is what `resolve_attention_backend` picks on a GPU.
    return StepShapes(cfg, arch, dtype, block_size=BLOCK_SIZE, num_blocks=num_blocks, num_state_rows=NUM_STATE_ROWS,
                      attention_backend=AttentionBackend(backend), tp=None)


@pytest.fixture(scope="module")
def lower_forward(llama: tuple[Any, Any, np.dtype], num_blocks: int) -> Callable[[str, tuple], Any]:
    """(backend, program key) -> the forward program lowered for CUDA, each lowered once for all tests.

    `StepShapes.spec`'s own `lower` lowers for the default platform (this CPU), so the program is
    traced from the same arguments and statics and lowered for CUDA here."""

    @functools.cache
    def lower(backend: str, key: tuple) -> Any:
        shapes = _shapes(llama, num_blocks, backend)
        _, args, _ = shapes.spec(key)
        return lower_jitted_for_cuda(jitted_logits(llama[1].forward), *args, **shapes.statics(key[0]))

    return lower


def _cache_type(llama: tuple[Any, Any, np.dtype], num_blocks: int) -> str:
    cfg = llama[0]
    return f"tensor<{cfg.num_layers}x{num_blocks}x{BLOCK_SIZE}x{cfg.num_kv_heads}x{cfg.head_dim}xbf16>"


def _walk(op: ir.Operation) -> Iterator[ir.Operation]:
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield child.operation
                yield from _walk(child.operation)


def _custom_calls(lowered: Any) -> list[ir.Operation]:
    """Every stablehlo.custom_call of the lowered program (the scan's body function included)."""
    return [op for op in _walk(lowered.compiler_ir("stablehlo").operation) if op.name == "stablehlo.custom_call"]


def _target(call: ir.Operation) -> str:
    return ir.StringAttr(call.attributes["call_target_name"]).value


def _kernel_module(call: ir.Operation, backend: str) -> ir.Module:
    """The kernel's own MLIR module, which the backend's lowering serialised into the custom call's
    backend_config as bytecode: Triton IR, or the Mosaic GPU module (deserialised by the same
    `mosaic_gpu-serde` pass JAX runs before writing it)."""
    config = ir.DictAttr(call.attributes["mhlo.backend_config"])
    data = ir.StringAttr(config[KERNEL_MODULE_KEY[backend]]).value_bytes
    context = jax_mlir.make_ir_context()
    context.allow_unregistered_dialects = True
    if backend == "triton":
        from jax._src.lib import triton

        triton.dialect.register_dialect(context)
        return ir.Module.parse(data, context=context)
    from jax._src.lib import mosaic_gpu_dialect

    mosaic_gpu_dialect.register_dialect(context)
    module = ir.Module.parse(data, context=context)
    passmanager.PassManager.parse("builtin.module(mosaic_gpu-serde{serialize=false})", context).run(module.operation)
    return module


def _shape_dtypes(tree: Any) -> tuple[Any, list[tuple[tuple[int, ...], np.dtype]]]:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [(tuple(x.shape), np.dtype(x.dtype)) for x in leaves]


def test_the_h200_plan_gives_a_cache_past_int32_element_indexing(llama: tuple[Any, Any, np.dtype],
                                                                 num_blocks: int, report: Any) -> None:
    cfg, arch, dtype = llama
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype) == (32, 8, 128, np.dtype(jax.numpy.bfloat16))
    # 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB per token.
    assert cfg.kv_bytes_per_token * dtype.itemsize == 128 * 2**10
    assert 48_000 < num_blocks < 53_000, num_blocks  # the arithmetic above: ~50,6xx
    elements = cfg.num_layers * num_blocks * BLOCK_SIZE * cfg.num_kv_heads * cfg.head_dim
    # What makes this size worth lowering: flat element indices into one K array overflow int32.
    assert elements > INT32_LIMIT
    cache_bytes = 2 * elements * dtype.itemsize
    assert cache_bytes + param_bytes(arch.abstract_params(cfg, dtype)) < GPU_MEMORY_UTILIZATION * H200_BYTES
    report(f"H200 plan for Llama-3-8B bf16: {num_blocks:,} blocks of {BLOCK_SIZE}, K and V "
           f"{cache_bytes / 1e9:.1f} GB, {elements:,} elements per array ({elements / INT32_LIMIT:.1f} x 2**31)")


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("backend", ["mosaic", "triton"])
def test_forward_lowers_for_sm90_at_size(backend: str, bucket: tuple, lower_forward: Any,
                                         llama: tuple[Any, Any, np.dtype], num_blocks: int) -> None:
    lowered = lower_forward(backend, bucket)
    cache = _cache_type(llama, num_blocks)
    kernels = [call for call in _custom_calls(lowered) if _target(call) in KERNEL_CALL.values()]
    # The model is one lax.scan over layers, so the attention kernel is in the program once (in the
    # scan's body), and it is the backend's own kernel (no silent fallback to the other one).
    assert [_target(call) for call in kernels] == [KERNEL_CALL[backend]]
    if backend == "triton":  # a pure-decode program runs the decode-only kernel, any other the ragged one
        config = ir.DictAttr(kernels[0].attributes["mhlo.backend_config"])
        expected = "paged_decode_attention" if bucket[0] == "decode" else "ragged_paged_attention"
        assert ir.StringAttr(config["name"]).value == expected
    # The kernel reads the whole stacked cache [layers, blocks, block_size, kv_heads, head_dim] with the
    # layer as an index: a per-layer slice here would be a 1.7 GB copy per layer.
    operand_types = [str(operand.type) for operand in kernels[0].operands]
    assert operand_types.count(cache) == 2, operand_types
    # K and V are donated and aliased to the outputs: without it XLA keeps a second ~107 GB cache.
    text = lowered.as_text()
    main = re.search(r"func\.func public @main\((.*)", text).group(1)
    assert len(re.findall(rf"%arg\d+: {re.escape(cache)} \{{tf\.aliasing_output = \d+ : i32\}}", main)) == 2
    # The program's outputs are what StepShapes promises the compiled-program store (logits [S, V]
    # float32, then the cache).
    shapes = _shapes(llama, num_blocks, backend)
    _, _, example_out = shapes.spec(bucket)
    assert _shape_dtypes(lowered.out_info) == _shape_dtypes(example_out)


@pytest.mark.parametrize("bucket", BUCKETS)
def test_triton_kernel_addresses_the_cache_with_64_bit_offsets(bucket: tuple, lower_forward: Any,
                                                               llama: tuple[Any, Any, np.dtype],
                                                               num_blocks: int) -> None:
    """Pallas' Triton lowering addresses a ref through `tt.addptr(base, offsets)` with element offsets
    `sum(index_i * stride_i)` over the whole [L, N, P, K, D] array; here `layer * N*P*K*D` reaches
    31 x 832e6 = 2.6e10, so the offsets into K and V must be i64 (Pallas picks them for arrays past 4 GiB)."""
    (call,) = [c for c in _custom_calls(lower_forward("triton", bucket)) if _target(c) == KERNEL_CALL["triton"]]
    # The kernel function's arguments are the custom call's operands in order (then its outputs).
    cache_args = {i for i, operand in enumerate(call.operands) if str(operand.type) == _cache_type(llama, num_blocks)}
    assert len(cache_args) == 2
    widths: dict[int, set[int]] = {arg: set() for arg in cache_args}
    for op in _walk(_kernel_module(call, "triton").operation):
        if op.name == "tt.addptr" and (arg := _kernel_argument(op.operands[0])) in widths:
            offsets = op.operands[1].type.maybe_downcast()  # i32 / i64, or a tensor of them
            element = offsets.element_type if isinstance(offsets, ir.ShapedType) else offsets
            widths[arg].add(ir.IntegerType(element).width)
    assert widths == {arg: {64} for arg in cache_args}, widths


def _kernel_argument(pointer: ir.Value) -> int | None:
    """Which argument of the Triton kernel function a pointer (or a splat of one) comes from."""
    value = pointer.maybe_downcast()
    while isinstance(value, ir.OpResult) and value.owner.name in ("tt.splat", "tt.broadcast", "tt.expand_dims"):
        value = value.owner.operands[0].maybe_downcast()
    if isinstance(value, ir.BlockArgument) and value.owner.owner.name == "tt.func":
        return value.arg_number
    return None


@pytest.mark.parametrize("bucket", BUCKETS)
def test_mosaic_kernel_targets_sm90_and_its_tma_coordinates_fit_int32(
        bucket: tuple, lower_forward: Any, num_blocks: int, report: Any) -> None:
    """Mosaic GPU copies each page by TMA through a descriptor of the whole cache; to fit TMA's five
    dimensions it folds the squeezed (layer, page, KV head) indices into one coordinate,
    `layer * N*P*K + page * P*K + kv_head` (in units of head_dim), which the copy instruction takes
    as an int32. Every dimension of every descriptor's global view must stay below 2**31."""
    (call,) = [c for c in _custom_calls(lower_forward("mosaic", bucket)) if _target(c) == KERNEL_CALL["mosaic"]]
    module = _kernel_module(call, "mosaic")
    attributes = module.operation.attributes
    assert (ir.IntegerAttr(attributes["mosaic_gpu.arch_major"]).value,
            ir.IntegerAttr(attributes["mosaic_gpu.arch_minor"]).value) == (9, 0)
    # A TMA descriptor is built from the aligned pointer of its global-memory view; the view's type
    # gives the extent of each coordinate.
    views = re.findall(r"memref\.extract_aligned_pointer_as_index %\S+ : memref<((?:\d+x)+)",
                       module.operation.get_asm())
    extents = [[int(d) for d in view.rstrip("x").split("x")] for view in views]
    # q plus K and V; the cache views are those with a coordinate over the pages.
    cache_views = [e for e in extents if max(e) >= num_blocks]
    assert len(cache_views) == 2, extents
    largest = max(max(e) for e in extents)
    assert largest < INT32_LIMIT, extents
    report(f"Mosaic GPU, bucket T, S, B = {bucket}: largest TMA coordinate extent {largest:,} "
           f"({INT32_LIMIT / largest:.1f}x below 2**31)")


def test_sampler_lowers_for_cuda_at_size(llama: tuple[Any, Any, np.dtype], num_blocks: int) -> None:
    shapes = _shapes(llama, num_blocks, "mosaic")  # the sampler does not depend on the attention backend
    _, args, example_out = shapes.spec(("sample", MAX_NUM_SEQS))
    lowered = lower_jitted_for_cuda(sample_step, *args)
    assert _shape_dtypes(lowered.out_info) == _shape_dtypes(example_out)
    # The sampler state (counts and bias are [257, 128256]) is donated and updated in place.
    main = re.search(r"func\.func public @main\((.*)", lowered.as_text()).group(1)
    assert len(re.findall(r"\{tf\.aliasing_output = \d+ : i32\}", main)) == len(jax.tree.leaves(args[2]))
