"""EAGLE-3 speculation: random heads written in the published checkpoint format propose exactly what
an independent torch implementation of the head proposes from the target's hidden states
(transformers'), outputs equal plain decoding's, and heads that cannot serve are refused. Under
tensor parallelism and over two hosts: test_multihost.py (TP 4 over two processes, the same
reference)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from paxserve import Engine
from paxserve.config import EngineConfig
from paxserve.models.config import ModelConfig
from paxserve.models.eagle3 import eagle3_config
from paxserve.spec_decode.config import SpeculativeConfig
from tests.paxserve import test_spec_decode as spec
from tests.paxserve.test_spec_decode import ARGS, EXTRA, GREEDY, PROMPTS, SMALL_POOL, FlatTimes, record_proposals
from tests.paxserve.tiny_checkpoints import MODEL_VOCAB as VOCAB

# The speculation tests' target and its plain outputs (made again for this module).
tiny_dir, plain = spec.tiny_dir, spec.plain

HIDDEN, HEADS, KV_HEADS, INTER = 64, 4, 2, 96
AUX = [0, 1, 1]  # the tiny target has 2 layers (vLLM's default ids need 4 or more)


def write_head(folder: Path, seed: int, draft_vocab: int, common: int, *, own_embed: bool = False,
               norm_before_residual: bool = False, vocab: int = VOCAB) -> Path:
    """A random head for a target of `vocab` tokens (hidden size `HIDDEN`, 2 layers or more): its
    draft vocabulary maps half its ids onto distinct target tokens and half onto the target's most
    frequent greedy token `common`, so some proposals get accepted."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 512, "hidden_act": "silu",
              "tie_word_embeddings": False, "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX}}
    if norm_before_residual:
        config["norm_before_residual"] = True
    (folder / "config.json").write_text(json.dumps(config))
    d = HIDDEN // HEADS

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    targets = rng.permutation(vocab)[:draft_vocab]
    targets[draft_vocab // 2:] = common
    d2t = (targets - np.arange(draft_vocab)).astype(np.int64)
    t2d = np.zeros(vocab, bool)
    t2d[targets] = True
    tensors = {"fc.weight": w(HIDDEN, 3 * HIDDEN), "midlayer.input_layernorm.weight": norm(),
               "midlayer.hidden_norm.weight": norm(), "midlayer.post_attention_layernorm.weight": norm(),
               "midlayer.self_attn.q_proj.weight": w(HEADS * d, 2 * HIDDEN),
               "midlayer.self_attn.k_proj.weight": w(KV_HEADS * d, 2 * HIDDEN),
               "midlayer.self_attn.v_proj.weight": w(KV_HEADS * d, 2 * HIDDEN),
               "midlayer.self_attn.o_proj.weight": w(HIDDEN, HEADS * d), "midlayer.mlp.gate_proj.weight": w(INTER, HIDDEN),
               "midlayer.mlp.up_proj.weight": w(INTER, HIDDEN), "midlayer.mlp.down_proj.weight": w(HIDDEN, INTER),
               "norm.weight": norm(), "lm_head.weight": w(draft_vocab, HIDDEN), "d2t": d2t, "t2d": t2d}
    if own_embed:
        tensors["embed_tokens.weight"] = rng.standard_normal((vocab, HIDDEN)).astype(np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


class TorchHead:
    """The head as the EAGLE-3 paper's code runs it, without paging: every proposal recomputes the
    whole sequence of (next token, hidden state) inputs with causal attention."""

    def __init__(self, folder: Path, target: Any) -> None:
        import torch
        from safetensors.torch import load_file

        self.torch, self.target = torch, target
        self.w = load_file(str(folder / "model.safetensors"))
        self.cfg = json.loads((folder / "config.json").read_text())
        if "embed_tokens.weight" not in self.w:
            self.w["embed_tokens.weight"] = target.model.embed_tokens.weight.detach()

    def _rms(self, x: Any, name: str) -> Any:
        x = x.float()
        return self.w[name] * (x * self.torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]))

    def _rope(self, x: Any, positions: Any) -> Any:
        torch, d = self.torch, x.shape[-1]
        inv = 1.0 / (self.cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angles = positions[:, None].float() * inv[None]
        cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
        rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos + rotated * sin

    def _layer(self, tokens: Any, hidden: Any) -> tuple[Any, Any]:
        torch, w, m = self.torch, self.w, "midlayer."
        n, d = tokens.shape[0], HIDDEN // HEADS
        e = self._rms(w["embed_tokens.weight"][tokens], m + "input_layernorm.weight")
        if self.cfg.get("norm_before_residual"):
            h = residual = self._rms(hidden, m + "hidden_norm.weight")
        else:
            residual, h = hidden, self._rms(hidden, m + "hidden_norm.weight")
        x = torch.cat([e, h], -1)
        positions = torch.arange(n)
        q = self._rope((x @ w[m + "self_attn.q_proj.weight"].T).view(n, HEADS, d), positions)
        k = self._rope((x @ w[m + "self_attn.k_proj.weight"].T).view(n, KV_HEADS, d), positions)
        v = (x @ w[m + "self_attn.v_proj.weight"].T).view(n, KV_HEADS, d)
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HEADS * d)
        x = residual + out @ w[m + "self_attn.o_proj.weight"].T
        y = self._rms(x, m + "post_attention_layernorm.weight")
        gated = torch.nn.functional.silu(y @ w[m + "mlp.gate_proj.weight"].T) * (y @ w[m + "mlp.up_proj.weight"].T)
        x = x + gated @ w[m + "mlp.down_proj.weight"].T
        return self._rms(x, "norm.weight") @ w["lm_head.weight"].T, x

    def proposals(self, tokens: list[int], k: int) -> list[int]:
        """What the head proposes after `tokens` (the last one sampled, not yet computed)."""
        torch = self.torch
        with torch.no_grad():
            states = self.target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
            aux = torch.cat([states[i][0] for i in AUX], -1)[:-1]  # each layer's input, positions 0..N-2
            fed, hidden = torch.tensor(tokens[1:]), aux @ self.w["fc.weight"].T
            out = []
            for _ in range(k):
                logits, x = self._layer(fed, hidden)
                draft = int(logits[-1].argmax())
                out.append(draft + int(self.w["d2t"][draft]))
                fed, hidden = torch.cat([fed, torch.tensor([out[-1]])]), torch.cat([hidden, x[-1:]])
            return out


