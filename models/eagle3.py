"""EAGLE-3 draft heads (Li et al., 2025) read from their published checkpoint format, as a pure forward.

A head is one Llama decoder layer that reads the target model's own hidden states. `fc` folds the
residual streams entering three of the target's layers ([T, 3 x target hidden] -> [T, H]). The
layer's attention input is [input_layernorm(embed(next token)), hidden_norm(h)] side by side (2H
wide) and its residual is h (or hidden_norm(h) with `norm_before_residual`, the speculators
format's option); after the MLP come `norm` and a head over a smaller draft vocabulary whose ids map
onto the target's by `d2t` (target id = draft id + d2t[draft id]). The layer's output before `norm`
is what the head's next step reads in place of a target hidden state it cannot have yet.

At position p the head reads the token at p + 1 and the target's hidden state at p, and predicts
the token at p + 2; its KV for position p lives in the target's block for p (a one-layer cache).

Checkpoint: `config.json` (a Llama config with `draft_vocab_size`, optionally `target_hidden_size`,
`norm_before_residual` and `eagle_aux_hidden_state_layer_ids`, top level or under `eagle_config`)
and safetensors with `fc.weight`, `midlayer.*` (or `layers.0.*`: input_layernorm, hidden_norm,
post_attention_layernorm, self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj), `norm.weight`,
`lm_head.weight` and `d2t` (`t2d` is not needed); `embed_tokens.weight` when the head has its own
embedding, else it shares the target's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float, Int

from paxserve.kernels import REFERENCE, AttentionBackend, AttentionMetadata, KVCache, attention, write_kv_reference
from paxserve.models.config import ModelConfig, model_config_from_hf
from paxserve.models.decoder import _embed
from paxserve.models.layers import dense, mlp, rms_norm
from paxserve.models.quant_weights import GroupQuantizedWeight
from paxserve.models.rope import apply_rope, rope_cos_sin, rope_frequencies

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    """`layer`: the head's decoder layer as a one-layer Llama config (its vocab_size is the target's);
    `aux_layers`: the target layers whose incoming residual stream `fc` reads, in its order."""

    layer: ModelConfig
    target_hidden_size: int
    draft_vocab_size: int
    aux_layers: tuple[int, ...]
    norm_before_residual: bool = False


@struct.dataclass
class Eagle3Params:
    """Matrices are [in, out]."""

    fc: Float[Array, "A H"]  # A = 3 x the target's hidden size
    input_norm: Float[Array, " H"]
    hidden_norm: Float[Array, " H"]
    qkv_w: Float[Array, "H2 QKV"]  # H2 = 2H: the embedding and the hidden state side by side
    o_w: Float[Array, "NH H"]
    post_attn_norm: Float[Array, " H"]
    up_w: Float[Array, "H I2"]  # gate and up side by side
    down_w: Float[Array, "I H"]
    final_norm: Float[Array, " H"]
    lm_head: Float[Array, "H Vd"]
    d2t: Int[Array, " Vd"]  # target id - draft id
    embed: Float[Array, "V H"] | None = None  # the head's own embedding, if it has one


def _field(hf: dict[str, Any], name: str) -> Any:
    nested = hf.get("eagle_config") or {}
    return hf[name] if hf.get(name) is not None else nested.get(name)


def eagle3_config(hf: dict[str, Any], target: ModelConfig) -> Eagle3Config:
    """The head's config, checked against the target's: the same vocabulary and hidden width, aux
    layers inside the target (vLLM's default (2, L // 2, L - 3) when the checkpoint names none)."""
    arch = (hf.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"config.json architectures {hf.get('architectures')!r} is not an EAGLE-3 head "
                         f"(one of {', '.join(ARCHITECTURES)})")
    if hf.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"num_hidden_layers={hf['num_hidden_layers']}: only one-layer EAGLE-3 heads are supported")
    layer = model_config_from_hf({**hf, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
    if layer.vocab_size != target.vocab_size:
        raise ValueError(f"vocab_size={layer.vocab_size}, the target model's {target.vocab_size}: an EAGLE-3 head "
                         "must be trained for the target's vocabulary")
    target_hidden = int(_field(hf, "target_hidden_size") or layer.hidden_size)
    if target_hidden != target.hidden_size:
        raise ValueError(f"the head reads hidden states {target_hidden} wide, the target model's are "
                         f"{target.hidden_size}: it was trained for another model")
    draft_vocab = int(_field(hf, "draft_vocab_size") or layer.vocab_size)
    n = target.num_layers
    aux = tuple(int(i) for i in (_field(hf, "eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3)))
    if len(aux) != 3 or not all(0 <= i < n for i in aux):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids={list(aux)} must name 3 of the target's {n} layers "
                         f"(0 to {n - 1})")
    return Eagle3Config(layer, target_hidden, draft_vocab, aux, bool(_field(hf, "norm_before_residual") or False))


def _name(key: str) -> str:
    key = key.removeprefix("model.")
    return "midlayer." + key.removeprefix("layers.0.") if key.startswith("layers.0.") else key


def _read(folder: Path, target: ModelConfig) -> tuple[Eagle3Config, list[Path]]:
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{folder}: cannot read config.json: {e}") from None
    cfg = eagle3_config(hf, target)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no .safetensors file")
    return cfg, files


def inspect_eagle3(path: str | Path, target: ModelConfig, itemsize: int) -> tuple[Eagle3Config, int]:
    """The head's config (checked against the target's) and its weights' bytes at `itemsize` per
    value, from the files' headers (nothing is loaded)."""
    from safetensors import safe_open

    cfg, files = _read(Path(path), target)
    values = 0
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            values += sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys() if not k.endswith("t2d"))
    return cfg, values * itemsize


def load_eagle3(path: str | Path, target: ModelConfig, dtype: Any) -> tuple[Eagle3Config, Eagle3Params]:
    """Read a head from its directory (config.json and *.safetensors), in `dtype` on the default device."""
    from safetensors.numpy import load_file

    folder = Path(path)
    cfg, files = _read(folder, target)
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        tensors |= {_name(k): v for k, v in load_file(file).items()}
    c = cfg.layer
    h, i, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    a = "midlayer."
    shapes = {"fc.weight": (h, 3 * cfg.target_hidden_size), a + "input_layernorm.weight": (h,),
              a + "hidden_norm.weight": (h,), a + "post_attention_layernorm.weight": (h,),
              a + "self_attn.q_proj.weight": (q, 2 * h), a + "self_attn.k_proj.weight": (kv, 2 * h),
              a + "self_attn.v_proj.weight": (kv, 2 * h), a + "self_attn.o_proj.weight": (h, q),
              a + "mlp.gate_proj.weight": (i, h), a + "mlp.up_proj.weight": (i, h), a + "mlp.down_proj.weight": (h, i),
              "norm.weight": (h,), "lm_head.weight": (cfg.draft_vocab_size, h)}
    for name, shape in shapes.items():
        if name not in tensors:
            raise ValueError(f"{folder}: the EAGLE-3 head has no tensor {name!r}")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{folder}: {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    if cfg.draft_vocab_size == c.vocab_size and "d2t" not in tensors:
        d2t = np.zeros(c.vocab_size, np.int64)
    elif tuple(tensors.get("d2t", np.zeros(0)).shape) != (cfg.draft_vocab_size,):
        raise ValueError(f"{folder}: d2t must map each of the {cfg.draft_vocab_size} draft tokens to the target's")
    else:
        d2t = tensors["d2t"].astype(np.int64)
    mapped = np.arange(cfg.draft_vocab_size) + d2t
    if mapped.min() < 0 or mapped.max() >= c.vocab_size:
        raise ValueError(f"{folder}: d2t maps draft tokens outside the target's {c.vocab_size}-token vocabulary")
    embed = tensors.get("embed_tokens.weight")
    if embed is not None and tuple(embed.shape) != (c.vocab_size, h):
        raise ValueError(f"{folder}: embed_tokens.weight has shape {tuple(embed.shape)}, expected {(c.vocab_size, h)}")

    def w(name: str) -> jax.Array:
        return jnp.asarray(np.asarray(tensors[name], np.float32), dtype)

    def t(*names: str) -> jax.Array:  # HF [out, in] -> [in, out], several side by side
        return jnp.asarray(np.concatenate([np.asarray(tensors[n], np.float32).T for n in names], axis=1), dtype)

    params = Eagle3Params(
        fc=t("fc.weight"), input_norm=w(a + "input_layernorm.weight"), hidden_norm=w(a + "hidden_norm.weight"),
        qkv_w=t(*(f"{a}self_attn.{p}_proj.weight" for p in "qkv")), o_w=t(a + "self_attn.o_proj.weight"),
        post_attn_norm=w(a + "post_attention_layernorm.weight"),
        up_w=t(a + "mlp.gate_proj.weight", a + "mlp.up_proj.weight"), down_w=t(a + "mlp.down_proj.weight"),
        final_norm=w("norm.weight"), lm_head=t("lm_head.weight"), d2t=jnp.asarray(d2t.astype(np.int32)),
        embed=None if embed is None else jnp.asarray(np.asarray(embed, np.float32), dtype))
    return cfg, params


def eagle3_forward(
    params: Eagle3Params,
    target_embed: Float[Array, "V H"] | GroupQuantizedWeight,
    kv_cache: KVCache,
    input_ids: Int[Array, " T"],
    hidden: Float[Array, "T A"],
    positions: Int[Array, " T"],
    metadata: AttentionMetadata,
    cfg: Eagle3Config,
    attention_backend: AttentionBackend = REFERENCE,
    with_head: bool = True,
) -> tuple[Int[Array, " S"] | None, Float[Array, "S H"], KVCache]:
    """The head over a ragged batch: each token reads the token after its position (`input_ids`)
    and the hidden state at its position (`hidden`: the target's aux states, 3 x its width, which
    `fc` folds, or the head's own earlier output, H wide). Returns, at `metadata.logits_indices`, the
    greedy next token in the target's vocabulary and the output before `norm` (the next step's
    hidden state), and the updated one-layer cache. Without `with_head` (static: a catch-up whose
    proposals nobody asks for) no token is computed (None): the head's vocabulary-wide product is
    most of a pass's cost on few tokens."""
    c = cfg.layer
    eps, n = c.rms_norm_eps, input_ids.shape[0]
    dtype = params.final_norm.dtype
    embed = params.embed if params.embed is not None else target_embed
    e = rms_norm(_embed(embed, input_ids, None, dtype), params.input_norm, eps)
    h = hidden.astype(dtype)
    if h.shape[-1] != c.hidden_size:
        h = dense(h, params.fc)
    if cfg.norm_before_residual:
        h = residual = rms_norm(h, params.hidden_norm, eps)
    else:
        residual, h = h, rms_norm(h, params.hidden_norm, eps)
    qkv = dense(jnp.concatenate([e, h], axis=-1), params.qkv_w)
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q = qkv[:, :q_size].reshape(n, c.num_heads, c.head_dim)
    k = qkv[:, q_size:q_size + kv_size].reshape(n, c.num_kv_heads, c.head_dim)
    v = qkv[:, q_size + kv_size:].reshape(n, c.num_kv_heads, c.head_dim)
    cos, sin = rope_cos_sin(positions, *rope_frequencies(c), dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache, v_cache = write_kv_reference(kv_cache.k, kv_cache.v, 0, k, v, metadata.slot_mapping)
    out = attention(q, k_cache, v_cache, 0, metadata, sm_scale=c.softmax_scale, backend=attention_backend)
    x = residual + dense(out.reshape(n, q_size), params.o_w)
    x = x + mlp(rms_norm(x, params.post_attn_norm, eps), params.up_w, None, params.down_w, None, act=c.hidden_act,
                gated=True)
    x = x[metadata.logits_indices]
    if not with_head:
        return None, x, kv_cache.replace(k=k_cache, v=v_cache)
    logits = jnp.dot(rms_norm(x, params.final_norm, eps), params.lm_head, precision=jax.lax.Precision.HIGHEST,
                     preferred_element_type=jnp.float32)
    draft = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return draft + params.d2t[draft], x, kv_cache.replace(k=k_cache, v=v_cache)
