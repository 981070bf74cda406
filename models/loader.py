"""Load a model: resolve the source, read its config, check and convert its tensors, load its tokenizer.

Sources: a Hugging Face checkpoint directory (`config.json` + safetensors), a `.gguf` file (or a
directory holding one), or None for the bundled default. A GGUF file's conversion is slow, so its
result goes to the on-disk param cache (models/param_cache.py), keyed by the file, the target dtype
and whether its weights stay quantized. Pre-quantized checkpoints (GGUF, compressed-tensors, AWQ,
GPTQ) are read as stored (models/stored_quantization.py and the format modules).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from paxserve.models.awq_gptq import GroupCheckpoint, GroupScheme
from paxserve.models.bundled import default_model_path
from paxserve.models.compressed_tensors import CompressedCheckpoint, WeightScheme
from paxserve.models.config import ModelConfig, model_config_from_hf
from paxserve.models.gguf_io import GGUFCheckpoint
from paxserve.models.gguf_weights import KEPT_TYPES, GroupFormat
from paxserve.models.layout import KEPT_TOP, stored_formats
from paxserve.models.param_cache import cache_key, cache_root, converting, restore_cached, save_cached
from paxserve.kernels.matmul_dispatch import MatmulKernel, cpu_matmul_kernel
from paxserve.models.quant_weights import QUANTIZATION_METHODS, WeightQuantization, with_matmul_kernel
from paxserve.models.registry import Architecture, Quantization, get_architecture
from paxserve.models.safetensors_io import SafetensorsCheckpoint
from paxserve.models.sharding import TensorParallel, map_fields, param_bytes
from paxserve.models.stored_quantization import StoredQuantization
from paxserve.models.tokenizer import tokenizer_from_directory, tokenizer_from_gguf

logger = logging.getLogger(__name__)

DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


@dataclass
class LoadedModel:
    """A model ready to run: static config, params pytree, forward and tokenizer."""

    config: ModelConfig
    params: Any
    architecture: Architecture
    tokenizer: PreTrainedTokenizerBase | None
    dtype: np.dtype
    source: str
    generation_config: dict[str, Any] = field(default_factory=dict)
    load_seconds: float = 0.0
    from_cache: bool = False
    tp: TensorParallel | None = None  # how params are split over devices (None: one device)
    quantization: Quantization = None  # how the linear weights were quantized at load, or kept as stored
    # The same model unquantized (`load_model(keep_unquantized=True)`), for the start-up numerics
    # check; whoever asked for it drops it (sets it to None) before the KV cache is made.
    unquantized_params: Any = None
    # The checkpoint's own per-layer fp8 K and V scales (a compressed-tensors kv_cache_scheme), or None.
    kv_scales: tuple[np.ndarray, np.ndarray] | None = None


def resolve_source(model: str | os.PathLike | None) -> tuple[str, Path]:
    """("hf", directory) or ("gguf", file) for what the user passed."""
    if model is None:
        return "gguf", default_model_path()
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf", path.resolve()
        raise ValueError(f"model {str(model)!r} is a file but not a .gguf file; pass a checkpoint directory or a .gguf")
    if path.is_dir():
        if (path / "config.json").exists():
            return "hf", path.resolve()
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0].resolve()
        raise ValueError(
            f"model directory {str(model)!r} has no config.json"
            + (f" and several .gguf files {[g.name for g in ggufs]}; pass one of them" if ggufs else
               " (a Hugging Face checkpoint directory needs config.json and safetensors weights)")
        )
    raise ValueError(
        f"model {str(model)!r} is not a local directory or .gguf file, nor a Hugging Face Hub id (org/name, or "
        "org/name:FILE.gguf)"
    )


def resolve_dtype(dtype: str, hf_config: dict[str, Any], kind: str) -> np.dtype:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; choose one of: auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if kind == "gguf":
        # The file's weights are kept quantized and dequantized inside each matmul to this dtype:
        # bfloat16 on a GPU (half the activation traffic, tensor cores); float32 on a CPU, where
        # XLA's bfloat16 products are many times slower (benchmarks/RESULTS.md).
        return DTYPES["bfloat16"] if jax.default_backend() == "gpu" else DTYPES["float32"]
    declared = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    return DTYPES.get(str(declared).removeprefix("torch."), DTYPES["float32"])


def check_tensors(
    arch: Architecture, cfg: ModelConfig, names: set[str], shape_of: Callable[[str], tuple[int, ...]], source: str
) -> None:
    """Strict: every expected tensor present with its exact shape, nothing unexpected."""
    expected = arch.hf_tensor_shapes(cfg)
    ignorable = {n for n in names if n.endswith(arch.hf_ignored_suffixes) or n.startswith(arch.hf_ignored_prefixes)}
    if cfg.tie_word_embeddings:
        ignorable.add("lm_head.weight")  # some tied checkpoints still store the copy
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected) - ignorable)
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(
            f"unexpected tensors ({len(unexpected)}): {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    for name in sorted(set(expected) & names):
        if tuple(shape_of(name)) != expected[name]:
            problems.append(f"tensor {name!r} has shape {tuple(shape_of(name))}, expected {expected[name]}")
    if problems:
        raise ValueError(f"checkpoint {source} does not match {cfg.architecture}: " + "; ".join(problems))


def _gguf_cache_entry(path: Path, dtype: str, cache_dir: str | os.PathLike | None, keep: bool = True) -> Path:
    # The key needs the resolved dtype, which for GGUF does not depend on the file's contents.
    key = cache_key(path, resolve_dtype(dtype, {}, "gguf"))
    return cache_root(cache_dir) / "params" / (key if keep else f"{key}-dequantized")


def gguf_keeps_quantized(path: Path, method: str | None, dtype: str = "auto") -> tuple[bool, str]:
    """Whether a GGUF file's weights stay quantized on the device, and why (for the log). Always
    on an accelerator and with `--quantization gguf`. On a CPU, for a float32 model, they stay
    quantized when paxserve's CPU kernel builds and passes its self-check (it reads the codes
    where they lie: a decode step reads the file's bytes instead of 4-8x as many in float32);
    without it they are dequantized at load while that fits easily (XLA:CPU writes out each
    dequantized weight before its product, about 2x slower than reading float32 weights,
    benchmarks/RESULTS.md), and a file whose dequantized weights could take half the host's memory
    (estimated as 8x the file: float32 from 4-bit) stays quantized."""
    if method == "gguf":
        return True, "--quantization gguf"
    if jax.default_backend() != "cpu":
        return True, f"on {jax.default_backend().upper()} the weights stay as the file stores them"
    kernel = _cpu_kernel(dtype)
    if not isinstance(kernel, str):
        return True, "on a CPU, paxserve's CPU kernel reads them at their own width"
    why_not = kernel
    estimate, ram = 8 * path.stat().st_size, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if estimate > ram // 2:
        return True, (f"dequantized they could take {estimate / 2**30:.1f} GiB, over half of this host's "
                      f"{ram / 2**30:.1f} GiB ({why_not})")
    return False, (f"{why_not}; on a CPU without it, dequantized weights decode about 2x faster (XLA:CPU "
                   "materializes each dequantized weight); --quantization gguf keeps them quantized")


def _cpu_kernel(dtype: str) -> MatmulKernel | str:
    """The CPU matmul kernel for a GGUF model of this dtype on a CPU, or why it does not serve."""
    if resolve_dtype(dtype, {}, "gguf") != np.float32:
        return "the CPU kernel takes float32 models"
    kernel = cpu_matmul_kernel()
    return f"the CPU kernel is not available ({kernel})" if isinstance(kernel, str) else kernel


def _convert(arch: Architecture, cfg: ModelConfig, ckpt: Any, dtype: np.dtype, desc: str,
             place: Callable[[str, np.ndarray], Any] | None = None,
             quantization: Quantization = None, keep_unquantized: bool = False,
             stored: Any = None) -> tuple[Any, Any]:
    total = len(arch.hf_tensor_shapes(cfg))
    with tqdm(total=total, desc=desc, unit="tensor", leave=False, disable=None) as bar:

        def read(name: str) -> np.ndarray:
            bar.update(1)
            return ckpt.read(name)

        return arch.params_from_hf(read, cfg, dtype, place, quantization, keep_unquantized,
                                   None if stored is None else _Counted(stored, bar))


class _Counted:
    """A stored-tensor reader whose reads advance the progress bar."""

    def __init__(self, stored: Any, bar: Any) -> None:
        self._stored, self._bar = stored, bar

    def read_codes(self, name: str) -> Any:
        self._bar.update(1)
        return self._stored.read_codes(name)

    def read_channel(self, name: str) -> Any:
        self._bar.update(1)
        return self._stored.read_channel(name)


def _keep_on_host(path: str, array: np.ndarray) -> np.ndarray:
    return array


def _tensor_parallel(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> TensorParallel | None:
    return TensorParallel.create(cfg, size, expert_parallel=expert_parallel) if size > 1 else None


def _device_bytes(params: Any) -> int:
    """Bytes of params the first device holds."""
    return int(sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree_util.tree_leaves(params)))


def _place_all(params: Any, tp: TensorParallel) -> Any:
    """Params already assembled (a GGUF conversion or its cache) onto the mesh, field by field."""
    def place(path: str, leaf: Any) -> jax.Array:
        placed = tp.place(path, np.asarray(leaf))
        if isinstance(leaf, jax.Array):
            leaf.delete()  # one field on the default device at a time
        return placed

    return map_fields(place, params)


class _RenamedCheckpoint:
    """A checkpoint seen through a tensor renaming (legacy names -> the ones the layout uses)."""

    def __init__(self, ckpt: Any, rename: Callable[[str], str]) -> None:
        self._ckpt = ckpt
        self._original = {rename(n): n for n in ckpt.names()}

    def names(self) -> set[str]:
        return set(self._original)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._ckpt.shape(self._original[name])

    def read(self, name: str) -> np.ndarray:
        return self._ckpt.read(self._original[name])


def _as_laid_out(ckpt: Any, arch: Architecture) -> Any:
    """The checkpoint under the tensor names the architecture's layout uses."""
    if arch.rename is not None:
        ckpt = _RenamedCheckpoint(ckpt, arch.rename)
    return ckpt if arch.view is None else arch.view(ckpt)


