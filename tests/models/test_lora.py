"""LoRA adapters in PEFT's format, applied per token row by the decoder (models/lora.py): a batch
mixing base-model rows and rows of several adapters (different ranks, rsLoRA, rank and alpha
patterns, different target modules) gives each sequence the logits transformers + PEFT give it, and
those of the model with the adapter merged into its weights. Adapters that cannot serve are refused
naming the reason."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from paxserve.models.decoder import forward
from paxserve.models.loader import load_model
from paxserve.models.layer_split import split_layers
from paxserve.models.lora import empty_weights, read_adapter, write_slot
from paxserve.models.registry import get_architecture
from paxserve.worker.step_functions import attention_metadata
from paxserve.worker.step_inputs import SeqChunk, build_batch
from tests.helpers import make_tiny_llama, rel_error
from tests.models.family_checkpoints import make_family_checkpoint

# transformers' and PEFT's own notices while PEFT wraps and saves a model (not paxserve's concern).
pytestmark = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
              pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`:UserWarning")]

MAX_RANK = 16
NUM_SLOTS = 3
# Adapters as users train them: all projections at rank 8; attention only at rank 4 with rsLoRA and
# per-module rank and alpha patterns; the MLP only at rank 16.
ADAPTERS: list[dict[str, Any]] = [
    dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"]),
    dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj"],
         rank_pattern={"o_proj": 2}, alpha_pattern={"v_proj": 3}),
    dict(r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]),
]
ATTENTION_ONLY = ["q_proj", "k_proj", "v_proj", "o_proj"]


def write_adapter(base: Any, directory: Path, seed: int, **settings: Any) -> tuple[Path, Any]:
    """A random PEFT adapter of `base` (lora_B drawn too, so it changes the outputs), saved by PEFT
    itself; returns its directory and the PEFT model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **settings))
    with torch.no_grad():  # PEFT's random init leaves B small; scale it so the delta is not lost in noise
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0)
    model.eval()
    model.save_pretrained(str(directory))
    return directory, model


