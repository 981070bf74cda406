"""Memory planning and engine-config validation (pure functions, no model)."""

from __future__ import annotations

import pytest

from paxserve.config import EngineConfig
from paxserve.models.config import ModelConfig
from paxserve.worker.memory_plan import kv_bytes_per_block, plan_kv_cache
from paxserve.worker.sampling.sampler import SamplerState

# A Llama-3-8B-shaped config: 32 layers x 8 KV heads x 128 dims -> 128 KiB per token in bf16.
LLAMA8B = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                      max_position_embeddings=8192)
GiB = 2**30


def test_kv_bytes_per_block_from_the_model_config() -> None:
    assert kv_bytes_per_block(LLAMA8B, 16, 2) == 2 * 32 * 8 * 128 * 16 * 2 == 2 * 2**20


def test_gpu_budget_is_utilization_times_memory_minus_weights_and_activations(caplog) -> None:
    caplog.set_level("INFO")
    plan = plan_kv_cache(LLAMA8B, EngineConfig(gpu_memory_utilization=0.9), 2, weight_bytes=16 * GiB,
                         device_bytes=80 * GiB, activation_bytes=2 * GiB)
    expected = int(0.9 * 80 * GiB - 18 * GiB) // (2 * 2**20)
    assert plan.num_blocks == expected
    assert plan.max_model_len == 8192
    assert plan.max_concurrency == pytest.approx((expected - 1) * 16 / 8192)
    assert f"maximum concurrency for 8192-token requests: {plan.max_concurrency:.2f}x" in caplog.text
    # The sampler's per-request state (Llama 3's 128k vocabulary x 257 rows: 0.25 GiB) comes off too.
    state = SamplerState.num_bytes(257, 128256)
    assert 0.24 * GiB < state < 0.26 * GiB
    with_state = plan_kv_cache(LLAMA8B, EngineConfig(gpu_memory_utilization=0.9), 2, weight_bytes=16 * GiB,
                               device_bytes=80 * GiB, activation_bytes=2 * GiB, sampler_state_bytes=state)
    assert with_state.num_blocks == int(0.9 * 80 * GiB - 18 * GiB - state) // (2 * 2**20)


def test_weights_that_do_not_fit_say_so_and_point_at_tensor_parallelism() -> None:
    # Llama-3-70B in bf16 (131 GiB) on one 141 GB device; on each of two it fits.
    seventy = LLAMA8B.replace(hidden_size=8192, num_layers=80, num_heads=64, intermediate_size=28672)
    with pytest.raises(ValueError, match=r"the model does not fit: its weights take 131.42 GiB on the device .*"
                                         r"--tensor-parallel-size"):
        plan_kv_cache(seventy, EngineConfig(), 2, int(131.42 * GiB), 141 * 10**9)
    half = seventy.replace(num_heads=32, num_kv_heads=4, intermediate_size=14336)
    plan = plan_kv_cache(half, EngineConfig(), 2, int(65.71 * GiB), 141 * 10**9, num_devices=2)
    assert plan.max_model_len == 8192 and plan.max_concurrency > 40


def test_explicit_budgets_and_overrides() -> None:
    assert plan_kv_cache(LLAMA8B, EngineConfig(num_gpu_blocks_override=600), 2, 0, None).num_blocks == 600
    assert plan_kv_cache(LLAMA8B, EngineConfig(kv_cache_memory_bytes=2 * GiB), 2, 0, None).num_blocks == 1024
    cpu = plan_kv_cache(LLAMA8B, EngineConfig(), 2, 0, None)  # no device: the fixed host budget
    assert cpu.num_blocks == 4 * GiB // (2 * 2**20)


def test_a_max_model_len_that_cannot_fit_fails_with_numbers_and_the_largest_that_fits() -> None:
    with pytest.raises(ValueError) as exc:
        plan_kv_cache(LLAMA8B, EngineConfig(num_gpu_blocks_override=101), 2, 0, None)
    msg = str(exc.value)
    assert "one 8192-token request needs 512 KV blocks" in msg
    assert "largest max_model_len that fits is 1600" in msg
    assert "--max-model-len" in msg and "--gpu-memory-utilization" in msg


def test_auto_max_model_len_is_the_largest_that_fits() -> None:
    plan = plan_kv_cache(LLAMA8B, EngineConfig(max_model_len="auto", num_gpu_blocks_override=101), 2, 0, None)
    assert plan.max_model_len == 1600
    full = plan_kv_cache(LLAMA8B, EngineConfig(max_model_len="auto", num_gpu_blocks_override=2000), 2, 0, None)
    assert full.max_model_len == 8192  # capped at the model's own context


