"""InputProcessor with the real bundled tokenizer (SmolLM2, vocabulary 49152), max_model_len=64.

What is checked is what a client sees: which prompts and parameters are accepted, the token ids,
limits and seeds a request gets, and the error (message and `param`) for those refused.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from paxserve.engine.chat_template.template import RenderLimits
from paxserve.engine.input_processor import InputProcessor, RequestError, max_token_chars
from paxserve.sampling_params import SamplingParams

VOCAB = 49152
MAX_LEN = 64
TEXT = "Hello, world! The quick brown fox."


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def make(tok, **kwargs) -> InputProcessor:
    return InputProcessor(tok, vocab_size=VOCAB, eos_token_ids=(2,), max_model_len=MAX_LEN, seed=kwargs.pop("seed", 0),
                          **kwargs)


@pytest.fixture
def ip(tok):
    return make(tok)


def refused(fn, *args, **kwargs) -> RequestError:
    with pytest.raises(RequestError) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    return info.value


# ---- prompt forms ----------------------------------------------------------------------------------------


def test_text_token_and_dict_prompts(tok, ip):
    ids = tok.encode(TEXT)
    r = ip.process("a", TEXT)
    assert r.request_id == "a" and r.prompt == TEXT and r.prompt_token_ids == ids and r.cache_salt is None
    r = ip.process("b", {"prompt": TEXT})
    assert r.prompt == TEXT and r.prompt_token_ids == ids
    r = ip.process("c", [np.int64(ids[0]), *ids[1:]])
    assert r.prompt is None and r.prompt_token_ids == ids and all(type(t) is int for t in r.prompt_token_ids)
    r = ip.process("d", {"prompt_token_ids": ids, "cache_salt": "s"})
    assert r.prompt is None and r.prompt_token_ids == ids and r.cache_salt == "s"
    assert ip.process("e", TEXT, cache_salt="t").cache_salt == "t"
    assert ip.process("f", {"prompt": TEXT, "cache_salt": "t"}, cache_salt="t").cache_salt == "t"
    assert ip.process("g", [0, VOCAB - 1]).prompt_token_ids == [0, VOCAB - 1]


@pytest.mark.parametrize("prompt", [
    {},
    {"prompt": TEXT, "prompt_token_ids": [1, 2]},
    {"prompt": TEXT, "multi_modal_data": {}},
    {"cache_salt": "s"},
    {"prompt": 5},
    None,
    [[1, 2]],
    [True, 5],
    [1, 2.0],
])
def test_malformed_prompts_are_refused(ip, prompt):
    assert refused(ip.process, "r", prompt).param == "prompt"


@pytest.mark.parametrize("bad", [[VOCAB], [5, -1], [0, 1, VOCAB + 100]])
def test_out_of_vocabulary_token_ids_are_refused(ip, bad):
    e = refused(ip.process, "r", bad)
    assert e.param == "prompt" and str(VOCAB) in str(e)


@pytest.mark.parametrize("prompt, kwargs", [
    (TEXT, {"cache_salt": ""}),
    (TEXT, {"cache_salt": 5}),
    ({"prompt": TEXT, "cache_salt": ""}, {}),
    ({"prompt_token_ids": [1, 2], "cache_salt": ["s"]}, {}),
    ({"prompt": TEXT, "cache_salt": "a"}, {"cache_salt": "b"}),
])
def test_bad_cache_salts_are_refused(ip, prompt, kwargs):
    assert refused(ip.process, "r", prompt, **kwargs).param == "cache_salt"


def test_explicit_none_salt_in_dict_keeps_the_given_salt(ip):
    assert ip.process("r", {"prompt": TEXT, "cache_salt": None}, cache_salt="s").cache_salt == "s"


def test_request_id_must_be_a_non_empty_string(ip):
    assert refused(ip.process, "", TEXT).param == "request_id"
    assert refused(ip.process, 7, TEXT).param == "request_id"


# ---- lengths ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt_is_refused(ip, prompt):
    assert refused(ip.process, "r", prompt).param == "prompt"


def test_prompt_that_fills_the_context_is_refused_with_vllms_wording(ip):
    e = refused(ip.process, "r", [5] * MAX_LEN)
    assert e.param == "prompt"
    assert str(e).startswith("This model's maximum context length is 64 tokens. However, your request has 64 input "
                             "tokens, which leaves no room for output.")
    e = refused(ip.process, "r", [5] * (MAX_LEN + 10))
    assert "your request has 74 input tokens" in str(e)
    r = ip.process("r", [5] * (MAX_LEN - 1), SamplingParams(max_tokens=None))
    assert r.max_tokens == 1


def test_max_tokens_is_the_room_left_at_most(ip):
    prompt = [7] * 10
    assert ip.process("r", prompt, SamplingParams(max_tokens=None)).max_tokens == MAX_LEN - 10
    assert ip.process("r", prompt, SamplingParams(max_tokens=MAX_LEN - 10)).max_tokens == MAX_LEN - 10
    assert ip.process("r", prompt, SamplingParams(max_tokens=5)).max_tokens == 5
    e = refused(ip.process, "r", prompt, SamplingParams(max_tokens=MAX_LEN - 9))
    assert e.param == "max_tokens"
    assert str(e) == ("'max_tokens' or 'max_completion_tokens' is too large: 55. This model's maximum context length "
                      "is 64 tokens and your request has 10 input tokens (55 > 64 - 10).")


# ---- the text-length cap ---------------------------------------------------------------------------------


@pytest.fixture
def encode_calls(tok, monkeypatch):
    calls: list[int] = []
    real = tok.encode

    def recording(text, *args, **kwargs):
        calls.append(len(text))
        return real(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", recording)
    return calls


def test_text_longer_than_the_cap_is_refused_without_tokenizing(tok, encode_calls):
    ip = make(tok)
    assert ip.max_prompt_chars == MAX_LEN * max_token_chars(tok) > MAX_LEN
    e = refused(ip.process, "r", "a" * (ip.max_prompt_chars + 1))
    assert e.param == "prompt" and "maximum context length is 64 tokens" in str(e)
    assert encode_calls == []
    e = refused(ip.process, "r", {"prompt": "a" * 10**6})
    assert e.param == "prompt" and encode_calls == []
    # At the cap itself the text is tokenized, and it is the token count that refuses it.
    e = refused(ip.process, "r", "a" * ip.max_prompt_chars)
    assert encode_calls == [ip.max_prompt_chars]
    assert "which leaves no room for output" in str(e)


def longest_token_text(tok) -> str:
    vocab = tok.get_vocab()
    return tok.decode([vocab[max(vocab, key=len)]])


@pytest.mark.parametrize("kind", ["longest token", "spaces", "newline+spaces", "hashes", "emoji", "cjk", "digits",
                                  "words", "special token", "nul", "replacement char", "crlf"])
def test_the_cap_is_sound_no_text_at_the_cap_fits(tok, ip, kind):
    # The cap claims that no text over max_model_len x (longest token's characters) can fit the
    # context: so even a text of exactly max_prompt_chars characters must need >= max_model_len tokens.
    unit = {"longest token": longest_token_text(tok), "spaces": " ", "newline+spaces": "\n" + " " * 15,
            "hashes": "#", "emoji": "👍", "cjk": "中", "digits": "7", "words": " the",
            "special token": "<|im_start|>",
            "nul": "\x00", "replacement char": "\ufffd", "crlf": "\r\n"}[kind]
    text = (unit * (ip.max_prompt_chars // len(unit) + 1))[:ip.max_prompt_chars]
    assert len(text) == ip.max_prompt_chars
    assert len(tok.encode(text)) >= MAX_LEN


# ---- sampling parameters and seeds -----------------------------------------------------------------------


def test_unseeded_requests_get_distinct_seeds(ip):
    seeds = [s for i in range(20) for s in ip.process(f"r{i}", [1, 2], SamplingParams(n=1 + i % 3)).seeds]
    assert len(seeds) == sum(1 + i % 3 for i in range(20))
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)


def test_seeded_requests_get_reproducible_seeds(tok, ip):
    assert ip.process("r", [1], SamplingParams(seed=1234)).seeds == [1234]
    three = ip.process("r", [1], SamplingParams(seed=1234, n=3)).seeds
    assert len(three) == len(set(three)) == 3
    # The same on another server (different processor seed) and on every call.
    other = make(tok, seed=99)
    assert other.process("x", [1], SamplingParams(seed=1234, n=3)).seeds == three
    assert ip.process("r", [1], SamplingParams(seed=1234, n=3)).seeds == three
    assert ip.process("r", [1], SamplingParams(seed=1235, n=3)).seeds != three


def test_concurrent_process_calls_all_succeed_with_distinct_seeds(tok, ip):
    barrier = threading.Barrier(8)
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    texts = [f"Thread {i} says: {TEXT} " * (1 + i % 3) for i in range(8)]

    def worker(i: int) -> None:
        try:
            barrier.wait()
            results[i] = [ip.process(f"t{i}-{j}", texts[i], SamplingParams(max_tokens=None)) for j in range(25)]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert sorted(results) == list(range(8))
    seeds = [s for rs in results.values() for r in rs for s in r.seeds]
    assert len(seeds) == 200 and len(set(seeds)) == 200
    for i, rs in results.items():
        expected = tok.encode(texts[i])
        assert all(r.prompt_token_ids == expected and r.max_tokens == MAX_LEN - len(expected) for r in rs)


def test_sampling_options(ip):
    r = ip.process("r", [1, 2], SamplingParams(n=3, temperature=0))
    assert len(r.seeds) == 3 and r.sampling_params.n == 3
    assert ip.process("r", [1, 2]).eos_token_ids == (2,)
    assert ip.process("r", [1, 2], SamplingParams(ignore_eos=True)).eos_token_ids == ()
    assert refused(ip.process, "r", [1], SamplingParams(stop_token_ids=[VOCAB])).param == "stop_token_ids"
    assert refused(ip.process, "r", [1], SamplingParams(logit_bias={VOCAB: 1.0})).param == "logit_bias"
    assert ip.process("r", [1], SamplingParams(stop_token_ids=[VOCAB - 1], logit_bias={0: -100})).max_tokens == 16


def test_without_a_tokenizer_only_token_ids_and_no_stop_strings(ip):
    bare = make(None)
    assert bare.process("r", [1, 2, 3]).prompt_token_ids == [1, 2, 3]
    assert refused(bare.process, "r", [1, 2, 3], SamplingParams(stop=["\n"])).param == "stop"
    assert refused(bare.process, "r", "some text").param == "prompt"
    assert refused(bare.render_chat, [{"role": "user", "content": "hi"}]).param == "messages"
    # With a tokenizer, stop strings are fine.
    assert ip.process("r", [1, 2, 3], SamplingParams(stop=["\n"])).sampling_params.stop_strings == ("\n",)


# ---- chat ------------------------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! 👋"},
            {"role": "user", "content": "How are you?"}]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_chat_matches_transformers(tok, ip, add_generation_prompt):
    ours = ip.render_chat(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert ours == tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_a_template_that_raises_is_a_messages_error(ip):
    e = refused(ip.render_chat, MESSAGES, chat_template="{{ raise_exception('nope') }}")
    assert e.param == "messages" and "nope" in str(e)


def test_a_runaway_template_is_stopped_by_the_time_limit(tok):
    ip = make(tok, render_limits=RenderLimits(timeout_s=0.3))
    template = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
    start = time.monotonic()
    e = refused(ip.render_chat, MESSAGES, chat_template=template)
    assert time.monotonic() - start < 1.5
    assert e.param == "messages" and "time limit" in str(e)
