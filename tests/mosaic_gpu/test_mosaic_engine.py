"""The whole Engine on the Mosaic GPU kernels (interpret mode) gives the reference backend's tokens.

A random-weight Llama checkpoint is written with numpy and safetensors (no torch in this lane), in
bfloat16 with a GQA group of 2 and head_dim 64, served with int8 weights (`--quantization int8`);
prompts of 5, 70 and 17 tokens (the 70-token one prefilled in chunks of 64, on top of its own cached
chunk) decode together, so the attention kernels serve mixed ragged steps and pure decode steps, and
the weight-only matmul kernel every linear layer (unrolled in small passes, scanned in larger
ones: models/layer_split.py). The reference engine runs the same int8 weights on XLA's matmul and
attention. (fp8 pages are checked through the same dispatch by the start-up self-check in
test_mosaic_dispatch.py; an engine over them drifts from the reference faster than bf16 pages do,
since fp8 rounding turns a last-bit difference of K or V into a whole fp8 step, so its comparison
would need looser bounds than this one.)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from paxserve import Engine, SamplingParams
from paxserve.kernels.matmul_dispatch import MatmulKernel
from paxserve.models.quant_weights import matmul_kernel


def write_random_llama(directory: Path, *, layers: int = 2, hidden: int = 128, heads: int = 2, kv_heads: int = 1,
                       inter: int = 256, vocab: int = 256, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    hd = hidden // heads
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=hidden,
                  intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=512, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32", bos_token_id=1,
                  eos_token_id=2)

    def w(*shape: int) -> np.ndarray:
        return (0.15 * rng.standard_normal(shape)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": norm(hidden),
               "lm_head.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(heads * hd, hidden), p + "self_attn.k_proj.weight": w(kv_heads * hd, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * hd, hidden), p + "self_attn.o_proj.weight": w(hidden, heads * hd),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter), p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden)})
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))


# bfloat16 attention computed two ways differs by a few hundredths of a nat in the logprobs (the
# kernel rounds P to bf16 for the P V product, as flash attention does): tokens must agree except
# where the reference's top two are closer than that.
LOGPROB_TOL = 0.1
NEAR_TIE = 0.1


def test_engine_on_mosaic_gives_the_reference_tokens(tmp_path: Path) -> None:
    write_random_llama(tmp_path)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 70, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    outputs = {}
    for backend in ("reference", "mosaic"):
        engine = Engine(str(tmp_path), dtype="bfloat16", max_model_len=128, max_num_seqs=4,
                        max_num_batched_tokens=64, block_size=16, kv_cache_memory_bytes=8 * 2**20, warmup=False,
                        log_stats_interval=0, compilation_cache_dir="", attention_backend=backend,
                        quantization="int8", quantization_check="off")
        assert engine.attention_backend.name == backend
        # Asking for the Mosaic GPU family on a CPU puts the quantized matmuls on its kernel too.
        assert matmul_kernel(engine.model.params) == (MatmulKernel(interpret=True) if backend == "mosaic" else None)
        outputs[backend] = [out.outputs[0] for out in engine.generate(prompts, params)]
        # The last steps decode all three alone: on Mosaic GPU, as "decode" programs on its
        # decode-only kernel (the mixed steps on the ragged one).
        kinds = {key[0] for key in engine.runner.programs.keys()}
        assert ("decode" in kinds) == (backend == "mosaic") and "forward" in kinds, kinds
    compared = 0
    for ref, ours in zip(outputs["reference"], outputs["mosaic"]):
        assert len(ours.token_ids) == len(ref.token_ids) == 4
        for step, (token, our_token) in enumerate(zip(ref.token_ids, ours.token_ids)):
            top = sorted((lp.logprob for lp in ref.logprobs[step].values()), reverse=True)
            if our_token != token:  # only a near tie may flip; after it the contexts differ
                assert top[0] - top[1] < NEAR_TIE, (f"step {step}: mosaic chose {our_token}, the reference {token} "
                                                    f"by a margin of {top[0] - top[1]:.3f} nats")
                break
            diff = abs(ours.logprobs[step][token].logprob - ref.logprobs[step][token].logprob)
            assert diff < LOGPROB_TOL, f"step {step}: logprob of token {token} differs by {diff:.3f}"
            compared += 1
    assert compared >= 9, f"only {compared} of 12 tokens could be compared"
