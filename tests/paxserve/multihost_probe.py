"""One rank of a two-process engine (2 simulated CPU devices each), for test_multihost.py.

    python multihost_probe.py RANK MASTER_PORT OUT EAGLE3_HEAD_DIR LORA_DIR,LORA_DIR MODEL_DIR [MODEL_DIR ...]

Each model in turn: every rank builds the engine with the same settings (tensor parallel 4 over the
two processes); rank 0 completes the requests of `multihost_args` and writes them, with
what the engine decided, to OUT.rank0.json; rank 1 runs rank 0's steps until rank 0 closes the engine.
Then the first model again with speculation: n-gram (its proposals the first run's own answers,
right for two tokens, then wrong, so that steps verify and reject proposals over both processes),
itself as its draft model, and the EAGLE-3 head (their passes replayed by rank 1 too); and with two
LoRA adapters sharing one device slot (rank 1 replays each slot write).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=2"])
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.paxserve.multihost_args import ENGINE_ARGS, PROMPTS, SPEC, logprob_rows, sampling_params  # noqa: E402


def main() -> int:
    rank, port, out_path = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    head, loras, models = sys.argv[4], sys.argv[5].split(","), sys.argv[6:]
    logging.basicConfig(level=logging.INFO, format=f"rank{rank} %(levelname)s %(name)s: %(message)s")
    import jax

    from paxserve import Engine

    results = {}
    for model in models:
        engine = Engine(model, **ENGINE_ARGS, nnodes=2, node_rank=rank, master_port=port,
                        distributed_init_timeout=60)
        if engine.is_worker:
            results[model] = {"worker_steps": engine.run_worker()}
            continue
        outs = engine.generate(PROMPTS, sampling_params(), use_tqdm=False)
        results[model] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": logprob_rows(outs[1]),
            "mesh": [[d.process_index, d.id] for d in engine.model.tp.mesh.devices.flat],
            "kv_blocks": engine.plan.num_blocks,
            "blocks_free": engine.kv.num_free_blocks,
            "buckets": sorted(engine.runner.compiled),
        }
        engine.close()
    answers = None if rank else [p + t for p, t in zip(PROMPTS, results[models[0]]["tokens"])]
    for name, config in [("spec", SPEC), ("draft", {"model": models[0], "num_speculative_tokens": 3}),
                         ("eagle3", {"method": "eagle3", "model": head, "num_speculative_tokens": 3})]:
        results[name] = speculate(models[0], rank, port, config, answers)
    results["lora"] = lora(models[0], rank, port, loras)
    out_path.with_suffix(f".rank{rank}.json").write_text(json.dumps(
        {"devices": jax.device_count(), "local": jax.local_device_count(), "models": results}))
    return 0


def lora(model: str, rank: int, port: int, adapters: list[str]) -> dict:
    """The first model serving two adapters from one slot, greedy: requests [A, B, base, A]."""
    from paxserve import Engine, LoRARequest, SamplingParams

    engine = Engine(model, **ENGINE_ARGS, nnodes=2, node_rank=rank, master_port=port, distributed_init_timeout=60,
                    enable_lora=True, max_loras=1, max_lora_rank=8)
    if engine.is_worker:
        return {"worker_steps": engine.run_worker(), "lora_writes": engine.runner.num_lora_writes}
    requests = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False,
                           lora_request=[requests[0], requests[1], None, requests[0]])
    result = {"tokens": [o.outputs[0].token_ids for o in outs], "lora_writes": engine.runner.num_lora_writes,
              "blocks_free": engine.kv.num_free_blocks, "kv_blocks": engine.plan.num_blocks}
    engine.close()
    return result


def speculate(model: str, rank: int, port: int, config: dict, answers: list[list[int]] | None) -> dict:
    """The first model with `config`'s speculation: on rank 0 its outputs, counters and (a drafter's)
    proposals with the tokens they followed; on a worker the steps it ran."""
    from paxserve import Engine
    from paxserve.spec_decode import acceptance
    from tests.paxserve.test_spec_decode import FlatTimes, OracleProposer, record_proposals

    engine = Engine(model, **ENGINE_ARGS, nnodes=2, node_rank=rank, master_port=port, distributed_init_timeout=60,
                    speculative_config=config)
    speculator = engine.parts.core._speculator
    drafter = speculator.drafter
    if engine.is_worker:
        return {"worker_steps": engine.run_worker(),
                "drafter_programs": None if drafter is None else drafter.programs.num_compiled,
              # Under tensor parallelism the head is kept whole on every device (test_multihost.py).
              "head_cache_devices": None if speculator.eagle is None else
              len(speculator.eagle.kv_cache.k.sharding.device_set) *
              speculator.eagle.kv_cache.k.sharding.is_fully_replicated}
    speculator.times = FlatTimes()  # every proposal is verified, whatever this machine's step times
    acceptance._LOW_ACCEPTANCE = -1.0  # and no request backs off: each decoding step proposes
    seen: list[tuple[list[int], list[int]]] = []
    if drafter is None:
        speculator.proposer = OracleProposer(answers, right=2, vocab_size=engine.model.config.vocab_size)
    else:
        seen = record_proposals(drafter)
    outs = engine.generate(PROMPTS, sampling_params(), use_tqdm=False)
    stats = engine.parts.core.spec_stats
    result = {"tokens": [o.outputs[0].token_ids for o in outs], "logprobs": logprob_rows(outs[1]),
              "drafts": stats.num_drafts, "draft_tokens": stats.num_draft_tokens,
              "accepted": stats.num_accepted_tokens, "blocks_free": engine.kv.num_free_blocks,
              "kv_blocks": engine.plan.num_blocks, "proposals": seen,
              "drafter_programs": None if drafter is None else drafter.programs.num_compiled,
              # Under tensor parallelism the head is kept whole on every device (test_multihost.py).
              "head_cache_devices": None if speculator.eagle is None else
              len(speculator.eagle.kv_cache.k.sharding.device_set) *
              speculator.eagle.kv_cache.k.sharding.is_fully_replicated}
    engine.close()
    return result


if __name__ == "__main__":
    sys.exit(main())
