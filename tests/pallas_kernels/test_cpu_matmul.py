"""The CPU kernel for weights kept quantized (pallas_kernels/cpu_matmul.cc) against XLA's
dequantize-then-dot, on every layout, code width and row count it has a path for."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxserve.kernels import cpu_matmul
from paxserve.kernels.matmul_dispatch import MatmulKernel, cpu_matmul_kernel, kernel_serves, resolve_matmul_kernel
from paxserve.models.quant_weights import GroupQuantizedWeight, group_matmul, table_matmul, with_matmul_kernel


@pytest.fixture(scope="module")
def kernel() -> MatmulKernel:
    loaded = cpu_matmul_kernel()
    assert isinstance(loaded, MatmulKernel), loaded  # g++ is on every machine of this project
    return loaded


def _weight(rng: np.random.Generator, k: int, n: int, bits: int, group: int, offset: bool, f16: bool,
            bias: int = 0) -> dict:
    dt = np.float16 if f16 else np.float32
    codes = rng.integers(0, 256, (k // 2, n)).astype(np.uint8) if bits == 4 else \
        rng.integers(-127, 128, (k, n)).astype(np.int8)
    scale = (rng.random((k // group, n)) * 0.05 + 0.001).astype(dt)
    return dict(codes=codes, scale=scale, offset=(rng.standard_normal((k // group, n)) * 0.05).astype(dt)
                if offset else None, bits=bits, bias=bias)


@pytest.mark.parametrize("rows", [1, 3, 9, 70])  # codes per row and per pair; panels, two blocks of rows
@pytest.mark.parametrize("bits,group,offset,f16,bias", [(4, 32, True, True, 0), (4, 128, False, False, 8),
                                                        (8, 32, False, True, 0), (8, 16, True, False, 0)])
def test_columns_layout_matches_xla(kernel: MatmulKernel, rows: int, bits: int, group: int, offset: bool, f16: bool,
                                    bias: int) -> None:
    rng = np.random.default_rng(rows * 7 + bits)
    k, n = 256, 64 * 3 + 24  # three whole tiles of columns and a remainder the scalar path computes
    w = _weight(rng, k, n, bits, group, offset, f16, bias)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    arrays = {name: jnp.asarray(v) for name, v in w.items() if isinstance(v, np.ndarray)}
    want = np.asarray(cpu_matmul.cpu_group_matmul_reference(x, **arrays, bits=bits, bias=bias))
    got = np.asarray(jax.jit(lambda x, a: cpu_matmul.cpu_group_matmul(x, **a, bits=bits, bias=bias))(x, arrays))
    assert got.shape == (rows, n)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("rows", [1, 9])  # codes widened per row; dequantized panels
@pytest.mark.parametrize("bits", [4, 8])
def test_weights_set_to_the_kernel_are_tiled_and_give_the_plain_weights_product(kernel: MatmulKernel, rows: int,
                                                                                bits: int) -> None:
    """`with_matmul_kernel` reorders a weight of whole tiles into the kernel's tile order (layers
    stacked in front), the product on the kernel equals XLA's on the plain weight, the weight
    dequantizes to the same values, and any other choice of kernel puts the plain order back."""
    rng = np.random.default_rng(rows + 10 * bits)
    k, n = 128, 3 * cpu_matmul.TILE
    layers = [_weight(rng, k, n, bits, 32, bits == 4, True) for _ in range(2)]
    plain = GroupQuantizedWeight(
        codes=jnp.asarray(np.stack([w["codes"] for w in layers])), scale=jnp.asarray(np.stack([w["scale"] for w in
                                                                                                 layers])),
        offset=jnp.asarray(np.stack([w["offset"] for w in layers])) if bits == 4 else None, bits=bits)
    odd = plain.replace(codes=plain.codes[..., :40], scale=plain.scale[..., :40],
                        offset=None if plain.offset is None else plain.offset[..., :40])  # not whole tiles
    tiled, odd_set = with_matmul_kernel((plain, odd), kernel)
    assert tiled.tiled and not odd_set.tiled and tiled.codes.shape == plain.codes.shape
    assert not np.array_equal(np.asarray(tiled.codes), np.asarray(plain.codes))
    np.testing.assert_array_equal(np.asarray(tiled.dequantize()), np.asarray(plain.dequantize()))
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    one = lambda w: jax.tree.map(lambda a: a[1], w)  # noqa: E731 - the second layer, as a split model slices it
    want = np.asarray(group_matmul(x, one(plain)))  # no kernel: XLA's
    got = np.asarray(jax.jit(group_matmul)(x, one(tiled)))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    back = with_matmul_kernel(tiled, None)
    assert not back.tiled and np.array_equal(np.asarray(back.codes), np.asarray(plain.codes))
    sharded = with_matmul_kernel(plain, MatmulKernel(name="cpu"))  # tensor parallel: shards cut from the plain order
    assert not sharded.tiled and sharded.kernel == MatmulKernel(name="cpu")


@pytest.mark.parametrize("rows", [1, 2, 3, 6])
@pytest.mark.parametrize("bits", [4, 8])
def test_an_embedding_table_as_the_head_matches_xla(kernel: MatmulKernel, rows: int, bits: int) -> None:
    """The tied head reads the table's rows where they lie: `table_matmul` on the kernel gives XLA's
    x @ table.T (a vocabulary that is not a whole number of the kernel's chunks of rows)."""
    rng = np.random.default_rng(rows + bits)
    vocab, hidden = 1000, 128
    w = _weight(rng, hidden, vocab, bits, 32, bits == 4, True)
    table = GroupQuantizedWeight(codes=jnp.asarray(w["codes"]), scale=jnp.asarray(w["scale"]),
                                 offset=None if w["offset"] is None else jnp.asarray(w["offset"]),
                                 bits=bits).as_table()
    x = jnp.asarray(rng.standard_normal((rows, hidden)), jnp.float32)
    want = np.asarray(table_matmul(x, table))  # no kernel: XLA's
    on_kernel = table.replace(kernel=kernel)
    assert kernel_serves(kernel, x, on_kernel.codes, on_kernel.scale.shape[-1], bits, table=True)
    got = np.asarray(jax.jit(table_matmul)(x, on_kernel))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_what_the_kernel_does_not_take_stays_on_xlas_path(kernel: MatmulKernel) -> None:
    rng = np.random.default_rng(0)
    w = _weight(rng, 64, 64, 4, 32, True, True)
    weight = GroupQuantizedWeight(codes=jnp.asarray(w["codes"]), scale=jnp.asarray(w["scale"]),
                                  offset=jnp.asarray(w["offset"]), bits=4, kernel=kernel)
    x16 = jnp.asarray(rng.standard_normal((2, 64)), jnp.bfloat16)
    assert not kernel_serves(kernel, x16, weight.codes, 2, 4)  # bfloat16 activations
    want = jnp.dot(x16, weight.dequantize(jnp.bfloat16), preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(group_matmul(x16, weight)), np.asarray(want))
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    assert not cpu_matmul.serves(x, weight.codes, 3, 4, False)  # groups that do not divide the inputs


def test_the_engine_chooses_the_cpu_kernel_for_float32_and_says_why_not_otherwise(caplog) -> None:
    assert resolve_matmul_kernel("auto", "cpu", dtype=jnp.float32) == MatmulKernel(name="cpu", tiles=True)
    with caplog.at_level("INFO"):
        assert resolve_matmul_kernel("auto", "cpu", dtype=jnp.bfloat16) is None
    assert "the CPU kernel takes float32 activations" in caplog.text
    assert cpu_matmul.self_check_cpu_matmul(seed=3) is None


def test_a_start_beside_a_build_waits_for_it_instead_of_building_too(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The kernels' build lock (models/param_cache.py's file_lock, as cpu_library holds it): a second
    holder logs that it waits and enters only once the first has left."""
    import logging
    import threading
    import time

    from paxserve.models.param_cache import file_lock

    lock, order = tmp_path / "kernels" / "build.lock", []

    def second() -> None:
        with file_lock(lock, "another process is building: waiting for it"):
            order.append("second")

    caplog.set_level(logging.INFO)
    with file_lock(lock, "unused"):
        thread = threading.Thread(target=second)
        thread.start()
        deadline = time.monotonic() + 30
        while "waiting for it" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        order.append("first")
    thread.join(30)
    assert "another process is building: waiting for it" in caplog.text
    assert order == ["first", "second"]
