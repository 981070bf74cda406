"""Shared test helpers: tiny random Hugging Face checkpoints and error measures."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np

# Small enough to compile in about a second, big enough to exercise GQA, multi-block contexts and RoPE.
TINY_BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def make_tiny_llama(directory: Path, seed: int = 0, max_shard_size: str | None = None, **overrides: Any):
    """Write a random `LlamaForCausalLM` with `save_pretrained` and return the torch model (float32, eval).

    Every parameter, biases and norm weights included, is drawn at random: HF initialises biases to
    zero and norms to one, which would hide a missing bias or a misplaced norm.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_BASE, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    return model


def rel_error(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max abs error, max abs error / max |ref|): a scale-aware relative error for logits."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    abs_err = float(np.max(np.abs(ours - ref)))
    return abs_err, abs_err / float(np.max(np.abs(ref)))


def lower_for_cuda(fn, *args) -> str:  # noqa: ANN001
    """StableHLO text of `fn` lowered for CUDA on this GPU-less machine; raises on any lowering error.

    Pallas' Triton lowering needs to know the target GPU; from JAX 0.11 it reads it from an abstract
    mesh's device (earlier versions ignore it), so lower as if for the H200 the GPU checks run on.
    """
    import jax

    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def lower_jitted_for_cuda(jitted: Any, *args: Any, **kwargs: Any) -> Any:
    """`jitted` (already a `jax.jit` function, with its own static and donated arguments, e.g. an
    engine step program) lowered for CUDA on this GPU-less machine, as `lower_for_cuda` does; returns
    the `jax.stages.Lowered`, so a test can read its text, its module and its output shapes.

    Only lowering: nothing is compiled or allocated, so the arguments may be abstract arrays of any
    size (a real-size KV cache of tens of GB)."""
    import jax

    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        return jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))


def load_benchmark(name: str, module_name: str | None = None):  # noqa: ANN201
    """Import `benchmarks/<name>.py` by path (the benchmarks are scripts, not an installed package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(module_name or f"paxserve_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def app_in_thread(app: Any, make_runner: Any = None, timeout: float = 60.0) -> Iterator[str]:
    """Serve an aiohttp `app` on 127.0.0.1 (a free port) from an event loop on a background thread;
    yields its base URL and stops it afterwards. `make_runner(app)` builds the runner (default:
    aiohttp's AppRunner)."""
    import asyncio
    import threading

    from aiohttp import web

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> web.BaseRunner:
        runner = (make_runner or web.AppRunner)(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    runner = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout)
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        loop.close()


def release_compiled_programs() -> None:
    """Drop JAX's compiled-program caches. Every CPU executable keeps memory mappings for its code,
    and one pytest process compiles thousands of programs: without this the whole suite passes the
    kernel's 65530-mapping limit (vm.max_map_count) and XLA aborts mid-compile."""
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


def real_model_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a subprocess that serves the real model: the test process's, without the
    -O0 code generation that tests/conftest.py gives the tests' own process for its tiny models."""
    out = dict(os.environ if env is None else env)
    out["XLA_FLAGS"] = " ".join(f for f in out.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_backend_optimization_level"))
    return out


def compute_logits(runner: Any, batch: Any) -> np.ndarray:
    """Float32 logits [num_seqs, vocab] for the real sequences of `batch` through a ModelRunner's
    model, cache and attention backend, as one jitted forward with no program store and no sampler
    (the parity tests' path; the runner's cache takes the step's K/V)."""
    from paxserve.worker.model_runner import host_copy
    from paxserve.worker.step_functions import jitted_logits

    logits, runner.kv_cache = jitted_logits(runner.model.architecture.forward)(*runner.forward_args(batch),
                                                                               **runner.shapes.statics())
    return host_copy(logits)[: batch.num_seqs]



def quantize_loaded(params: Any, method: str) -> Any:
    """A loaded model's params with the fields `--quantization` quantizes quantized as the loader
    does (per layer and output channel, from the loaded values), on one device: the real GGUF models
    quantized without writing them out as float checkpoints first."""
    import jax
    import jax.numpy as jnp

    from paxserve.models.layout import QUANTIZABLE
    from paxserve.models.quant_weights import WeightQuantization, dequantize_kept
    from paxserve.models.sharding import map_fields

    quantization = WeightQuantization(method)
    params = dequantize_kept(params, jnp.float32)  # the GGUF's own formats first, as a float checkpoint holds them

    def one(path: str, leaf: Any) -> Any:
        return jax.tree.map(jnp.asarray, quantization.quantize(np.asarray(leaf))) if path in QUANTIZABLE else leaf

    return map_fields(one, params)


def load_hf_smollm2() -> tuple[Any, Any]:
    """transformers' own SmolLM2 (float32, eval) and tokenizer from the bundled GGUF. Reading the file
    takes transformers ~20 s (most of it parsing the GGUF metadata in Python), in every xdist worker
    that needs it: the first saves what transformers made under the run's cache folder and the others
    load that (~1 s): the same model, transformers' own conversion of the file."""
    import pickle

    import torch
    import transformers
    from filelock import FileLock
    from safetensors.torch import load_model, save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paxserve.models.bundled import default_model_path

    path = default_model_path()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    saved = cache / "paxserve" / f"hf-{path.stem}-{path.stat().st_size}-transformers-{transformers.__version__}"
    saved.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(saved) + ".lock"):
        if not (saved / "done").exists():
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            # transformers refuses to save a model read from a GGUF file: its config and tensors go
            # as they are, and come back into a model made from that config.
            saved.mkdir(exist_ok=True)
            with open(saved / "config.pickle", "wb") as f:
                pickle.dump(model.config, f)
            save_model(model, str(saved / "model.safetensors"))
            tokenizer.save_pretrained(str(saved))
            (saved / "done").touch()
            return model.eval(), tokenizer
    with open(saved / "config.pickle", "rb") as f:
        config = pickle.load(f)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    load_model(model, str(saved / "model.safetensors"))
    return model.eval(), AutoTokenizer.from_pretrained(str(saved))


def write_random_lora(directory: Path, num_layers: int, shapes: dict[str, tuple[str, int, int]], rank: int,
                      seed: int, alpha: float | None = None, base_model: str | None = None, scale: float = 1.0) -> Path:
    """A random LoRA adapter in PEFT's files, written without torch: `shapes` maps each target module
    ("q_proj") to (its parent, "self_attn" or "mlp", in features, out features). lora_B is drawn
    too (PEFT starts it at zero, which would change nothing)."""
    import json

    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(num_layers):
        for module, (parent, rows_in, rows_out) in shapes.items():
            stem = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{stem}.lora_A.weight"] = (rng.standard_normal((rank, rows_in)) / np.sqrt(rows_in)).astype(np.float32)
            tensors[f"{stem}.lora_B.weight"] = (scale * rng.standard_normal((rows_out, rank)) / np.sqrt(rank)).astype(
                np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha or 2 * rank,
              "target_modules": sorted(shapes), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
              "base_model_name_or_path": base_model, "inference_mode": True}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


# SmolLM2-135M's projections, for `write_random_lora`.
SMOLLM2_LORA_SHAPES: dict[str, tuple[str, int, int]] = {
    "q_proj": ("self_attn", 576, 576), "k_proj": ("self_attn", 576, 192), "v_proj": ("self_attn", 576, 192),
    "o_proj": ("self_attn", 576, 576), "gate_proj": ("mlp", 576, 1536), "up_proj": ("mlp", 576, 1536),
    "down_proj": ("mlp", 1536, 576)}