def _read_hf_config(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{directory / 'config.json'} is not valid JSON: {e}") from None


def _model_spec(hf_config: dict[str, Any], dtype: str, kind: str) -> tuple[ModelConfig, Architecture, np.dtype]:
    cfg = model_config_from_hf(hf_config)
    return cfg, get_architecture(cfg.architecture), resolve_dtype(dtype, hf_config, kind)


def _load_gguf(
    path: Path, dtype: str, cache_dir: str | os.PathLike | None, use_cache: bool, tp_size: int = 1,
    expert_parallel: bool = False, keep: bool = True,
) -> tuple[Any, dict[str, Any], Any, bool, TensorParallel | None]:
    """Dequantising a GGUF is slow, so its converted params, config and tokenizer are cached on disk
    (in the whole model's layout, whatever the tensor parallelism: they are split afterwards).
    Returns (params, hf_config, tokenizer, from_cache, the split or None)."""
    def abstract_of(hf_config: dict[str, Any]) -> Any:
        cfg, arch, np_dtype = _model_spec(hf_config, dtype, "gguf")
        return arch.abstract_params(cfg, np_dtype, gguf_quantization(hf_config))

    entry = _gguf_cache_entry(path, dtype, cache_dir, keep)
    if not use_cache:
        params, hf_config, tokenizer, tp = _convert_gguf(path, dtype, tp_size, expert_parallel, keep)
        return (params if tp is None else _place_all(params, tp)), hf_config, tokenizer, False, tp
    cached = restore_cached(entry, abstract_of)
    if cached is None:
        # Replicas starting together would each spend the whole conversion on the same file: the
        # first converts, the others wait for its entry and read it.
        with converting(entry, path):
            cached = restore_cached(entry, abstract_of)
            if cached is None:
                params, hf_config, tokenizer, tp = _convert_gguf(path, dtype, tp_size, expert_parallel, keep)
                save_cached(entry, params, hf_config, tokenizer)
                return (params if tp is None else _place_all(params, tp)), hf_config, tokenizer, False, tp
    params, hf_config, tokenizer = cached
    tp = _tensor_parallel(_model_spec(hf_config, dtype, "gguf")[0], tp_size, expert_parallel)
    return (params if tp is None else _place_all(params, tp)), hf_config, tokenizer, True, tp


def _convert_gguf(path: Path, dtype: str, tp_size: int, expert_parallel: bool, keep: bool
                  ) -> tuple[Any, dict[str, Any], Any, TensorParallel | None]:
    """(params in the whole model's layout, on the host when they are to be split; hf_config;
    tokenizer; the split or None)."""
    gguf_file = GGUFCheckpoint(path)
    hf_config = _gguf_hf_config(gguf_file, dtype, keep, log=True)
    cfg, arch, np_dtype = _model_spec(hf_config, dtype, "gguf")
    tp = _tensor_parallel(cfg, tp_size, expert_parallel)
    ckpt = _as_laid_out(gguf_file, arch)
    check_tensors(arch, cfg, ckpt.names(), ckpt.shape, str(path))
    params, _ = _convert(arch, cfg, ckpt, np_dtype, f"Reading {path.name}", None if tp is None else _keep_on_host,
                         gguf_quantization(hf_config), stored=gguf_file)
    return params, hf_config, tokenizer_from_gguf(gguf_file), tp


_GGUF_FORMATS = "paxserve_gguf_formats"  # the key of a GGUF's kept formats in its hf_config (and cache entry)


def gguf_quantization(hf_config: dict[str, Any]) -> StoredQuantization:
    """How a GGUF file's weights are kept, as `_gguf_hf_config` recorded it."""
    return StoredQuantization.from_json(hf_config.get(_GGUF_FORMATS, {}))


def _kept(quantization: StoredQuantization) -> StoredQuantization | None:
    """The stored quantization, or None when it keeps no field quantized (a GGUF dequantized at load)."""
    return quantization if quantization.formats else None


def _gguf_hf_config(gguf_file: GGUFCheckpoint, dtype: str, keep: bool, log: bool = False) -> dict[str, Any]:
    """The file's HF config plus how its linear weights are kept (decided from the tensors'
    formats alone): with `keep`, quantized where every layer's format is one paxserve keeps, at
    full width where a layer's tensor is float or in another format (dequantized at load)."""
    hf_config = gguf_file.hf_config()
    cfg, arch, np_dtype = _model_spec(hf_config, dtype, "gguf")
    kept, full = stored_formats(arch.layout(cfg), cfg.num_layers, "gguf", gguf_file.types,
                                lambda types, width: GroupFormat.for_types(types) if keep else None, KEPT_TOP)
    if log and keep:
        for path, fmt in kept.formats:
            logger.info("GGUF %s kept quantized: %s (%.2f bits per weight)", path, fmt.describe(), fmt.bits_per_weight())
        for path, types in full.items():
            logger.info("GGUF %s dequantized at load to %s: its tensors are %s (kept quantized: %s)", path,
                        np_dtype.name, "/".join(types), ", ".join(KEPT_TYPES))
    return {**hf_config, _GGUF_FORMATS: kept.to_json()}


def _hf_checkpoint(path: Path, hf_config: dict[str, Any], arch: Architecture, cfg: ModelConfig, log: bool = False
                   ) -> tuple[Any, StoredQuantization | None]:
    """The checkpoint's tensors, and for a pre-quantized one (compressed-tensors, AWQ, GPTQ), how its
    weights are kept (from its headers and config alone)."""
    raw = SafetensorsCheckpoint(path)
    qc = hf_config.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method not in STORED_METHODS:
        return raw, None
    ct = CompressedCheckpoint(raw, WeightScheme.parse(qc, path)) if method == "compressed-tensors" else \
        GroupCheckpoint(raw, GroupScheme.parse(qc, path))
    names = ct.names()
    device = jax.local_devices()[0]

    def fmt(types: list[str], width: int) -> Any:
        f = ct.format_for(types, width)
        return WeightQuantization.for_device(f, device.platform, getattr(device, "compute_capability", None)) \
            if isinstance(f, str) else f

    kept, full = stored_formats(arch.layout(cfg), cfg.num_layers, method,
                                lambda name: ct.types(name) if name in names else ["not stored as such"], fmt)
    if log:
        logger.info("%s checkpoint: %s; kept as stored: %s", method, ct.scheme.describe(),
                    ", ".join(path for path, _ in kept.formats) or "none")
        for field_path, types in full.items():
            logger.info("%s %s dequantized at load: its tensors are %s", method, field_path, "/".join(types))
    return ct, kept


# Checkpoints quantized already, read as stored (vLLM's method names).
STORED_METHODS = ("gguf", "compressed-tensors", "awq", "gptq")


def resolve_quantization(method: str | None, kind: str, hf_config: dict[str, Any], source: str | Path
                         ) -> WeightQuantization | None:
    """The load-time quantization `method` asks for (None: none), checked against the checkpoint:
    one that is quantized already (a GGUF file, or a `quantization_config` in config.json) is read
    as it is, so asking for another method is an error naming both."""
    stored = "gguf" if kind == "gguf" else (hf_config.get("quantization_config") or {}).get("quant_method")
    if kind == "hf" and "quantization_config" in hf_config and stored not in STORED_METHODS:
        raise ValueError(f"{source} is a pre-quantized checkpoint (quantization_config: quant_method={stored!r}); "
                         f"paxserve reads {', '.join(repr(m) for m in STORED_METHODS)} checkpoints, not this one yet: "
                         "load the unquantized checkpoint, with --quantization fp8 or int8 to quantize it at load")
    if method is None or method == stored:
        return None  # a quantized checkpoint's own method: the loader reads how its weights are kept
    if method in STORED_METHODS:
        raise ValueError(f"quantization={method!r} is the method of {method} checkpoints, and {source} is "
                         f"{'not quantized' if stored is None else f'a {stored} one'}: drop it, or use fp8 / int8 to "
                         "quantize a float checkpoint at load")
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={method!r} is not supported; supported: {', '.join(QUANTIZATION_METHODS)} "
                         "(applied at load to a float checkpoint)")
    if stored is not None:
        raise ValueError(f"quantization={method!r} cannot apply to {source}: it is quantized already ({stored}), "
                         "and paxserve runs a quantized checkpoint by its own method; drop --quantization")
    device = jax.local_devices()[0]
    return WeightQuantization.for_device(method, device.platform, getattr(device, "compute_capability", None))


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What memory planning needs, read without loading any weights."""

    config: ModelConfig
    dtype: np.dtype
    weight_bytes: int
    quantization: Quantization = None


def inspect_model(
    model: str | os.PathLike | None = None, dtype: str = "auto", *, cache_dir: str | os.PathLike | None = None,
    quantization: str | None = None,
) -> ModelInfo:
    kind, path = resolve_source(model)
    if kind == "hf":
        hf_config = _read_hf_config(path)
    else:
        keep = gguf_keeps_quantized(path, quantization, dtype)[0]
        cached = _gguf_cache_entry(path, dtype, cache_dir, keep) / "config.json"
        hf_config = json.loads(cached.read_text()) if cached.exists() else \
            _gguf_hf_config(GGUFCheckpoint(path), dtype, keep)
    cfg, arch, np_dtype = _model_spec(hf_config, dtype, kind)
    quant = resolve_quantization(quantization, kind, hf_config, path)
    if kind == "gguf":
        quant = _kept(gguf_quantization(hf_config))
    elif (hf_config.get("quantization_config") or {}).get("quant_method") in STORED_METHODS:
        quant = _hf_checkpoint(path, hf_config, arch, cfg)[1]  # from the headers: planning reads no weights
    abstract = arch.abstract_params(cfg, np_dtype, quant)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(abstract))
    return ModelInfo(config=cfg, dtype=np_dtype, weight_bytes=int(weight_bytes), quantization=quant)


def _read_generation_config(directory: Path) -> dict[str, Any]:
    """The checkpoint's generation_config.json ({} when it has none)."""
    gen_path = directory / "generation_config.json"
    if not gen_path.exists():
        return {}
    try:
        data = json.loads(gen_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{gen_path} is not valid JSON: {e} (fix it, or delete it to use no generation config)") \
            from None
    if not isinstance(data, dict):
        raise ValueError(f"{gen_path} must hold a JSON object, not a JSON {type(data).__name__}")
    return data


def _tokenizer_from_path(source: str | os.PathLike) -> PreTrainedTokenizerBase:
    """A tokenizer from a local directory of Hugging Face tokenizer files or a .gguf file."""
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return tokenizer_from_gguf(GGUFCheckpoint(path))
    if path.is_dir():
        found = tokenizer_from_directory(path)
        if found is None:
            raise ValueError(f"tokenizer {str(source)!r} has no tokenizer files (tokenizer.json, "
                             "tokenizer_config.json, tokenizer.model or vocab.json)")
        return found
    raise ValueError(f"tokenizer {str(source)!r} is not a local directory or .gguf file, nor a Hugging Face Hub id "
                     "(org/name)")


def _check_tokenizer_vocab(tok: PreTrainedTokenizerBase, vocab_size: int, source: str) -> None:
    # A model's vocabulary may be padded past the tokenizer's, never the other way round.
    if len(tok) > vocab_size:
        raise ValueError(f"tokenizer {source!r} has {len(tok)} tokens but the model's vocabulary has only "
                         f"{vocab_size}: it is not this model's tokenizer")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def load_model(
    model: str | os.PathLike | None = None,
    dtype: str = "auto",
    *,
    cache_dir: str | os.PathLike | None = None,
    use_param_cache: bool = True,
    tokenizer: str | os.PathLike | None = None,
    tensor_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
    quantization: str | None = None,
    keep_unquantized: bool = False,
) -> LoadedModel:
    """Load config, weights and tokenizer. Errors name the problem (missing config, unsupported
    architecture, truncated or mismatched tensors). `tokenizer`: a local tokenizer directory or
    .gguf file to use instead of the model's own (vLLM's --tokenizer). `tensor_parallel_size` > 1
    splits the weights over that many local devices as they load (ValueError naming the valid
    sizes when the model does not divide); `enable_expert_parallel` places an MoE model's routed
    experts whole on the devices instead of splitting each one. `quantization` ("fp8", "int8")
    quantizes the linear weights of a float checkpoint as they load; `keep_unquantized` also keeps
    them at full width (`LoadedModel.unquantized_params`) from the same read."""
    start = time.perf_counter()
    kind, path = resolve_source(model)
    tokenizer_source = tokenizer  # the name `tokenizer` is reused below for the loaded one
    tokenizer_override = _tokenizer_from_path(tokenizer_source) if tokenizer_source is not None else None
    logger.info("loading %s checkpoint %s", "GGUF" if kind == "gguf" else "Hugging Face", path)
    if kind == "gguf":
        resolve_quantization(quantization, kind, {}, path)  # raises for fp8/int8: a GGUF is quantized already
        keep, why = gguf_keeps_quantized(path, quantization, dtype)
        logger.info("GGUF weights %s: %s", "kept quantized" if keep else "dequantized at load", why)
        params, hf_config, tokenizer, from_cache, tp = _load_gguf(path, dtype, cache_dir, use_param_cache,
                                                                  tensor_parallel_size, enable_expert_parallel, keep)
        kernel = _cpu_kernel(dtype) if keep and jax.default_backend() == "cpu" else None
        if isinstance(kernel, MatmulKernel):  # kept for the CPU kernel: handed over set to run on it
            params = with_matmul_kernel(params, kernel if tp is None else dataclasses.replace(kernel, tiles=False))
        generation_config: dict[str, Any] = {}
        cfg, arch, np_dtype = _model_spec(hf_config, dtype, kind)
        quant = _kept(gguf_quantization(hf_config))
        unquantized = kv_scales = None  # nothing was quantized at load
    else:
        hf_config = _read_hf_config(path)
        generation_config = _read_generation_config(path)
        cfg, arch, np_dtype = _model_spec(hf_config, dtype, kind)
        quant = resolve_quantization(quantization, kind, hf_config, path)
        eos = generation_config.get("eos_token_id")
        if isinstance(eos, (int, list)):
            cfg = cfg.replace(eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,))
        tp = _tensor_parallel(cfg, tensor_parallel_size, enable_expert_parallel)
        raw, stored = _hf_checkpoint(path, hf_config, arch, cfg, log=True)
        quant = stored or quant
        ckpt = _as_laid_out(raw, arch)
        check_tensors(arch, cfg, ckpt.names(), ckpt.shape, str(path))
        params, unquantized = _convert(arch, cfg, ckpt, np_dtype,
                                       f"Loading {path.name}" + (f" ({quant.method})" if quant else ""),
                                       None if tp is None else tp.place, quant, keep_unquantized, stored and raw)
        kv_scales = raw.kv_scales(cfg.num_layers) if stored is not None else None
        tokenizer = tokenizer_from_directory(path) if tokenizer_override is None else None
        from_cache = False
    if tokenizer_override is not None:
        _check_tokenizer_vocab(tokenizer_override, cfg.vocab_size, str(tokenizer_source))
        tokenizer = tokenizer_override
    params = jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    leaves = jax.tree_util.tree_leaves(params)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(arch.abstract_params(cfg, np_dtype)))
    total_bytes = sum(x.nbytes for x in leaves)
    logger.info(
        "loaded %s: %s, %.1fM params in %s, %.1fs%s; %.3f GiB of weights", path.name, cfg.architecture,
        n_params / 1e6, np_dtype.name, seconds, " (from param cache)" if from_cache else "", total_bytes / 2**30,
    )
    if quant is not None:
        full = param_bytes(arch.abstract_params(cfg, np_dtype))
        logger.info("quantization: %s; weights %.3f GiB instead of %.3f GiB in %s (%.2fx smaller)", quant.describe(),
                    total_bytes / 2**30, full / 2**30, np_dtype.name, full / max(total_bytes, 1))
    logger.info("model: %s", cfg.describe())
    if cfg.num_experts:
        active = n_params - cfg.inactive_params_per_token
        logger.info("MoE: %d experts on %d of %d layers, %d routed per token: %s params in all (every expert "
                    "counted in the memory plan), %s active per token", cfg.num_experts, len(cfg.moe_layers),
                    cfg.num_layers, cfg.num_experts_per_tok, _count(n_params), _count(active))
    if tp is not None:
        logger.info("%s", tp.describe(param_bytes(arch.abstract_params(cfg, np_dtype, quant)), _device_bytes(params)))
    return LoadedModel(
        config=cfg, params=params, architecture=arch, tokenizer=tokenizer, dtype=np_dtype, source=str(path),
        generation_config=generation_config, load_seconds=seconds, from_cache=from_cache, tp=tp, quantization=quant,
        unquantized_params=unquantized, kv_scales=kv_scales,
    )
