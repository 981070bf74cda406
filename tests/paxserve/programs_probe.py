"""Run by test_programs.py in a fresh Python process (JAX's persistent cache off, as in a real
start): build an engine on a stored-program folder, generate, and print what it loaded, compiled and
traced as one JSON line."""

from __future__ import annotations

import json
import logging
import sys

import jax

from paxserve import Engine, SamplingParams
from tests.paxserve.test_engine import PROMPTS, TEST_ENGINE_ARGS


def main() -> None:
    model_dir, store, max_num_seqs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    logging.basicConfig(level=logging.INFO)
    traces: list[str] = []

    def on_event(event: str, duration: float, **kwargs: object) -> None:
        if event.endswith("jaxpr_trace_duration"):
            traces.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(on_event)
    engine = Engine(model_dir, **{**TEST_ENGINE_ARGS, "compilation_cache_dir": store, "max_num_seqs": max_num_seqs,
                                  "warmup": True})
    outs = engine.generate(PROMPTS[:max_num_seqs], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
    programs = engine.runner.programs
    print(json.dumps({"loaded": programs.num_loaded, "compiled": programs.num_compiled,
                      "keys": sorted("-".join(map(str, k)) for k in programs.keys()), "traces": traces,
                      "tokens": [o.outputs[0].token_ids for o in outs],
                      "finish": [o.outputs[0].finish_reason for o in outs]}))


if __name__ == "__main__":
    main()
