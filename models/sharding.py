"""Tensor parallelism: the Megatron layout of the decoder's params and KV cache over a `tp` mesh axis.

Column-parallel: the fused QKV projection (split by heads), gate/up (split by MLP width), each
expert's gate/up (split by expert width). Row-parallel: the attention output and down projections,
whose partial products the decoder sums with one all-reduce each. The KV cache is split on its
KV-head axis; when a model has fewer KV heads than devices, each head is repeated over
`size // num_kv_heads` devices (its K/V projection columns repeated to match), as vLLM does, so
every device attends its own query heads with the same kernels, on local shapes.

A fused axis (QKV, gate|up) is reordered at load time so device d's contiguous slice holds exactly
its own part of each piece: [q_d | k_d | v_d] and [gate_d | up_d]. Inside `shard_map` the decoder
then runs unchanged on a `local` config (heads, KV heads, widths and, when it divides, the
vocabulary all divided by the size); the host side never learns how many devices there are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paxserve.models.config import ModelConfig

TP_AXIS = "tp"
KV_CACHE_SPEC = P(None, None, None, TP_AXIS, None)  # [layers, blocks, block_size, kv_heads, head_dim]


@dataclass(frozen=True)
class ShardRule:
    """`axis` of the field is split over the devices; `fused` names what the axis holds side by
    side ("qkv", or "gated" = gate | up), which each device needs its own slice of."""

    axis: int
    fused: str | None = None


def shard_rules(cfg: ModelConfig, vocab_parallel: bool, expert_parallel: bool = False) -> dict[str, ShardRule]:
    """Params field path (as `field_paths` names it) -> how it is split; fields not named are
    replicated (norms, q/k norms, output biases, the router and the shared-expert gate). With
    `expert_parallel`, routed experts are placed whole, `num_experts / size` per device, instead of
    every expert being split by width (the shared expert is still split by width)."""
    gated = "gated" if cfg.gated_mlp else None
    rules = {
        "layers.qkv_w": ShardRule(2, "qkv"), "layers.qkv_b": ShardRule(1, "qkv"),
        "layers.o_w": ShardRule(1),
        "layers.up_w": ShardRule(2, gated), "layers.up_b": ShardRule(1, gated), "layers.down_w": ShardRule(1),
        "dense_mlp.up_w": ShardRule(2, gated), "dense_mlp.up_b": ShardRule(1, gated),
        "dense_mlp.down_w": ShardRule(1),
        "moe.experts_up_w": ShardRule(3, "gated"), "moe.experts_down_w": ShardRule(2),
        "moe.shared_up_w": ShardRule(2, "gated"), "moe.shared_down_w": ShardRule(1),
    }
    # LoRA slots (models/lora.py, A [L, in, slots, rank] and B [L, slots, rank, out]) split with their
    # base weights: a column-parallel field's B by the same columns (regrouped per device the same
    # way), a row-parallel field's A by the same rows (its small product summed over the devices).
    rules |= {"lora.qkv_b": ShardRule(3, "qkv"), "lora.o_a": ShardRule(1), "lora.up_b": ShardRule(3, gated),
              "lora.down_a": ShardRule(1)}
    if expert_parallel:
        rules |= {"moe.experts_up_w": ShardRule(1), "moe.experts_down_w": ShardRule(1)}  # [L, E, in, out]
    if vocab_parallel:
        rules |= {"embed": ShardRule(0), "lm_head": ShardRule(1)}
    return rules


def rule_for(rules: dict[str, ShardRule], path: str, shape: tuple[int, ...]) -> ShardRule | None:
    """The rule of a leaf: its field's, or, for a quantized weight's values, scales and offsets
    ("layers.o_w.q", "layers.o_w.scale", a GGUF weight's ".codes" and ".offset"), the weight's
    (they keep its axes). A leaf of extent 1 on the split axis (a
    per-channel scale of a row-parallel weight: one value for the whole input axis) is replicated."""
    rule = rules.get(path)
    if rule is None and path.endswith((".q", ".scale", ".codes", ".offset")):
        rule = rules.get(path.rsplit(".", 1)[0])
    if rule is not None and shape[rule.axis] == 1:
        return None
    return rule


def field_paths(tree: Any) -> list[str]:
    """Dotted field paths of a params pytree's leaves ("layers.qkv_w", "moe.experts_up_w", "embed")."""
    return [".".join(str(getattr(k, "name", k)) for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def map_fields(fn: Callable[[str, Any], Any], tree: Any) -> Any:
    """`tree` with each leaf replaced by `fn(its field path, leaf)`, one leaf at a time."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, [fn(path, leaf) for path, leaf in zip(field_paths(tree), leaves)])


def _widths(cfg: ModelConfig, expert_parallel: bool = False) -> dict[str, int]:
    """The MLP widths split over the devices."""
    widths = {"intermediate_size": cfg.intermediate_size, "shared_expert_size": cfg.shared_expert_size}
    return widths if expert_parallel else widths | {"moe_intermediate_size": cfg.moe_intermediate_size}


def size_problems(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> list[str]:
    """Why `size` devices cannot split this model (empty when they can)."""
    problems = []
    if expert_parallel and not cfg.num_experts:
        problems.append("expert parallelism needs a mixture-of-experts model")
    elif expert_parallel and cfg.num_experts % size:
        problems.append(f"{cfg.num_experts} experts do not divide into {size}")
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads do not divide into {size}")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads neither divide into {size} nor {size} into them")
    problems += [f"{name}={width} does not divide into {size}" for name, width in _widths(cfg, expert_parallel).items()
                 if width and width % size]
    return problems


def valid_sizes(cfg: ModelConfig, limit: int = 64, expert_parallel: bool = False) -> list[int]:
    return [n for n in range(1, limit + 1) if not size_problems(cfg, n, expert_parallel)]


def split_config(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> tuple[ModelConfig, bool]:
    """(the config the decoder runs on each device, whether the vocabulary is split) for a size
    that `size_problems` accepts. Under expert parallelism it keeps every expert (the router
    scores all of them; each device learns which are its own from its weights' shape)."""
    vocab_parallel = cfg.vocab_size % size == 0
    local = cfg.replace(
        num_heads=cfg.num_heads // size, num_kv_heads=max(cfg.num_kv_heads, size) // size,
        vocab_size=cfg.vocab_size // size if vocab_parallel else cfg.vocab_size,
        **{name: width // size for name, width in _widths(cfg, expert_parallel).items() if width},
    )
    return local, vocab_parallel


def stored_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The model as the mesh stores it: KV heads repeated up to one per device when fewer."""
    return cfg.replace(num_kv_heads=max(cfg.num_kv_heads, size))


def device_share(cfg: ModelConfig, size: int, abstract_params: Callable[[ModelConfig], Any],
                 expert_parallel: bool = False) -> Any:
    """One device's params as ShapeDtypeStructs (`abstract_params(cfg)` gives a config's whole
    params): what memory planning and benchmarks/tp_memory.py count, with no device needed."""
    rules = shard_rules(cfg, cfg.vocab_size % size == 0, expert_parallel)

    def share(path: str, leaf: Any) -> jax.ShapeDtypeStruct:
        rule, shape = rule_for(rules, path, tuple(leaf.shape)), list(leaf.shape)
        if rule is not None:
            shape[rule.axis] //= size
        return jax.ShapeDtypeStruct(tuple(shape), leaf.dtype)

    return map_fields(share, abstract_params(stored_config(cfg, size)))


def mesh_devices(size: int) -> list[Any]:
    """The devices a `size`-device mesh takes: the first ones of this process, or, when JAX's
    runtime spans several processes (multi-host), `size / processes` from each, process by process,
    so neighbouring mesh positions (and the heaviest collectives' partners) share a host first."""
    processes = jax.process_count()
    if processes == 1:
        return jax.devices()
    if size % processes:
        raise ValueError(f"tensor_parallel_size={size} must be a multiple of the {processes} hosts it spans")
    per_host = size // processes
    chosen = []
    for process in range(processes):
        local = sorted((d for d in jax.devices() if d.process_index == process), key=lambda d: d.id)
        if len(local) < per_host:
            raise ValueError(f"tensor_parallel_size={size} over {processes} hosts needs {per_host} devices on each; "
                             f"node rank {process} has {len(local)}")
        chosen += local[:per_host]
    return chosen


@dataclass(frozen=True)
class TensorParallel:
    """A `tp` mesh and the model's split over it. Hashable, so it is a static argument of the
    jitted step (the mesh is part of the traced program)."""

    mesh: Mesh
    cfg: ModelConfig  # the whole model
    local: ModelConfig = field(compare=False)  # one device's share: what the decoder sees in shard_map
    vocab_parallel: bool = True
    expert_parallel: bool = False  # routed experts placed whole per device rather than split by width

    @property
    def size(self) -> int:
        return self.mesh.shape[TP_AXIS]

    @property
    def axis(self) -> str:
        return TP_AXIS

    @property
    def num_kv_heads_stored(self) -> int:
        """KV heads of the whole mesh's cache and K/V projections (the model's, or one per device)."""
        return stored_config(self.cfg, self.size).num_kv_heads

    @property
    def kv_replicas(self) -> int:
        """Devices holding each KV head (1 unless the model has fewer KV heads than devices)."""
        return max(1, self.size // self.cfg.num_kv_heads)

    @classmethod
    def create(cls, cfg: ModelConfig, size: int, devices: list[Any] | None = None,
               expert_parallel: bool = False) -> "TensorParallel":
        """Split `cfg` over `size` devices (default: `mesh_devices`); ValueError naming the valid
        sizes otherwise."""
        devices = list(mesh_devices(size) if devices is None else devices)
        problems = size_problems(cfg, size, expert_parallel)
        if problems:
            fitting = [n for n in valid_sizes(cfg, expert_parallel=expert_parallel) if n <= max(len(devices), 8)]
            raise ValueError(f"tensor_parallel_size={size} cannot split this model: {'; '.join(problems)}. Valid "
                             f"sizes for it: {', '.join(map(str, fitting))}")
        if size > len(devices):
            kind = devices[0].platform if devices else "no"
            hint = (f" (on CPU, start the process with XLA_FLAGS=--xla_force_host_platform_device_count={size} "
                    "to simulate devices)") if kind == "cpu" else ""
            raise ValueError(f"tensor_parallel_size={size} needs {size} devices but {len(devices)} {kind} "
                             f"device(s) are visible{hint}")
        local, vocab_parallel = split_config(cfg, size, expert_parallel)
        return cls(mesh=Mesh(np.asarray(devices[:size]), (TP_AXIS,)), cfg=cfg, local=local,
                   vocab_parallel=vocab_parallel, expert_parallel=expert_parallel)

    # ---- params -------------------------------------------------------------------------------

    def rule(self, path: str, shape: tuple[int, ...]) -> ShardRule | None:
        return rule_for(shard_rules(self.cfg, self.vocab_parallel, self.expert_parallel), path, shape)

    def spec(self, path: str, shape: tuple[int, ...]) -> P:
        rule = self.rule(path, shape)
        if rule is None:
            return P()
        return P(*(TP_AXIS if a == rule.axis else None for a in range(len(shape))))

    def param_specs(self, params: Any) -> Any:
        """A pytree of PartitionSpecs matching `params` (arrays or ShapeDtypeStructs), stacked or
        with their layers split (models/layer_split.py: "layers.[3].qkv_w" is split as one layer
        of "layers.qkv_w")."""
        def spec(path: str, leaf: Any) -> P:
            head, sep, rest = path.partition(".[")
            if not sep:
                return self.spec(path, tuple(leaf.shape))
            stacked = f"{head}.{rest.partition('].')[2]}"
            return P(*tuple(self.spec(stacked, (1, *leaf.shape)))[1:])

        return map_fields(spec, params)

    def reorder(self, path: str, array: np.ndarray) -> np.ndarray:
        """The field as this split stores it: fused axes regrouped per device, KV heads repeated
        when they are fewer than the devices. Other fields are returned as they are."""
        rule = self.rule(path, array.shape)
        if rule is None or rule.fused is None:
            return array
        axis, n = rule.axis, self.size
        if rule.fused == "gated":
            gate, up = np.split(array, 2, axis=axis)
            pieces = [gate, up]
        else:
            d = self.cfg.head_dim
            q_size, kv_size = self.cfg.num_heads * d, self.cfg.num_kv_heads * d
            q, k, v = np.split(array, [q_size, q_size + kv_size], axis=axis)
            k, v = (self._repeat_kv_heads(t, axis) for t in (k, v))
            pieces = [q, k, v]
        per_device = [np.split(piece, n, axis=axis) for piece in pieces]
        return np.concatenate([part for d in range(n) for part in (p[d] for p in per_device)], axis=axis)

    def _repeat_kv_heads(self, t: np.ndarray, axis: int) -> np.ndarray:
        if self.kv_replicas == 1:
            return t
        d = self.cfg.head_dim
        heads = t.reshape(*t.shape[:axis], self.cfg.num_kv_heads, d, *t.shape[axis + 1:])
        return np.repeat(heads, self.kv_replicas, axis=axis).reshape(
            *t.shape[:axis], self.cfg.num_kv_heads * self.kv_replicas * d, *t.shape[axis + 1:])

    def place(self, path: str, array: np.ndarray) -> jax.Array:
        """One host field onto the mesh: each device receives only its own slice."""
        array = self.reorder(path, np.asarray(array))
        rule = self.rule(path, array.shape)
        if rule is not None and array.shape[rule.axis] % self.size:
            # A GGUF weight's group scales split with its rows: each device needs whole groups.
            raise ValueError(f"{path} ({array.shape[rule.axis]} along its split axis) does not divide into "
                             f"{self.size} devices")
        return jax.device_put(array, NamedSharding(self.mesh, self.spec(path, array.shape)))

    def place_lora(self, lora: Any) -> Any:
        """LoRA slots (host arrays, models/lora.py's `LoraWeights`) onto the mesh, split with their
        base weights."""
        return map_fields(lambda path, leaf: self.place(f"lora.{path}", leaf), lora)

    def lora_specs(self, lora: Any) -> Any:
        return map_fields(lambda path, leaf: self.spec(f"lora.{path}", tuple(leaf.shape)), lora)

    def abstract_lora(self, lora: Any) -> Any:
        """LoRA slots' ShapeDtypeStructs (models/lora.py's `abstract_weights`, the stored model's)
        with the shardings `place_lora` gives them."""
        return map_fields(lambda path, leaf: jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype, sharding=NamedSharding(self.mesh, self.spec(f"lora.{path}", tuple(leaf.shape)))),
            lora)

    def abstract_params(self, abstract_params: Callable[[ModelConfig], Any]) -> Any:
        """The whole mesh's params as ShapeDtypeStructs with their shardings (`abstract_params(cfg)`
        gives a config's whole params), for lowering the step without weights."""
        return map_fields(lambda path, leaf: jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype, sharding=NamedSharding(self.mesh, self.spec(path, tuple(leaf.shape)))),
            abstract_params(stored_config(self.cfg, self.size)))

    # ---- KV cache and the sharded step --------------------------------------------------------

    @property
    def kv_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, KV_CACHE_SPEC)

    def kv_cache_shardings(self, kv_cache: Any) -> Any:
        """Shardings matching a KVCache: K and V split by KV heads, an fp8 cache's per-layer scales whole."""
        return jax.tree.map(lambda leaf: self.kv_sharding if leaf.ndim == 5 else self.replicated, kv_cache)

    @property
    def replicated(self) -> NamedSharding:
        """Whole on every device of the mesh (the sampler's state: sampling runs alike everywhere)."""
        return NamedSharding(self.mesh, P())

    def shard_forward(self, forward: Callable[..., Any], params: Any, kv_cache: Any, *,
                      attention_backend: Any, aux_layers: tuple[int, ...] = (), lora: Any = None
                      ) -> Callable[..., Any]:
        """`forward` run per device under `shard_map` on the local config: params and KV cache
        split as above, the batch (ids, positions, attention metadata) replicated, full-vocabulary
        logits back on every device (so sampling sees every token). With `aux_layers`, also the
        residual streams an EAGLE-3 head reads: whole on every device (each layer's row-parallel
        products are summed before they join the stream), so returned replicated. With `lora` (the
        placed slots, `place_lora`), the function also takes the slots and each token's slot."""
        kv_specs = jax.tree.map(lambda leaf: KV_CACHE_SPEC if leaf.ndim == 5 else P(), kv_cache)
        extra = {"aux_layers": aux_layers} if aux_layers else {}

        def local_forward(params, kv_cache, input_ids, positions, metadata, *lora_args):  # noqa: ANN001, ANN202
            kwargs = extra | (dict(zip(("lora", "lora_slots"), lora_args)) if lora_args else {})
            return forward(params, kv_cache, input_ids, positions, metadata, self.local,
                           attention_backend=attention_backend, tp=self, **kwargs)

        lora_specs = () if lora is None else (self.lora_specs(lora), P())
        return jax.shard_map(local_forward, mesh=self.mesh,
                             in_specs=(self.param_specs(params), kv_specs, P(), P(), P(), *lora_specs),
                             out_specs=(P(), kv_specs, *((P(),) if aux_layers else ())), check_vma=False)

    def describe(self, weight_bytes: int, local_weight_bytes: int) -> str:
        """The split in plain words, for the start-up log."""
        devices = ", ".join(str(d) for d in self.mesh.devices.flat)
        kv = (f"{self.local.num_kv_heads} KV head(s) per device" if self.kv_replicas == 1 else
              f"each of the {self.cfg.num_kv_heads} KV head(s) repeated on {self.kv_replicas} devices")
        vocab = (f"vocabulary split {self.local.vocab_size} per device" if self.vocab_parallel else
                 f"embedding and LM head replicated ({self.cfg.vocab_size} tokens do not divide into {self.size})")
        experts = (f"; experts placed whole, {self.cfg.num_experts // self.size} of {self.cfg.num_experts} per device"
                   if self.expert_parallel else "")
        return (f"tensor parallel over {self.size} devices ({devices}): {self.local.num_heads} of "
                f"{self.cfg.num_heads} query heads and {kv}; MLP width {self._width_line()}{experts}; {vocab}; weights "
                f"{local_weight_bytes / 2**30:.3f} GiB per device of {weight_bytes / 2**30:.3f} GiB in all")

    def _width_line(self) -> str:
        parts = [f"{getattr(self.local, name)} of {w}" for name, w in _widths(self.cfg, self.expert_parallel).items()
                 if w]
        return ", ".join(parts) if parts else "-"


def param_bytes(abstract: Any) -> int:
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(abstract)))
