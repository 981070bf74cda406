"""Load-time weight quantization (--quantization fp8 / int8): the formats, the matmul that reads
them, the tensor-parallel split of values and scales, the start-up numerics check (that it passes a
sound setting and stops a wrong scale), and the errors for what cannot be quantized."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxserve.config import QUANTIZATION_METHODS, EngineConfig, QuantizationCheck
from paxserve.models import load_model
from paxserve.models.layers import dense
from paxserve.models.layout import QUANTIZABLE
from paxserve.models.quant_weights import QUANTIZATION_METHODS as FORMATS, QuantizedWeight, WeightQuantization
from paxserve.models.sharding import field_paths
from paxserve.worker.memory_plan import kv_bytes_per_block
from paxserve.worker.model_runner import ModelRunner
from paxserve.worker.quantization_check import check_against, enforce, make_probe, run_check
from paxserve.kernels import REFERENCE
from tests.helpers import make_tiny_llama, rel_error
from tests.paged_greedy import greedy_tokens_and_logits


def test_the_config_and_the_formats_name_the_same_methods() -> None:
    from paxserve.config import KV_CACHE_DTYPES as KV_NAMES
    from paxserve.kernels.kv_cache import KV_CACHE_DTYPES

    assert QUANTIZATION_METHODS == (*FORMATS, "gguf", "compressed-tensors", "awq", "gptq")
    assert set(KV_NAMES) == {"auto", *KV_CACHE_DTYPES}


@pytest.mark.parametrize("method,bound", [("int8", 0.5 / 127), ("fp8", 2.0**-4)])
def test_per_channel_quantization_keeps_each_weight_within_its_format_s_rounding(method: str, bound: float) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 64, 24)).astype(np.float32) * rng.uniform(0.01, 10, (3, 1, 24)).astype(np.float32)
    w[1, :, 5] = 0.0  # an all-zero channel
    q = WeightQuantization(method).quantize(w)
    assert q.q.dtype == WeightQuantization(method).storage and q.scale.shape == (3, 1, 24)
    assert q.scale[1, 0, 5] == 1.0 and np.all(np.asarray(q.q[1, :, 5], np.float32) == 0)
    back = np.asarray(q.q, np.float32) * q.scale
    amax = np.max(np.abs(w), axis=-2, keepdims=True)
    # int8: half a step of amax/127; fp8: 3 mantissa bits, relative to the value (or its channel's amax)
    scale_of = amax if method == "int8" else np.maximum(np.abs(w), amax * 2.0**-6)
    err = np.abs(back - w) / np.maximum(scale_of, 1e-30)
    assert float(np.max(err)) <= bound * 1.0001
    abstract = WeightQuantization(method).abstract(w.shape)
    assert (abstract.q.shape, abstract.q.dtype, abstract.scale.shape) == (q.q.shape, q.q.dtype, q.scale.shape)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_the_matmul_dequantizes_inside_the_product(method: str) -> None:
    """x @ QuantizedWeight equals x @ the dequantized weight (the scale applied to the float32
    product is the same arithmetic up to rounding), and the row-parallel reduce sees float32."""
    rng = np.random.default_rng(1)
    w = WeightQuantization(method).quantize(rng.standard_normal((48, 20)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((5, 48)), jnp.float32)
    qw = jax.tree.map(jnp.asarray, w)
    got = np.asarray(dense(x, qw))
    want = np.asarray(dense(x, qw.dequantize()))
    assert rel_error(got, want)[1] < 1e-6


def test_fp8_activations_follow_the_weight_only_product_within_fp8_rounding() -> None:
    """The Hopper path (fp8 x fp8 with per-token activation scales) as XLA computes it here."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((7, 64)) * rng.uniform(0.1, 30, (7, 1)), jnp.float32)
    weight_only = jax.tree.map(jnp.asarray, WeightQuantization("fp8").quantize(w))
    with_activations = QuantizedWeight(weight_only.q, weight_only.scale, fp8_activations=True)
    a, b = np.asarray(dense(x, with_activations)), np.asarray(dense(x, weight_only))
    assert rel_error(a, b)[1] < 0.05  # one more fp8 rounding, of the activations (2^-4 relative each)
    assert WeightQuantization.for_device("fp8", "gpu", "9.0").fp8_activations
    assert not WeightQuantization.for_device("fp8", "gpu", "8.0").fp8_activations
    assert not WeightQuantization.for_device("fp8", "cpu", None).fp8_activations
    assert not WeightQuantization.for_device("int8", "gpu", "9.0").fp8_activations


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("quant-llama")
    make_tiny_llama(directory, seed=3, num_key_value_heads=2)
    return directory


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(3, 250, n).tolist() for n in (6, 19)]


