"""gpu_check part (c): the whole Engine end to end on one attention backend, on a random-weight
Llama-3-8B-shaped bfloat16 model (`gpu_check.py` runs one process per backend, side by side).

Workload (full size): 128 prompts of 512 random tokens, `max_num_batched_tokens` 8192, an explicit
16 GiB KV cache (no activation measurement: only the programs this workload runs are compiled, each
printed with its compile time; no background compiles, no warm-up of buckets it never uses).

- prefill: the prompts with max_tokens=1 on an empty prefix cache (8 steps of 8192 tokens), judged
  against the measured bf16 matmul rate: 2 x (matmul weights) FLOPs per token, plus attention;
- decode: the same prompts again, now in the prefix cache, with 64 output tokens each; the decode
  rate is counted from the moment every request has its first token (the step that recomputes
  each prompt's last token is left out), judged against the measured copy bandwidth: each decode
  step must read every weight but the embedding table, and every sequence's K and V, once.

Each is timed with async scheduling on and off (the same engine and programs), median of 2 runs.
With several backends on one GPU (`--lock`), the processes compile side by side and take turns
to time, so no timing shares the GPU with another process.

    python benchmarks/gpu_check_e2e.py BACKEND [--smoke] [--rows FILE] [--lock FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

# Last, for `benchmarks.*`: paxserve comes from gpu_check.sh's PYTHONPATH (benchmarks/checkout.py).
sys.path.append(str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_check_common import Rows, one_line  # noqa: E402

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    bos_token_id=128000, eos_token_id=128001,
)
# Head dim 64: the smallest the Mosaic GPU kernel takes, so the smoke run reaches it too.
TINY = dict(LLAMA3_8B, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def random_model_loader(directory: Path):  # noqa: ANN201
    """A stand-in for `load_model`: the config from `directory`, random weights made on the device."""
    import jax

    from paxserve.models.loader import LoadedModel, _model_spec, _read_hf_config

    def load(model: Any, dtype: str = "auto", **_: Any) -> LoadedModel:
        cfg, arch, np_dtype = _model_spec(_read_hf_config(directory), dtype, "hf")
        abstract = arch.abstract_params(cfg, np_dtype)
        leaves, treedef = jax.tree_util.tree_flatten(abstract)
        keys = jax.random.split(jax.random.key(0), len(leaves))
        make = jax.jit(lambda key, shape, dt: 0.02 * jax.random.normal(key, shape, dt), static_argnums=(1, 2))
        params = jax.tree_util.tree_unflatten(treedef, [make(key, x.shape, x.dtype) for key, x in zip(keys, leaves)])
        return LoadedModel(config=cfg, params=jax.block_until_ready(params), architecture=arch, tokenizer=None,
                           dtype=np_dtype, source=f"random:{directory}")

    return load


class _CompileLog(logging.Handler):
    """Turns the program store's "compiled KEY in Ns" log lines into rows."""

    PATTERN = re.compile(r"compiled (\S+) in ([\d.]+)s")

    def __init__(self, rows: Rows, backend: str) -> None:
        super().__init__(logging.INFO)
        self.rows, self.backend, self.seconds = rows, backend, 0.0

    def emit(self, record: logging.LogRecord) -> None:
        match = self.PATTERN.search(record.getMessage())
        if match:
            self.seconds += float(match.group(2))
            self.rows(f"{self.backend}: compiled {match.group(1)}", f"{float(match.group(2)):.1f} s",
                      "program key: kind-tokens-sequences-block width")


def wait_for_peers(lock: Path | None, name: str, peers: int, timeout: float = 150.0) -> float:
    """Say this process has compiled, then wait (at most `timeout`) until `peers` processes have, so
    no timing runs beside another process's compiles (they take the host's cores the step loop
    needs). Returns the seconds waited."""
    if lock is None or peers <= 1:
        return 0.0
    ready = lock.with_name(lock.name + ".ready")
    ready.mkdir(exist_ok=True)
    (ready / name).touch()
    start = time.monotonic()
    while len(list(ready.iterdir())) < peers and time.monotonic() - start < timeout:
        time.sleep(0.2)
    return time.monotonic() - start


