"""LoRA adapters (PEFT's format) as the decoder applies them: many at once, one per token row.

An adapter is `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `target_modules`,
`rank_pattern`, `alpha_pattern`) and `adapter_model.safetensors`, whose `lora_A` [r, in] and
`lora_B` [out, r] tensors sit under the base model's module names. The decoder fuses some of those
modules into one matrix (q, k and v into `qkv_w`, gate and up into `up_w`); an adapter's matrices
for a fused field are laid out to match: the parts' A side by side ([in, parts x R]) and their B
side by side along the output ([R, out], each part's B in its own columns, scaled by alpha / r, or
alpha / sqrt(r) with rsLoRA): a part's columns take its own R columns of x @ A (the decoder knows
where each part's columns are: it splits the base product the same way). Half to two thirds of a
block-diagonal B would be zeros, read at every step. A part the adapter does not target is zeros.
R is the engine's maximum rank: an adapter of lower rank is padded with zeros, which add nothing.

The engine keeps `max_loras` adapters at once in slots ([layers, slots, ...] per field). Each
token row carries its slot (-1: the base model alone) as runtime data, so any mix of adapters runs
in the same compiled program: the delta is x @ A[slot] @ B[slot], computed as one product against
every slot's A (a few columns each) masked to the row's own slot, then one against the B's. For a
handful of slots of low rank that is a few percent of the base product, with no per-token gather
of weight matrices. Under tensor parallelism the slots split with their base weights
(models/sharding.py): B by a column-parallel field's columns, A by a row-parallel field's rows.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float, Int

from paxserve.models.config import ModelConfig
from paxserve.models.layout import LAYER_INDEX, Layout

# The decoder's fields an adapter may target: attention always, the MLP where it is dense (an MoE
# model's experts, shared experts and dense-MLP stacks take no adapter).
FIELDS = ("qkv_w", "o_w", "up_w", "down_w")
SHORT = tuple(name.removesuffix("_w") for name in FIELDS)
SLOT_AXIS = {"a": 2, "b": 1}  # where the slots are in a field's A [L, in, S, P x R] and B [L, S, R, out]
_CONFIG, _WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# PEFT settings whose adapters compute something else than x @ A @ B * scale on these modules.
_UNSUPPORTED = {"use_dora": "DoRA adapters", "lora_bias": "adapters that train a bias on lora_B",
                "modules_to_save": "adapters that also replace whole modules (modules_to_save)"}


@struct.dataclass
class LoraWeights:
    """Every slot's adapter, per fused field: `{field}_a` [L, in, S, P x R] and `{field}_b`
    [L, S, R, out] (P: the field's parts). Slots without an adapter are zeros; the MLP's fields are
    None in an MoE model. A's slots follow its input rows, so x @ A for every slot is one plain
    product with an [in, S x P x R] matrix (slots first, XLA copied A into that order every step:
    twice the time on a CPU); B's rows are (slot, rank), already a product's order."""

    qkv_a: Float[Array, "L H S QR"]
    qkv_b: Float[Array, "L S R QKV"]
    o_a: Float[Array, "L NH S R"]
    o_b: Float[Array, "L S R H"]
    up_a: Float[Array, "L H S UR"] | None = None
    up_b: Float[Array, "L S R I2"] | None = None
    down_a: Float[Array, "L I S R"] | None = None
    down_b: Float[Array, "L S R H"] | None = None

    def replace_slot(self, slot: Int[Array, ""], one: "LoraWeights") -> "LoraWeights":
        """These slots with `slot` replaced by `one`'s only slot."""
        def put(every: Array | None, new: Array | None, axis: int) -> Array | None:
            if every is None:
                return None
            return jax.lax.dynamic_update_slice_in_dim(every, new.astype(every.dtype), slot, axis=axis)

        return self.replace(**{f"{short}_{side}": put(getattr(self, f"{short}_{side}"), getattr(one, f"{short}_{side}"),
                                                      SLOT_AXIS[side]) for short in SHORT for side in "ab"})

    @property
    def num_slots(self) -> int:
        return self.qkv_b.shape[SLOT_AXIS["b"]]


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter read from disk and laid out for the decoder: per field, A [L, in, P x R] and B
    [L, R, out] as numpy (host) arrays, ready to be written into a slot."""

    path: Path
    rank: int  # the largest rank among its modules
    targets: tuple[str, ...]  # the base model's module names it adapts (one layer's, e.g. "q_proj")
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    base_model: str | None  # `base_model_name_or_path` as the adapter states it


def _parts(layout: Layout) -> dict[str, list[tuple[str, int]]]:
    """Per fused field: its parts' module names (with `{i}`) and output rows, in the field's order."""
    out = {}
    for name in FIELDS:
        leaf = layout.layer.get(name)
        if leaf is None or not leaf.linear:
            continue
        out[name] = [(part.removesuffix(".weight"), shape[0]) for part, shape in leaf.parts]
    return out


def empty_weights(cfg: ModelConfig, layout: Layout, num_slots: int, max_rank: int, dtype: Any) -> LoraWeights:
    """Zeroed slots for `num_slots` adapters of rank up to `max_rank` (host numpy: the engine places
    them)."""
    return jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype),
                        abstract_weights(cfg, layout, num_slots, max_rank, dtype))


def abstract_weights(cfg: ModelConfig, layout: Layout, num_slots: int, max_rank: int, dtype: Any) -> LoraWeights:
    """The shapes and dtype of `empty_weights` (for lowering programs without making the arrays)."""
    arrays = {}
    for name, (rows_in, width, rows_out) in _field_shapes(cfg, layout, max_rank).items():
        short = name.removesuffix("_w")
        arrays[f"{short}_a"] = jax.ShapeDtypeStruct((cfg.num_layers, rows_in, num_slots, width), np.dtype(dtype))
        arrays[f"{short}_b"] = jax.ShapeDtypeStruct((cfg.num_layers, num_slots, max_rank, rows_out), np.dtype(dtype))
    return LoraWeights(**arrays)


def _field_shapes(cfg: ModelConfig, layout: Layout, max_rank: int) -> dict[str, tuple[int, int, int]]:
    """(in, P x R, out) of each field the model has."""
    parts = _parts(layout)
    if "qkv_w" not in parts or "o_w" not in parts:
        raise ValueError(f"{cfg.architecture}: LoRA adapters need the decoder's attention projections")
    out = {}
    for name, field_parts in parts.items():
        in_rows = layout.layer[name].shape()[0]
        out[name] = (in_rows, len(field_parts) * max_rank, sum(rows for _, rows in field_parts))
    return out


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's `rank_pattern` / `alpha_pattern`: a key names a module by its name's ending (a regex)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _module_of(tensor_name: str) -> str:
    """The module a tensor of an adapter file belongs to, by its last name ("lm_head", "q_proj")."""
    stem = re.sub(r"\.(lora_[A-Za-z_]+|base_layer)(\..*)?$", "", tensor_name)
    return stem.removesuffix(".weight").removesuffix(".bias").split(".")[-1]


def read_adapter(path: str | Path, cfg: ModelConfig, layout: Layout, max_rank: int, dtype: Any) -> LoraAdapter:
    """Read a PEFT adapter for a model of `cfg` (its tensors named as `layout` names the base model's)
    and lay it out for the decoder at `max_rank`. Raises ValueError naming what cannot serve: a
    missing file, a setting paxserve does not run, a module it cannot adapt, a rank over
    `max_rank`, or a shape that is not the base model's."""
    path = Path(path)
    config_file, weights_file = path / _CONFIG, path / _WEIGHTS
    for f in (config_file, weights_file):
        if not f.is_file():
            raise ValueError(f"LoRA adapter {path}: {f.name} not found (a PEFT adapter directory holds "
                             f"{_CONFIG} and {_WEIGHTS})")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path}: {_CONFIG} is not readable JSON ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {path}: {what} are not supported ({key}={config[key]!r})")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path}: adapters that train the base model's biases are not supported "
                         f"(bias={config['bias']!r}; PEFT's default is 'none')")
    from safetensors.numpy import load_file

    tensors = load_file(str(weights_file))
    parts = _parts(layout)
    shapes = _field_shapes(cfg, layout, max_rank)
    known = {}  # PEFT's tensor name stem -> (field, part index, layer)
    for field_name, field_parts in parts.items():
        for j, (module, _) in enumerate(field_parts):
            for i in range(cfg.num_layers):
                known[f"base_model.model.{module.replace(LAYER_INDEX, str(i))}"] = (field_name, j, i)
    found: dict[tuple[str, int, int], dict[str, np.ndarray]] = {}
    unknown = []
    for name, tensor in tensors.items():
        m = re.fullmatch(r"(.*)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", name)
        if m is None or m.group(1) not in known:
            unknown.append(name)
            continue
        found.setdefault(known[m.group(1)], {})[m.group(2)] = tensor
    if unknown:
        modules = sorted({_module_of(n) for n in unknown})
        raise ValueError(f"LoRA adapter {path}: it adapts modules paxserve cannot ({', '.join(modules)}); "
                         f"supported: the attention and dense MLP projections ("
                         f"{', '.join(sorted({m.split('.')[-1] for f in parts.values() for m, _ in f}))})")
    if not found:
        raise ValueError(f"LoRA adapter {path}: {_WEIGHTS} holds no lora_A / lora_B tensors")
    alpha, rank_patterns = config.get("lora_alpha", 8), config.get("rank_pattern") or {}
    alpha_patterns, rslora = config.get("alpha_pattern") or {}, bool(config.get("use_rslora", False))
    weights = {}
    top_rank = 0
    for field_name, field_parts in parts.items():
        rows_in, width, rows_out = shapes[field_name]
        a = np.zeros((cfg.num_layers, rows_in, width), np.float32)
        b_hf = np.zeros((cfg.num_layers, rows_out, max_rank), np.float32)  # [out, R], HF's row order
        offset = 0
        for j, (module, rows) in enumerate(field_parts):
            for i in range(cfg.num_layers):
                pair = found.get((field_name, j, i))
                if pair is None:
                    continue
                name = module.replace(LAYER_INDEX, str(i))
                if set(pair) != {"lora_A", "lora_B"}:
                    raise ValueError(f"LoRA adapter {path}: {name} has {', '.join(pair)}, not both lora_A and "
                                     "lora_B")
                la, lb = pair["lora_A"], pair["lora_B"]
                r = la.shape[0]
                if la.shape != (r, rows_in) or lb.shape != (rows, r):
                    raise ValueError(f"LoRA adapter {path}: {name}'s lora_A {list(la.shape)} / lora_B {list(lb.shape)} "
                                     f"do not fit the base model's [{rows}, {rows_in}] weight: an adapter for another "
                                     "model?")
                if r > max_rank:
                    raise ValueError(f"LoRA adapter {path}: rank {r} ({name}) is over max_lora_rank={max_rank}")
                top_rank = max(top_rank, r)
                expected = _pattern_value(rank_patterns, name, config.get("r", r))
                if int(expected) != r:
                    raise ValueError(f"LoRA adapter {path}: {name} has rank {r}, its config says {expected}")
                module_alpha = float(_pattern_value(alpha_patterns, name, alpha))
                scale = module_alpha / (math.sqrt(r) if rslora else r)
                a[i, :, j * max_rank:j * max_rank + r] = la.T
                b_hf[i, offset:offset + rows, :r] = lb * scale
            offset += rows
        transform = layout.layer[field_name].transform
        if transform is not None:  # the field's rows re-ordered as the base weight's are (Falcon's QKV)
            b_hf = np.stack([transform(b_hf[i]) for i in range(cfg.num_layers)])
        weights[field_name] = (a.astype(dtype), b_hf.transpose(0, 2, 1).astype(dtype))
    targets = tuple(sorted({parts[f][j][0].split(".")[-1] for f, j, _ in found}))
    return LoraAdapter(path, top_rank, targets, weights, config.get("base_model_name_or_path"))