def test_quantized_params_hold_int8_values_and_scales_only_where_vllm_quantizes(tiny: Path) -> None:
    model = load_model(tiny, quantization="int8")
    quantized = {p.rsplit(".", 1)[0] for p in field_paths(model.params) if p.endswith(".q")}
    assert quantized == {p for p in QUANTIZABLE if p.startswith("layers.")}
    assert model.params.embed.dtype == np.float32 and model.params.lm_head.dtype == np.float32
    full = load_model(tiny)
    nbytes = lambda p: sum(x.nbytes for x in jax.tree_util.tree_leaves(p))  # noqa: E731
    linear = sum(getattr(full.params.layers, f.split(".")[1]).nbytes for f in quantized)
    # int8 values (a quarter of float32) and one float32 scale per output column
    assert nbytes(full.params) - nbytes(model.params) > 0.7 * linear


def test_quantized_forward_equals_the_dequantized_model_and_stays_near_the_full_one(tiny: Path) -> None:
    """The paged, batched path with int8 weights computes what a float model holding the
    dequantized weights computes (tokens equal, logits to float rounding); against the original
    weights, logits stay close."""
    prompts = _prompts()
    model = load_model(tiny, quantization="int8", keep_unquantized=True)
    dequantized = jax.tree.map(lambda w: w.dequantize() if isinstance(w, QuantizedWeight) else w, model.params,
                               is_leaf=lambda w: isinstance(w, QuantizedWeight))
    results = []
    for params in (model.params, dequantized, model.unquantized_params):
        model.params = params
        runner = ModelRunner(model, num_blocks=16, block_size=8, max_model_len=64)
        results.append(greedy_tokens_and_logits(runner, prompts, 6, shuffle_seed=1))
    (tokens_q, logits_q), (tokens_d, logits_d), (_, logits_full) = results
    assert tokens_q == tokens_d
    assert max(rel_error(a, b)[1] for la, lb in zip(logits_q, logits_d) for a, b in zip(la, lb)) < 1e-5
    # The prompt's logits (later steps may follow different tokens): int8's rounding of random weights
    assert max(rel_error(la[0], lb[0])[1] for la, lb in zip(logits_q, logits_full)) < 0.1


def _check(model) -> object:  # noqa: ANN001
    return run_check(make_probe(model, REFERENCE), model.params, model.unquantized_params)


def test_the_check_passes_a_sound_setting_and_stops_a_wrong_scale(tiny: Path) -> None:
    model = load_model(tiny, quantization="int8", keep_unquantized=True)
    sound = _check(model)
    assert sound.top1 >= 0.9 and sound.mean_kl < 0.01
    enforce(sound, QuantizationCheck(), "int8")
    layers = model.params.layers
    # One field's scales off by 2x: a bug of the kind the check exists for.
    wrong = layers.replace(up_w=layers.up_w.replace(scale=layers.up_w.scale * 2))
    model.params = model.params.replace(layers=wrong)
    broken = _check(model)
    assert broken.mean_kl > 10 * sound.mean_kl
    with pytest.raises(ValueError, match=r"quantization check failed for int8: top-1 agreement .* mean KL"):
        enforce(broken, QuantizationCheck(max_kl=3 * sound.mean_kl), "int8")


@pytest.mark.parametrize("text,parsed", [
    ("on", QuantizationCheck()), ("off", QuantizationCheck(enabled=False)),
    ("top1=0.95", QuantizationCheck(min_top1=0.95)), ("kl=0.02,top1=0.5", QuantizationCheck(min_top1=0.5, max_kl=0.02)),
])
def test_check_thresholds_parse(text: str, parsed: QuantizationCheck) -> None:
    assert QuantizationCheck.parse(text) == parsed