def run_batch(model: Any, prompts: list[list[int]], slots: list[int], lora: Any) -> np.ndarray:
    """Last-position logits of each prompt, all in one step, each row through its slot (split over
    the model's devices as its params are, under tensor parallelism)."""
    block = 16
    free = list(range(1, 64))
    chunks = [SeqChunk(p, 0, [free.pop(0) for _ in range(-(-len(p) // block))]) for p in prompts]
    batch = build_batch(chunks, block, pad_tokens_to=128, pad_seqs_to=4, pad_blocks_to=4)
    token_slots = np.full(batch.input_ids.shape, -1, np.int32)
    start = 0
    for p, slot in zip(prompts, slots):
        token_slots[start:start + len(p)] = slot
        start += len(p)
    from paxserve.kernels import REFERENCE
    from paxserve.worker.model_runner import zeroed_kv_cache

    cfg, tp = model.config, model.tp
    cache = zeroed_kv_cache(cfg, tp, 64, block, np.dtype(np.float32))
    args = (jnp.asarray(batch.input_ids), jnp.asarray(batch.positions), attention_metadata(batch))
    if tp is None:
        run = jax.jit(forward, static_argnames=("cfg",))
        logits, _ = run(model.params, cache, *args, cfg=cfg, lora=jax.tree.map(jnp.asarray, lora),
                        lora_slots=jnp.asarray(token_slots))
    else:
        placed = tp.place_lora(lora)
        run = jax.jit(tp.shard_forward(forward, model.params, cache, attention_backend=REFERENCE, lora=placed))
        logits, _ = run(model.params, cache, *args, placed, jnp.asarray(token_slots))
    return np.asarray(logits)[:len(prompts)]


def last_logits(hf: Any, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1].float().numpy()


@pytest.mark.parametrize("family", ["llama", "qwen3-bias", "mixtral"])
def test_a_mixed_batch_gives_each_row_its_adapters_logits(family: str, tmp_path: Path, report) -> None:
    if family == "llama":
        base = make_tiny_llama(tmp_path / "base", seed=1, num_key_value_heads=2)
    else:
        base = make_family_checkpoint(family, tmp_path / "base", seed=1)
    moe = family == "mixtral"
    settings = [dict(r=8, lora_alpha=16, target_modules=ATTENTION_ONLY), ADAPTERS[1]] if moe else ADAPTERS
    adapters = [write_adapter(base, tmp_path / f"adapter{i}", seed=10 + i, **s) for i, s in enumerate(settings)]
    model = load_model(str(tmp_path / "base"))
    layout = get_architecture(model.config.architecture).layout(model.config)
    lora = empty_weights(model.config, layout, NUM_SLOTS, MAX_RANK, np.float32)
    assert (lora.up_a is None) == moe  # an MoE model's MLPs take no adapter
    read = [read_adapter(path, model.config, layout, MAX_RANK, np.float32) for path, _ in adapters]
    assert read[0].rank == 8 and read[1].rank == 4 and read[1].targets == ("o_proj", "q_proj", "v_proj")
    # Slots out of order, one left empty: adapter i in slot NUM_SLOTS - 1 - i.
    for i, adapter in enumerate(read):
        write_slot(lora, NUM_SLOTS - 1 - i, adapter)
    if len(read) < NUM_SLOTS:
        write_slot(lora, 0, None)
    rng = np.random.default_rng(3)
    vocab = model.config.vocab_size
    prompts = [rng.integers(3, vocab, n).tolist() for n in (9, 23, 5, 17)]
    # Row 0 on the base model, then one row per adapter (and the base again if a slot is spare).
    slots = [-1] + [NUM_SLOTS - 1 - i for i in range(len(read))]
    slots += [-1] * (len(prompts) - len(slots))
    ours = run_batch(model, prompts, slots, lora)
    worst = 0.0
    for row, (prompt, slot) in enumerate(zip(prompts, slots)):
        if slot == -1:
            want = last_logits(base, prompt)
        else:
            _, peft_model = adapters[NUM_SLOTS - 1 - slot]
            want = last_logits(peft_model, prompt)
            # The adapter changes the logits well beyond the tolerance (it is not a no-op here).
            assert rel_error(last_logits(base, prompt), want)[1] > 1e-2
            merged = copy.deepcopy(peft_model).merge_and_unload()
            assert rel_error(want, last_logits(merged, prompt))[1] < 1e-4
        err = rel_error(ours[row], want)[1]
        worst = max(worst, err)
        assert err < 1e-4, f"row {row} (slot {slot}): relative error {err:.2e}"
    report(f"{family}: {len(read)} adapters and base rows in one step, each row = transformers + PEFT "
           f"(worst relative logit error {worst:.1e})")


# The other families' own module names: Falcon fuses q, k and v in one module (its rows interleaved
# per KV group, which the adapter's B follows) and names its MLP after widths; Qwen2-MoE's MLP is MoE.
OTHER_FAMILIES = {"gemma3": ADAPTERS[0]["target_modules"],
                  "falcon-grouped": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
                  "qwen2-moe": ATTENTION_ONLY}


@pytest.mark.parametrize("family", list(OTHER_FAMILIES))
def test_the_other_families_take_adapters_on_their_own_module_names(family: str, tmp_path: Path) -> None:
    base = make_family_checkpoint(family, tmp_path / "base", seed=2)
    path, peft_model = write_adapter(base, tmp_path / "adapter", seed=12, r=8, lora_alpha=16,
                                     target_modules=OTHER_FAMILIES[family])
    model = load_model(str(tmp_path / "base"))
    layout = get_architecture(model.config.architecture).layout(model.config)
    lora = write_slot(empty_weights(model.config, layout, 2, MAX_RANK, np.float32), 1,
                      read_adapter(path, model.config, layout, MAX_RANK, np.float32))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (13, 8)]
    ours = run_batch(model, prompts, [1, -1], lora)
    for row, (prompt, hf) in enumerate(zip(prompts, (peft_model, base))):
        want = last_logits(hf, prompt)
        assert rel_error(ours[row], want)[1] < 1e-4, row
    assert rel_error(last_logits(base, prompts[0]), last_logits(peft_model, prompts[0]))[1] > 1e-2


def test_adapters_that_cannot_serve_are_refused_naming_why(tmp_path: Path) -> None:
    base = make_tiny_llama(tmp_path / "base", seed=2, num_key_value_heads=2)
    model = load_model(str(tmp_path / "base"))
    cfg, layout = model.config, get_architecture(model.config.architecture).layout(model.config)
    path, _ = write_adapter(base, tmp_path / "good", seed=1, r=8, lora_alpha=8, target_modules=["q_proj"])

    def refused(directory: Path, words: str, max_rank: int = MAX_RANK) -> None:
        with pytest.raises(ValueError, match=words):
            read_adapter(directory, cfg, layout, max_rank, np.float32)

    refused(path, "rank 8 .* is over max_lora_rank=4", max_rank=4)
    refused(tmp_path / "nowhere", "adapter_config.json not found")
    lm_head, _ = write_adapter(base, tmp_path / "head", seed=1, r=4, target_modules=["q_proj", "lm_head"])
    refused(lm_head, r"modules paxserve cannot \(lm_head\)")
    other = make_tiny_llama(tmp_path / "other", seed=2, hidden_size=32, num_key_value_heads=2)
    wrong, _ = write_adapter(other, tmp_path / "wrong", seed=1, r=4, target_modules=["q_proj"])
    refused(wrong, "do not fit the base model's .* an adapter for another model")
    for key, value, words in (("use_dora", True, "DoRA adapters are not supported"),
                              ("bias", "all", "train the base model's biases"),
                              ("modules_to_save", ["lm_head"], "replace whole modules")):
        changed = tmp_path / f"changed-{key}"
        changed.mkdir()
        (changed / "adapter_model.safetensors").write_bytes((path / "adapter_model.safetensors").read_bytes())
        config = json.loads((path / "adapter_config.json").read_text())
        (changed / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        refused(changed, words)


@pytest.mark.parametrize("size", [2, 4])
def test_under_tensor_parallelism_the_slots_split_with_their_weights(size: int, tmp_path: Path, report) -> None:
    """At TP 2 (a KV head per device) and TP 4 (each of the 2 KV heads on two devices, their K/V
    columns repeated, B's too): every row's logits are transformers + PEFT's, the adapters' B split
    by the fused QKV and gate|up columns as the base weights are, A by the o and down rows."""
    base = make_tiny_llama(tmp_path / "base", seed=4, num_key_value_heads=2)
    adapters = [write_adapter(base, tmp_path / f"adapter{i}", seed=20 + i, **s) for i, s in enumerate(ADAPTERS[:2])]
    model = load_model(str(tmp_path / "base"), tensor_parallel_size=size)
    layout = get_architecture(model.config.architecture).layout(model.config)
    lora = empty_weights(model.config, layout, 2, MAX_RANK, np.float32)
    for i, (path, _) in enumerate(adapters):
        write_slot(lora, i, read_adapter(path, model.config, layout, MAX_RANK, np.float32))
    placed = model.tp.place_lora(lora)
    assert placed.qkv_b.sharding.spec[3] == "tp" and placed.o_a.sharding.spec[1] == "tp"
    assert placed.qkv_a.sharding.is_fully_replicated and placed.o_b.sharding.is_fully_replicated
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (7, 19, 12)]
    slots = [1, -1, 0]
    ours = run_batch(model, prompts, slots, lora)
    worst = 0.0
    for row, (prompt, slot) in enumerate(zip(prompts, slots)):
        want = last_logits(base if slot == -1 else adapters[slot][1], prompt)
        err = rel_error(ours[row], want)[1]
        worst = max(worst, err)
        assert err < 1e-4, f"row {row} (slot {slot}): relative error {err:.2e}"
    report(f"TP {size}: 2 adapters and a base row in one step = transformers + PEFT (worst {worst:.1e})")


@pytest.mark.parametrize("size", [1, 2])
def test_one_compiled_step_program_serves_any_mix_of_adapters(size: int, tmp_path: Path) -> None:
    """The engine's forward program (lowered from abstract shapes, as `Programs` compiles it) takes
    the slots' weights and each token's slot as arguments: one executable runs two different mixes
    of adapters and base rows, each row matching transformers + PEFT."""
    from paxserve.worker.model_runner import zeroed_kv_cache
    from paxserve.worker.step_functions import StepShapes

    base = make_tiny_llama(tmp_path / "base", seed=6, num_key_value_heads=2)
    adapters = [write_adapter(base, tmp_path / f"adapter{i}", seed=30 + i, **s) for i, s in enumerate(ADAPTERS[:2])]
    model = load_model(str(tmp_path / "base"), tensor_parallel_size=size)
    cfg, tp = model.config, model.tp
    layout = get_architecture(cfg.architecture).layout(cfg)
    lora = empty_weights(cfg, layout, 2, MAX_RANK, np.float32)
    for i, (path, _) in enumerate(adapters):
        write_slot(lora, i, read_adapter(path, cfg, layout, MAX_RANK, np.float32))
    lora = jax.tree.map(jnp.asarray, lora) if tp is None else tp.place_lora(lora)
    block, num_blocks = 16, 32
    shapes = StepShapes(cfg, model.architecture, np.dtype(np.float32), block, num_blocks, 5, tp=tp, lora=(2, MAX_RANK))
    lower, abstract, _ = shapes.spec(("forward", 64, 4, 2))
    program = lower().compile()
    assert len(abstract) == 9  # the step's 7 arguments, then the slots' weights and each token's slot
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (11, 6, 20)]
    for slots in ([0, -1, 1], [1, 0, -1]):
        chunks = [SeqChunk(p, 0, [2 * i + 1, 2 * i + 2]) for i, p in enumerate(prompts)]
        batch = build_batch(chunks, block, pad_tokens_to=64, pad_seqs_to=4, pad_blocks_to=2)
        token_slots = np.full(64, -1, np.int32)
        token_slots[:sum(map(len, prompts))] = np.repeat(slots, [len(p) for p in prompts])
        cache = zeroed_kv_cache(cfg, tp, num_blocks, block, np.dtype(np.float32))
        params = split_layers(model.params)  # as the runner serves them (models/layer_split.py)
        logits, _ = program(params, cache, jnp.asarray(batch.input_ids), jnp.asarray(batch.positions),
                            attention_metadata(batch), jnp.zeros(5, jnp.int32), jnp.full(64, -1, jnp.int32), lora,
                            jnp.asarray(token_slots))
        for row, (prompt, slot) in enumerate(zip(prompts, slots)):
            want = last_logits(base if slot == -1 else adapters[slot][1], prompt)
            assert rel_error(np.asarray(logits)[row], want)[1] < 1e-4, (slots, row)
