"""The start-up numerics check of a quantized configuration: does it still answer like the model?
(paxserve/engine/numerics.py decides when it runs and remembers its outcome.)

A few fixed prompts run through the serving configuration (quantized weights) and through the
same model unquantized, on the same device and attention backend, as one prefill step with logits
at every position. Two figures come out: top-1 agreement (the share of positions whose most likely
next token is the same) and the mean KL divergence of the quantized next-token distribution from
the unquantized one. Below the thresholds the engine refuses to start and says by how much: a
wrong scale or a broken kernel shows up here, not in users' answers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from paxserve.config import QuantizationCheck
from paxserve.kernels import AttentionBackend, AttentionMetadata, KVCache

logger = logging.getLogger(__name__)

# Varied enough to exercise what a model does (prose, code, arithmetic, a list), short enough that
# the check is one small prefill.
CHECK_TEXTS = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type with an oil-based ink and a screw press adapted from wine making.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])",
    "Question: A train travels 120 kilometres in 1.5 hours. What is its average speed?\nAnswer: The average "
    "speed is distance divided by time, 120 / 1.5 = 80 kilometres per hour.",
)
MAX_TOKENS_PER_TEXT = 48
BLOCK = 16


@dataclass(frozen=True)
class CheckResult:
    top1: float
    mean_kl: float
    max_kl: float
    positions: int
    seconds: float

    def describe(self) -> str:
        return (f"top-1 agreement {self.top1:.1%} over {self.positions} positions, mean KL {self.mean_kl:.4f} nats "
                f"(worst position {self.max_kl:.4f}), {self.seconds:.1f}s")


def check_prompts(tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """The check's token ids: the fixed texts through the model's tokenizer, or, for a model
    without one, fixed pseudo-random ids."""
    if tokenizer is None:
        rng = np.random.default_rng(0)
        return [rng.integers(0, vocab_size, MAX_TOKENS_PER_TEXT).tolist() for _ in CHECK_TEXTS]
    return [[t for t in tokenizer.encode(text)][:MAX_TOKENS_PER_TEXT] for text in CHECK_TEXTS]


def _prefill_batch(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray, AttentionMetadata, int]:
    """(ids, positions, metadata with logits at every position, blocks used) for all prompts as one
    prefill step, each in its own blocks after the null block."""
    ids, positions, slots, tables, starts = [], [], [], [], [0]
    width = max(-(-len(p) // BLOCK) for p in prompts)
    next_block = 1
    for p in prompts:
        blocks = list(range(next_block, next_block + -(-len(p) // BLOCK)))
        next_block += len(blocks)
        ids += p
        positions += range(len(p))
        slots += [blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(len(p))]
        tables.append(blocks + [0] * (width - len(blocks)))
        starts.append(starts[-1] + len(p))
    i32 = lambda a: jnp.asarray(np.asarray(a, np.int32))  # noqa: E731
    metadata = AttentionMetadata(slot_mapping=i32(slots), block_tables=i32(tables),
                                 context_lens=i32([len(p) for p in prompts]), query_start_loc=i32(starts),
                                 logits_indices=i32(np.arange(len(ids))))
    return np.asarray(ids, np.int32), np.asarray(positions, np.int32), metadata, next_block


def compare_logits(reference: np.ndarray, served: np.ndarray) -> tuple[float, float, float]:
    """(top-1 agreement, mean KL(reference || served), worst position's KL) of [positions, vocab]."""
    ref = jax.nn.log_softmax(jnp.asarray(reference, jnp.float32), axis=-1)
    got = jax.nn.log_softmax(jnp.asarray(served, jnp.float32), axis=-1)
    kl = np.asarray(jnp.sum(jnp.exp(ref) * (ref - got), axis=-1))
    top1 = float(np.mean(np.argmax(reference, -1) == np.argmax(served, -1)))
    return top1, float(np.mean(kl)), float(np.max(kl))


@dataclass(frozen=True)
class Probe:
    """The fixed prompts as one prefill step through a model's serving forward (`forward(params,
    kv_cache, ids, positions, metadata)`, its backend and split bound), each run on a fresh cache
    placed as the serving one is (`place`, under tensor parallelism)."""

    forward: Callable[..., Any]
    cfg: Any
    dtype: Any  # the model's
    num_kv_heads: int  # as the cache stores them
    prompts: tuple[tuple[int, ...], ...]
    place: Callable[[KVCache], KVCache] | None = None

    @property
    def positions(self) -> int:
        return sum(len(p) for p in self.prompts)

    def _args(self, params: Any, kv_dtype: Any, kv_scales: tuple[np.ndarray, np.ndarray] | None) -> tuple:
        ids, positions, metadata, blocks = _prefill_batch([list(p) for p in self.prompts])
        cache = KVCache.zeros(self.cfg.num_layers, blocks, BLOCK, self.num_kv_heads, self.cfg.head_dim,
                              self.dtype if kv_dtype is None else kv_dtype)
        if kv_scales is not None:
            cache = cache.replace(k_scale=jnp.asarray(kv_scales[0], jnp.float32),
                                  v_scale=jnp.asarray(kv_scales[1], jnp.float32))
        if self.place is not None:
            cache = self.place(cache)
        return params, cache, jnp.asarray(ids), jnp.asarray(positions), metadata

    def compile(self, params: Any, kv_dtype: Any = None) -> Callable[..., Any]:
        """The prefill's program for these params and cache dtype, compiled ahead (the check compiles
        its two side by side: XLA's compiler releases the GIL)."""
        return self.forward.lower(*self._args(params, kv_dtype, None)).compile()

    def prefill(self, params: Any, kv_dtype: Any = None, kv_scales: tuple[np.ndarray, np.ndarray] | None = None,
                compiled: Callable[..., Any] | None = None) -> tuple[np.ndarray, KVCache]:
        """(float32 logits at every prompt position, the cache the step wrote); `compiled`: the
        program `compile` made for these params and cache dtype."""
        logits, cache = (compiled or self.forward)(*self._args(params, kv_dtype, kv_scales))
        return np.asarray(jax.device_get(logits), np.float32), cache

    @staticmethod
    def scales_from(cache: KVCache, kv_dtype: Any) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer K and V scales for an fp8 cache (vLLM's --calculate-kv-scales): each layer's
        largest |K| and |V| in a full-width cache a prefill wrote, mapped to the format's largest value."""
        limit = float(ml_dtypes.finfo(np.dtype(kv_dtype)).max)

        def per_layer(x: jax.Array) -> np.ndarray:
            amax = np.asarray(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(1, 2, 3, 4)))
            return np.where(amax > 0, amax / limit, 1.0).astype(np.float32)

        return per_layer(cache.k), per_layer(cache.v)


def make_probe(model: Any, attention_backend: AttentionBackend) -> Probe:
    """The probe of a loaded model on the backend and split the engine serves it with."""
    from paxserve.worker.step_functions import run_forward

    cfg, tp = model.config, model.tp
    forward = jax.jit(lambda p, kv, ids, pos, md: run_forward(model.architecture.forward, p, kv, ids, pos, md, cfg,
                                                              attention_backend, tp))
    heads = cfg.num_kv_heads if tp is None else tp.num_kv_heads_stored
    place = None if tp is None else (lambda cache: jax.device_put(cache, tp.kv_cache_shardings(cache)))
    prompts = tuple(tuple(p) for p in check_prompts(model.tokenizer, cfg.vocab_size))
    return Probe(forward, cfg, jnp.dtype(model.dtype), heads, prompts, place)


def check_against(probe: Probe, reference: np.ndarray, params: Any, kv_dtype: Any = None,
                  kv_scales: tuple[np.ndarray, np.ndarray] | None = None, compiled: Callable[..., Any] | None = None,
                  started: float | None = None) -> CheckResult:
    """The served setting (`params`, a `kv_dtype` cache with `kv_scales`; `compiled`: its program,
    if made ahead) against `reference`, the unquantized model's logits on the probe's prompts;
    `started`: when the check began (its reference run included), for the reported time."""
    start = time.perf_counter() if started is None else started
    served, _ = probe.prefill(params, kv_dtype, kv_scales, compiled)
    top1, mean_kl, worst = compare_logits(reference, served)
    return CheckResult(top1, mean_kl, worst, probe.positions, time.perf_counter() - start)


def run_check(probe: Probe, params: Any, unquantized: Any, kv_dtype: Any = None,
              kv_scales: tuple[np.ndarray, np.ndarray] | None = None) -> CheckResult:
    """The served setting against the unquantized model (`unquantized` params, a cache in the
    model's dtype) on the probe's prompts."""
    start = time.perf_counter()
    reference, _ = probe.prefill(unquantized)
    return check_against(probe, reference, params, kv_dtype, kv_scales, started=start)


def enforce(result: CheckResult, thresholds: QuantizationCheck, what: str) -> None:
    """Log the result; raise ValueError with the numbers when it is below the thresholds."""
    if result.top1 >= thresholds.min_top1 and result.mean_kl <= thresholds.max_kl:
        logger.info("quantization check passed for %s: %s (thresholds: top-1 >= %.0f%%, KL <= %.3f)", what,
                    result.describe(), 100 * thresholds.min_top1, thresholds.max_kl)
        return
    raise ValueError(
        f"quantization check failed for {what}: {result.describe()}, against the unquantized model on the same "
        f"device; the thresholds are top-1 >= {thresholds.min_top1:.0%} and mean KL <= {thresholds.max_kl}. "
        "This setting changes the model's answers more than allowed: serve it unquantized, try another method, "
        "or set --quantization-check (e.g. 'top1=0.8,kl=0.3', or 'off') if you accept it")