@pytest.mark.parametrize("kwargs,match", [
    (dict(quantization="marlin"),
     r"EngineConfig.quantization='marlin' is invalid: must be None or one of fp8, int8, gguf, compressed-tensors, awq"),
    (dict(quantization_check="top1=2"), r"quantization_check='top1=2' is invalid"),
    (dict(quantization_check="strict"), r"quantization_check='strict' is invalid"),
])
def test_engine_config_rejects_unknown_methods_and_thresholds(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_a_quantized_checkpoint_is_not_quantized_again(tiny: Path, tmp_path: Path) -> None:
    from paxserve.models.bundled import default_model_path

    with pytest.raises(ValueError, match=r"quantization='int8' cannot apply to .*gguf.*quantized already \(gguf\)"):
        load_model(default_model_path(), quantization="int8")
    with pytest.raises(ValueError, match=r"quantization='gguf' is the method of gguf checkpoints.*not quantized"):
        load_model(tiny, quantization="gguf")
    pre = tmp_path / "pre"
    pre.mkdir()
    for f in tiny.iterdir():
        (pre / f.name).write_bytes(f.read_bytes())
    config = json.loads((tiny / "config.json").read_text())
    (pre / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "bitsandbytes"}}))
    with pytest.raises(ValueError, match=r"pre-quantized checkpoint \(quantization_config: quant_method='bitsandbytes'\)"):
        load_model(pre)


# ---- fp8 KV cache ---------------------------------------------------------------------------------

def _fp8() -> np.dtype:
    from paxserve.kernels.kv_cache import KV_CACHE_DTYPES

    return KV_CACHE_DTYPES["fp8"]


def test_fp8_cache_with_calibrated_scales_stays_near_the_full_cache_and_a_wrong_scale_is_caught(tiny: Path) -> None:
    model = load_model(tiny)
    probe = make_probe(model, REFERENCE)
    reference, cache = probe.prefill(model.params)
    scales = probe.scales_from(cache, _fp8())
    assert all(s.shape == (model.config.num_layers,) and np.all(s > 0) for s in scales)
    sound = check_against(probe, reference, model.params, _fp8(), scales)
    assert sound.top1 >= 0.85 and sound.mean_kl < 0.01  # a random model's near-ties flip more than a real one's
    # Scales 100x too small: K and V saturate at fp8's largest value.
    wrong = check_against(probe, reference, model.params, _fp8(), tuple(s / 100 for s in scales))
    assert wrong.mean_kl > 10 * sound.mean_kl
    with pytest.raises(ValueError, match="quantization check failed"):
        enforce(wrong, QuantizationCheck(max_kl=3 * sound.mean_kl), "fp8 KV cache")


def test_int8_weights_and_an_fp8_cache_at_tp_1_and_2(tiny: Path) -> None:
    """Shuffled pages, batched decoding, int8 weights on an fp8 cache (uint8 bits, scales applied
    around the kernel): column-parallel scales split with their columns, a row-parallel weight's
    per-channel scale is whole on every device, TP 2 computes TP 1's logits, the setting tracks the
    unquantized model, and a reset keeps the cache's scales."""
    prompts = _prompts()
    full = load_model(tiny)
    probe = make_probe(full, REFERENCE)
    scales = probe.scales_from(probe.prefill(full.params)[1], _fp8())
    base = greedy_tokens_and_logits(ModelRunner(full, num_blocks=16, block_size=8, max_model_len=64), prompts, 4,
                                    shuffle_seed=3)
    out = {}
    for size in (1, 2):
        model = load_model(tiny, quantization="int8", tensor_parallel_size=size)
        if size == 2:
            qkv, o = model.params.layers.qkv_w, model.params.layers.o_w
            assert qkv.q.sharding.spec == qkv.scale.sharding.spec == jax.sharding.PartitionSpec(None, None, "tp")
            assert o.q.sharding.spec == jax.sharding.PartitionSpec(None, "tp", None)
            assert o.scale.is_fully_replicated
        runner = ModelRunner(model, num_blocks=16, block_size=8, max_model_len=64, kv_cache_dtype=_fp8(),
                             kv_scales=scales)
        assert runner.kv_cache.k.dtype == np.uint8 and runner.kv_cache.fp8 == "float8_e4m3fn"
        out[size] = greedy_tokens_and_logits(runner, prompts, 4, shuffle_seed=size)
        runner.reset_kv_cache()
        assert np.array_equal(np.asarray(runner.kv_cache.k_scale), scales[0])
    # int8 and fp8 round each weight and each K and V; a random model's logits move by several
    # percent (the check's KL measures what users would see), a wrong scale by far more (tests above).
    assert max(rel_error(a[0], b[0])[1] for a, b in zip(out[1][1], base[1])) < 0.2
    assert out[2][0] == out[1][0]
    assert max(rel_error(a, b)[1] for la, lb in zip(out[2][1], out[1][1]) for a, b in zip(la, lb)) < 1e-5