def write_slot(weights: LoraWeights, slot: int, adapter: LoraAdapter | None) -> LoraWeights:
    """`weights` with `slot` holding `adapter` (None: zeros); host numpy arrays, in place."""
    for field_name in FIELDS:
        short = field_name.removesuffix("_w")
        a_all, b_all = getattr(weights, f"{short}_a"), getattr(weights, f"{short}_b")
        if a_all is None:
            continue
        if adapter is None:
            a_all[:, :, slot] = 0
            b_all[:, slot] = 0
        else:
            a, b = adapter.weights[field_name]
            a_all[:, :, slot], b_all[:, slot] = a, b
    return weights


def slot_mask(slots: Int[Array, " T"], num_slots: int, dtype: Any) -> Float[Array, "T S"]:
    """One-hot rows of each token's slot (all zeros for -1, the base model alone)."""
    return (slots[:, None] == jnp.arange(num_slots, dtype=slots.dtype)[None, :]).astype(dtype)


def lora_delta(x: Float[Array, "T I"], a: Float[Array, "I S PR"], b: Float[Array, "S R O"],
               mask: Float[Array, "T S"], reduce: Callable[[Array], Array] | None = None,
               parts: tuple[int, ...] = ()) -> Float[Array, "T O"]:
    """Each row's x @ A[slot] @ B[slot] (zeros for a row without a slot), float32 accumulation. For
    a fused field of P parts, `parts` gives each part's output columns (in order): they take that
    part's R columns of x @ A. `reduce` (row-parallel: `x` and `a` hold this device's rows) sums
    the small x @ A over the devices before the product with B, which every device holds whole."""
    xa = jnp.einsum("ti,isr->tsr", x, a.astype(x.dtype), precision=jax.lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32)
    if reduce is not None:
        xa = reduce(xa)
    xa = (xa * mask[:, :, None].astype(jnp.float32)).astype(x.dtype)
    t, s, width = xa.shape
    rank = b.shape[1]
    num_parts = width // rank
    if num_parts == 1:
        parts = (b.shape[2],)
    elif len(parts) != num_parts or sum(parts) != b.shape[2]:
        raise ValueError(f"a fused LoRA field of {num_parts} parts over {b.shape[2]} columns, split as {parts}")
    xa = xa.reshape(t, s, num_parts, rank)
    outs, start = [], 0
    for p, columns in enumerate(parts):
        outs.append(jnp.einsum("tsr,sro->to", xa[:, :, p], b[:, :, start:start + columns].astype(x.dtype),
                               precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32))
        start += columns
    return (outs[0] if num_parts == 1 else jnp.concatenate(outs, axis=1)).astype(x.dtype)