@pytest.fixture(scope="module")
def target(tiny_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_dir), torch_dtype=torch.float32).eval()


def test_eagle3_heads_propose_what_the_reference_head_does_and_outputs_stay_plain_decodings(
        tiny_dir: Path, plain: dict[str, list], target: Any, tmp_path: Path) -> None:
    """A head in the published format (no embedding of its own: it reads the target's), through a
    pool too small for the batch: requests are preempted and recomputed, and the head catches up
    on their positions again. With async scheduling: a step whose requests will not propose is
    overlapped by the next, so the head may catch up on two steps' positions at once."""
    greedy = [o.outputs[0].token_ids for o in plain["greedy"]]
    common = int(np.bincount(np.concatenate(greedy)).argmax())
    head = write_head(tmp_path / "head", 1, 96, common)  # a seed whose head gets runs of proposals accepted
    engine = Engine(str(tiny_dir), speculative_config={"method": "eagle3", "model": str(head),
                                                       "num_speculative_tokens": 3},
                    block_size=8, async_scheduling=True, **{**ARGS, **SMALL_POOL})
    core = engine.parts.core
    core._speculator.times = FlatTimes()
    eagle = core._speculator.eagle
    seen = record_proposals(eagle)
    catch_up, steps_caught_up = eagle.catch_up, []

    def counting(*args):  # noqa: ANN002, ANN202
        steps_caught_up.append(len(eagle._pending))
        return catch_up(*args)

    eagle.catch_up = counting
    # Greedy rows beside penalised and structured ones (a seeded grammar row among them); seeded
    # sampling at every verified position is the verification's, whatever proposed (test_spec_decode).
    prompts = PROMPTS + [p for p, _ in EXTRA]
    outs = engine.generate(prompts, [GREEDY] * len(PROMPTS) + [q for _, q in EXTRA], use_tqdm=False)
    for out, want in zip(outs, plain["greedy"] + plain["extra"]):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    reference = TorchHead(head, target)
    assert len(seen) > 20
    for tokens, proposal in seen:
        assert proposal == reference.proposals(tokens, len(proposal)), tokens
    stats = core.spec_stats
    assert stats.num_drafts > 10 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert stats.accepted_per_position[1] > 0  # runs of accepted proposals: the head caught up on several
    assert core.stats.preemptions > 0
    assert core.num_spec_waits > 0 and core.num_overlapped_steps > 0 and max(steps_caught_up) == 2
    assert engine.kv.num_free_blocks == engine.plan.num_blocks - 1


