"""Run by test_eagle3.py in a fresh Python process (JAX's persistent cache off, as in a real
start): two EAGLE-3 proposers one after the other on one stored-program folder run the same passes
(a catch-up with the head's product, a further pass on its own output, a catch-up without the
product), the first
after its warm-up; prints what each compiled and loaded and their proposals, as one JSON line.

    python -m tests.paxserve.eagle3_store_probe MODEL_DIR HEAD_DIR STORE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np

from paxserve.kernels import REFERENCE
from paxserve.models.eagle3 import load_eagle3
from paxserve.models.loader import inspect_model
from paxserve.spec_decode.eagle3 import Eagle3Proposer


def main() -> None:
    model_dir, head_dir, store = sys.argv[1:4]
    target = inspect_model(model_dir, "float32").config
    cfg, params = load_eagle3(head_dir, target, jnp.float32)
    rng = np.random.default_rng(0)
    embed = jnp.asarray(rng.standard_normal((target.vocab_size, target.hidden_size)), jnp.float32)
    aux = jnp.asarray(rng.standard_normal((8, 3 * target.hidden_size)), jnp.float32)
    request = SimpleNamespace(request_id="r")
    blocks = lambda _: [3, 5]  # noqa: E731
    runs = []
    for start in range(2):
        head = Eagle3Proposer(cfg, params, embed, 8, 16, REFERENCE, True, program_store=Path(store))
        if start == 0:  # as an engine's warm-up: a decoding sequence's passes, ready before any request
            warmed = head.warmup([1], aux.shape[1])
        head.keep_aux(0, aux)
        first = head._run([(request, 0, list(range(10, 16)))], (0,), np.arange(6, dtype=np.int32), blocks)
        second = head._run([(request, 6, [first[0]])], None, np.asarray([0], np.int32), blocks)
        head.keep_aux(1, aux)
        head._run([(request, 7, [16])], (1,), np.asarray([6], np.int32), blocks, with_head=False)
        runs.append({"loaded": head.programs.num_loaded, "compiled": head.programs.num_compiled,
                     "keys": sorted("-".join(map(str, k)) for k in head.programs.keys()), "tokens": first + second,
                     "warmed": warmed})
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