@contextlib.contextmanager
def turn(lock: Path | None, name: str, last: bool, peers: int, timeout: float = 120.0) -> Iterator[float]:
    """Hold the timing turn (an exclusive lock on `lock`; released if this process dies). The `last`
    process (the XLA reference: its decode steps are the slowest by far) first waits, at most
    `timeout`, until the others have timed, so that it never eats the budget of the kernels the
    check is about. Yields the seconds waited for the others."""
    if lock is None:
        yield 0.0
        return
    timed = lock.with_name(lock.name + ".timed")
    timed.mkdir(exist_ok=True)
    start = time.monotonic()
    while last and len(list(timed.iterdir())) < peers - 1 and time.monotonic() - start < timeout:
        time.sleep(0.2)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield time.monotonic() - start
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
            (timed / name).touch()


def run_pass(engine: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, float]:
    """All prompts through the engine; wall time, when every request had its first token, tokens."""
    from paxserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    counts: dict[str, int] = {}
    all_started = None
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
        if all_started is None and len(counts) == len(prompts) and min(counts.values()) >= 1:
            all_started = time.perf_counter()
    end = time.perf_counter()
    return {"seconds": end - start, "decode_seconds": end - (all_started or end), "tokens": sum(counts.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("backend", choices=("mosaic", "triton", "reference"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rows", type=Path)
    ap.add_argument("--lock", type=Path, help="take turns to time with the other backends' processes")
    ap.add_argument("--peers", type=int, default=1, help="processes that compile side by side before timing")
    args = ap.parse_args()
    rows = Rows(args.rows, "c")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sys.exit(run(rows, args.backend, args.smoke, args.lock, args.peers))


def run(rows: Rows, backend: str, smoke: bool, lock: Path | None, peers: int = 1) -> int:
    import jax
    import numpy as np

    import paxserve.engine.build as engine_module  # where the engine is built (and its weights loaded)
    from paxserve import Engine

    config = TINY if smoke else LLAMA3_8B
    num_prompts, prompt_len, output_len = (4, 32, 4) if smoke else (128, 512, 64)
    compile_log = _CompileLog(rows, backend)
    logging.getLogger("paxserve.worker.programs").addHandler(compile_log)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        original = engine_module.load_model
        engine_module.load_model = random_model_loader(Path(tmp))
        try:
            engine = Engine(tmp, dtype="bfloat16", max_model_len=64 if smoke else 1024, max_num_seqs=num_prompts,
                            max_num_batched_tokens=64 if smoke else 8192,
                            kv_cache_memory_bytes=(8 if smoke else 16 * 1024) * 2**20,
                            warmup=False, compile_in_background=False, log_stats_interval=0,
                            compilation_cache_dir="", attention_backend=backend)
        except ValueError as e:  # the backend cannot serve this model here (the error says why)
            rows(f"{backend}: engine", "n/a", one_line(e), status="n/a")
            wait_for_peers(lock, backend, peers)
            return 0
        finally:
            engine_module.load_model = original
    chosen = engine.attention_backend.name + (" (interpret)" if engine.attention_backend.interpret else "")
    rows(f"{backend}: engine built", f"{time.perf_counter() - start:.1f} s",
         f"backend {chosen}; {engine.plan.num_blocks} KV blocks = "
         f"{engine.plan.num_blocks * engine.plan.bytes_per_block / 2**30:.1f} GiB (explicit)")
    if engine.attention_backend.name != backend:
        rows(f"{backend}: backend", "FAIL", f"the engine fell back to {chosen}: see the log for why", status="fail")
        wait_for_peers(lock, backend, peers)
        return 1
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config["vocab_size"], prompt_len).tolist() for _ in range(num_prompts)]
    # The first pass of each kind compiles its programs (the rows above name them).
    start = time.perf_counter()
    engine.reset_prefix_cache()
    run_pass(engine, prompts, 1, "warm-prefill")
    run_pass(engine, prompts, output_len, "warm-decode")
    rows(f"{backend}: first passes (compiling)", f"{time.perf_counter() - start:.1f} s",
         f"{compile_log.seconds:.1f} s of it compiling; buckets {sorted(engine.runner.compiled)}")
    cfg = engine.model_config
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(engine.model.params))
    embedding = cfg.vocab_size * cfg.hidden_size * 2
    matmul_params = cfg.num_layers * (cfg.hidden_size * cfg.num_heads * cfg.head_dim * 2
                                      + cfg.hidden_size * cfg.num_kv_heads * cfg.head_dim * 2
                                      + 3 * cfg.hidden_size * cfg.intermediate_size)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    # Causal attention over a prompt of n tokens: QK and PV, 2 FLOPs each, n^2 / 2 pairs per head.
    attention_flops = cfg.num_layers * cfg.num_heads * cfg.head_dim * 4 * prompt_len**2 / 2 * num_prompts
    prefill_flops = 2 * matmul_params * prompt_len * num_prompts + attention_flops \
        + 2 * cfg.hidden_size * cfg.vocab_size * num_prompts
    decode_bytes = sum((weights - embedding) + num_prompts * (prompt_len + i) * kv_per_token
                       for i in range(1, output_len))
    peak, bw = rows.value("matmul_peak"), rows.value("copy_bw")
    waited = wait_for_peers(lock, backend, peers)
    # The reference is the yardstick, not the subject: one asynchronous run, after the kernels'.
    reference = backend == "reference"
    with turn(lock, backend, last=reference, peers=peers) as queued:
        rows(f"{backend}: timing turn", f"after {waited:.0f} s waiting for the other backends to compile "
                                        f"and {queued:.0f} s for the kernels' turns")
        for async_on in (True,) if reference else (True, False):
            engine.core.async_scheduling = async_on
            mode = "async" if async_on else "sync"
            prefill, decode = [], []
            for i in range(1 if smoke or reference else 2):
                engine.reset_prefix_cache()
                prefill.append(run_pass(engine, prompts, 1, f"{mode}-prefill-{i}")["seconds"])
                out = run_pass(engine, prompts, output_len, f"{mode}-decode-{i}")
                decode.append(out["decode_seconds"])
            p_s, d_s = statistics.median(prefill), statistics.median(decode)
            tokens = num_prompts * prompt_len
            note = f"{prefill_flops / p_s / 1e12:.0f} TFLOP/s"
            if peak:
                note += f" = {100 * prefill_flops / p_s / peak:.0f}% of the measured bf16 matmul rate"
            rows(f"{backend} {mode}: prefill {num_prompts}x{prompt_len}", f"{tokens / p_s:.0f} tok/s",
                 f"{note}; {p_s:.2f} s (runs {', '.join(f'{x:.2f}' for x in prefill)})",
                 value=tokens / p_s, key=f"c:{backend}:{mode}:prefill")
            decoded = num_prompts * (output_len - 1)
            note = f"{1e3 * d_s / (output_len - 1):.2f} ms/step"
            if bw:
                bound = decoded / (decode_bytes / bw)
                note += f"; bound {bound:.0f} tok/s (weights + KV once per step at copy BW) = " \
                        f"{100 * decoded / d_s / bound:.0f}% of it"
            rows(f"{backend} {mode}: decode {num_prompts} seqs x {output_len - 1} steps", f"{decoded / d_s:.0f} tok/s",
                 f"{note} (runs {', '.join(f'{x:.2f}' for x in decode)} s)", value=decoded / d_s,
                 key=f"c:{backend}:{mode}:decode")
    for key in sorted(engine.runner.programs.keys()):
        executable = engine.runner.programs.get(key)
        analysis = executable.memory_analysis() if hasattr(executable, "memory_analysis") else None
        temp = getattr(analysis, "temp_size_in_bytes", None) if analysis is not None else None
        if temp is not None:
            rows(f"{backend}: temporaries of {'-'.join(map(str, key))}", f"{temp / 2**20:.0f} MiB",
                 "XLA's plan for this program: what the activation reservation would need for it")
    engine.close()
    return 0


if __name__ == "__main__":
    main()