def test_a_second_start_loads_the_heads_passes_from_the_program_store(tiny_dir: Path, tmp_path: Path) -> None:
    """The head's passes are stored programs like the target's steps: a second proposer on the same
    folder (in a fresh process, JAX's own cache off, as a restart) loads every pass the first one
    compiled, compiles none, and gives the same proposals."""
    head = write_head(tmp_path / "head", 1, 96, 0)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "tests.paxserve.eagle3_store_probe", str(tiny_dir), str(head),
                           str(tmp_path / "store")], capture_output=True, text=True, cwd=root, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = json.loads(done.stdout.strip().splitlines()[-1])
    # Warm-up readied a decoding sequence's three passes; the prompt's catch-up compiled when first run.
    assert first["warmed"] == 3
    assert first["keys"] == ["eagle3-1-1-1-192-0", "eagle3-1-1-1-192-1", "eagle3-1-1-1-64-1", "eagle3-8-1-1-192-1"]
    assert (first["compiled"], first["loaded"]) == (4, 0) and len(list(tmp_path.rglob("eagle3-*.xla"))) == 4
    assert (second["compiled"], second["loaded"]) == (0, 3)  # what its passes needed, from the store
    assert second["tokens"] == first["tokens"]


def test_a_head_with_its_own_embedding_and_the_norm_before_its_residual_matches_the_reference(
        tiny_dir: Path, target: Any, tmp_path: Path) -> None:
    """The speculators format's variants, on the head's forward alone: one sequence's catch-up,
    then a proposal pass that reads the head's own output."""
    import jax.numpy as jnp

    from paxserve.kernels import KVCache
    from paxserve.models.eagle3 import eagle3_forward, load_eagle3
    from paxserve.models.loader import inspect_model
    from paxserve.worker.step_functions import attention_metadata
    from paxserve.worker.step_inputs import assemble_batch

    head = write_head(tmp_path / "head", 8, 96, 0, own_embed=True, norm_before_residual=True)
    cfg, params = load_eagle3(head, inspect_model(str(tiny_dir), "float32").config, jnp.float32)
    assert cfg.norm_before_residual and params.embed is not None
    tokens = PROMPTS[2] + [5, 9]
    reference = TorchHead(head, target)
    want = reference.proposals(tokens, 2)
    import torch

    with torch.no_grad():
        states = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    aux = jnp.asarray(torch.cat([states[i][0] for i in AUX], -1)[:-1].numpy())
    cache = KVCache.zeros(1, 4, 16, KV_HEADS, HIDDEN // HEADS, jnp.float32)
    table = np.asarray([[1, 2]], np.int32)
    n = len(tokens) - 1
    batch = assemble_batch(np.asarray(tokens[1:], np.int32), np.asarray([0], np.int32), np.asarray([n], np.int32),
                           table, np.asarray([1], np.int32), 16)
    first, x, cache = eagle3_forward(params, None, cache, jnp.asarray(batch.input_ids), aux,
                                     jnp.asarray(batch.positions), attention_metadata(batch), cfg)
    batch = assemble_batch(np.asarray(first, np.int32), np.asarray([n], np.int32), np.asarray([1], np.int32),
                           table, np.asarray([1], np.int32), 16)
    second, _, _ = eagle3_forward(params, None, cache, jnp.asarray(batch.input_ids), x,
                                  jnp.asarray(batch.positions), attention_metadata(batch), cfg)
    assert [int(first[0]), int(second[0])] == want


def test_eagle3_heads_that_cannot_serve_are_refused_with_the_reason(tiny_dir: Path, tmp_path: Path) -> None:
    config = SpeculativeConfig.parse({"method": "eagle3", "model": "/a/head", "num_speculative_tokens": 2})
    assert (config.method, config.model) == ("eagle3", "/a/head")
    with pytest.raises(ValueError, match="model.* is required for method 'eagle3'"):
        SpeculativeConfig.parse({"method": "eagle3", "num_speculative_tokens": 2})
    llama = ModelConfig("LlamaForCausalLM", 1000, 64, 30, 4, 4, 16, 128)
    hf = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000, "draft_vocab_size": 100}
    assert eagle3_config(hf, llama).aux_layers == (2, 15, 27)  # vLLM's default: (2, L // 2, L - 3)
    for change, words in (({"vocab_size": 999}, "vocab_size=999, the target model's 1000"),
                          ({"target_hidden_size": 32}, "hidden states 32 wide"),
                          ({"eagle_aux_hidden_state_layer_ids": [2, 15, 30]}, "must name 3 of the target's 30"),
                          ({"num_hidden_layers": 2}, "one-layer"),
                          ({"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 head")):
        with pytest.raises(ValueError, match=words):
            eagle3_config({**hf, **change}, llama)
    # Over several hosts too (test_multihost.py runs one): the config takes it.
    assert EngineConfig(speculative_config=config, nnodes=2, node_rank=0,
                        tensor_parallel_size=2).speculative_config.method == "eagle3"
    head = write_head(tmp_path / "head", 1, 64, 0)
    (head / "model.safetensors").rename(head / "elsewhere.bin")
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative_config.model=.*no .safetensors file"):
        Engine(str(tiny_dir), speculative_config=spec, **ARGS)
    (head / "config.json").write_text(json.dumps({**json.loads((head / "config.json").read_text()),
                                                  "eagle_config": {}}))
    with pytest.raises(ValueError, match=r"\[2, 1, -1\] must name 3 of the target's 2 layers"):
        Engine(str(tiny_dir), speculative_config=spec, **ARGS)


@pytest.mark.parametrize("family", ["qwen3-bias", "mixtral"])
def test_the_steps_aux_hidden_states_are_the_inputs_of_the_named_layers(family: str, tmp_path: Path) -> None:
    """What a head reads, for a family with q/k norms and one with experts: the residual stream
    entering each named layer, as transformers' hidden states give it, at every token."""
    import jax
    import jax.numpy as jnp
    import torch

    from paxserve.kernels import KVCache
    from paxserve.models.decoder import forward
    from paxserve.models.loader import load_model
    from paxserve.worker.step_functions import attention_metadata
    from paxserve.worker.step_inputs import assemble_batch
    from tests.models.family_checkpoints import make_family_checkpoint

    hf = make_family_checkpoint(family, tmp_path)
    model = load_model(str(tmp_path), "float32", use_param_cache=False)
    cfg, tokens, layers = model.config, [3, 17, 99, 5, 42, 8, 250], (1, 0, 1)
    cache = KVCache.zeros(cfg.num_layers, 3, 8, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    batch = assemble_batch(np.asarray(tokens, np.int32), np.asarray([0], np.int32),
                           np.asarray([len(tokens)], np.int32), np.asarray([[1]], np.int32), np.asarray([1], np.int32), 8)
    run = jax.jit(forward, static_argnames=("cfg", "aux_layers"))
    _, _, aux = run(model.params, cache, jnp.asarray(batch.input_ids), jnp.asarray(batch.positions),
                    attention_metadata(batch), cfg=cfg, aux_layers=layers)
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in layers], -1).numpy()
    np.testing.assert_allclose(np.asarray(aux), want, rtol=1e-4, atol=1e-4)
