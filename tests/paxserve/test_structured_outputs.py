"""Structured outputs in the engine: constraints compile (or fail clearly), the device bitmask keeps
exactly the allowed tokens, and every guided output parses and validates, even from random weights,
through sampling, n > 1, seeds, preemption, chunked prefill and stop strings, beside free requests
that come out exactly as they would alone."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from paxserve import Engine, SamplingParams
from paxserve.engine.grammar import GrammarCompiler, GrammarError
from paxserve.engine.input_processor import RequestError
from paxserve.structured_outputs import StructuredOutputsParams as SO
from paxserve.worker.sampling.host_inputs import SamplingRow, bitmask_width, build_sampling_inputs
from paxserve.worker.sampling.sampler import apply_token_bitmask
from tests.paxserve.test_async_engine import ARGS
from tests.paxserve.test_engine import VOCAB, assert_no_blocks_held, tiny_dir  # noqa: F401 - module fixture

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]},
                         "tags": {"type": "array", "maxItems": 3, "items": {"type": "boolean"}}}}
LARK = 'start: "answer: " NUM " " UNIT\nNUM: /[1-9][0-9]?/\nUNIT: "cm" | "kg"'


# ---- the constraint and its compiler ----------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"), ({"json": "{not json"}, "valid JSON"),
    ({"json": "[1]"}, "must be an object"), ({"choice": []}, "non-empty list"), ({"regex": ""}, "non-empty"),
])
def test_a_constraint_is_exactly_one_valid_kind(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SO(**kwargs)


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(smollm2_tokenizer, VOCAB)


def test_compiles_are_cached_by_constraint_and_failures_are_clear(compiler: GrammarCompiler) -> None:
    first = compiler.compile(SO(json=PERSON))
    assert compiler.compile(SO(json=json.dumps(PERSON))) is first  # the same schema as text: one compile
    assert compiler.compile(SO(json={**PERSON, "required": ["name"]})) is not first
    for bad, match in [(SO(regex="a(b"), "unclosed group"), (SO(json={"$ref": "#/nowhere"}), "nowhere"),
                       (SO(grammar="start: missing_rule"), "missing_rule")]:
        with pytest.raises(GrammarError, match=match):
            compiler.compile(bad)
    # A failure is not cached: the same bad constraint fails the same way again.
    with pytest.raises(GrammarError, match="unclosed group"):
        compiler.compile(SO(regex="a(b"))


def test_a_slow_compile_is_given_up_on_with_a_clear_error(smollm2_tokenizer: Any) -> None:
    slow = GrammarCompiler(smollm2_tokenizer, VOCAB, timeout_s=1e-4)
    slow.ll_tokenizer()  # the token table is built once per engine; the limit is about the grammar
    big = {"type": "object", "required": [f"p{i}" for i in range(2000)],
           "properties": {f"p{i}": {"type": "string", "pattern": f"[a-z]{{1,{i % 40 + 1}}}x"} for i in range(2000)}}
    with pytest.raises(GrammarError, match="took longer than"):
        slow.compile(SO(json=big))


def test_the_input_processor_names_the_field(engine: Engine) -> None:
    with pytest.raises(RequestError) as e:
        engine.input_processor.process("r", [5, 6], SamplingParams(structured_outputs=SO(regex="(")))
    assert e.value.param == "structured_outputs"


# ---- the bitmask on the device ------------------------------------------------------------------------

def test_the_bitmask_keeps_exactly_the_allowed_tokens_and_leaves_free_rows_alone() -> None:
    rng = np.random.default_rng(0)
    v = 70  # not a multiple of 32: the last word is partly padding
    logits = jnp.asarray(rng.normal(size=(3, v)).astype(np.float32))
    allowed = np.zeros((3, v), bool)
    allowed[0] = True
    allowed[1, [3, 40, 69]] = True
    allowed[2, 5] = True
    words = np.packbits(np.pad(allowed, ((0, 0), (0, 32 * bitmask_width(v) - v))), axis=1, bitorder="little")
    mask = jnp.asarray(words.view(np.int32))
    processed = logits.at[2, 5].set(-jnp.inf)  # min_tokens suppressing the only token the grammar allows
    out = np.asarray(apply_token_bitmask(processed, logits, mask))
    np.testing.assert_array_equal(out[0], np.asarray(processed[0]))  # all ones: bit-identical
    assert np.isfinite(out[1]).tolist() == allowed[1].tolist()
    np.testing.assert_array_equal(out[1, [3, 40, 69]], np.asarray(logits[1, [3, 40, 69]]))
    assert np.isfinite(out[2]).tolist() == allowed[2].tolist()  # the grammar wins over suppression


def test_only_rows_with_a_matcher_are_constrained(compiler: GrammarCompiler) -> None:
    matcher = compiler.compile(SO(choice=["yes", "no"])).new_matcher()
    free = SamplingRow(SamplingParams(), [1], [], 0, ())
    inputs = build_sampling_inputs([free, SamplingRow(SamplingParams(), [1], [], 0, (), matcher=matcher)], 4, VOCAB)
    bits = np.unpackbits(inputs.allowed_token_bitmask.view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
    assert bits[0].all() and bits[2:].all()  # free and padding rows allow everything
    assert 0 < bits[1].sum() < 10  # the first tokens of "yes" and "no"


# ---- the engine ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:  # noqa: F811
    # 25 blocks, 4 sequences and 64 tokens per step: guided requests get preempted and chunked.
    return Engine(str(tiny_dir), **{**ARGS, "num_gpu_blocks_override": 25})


def _check(kind: str, text: str) -> None:
    if kind == "person":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "numbers":
        value = json.loads(text)
        assert 2 <= len(value) <= 4 and all(isinstance(x, int) and 0 <= x <= 99 for x in value), text
    elif kind == "regex":
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,8}", text), text
    elif kind == "choice":
        assert text in ("red", "green", "blue"), text
    elif kind == "lark":
        assert re.fullmatch(r"answer: [1-9][0-9]? (cm|kg)", text), text


CASES: dict[str, tuple[SO, dict[str, Any]]] = {
    "person": (SO(json=PERSON), dict(temperature=1.0, seed=7, n=3, logprobs=2)),
    # Any JSON object (json_object) has unbounded keys, which random weights never close: the bundled
    # model's server test covers it.
    "numbers": (SO(json={"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2,
                         "maxItems": 4}), dict(temperature=0.8, seed=1)),
    "regex": (SO(regex=r"[0-9]{3}-[a-z]{2,8}"), dict(temperature=0.0)),
    "choice": (SO(choice=["red", "green", "blue"]), dict(temperature=1.0, seed=3)),
    "lark": (SO(grammar=LARK), dict(temperature=0.0)),
}


def test_every_guided_output_validates_beside_free_requests_through_preemption(engine: Engine) -> None:
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, int(rng.integers(90, 130))).tolist() for _ in range(len(CASES) + 2)]
    # Two long free requests go first and hold most of the pool, so the guided ones joining them preempt.
    free = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    alone = [engine.generate([p], free, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:2]]
    params = [SamplingParams(**{"max_tokens": 110, **kw}, structured_outputs=so) for so, kw in CASES.values()]
    preempted_before = engine.stats.preemptions
    outs = engine.generate(prompts, [free, free] + params, use_tqdm=False)
    assert engine.stats.preemptions > preempted_before, "the tiny pool was meant to force preemption"
    for kind, out in zip(CASES, outs[2:]):
        for o in out.outputs:
            assert o.finish_reason == "stop", (kind, o.text)
            _check(kind, o.text)
    person = outs[2].outputs
    assert len({o.text for o in person}) > 1  # n=3 sampled: the seeds give different people
    assert all(len(o.logprobs) == len(o.token_ids) for o in person)
    # Free requests in a batch with guided ones come out exactly as they do alone.
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    # A seeded guided request is reproducible whatever shares its batch.
    again = engine.generate([prompts[2]], params[0], use_tqdm=False)[0]
    assert [o.text for o in again.outputs] == [o.text for o in person]
    assert_no_blocks_held(engine)


def test_stop_strings_and_max_tokens_still_end_a_guided_request(engine: Engine) -> None:
    prompt = list(range(100, 130))
    so = SO(json=PERSON)
    cut = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=so),
                          use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 4
    whole = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=so),
                            use_tqdm=False)[0].outputs[0]
    stopped = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=so,
                                                       stop=['"city"']), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '"city"'
    assert whole.text.startswith(stopped.text) and '"city"' not in stopped.text