def test_max_model_len_beyond_the_model_is_rejected() -> None:
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=8192"):
        plan_kv_cache(LLAMA8B, EngineConfig(max_model_len=10000), 2, 0, None)


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_size=12), "block_size"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization"), (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_model_len=0), "max_model_len"), (dict(max_model_len="big"), "max_model_len"),
    (dict(dtype="int8"), "dtype"), (dict(num_gpu_blocks_override=1), "num_gpu_blocks_override"),
    (dict(kv_cache_memory_bytes=-1), "kv_cache_memory_bytes"), (dict(seed=-3), "seed"),
])
def test_invalid_engine_config_names_the_field_and_the_allowed_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"EngineConfig\.{field}=.* is invalid: "):
        EngineConfig(**kwargs)


def test_activation_peak_is_measured_from_shapes_alone() -> None:
    import numpy as np

    from paxserve.models.registry import get_architecture
    from paxserve.worker.step_functions import StepShapes, measure_activation_bytes

    tiny = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=256)
    shapes = StepShapes(tiny, get_architecture(tiny.architecture), np.dtype(np.float32), 16, 2, 9)
    small = measure_activation_bytes(shapes, 16, 2, 4)
    large = measure_activation_bytes(shapes, 256, 8, 16)
    assert 0 < small < large  # more tokens in the largest bucket need more scratch memory


def test_activation_peak_counts_prompt_logprobs_when_they_are_the_heavier_step() -> None:
    """A step scoring every prompt token holds [tokens, vocab] float32 logits: with a large
    vocabulary that, not the plain step's [sequences, vocab], sets the peak."""
    import numpy as np

    from paxserve.models.registry import get_architecture
    from paxserve.worker.step_functions import StepShapes, measure_activation_bytes

    big_vocab = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32768, hidden_size=64, num_layers=1,
                            num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                            max_position_embeddings=256)
    shapes = StepShapes(big_vocab, get_architecture(big_vocab.architecture), np.dtype(np.float32), 16, 2, 5)
    peak = measure_activation_bytes(shapes, 128, 4, 8)
    assert peak >= 128 * 32768 * 4  # the all-token logits alone


def test_allocator_is_sized_from_the_flag_before_the_backend_starts() -> None:
    from paxserve.worker.memory_plan import MEM_FRACTION, configure_allocator

    env: dict[str, str] = {}
    said = configure_allocator(0.85, backend_started=False, environ=env)
    assert env[MEM_FRACTION] == "0.8500" and "85%" in said
    env = {MEM_FRACTION: "0.5"}
    assert "set by the user is kept" in configure_allocator(0.85, backend_started=False, environ=env)
    assert env[MEM_FRACTION] == "0.5"
    env = {}
    assert "already started" in configure_allocator(0.85, backend_started=True, environ=env) and not env


def test_plan_uses_the_devices_total_and_is_capped_by_a_smaller_pool(caplog) -> None:  # noqa: ANN001
    """An H200 (141 GB) whose pool JAX made with the flag's fraction: the plan's budget is 0.9 x the
    total, not 0.9 x the pool; a user's smaller pool caps it (with a warning)."""
    from paxserve.worker.memory_plan import MEM_FRACTION, device_memory

    total = 150_754_820_096
    memory = device_memory({"bytes_limit": int(0.9 * total)}, environ={MEM_FRACTION: "0.9000"})
    assert abs(memory.total_bytes - total) <= 2 and memory.usable(0.9) == memory.pool_bytes
    assert device_memory({"bytes_limit": int(0.75 * total)}, environ={}).total_bytes == pytest.approx(total, abs=2)
    assert device_memory(None) is None and device_memory({}) is None
    config = EngineConfig(gpu_memory_utilization=0.9)
    full = plan_kv_cache(LLAMA8B, config, 2, 16 * GiB, memory.total_bytes, pool_bytes=memory.pool_bytes)
    small_pool = int(0.5 * total)
    capped = plan_kv_cache(LLAMA8B, config, 2, 16 * GiB, memory.total_bytes, pool_bytes=small_pool)
    per_block = kv_bytes_per_block(LLAMA8B, 16, 2)
    assert full.num_blocks == (int(0.9 * total) - 16 * GiB) // per_block
    assert capped.num_blocks == (small_pool - 16 * GiB) // per_block
    assert any("allocator pool" in r.getMessage() for r in caplog.records)