def test_engine_plans_four_times_the_blocks_for_an_fp8_cache_of_a_float32_model(tiny: Path, caplog) -> None:
    from paxserve import Engine, SamplingParams

    budget = 2**20
    with caplog.at_level("INFO"):
        fp8 = Engine(str(tiny), kv_cache_memory_bytes=budget, kv_cache_dtype="fp8", calculate_kv_scales=True,
                     quantization_check="top1=0.8,kl=0.05", warmup=False, compilation_cache_dir="",
                     log_stats_interval=0)
    cfg = fp8.parts.model.config  # one byte per value: 4x the float32 cache's blocks in the same budget
    assert fp8.parts.plan.num_blocks == budget // kv_bytes_per_block(cfg, 16, 1)
    assert budget // kv_bytes_per_block(cfg, 16, 1) == 4 * (budget // kv_bytes_per_block(cfg, 16, 4))
    assert "so 4.0x the tokens fit" in caplog.text and "quantization check passed for float8_e4m3fn KV cache" \
        in caplog.text
    params = SamplingParams(temperature=0.0, max_tokens=6)
    got = fp8.generate([_prompts()[1]], params)[0].outputs[0].token_ids
    assert len(got) == 6
    # A restart of the same setting reads the stored outcome (figures and scales) instead of
    # running the check again, and still applies the thresholds to it.
    caplog.clear()
    with caplog.at_level("INFO"):
        again = Engine(str(tiny), kv_cache_memory_bytes=budget, kv_cache_dtype="fp8", calculate_kv_scales=True,
                       quantization_check="top1=0.8,kl=0.05", warmup=False, compilation_cache_dir="",
                       log_stats_interval=0)
    assert "its stored figures are used" in caplog.text and again.parts.numerics_check == fp8.parts.numerics_check
    assert np.array_equal(np.asarray(again.parts.runner.kv_cache.k_scale), np.asarray(fp8.parts.runner.kv_cache.k_scale))
    assert again.generate([_prompts()[1]], params)[0].outputs[0].token_ids == got
    with pytest.raises(ValueError, match="quantization check failed"):
        Engine(str(tiny), kv_cache_memory_bytes=budget, kv_cache_dtype="fp8", calculate_kv_scales=True,
               quantization_check="top1=0.8,kl=0.0000001", warmup=False, compilation_cache_dir="",
               log_stats_interval=0)
    with pytest.raises(ValueError, match="calculate_kv_scales=True is invalid: computes the scales of an fp8"):
        EngineConfig(calculate_kv_scales=True)


def test_an_fp8_cache_with_unit_scales_serves(tiny: Path, caplog) -> None:
    """No checkpoint scales and no --calculate-kv-scales: K and V scales of 1.0, two arrays (one
    array for both was donated twice by every step, and every step failed)."""
    from paxserve import Engine, SamplingParams

    with caplog.at_level("WARNING"):
        engine = Engine(str(tiny), kv_cache_memory_bytes=2**20, kv_cache_dtype="fp8", quantization_check="off",
                        warmup=False, compilation_cache_dir="", log_stats_interval=0)
    assert "1.0" in caplog.text
    out = engine.generate([_prompts()[1]], SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_several_hosts_always_run_the_check_together(tiny: Path) -> None:
    """A stored outcome one host has and another has not would leave them out of step in the
    check's collectives: with nnodes > 1 no record is read or written."""
    from paxserve.engine.numerics import NumericsPlan
    from paxserve.models.loader import inspect_model

    info = inspect_model(tiny, quantization="int8")
    one = NumericsPlan.make(EngineConfig(model=str(tiny), quantization="int8"), info, None, None, None)
    two = NumericsPlan.make(EngineConfig(model=str(tiny), quantization="int8", nnodes=2, tensor_parallel_size=2),
                            info, None, None, None)
    assert one.check and one.key is not None
    assert two.check and two.key is None and two.stored is None and two.needs_unquantized
