"""Structured outputs on llguidance: compile a request's constraint into a token matcher, off the
step loop, cached by constraint, within a time limit.

Why llguidance (not xgrammar): it is on PyPI for this platform with no torch at run time (xgrammar's
wheels are not on our index and its Python side imports torch), compiles a JSON schema lazily in
about a millisecond (an Earley parser over a lazily built lexer, so a huge schema is not expanded
up front), fills a token bitmask in tens of microseconds per step, and bounds its own work with
fuel limits, so a hostile grammar ends in an error rather than a hang.

The matcher a request gets is a deep copy of the cached, never-advanced one; the step loop fills its
row of the token bitmask each step (`sampling.host_inputs`) and advances it with the sampled token
(`Request.append_output`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from paxserve.models.optional_import import MissingPackageError, import_for
from paxserve.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

# JSON the way OpenAI writes it: ", " and ": " and no free whitespace. Free whitespace lets a small
# model pad with newlines until max_tokens, and a schema-valid answer must also end.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 256


def _llguidance(module: str = "llguidance") -> Any:
    """llguidance (or one of its modules); without it a constraint is a GrammarError that says so,
    never an import failure of the engine (the GPU image, for one, has no llguidance)."""
    try:
        return import_for(module, "structured outputs (response_format, structured_outputs, guided_*, tools)",
                          "llguidance")
    except MissingPackageError as e:
        raise GrammarError(str(e)) from None


class GrammarError(ValueError):
    """A constraint that cannot be compiled (invalid, unsupported, too large or too slow)."""


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """One compiled constraint; `new_matcher()` is a fresh matcher for one sample."""

    key: tuple[str, str]
    _matcher: Any  # llguidance.LLMatcher at its start state; only ever copied

    def new_matcher(self) -> Any:
        return self._matcher.deep_copy()


def grammar_source(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text of a constraint."""
    llguidance = _llguidance()

    kind, text = params.key
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.grammar_from("choice", text)
    try:
        return llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise GrammarError(str(e)) from None


class GrammarCompiler:
    """Thread-safe: the input workers call `compile` concurrently. One compile per distinct
    constraint runs at a time; a second request for it waits on the first."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 cache_size: int = DEFAULT_CACHE_SIZE, max_workers: int = 2) -> None:
        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer")
        if timeout_s <= 0:
            raise ValueError(f"GrammarCompiler timeout_s={timeout_s} must be > 0")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str], concurrent.futures.Future] = OrderedDict()
        # Compiles run here, not on the caller's thread, so a slow one can be given up on. llguidance
        # drops the GIL while it compiles and bounds the work with its fuel limits.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")

    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                hf = _llguidance("llguidance.hf")
                start = time.perf_counter()
                self._ll_tokenizer = hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
                logger.info("structured outputs: llguidance token table for %d tokens built in %.2fs",
                            self.vocab_size, time.perf_counter() - start)
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint, from the cache when it was compiled before. Raises GrammarError."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(self._build, params)
                self._cache[key] = future
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            # The compile goes on in the background (bounded by fuel); the same constraint sent
            # again waits on it instead of starting another.
            raise GrammarError(f"compiling the {key[0]} constraint took longer than {self.timeout_s:g}s; simplify it") \
                from None
        except GrammarError:
            with self._lock:  # a failure is not cached: the next request gets the same clear error anew
                if self._cache.get(key) is future:
                    del self._cache[key]
            raise

    def _build(self, params: StructuredOutputsParams) -> CompiledGrammar:
        llguidance = _llguidance()

        start = time.perf_counter()
        try:
            source = grammar_source(params)
        except ValueError as e:  # llguidance's own parse of the schema (too deep, not JSON)
            raise GrammarError(f"the {params.kind} constraint is invalid or not supported: {_one_line(str(e))}") \
                from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), source, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {params.kind} constraint is invalid or not supported: "
                               f"{_one_line(matcher.get_error())}")
        logger.debug("compiled a %s constraint in %.1f ms", params.kind, 1000 * (time.perf_counter() - start))
        return CompiledGrammar(params.key, matcher)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _one_line(message: str) -> str:
    """llguidance's errors span lines (a caret under the fault): one line for an HTTP error message."""
    return " ".join(message.split())[:500] or "unknown error"
