"""The CPU kernel for decode steps' attention (pallas_kernels/cpu_attention.cc) against the XLA
reference, alone and inside the engine's programs."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxserve.kernels import REFERENCE, AttentionBackend, attention, cpu_attention
from paxserve.kernels.cpu_library import load_cpu_kernels
from paxserve.models import load_model
from paxserve.worker.model_runner import ModelRunner
from tests.paged_greedy import greedy_tokens_and_logits

CPU_KERNEL = AttentionBackend("reference", cpu_kernel=True)


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    loaded = load_cpu_kernels()
    assert not isinstance(loaded, str), loaded  # g++ is on every machine of this project


@pytest.mark.parametrize("seed", [1, 2])
def test_decode_steps_match_the_reference(seed: int) -> None:
    """Grouped query heads, partial last blocks, padding tokens and a padding sequence, two layers,
    decode steps and a prefill chunk."""
    assert cpu_attention.self_check_cpu_attention(seed=seed) is None


def test_dispatch_takes_the_kernel_only_where_it_serves() -> None:
    rng = np.random.default_rng(0)
    q, k, v, metadata = cpu_attention._problem(rng, 3, 4, 4, 2, 32)
    want = np.asarray(attention(q, k, v, 1, metadata, sm_scale=0.2, backend=REFERENCE))
    got = np.asarray(jax.jit(lambda q, k, v, m: attention(q, k, v, 1, m, sm_scale=0.2, backend=CPU_KERNEL))(
        q, k, v, metadata))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    common = dict(sliding_window=None, soft_cap=None, alibi_slopes=None, fp8=None)
    assert cpu_attention.serves(q, k, metadata, **common)
    assert not cpu_attention.serves(q, k, metadata, **{**common, "sliding_window": 4})  # variants: the reference
    assert not cpu_attention.serves(q, k, metadata, **{**common, "soft_cap": 30.0})
    assert not cpu_attention.serves(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), metadata, **common)
    many = jnp.zeros((8, 4, 32), jnp.float32)  # two tokens per sequence: a prefill chunk is the kernel's too
    assert cpu_attention.serves(many, k, metadata, **common)


def test_greedy_decoding_on_the_kernel_gives_the_references_tokens(tmp_path: Path) -> None:
    from tests.helpers import make_tiny_llama

    make_tiny_llama(tmp_path, seed=3, num_key_value_heads=2)
    model = load_model(tmp_path)
    prompts = [[5, 9, 13, 2, 7, 40, 41], [3, 3, 8], [60, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    want = greedy_tokens_and_logits(ModelRunner(model, num_blocks=24, block_size=8, max_model_len=64), prompts, 6)
    got = greedy_tokens_and_logits(ModelRunner(model, num_blocks=24, block_size=8, max_model_len=64,
                                               attention_backend=CPU_KERNEL), prompts, 6)
    assert got[0] == want[0]
    assert max(float(np.max(np.abs(x - y))) for a, b in zip(got[1], want[1]) for x, y in zip(a, b)) < 1e-4
