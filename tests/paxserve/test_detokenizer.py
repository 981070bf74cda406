"""IncrementalDetokenizer against the real bundled tokenizer (byte-level BPE, SmolLM2)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paxserve.engine.detokenizer import IncrementalDetokenizer
from paxserve.models.bundled import default_model_path
from paxserve.models.gguf_io import GGUFCheckpoint
from paxserve.models.tokenizer import tokenizer_from_gguf
from paxserve.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    " leading space",
    "   three leading spaces and  double  spaces   ",
    "line one\nline two\n\n\tindented\r\nwindows line",
    "中文测试：你好，世界。日本語のテキスト",
    "emoji 👍🏽👋🏿 family 👨‍👩‍👧‍👦 flag 🇫🇷 and 🤖",
    "accents: café naïve résumé Ångström Ñandú ½ ©",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint({'a': [1, 2]})",
    "mixed 好👍a é\n 🎉",
]


@pytest.fixture(scope="module")
def tok():
    return tokenizer_from_gguf(GGUFCheckpoint(default_model_path()))


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def split_random(ids: list[int], rng: random.Random) -> list[list[int]]:
    groups, i = [], 0
    while i < len(ids):
        size = rng.randint(1, 4)
        groups.append(ids[i:i + size])
        i += size
    return groups


def stream(tok, prompt_ids, groups, params, *, finish=True, allow_replacement=False):
    """Feeds `groups`, checking every delta; returns (detokenizer, stop reported, deltas)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, params)
    deltas: list[str] = []
    stop = None
    for group in groups:
        stop = detok.update(group)
        deltas.append(detok.get_delta())
        # What was emitted must always be the start of what is (and will be) the text.
        assert detok.output_text.startswith("".join(deltas))
        if stop is not None:
            break
    if finish and stop is None:
        detok.finish()
        deltas.append(detok.get_delta())
    if not allow_replacement:
        assert not any("\ufffd" in d for d in deltas)
    if detok.finished:
        assert "".join(deltas) == detok.output_text
    return detok, stop, deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("grouping", ["one", "random"])
def test_incremental_text_equals_full_decode(tok, text, grouping):
    ids = encode(tok, text)
    groups = [[t] for t in ids] if grouping == "one" else split_random(ids, random.Random(len(text)))
    prompt = encode(tok, "User said:")
    detok, stop, _ = stream(tok, prompt, groups, SamplingParams())
    assert stop is None
    assert detok.output_text == tok.decode(ids, skip_special_tokens=True) == text


def test_multibyte_characters_really_span_tokens(tok):
    # Guards the tests above: the emoji and CJK texts must exercise split UTF-8 characters.
    for text in (TEXTS[4], TEXTS[5]):
        pieces = [tok.decode([t]) for t in encode(tok, text)]
        assert any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("prompt", ["", "Hi", "Hello ", "end with emoji 👍", "<|im_start|>assistant\n"])
def test_first_token_after_prompt(tok, prompt):
    output = " the answer is 42"
    ids = encode(tok, output)
    detok, _, _ = stream(tok, encode(tok, prompt), [[t] for t in ids], SamplingParams())
    assert detok.output_text == tok.decode(ids) == output


def test_prompt_cut_inside_a_character_does_not_swallow_output(tok):
    # Token-id prompts may end mid-character; the output's first bytes then decode on their own.
    ids = encode(tok, "🤖 robot")
    for cut in range(1, 4):
        detok, _, _ = stream(tok, ids[:cut], [[t] for t in ids[cut:]], SamplingParams(), allow_replacement=True)
        assert detok.output_text == tok.decode(ids[cut:])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=40), seed=st.integers(0, 2**16))
def test_random_unicode_round_trips(tok, text, seed):
    ids = encode(tok, text)
    full = tok.decode(ids)
    # SmolLM2's vocabulary lacks a few bytes (e.g. 0xF1, 0xF2 leading rarely used planes), so rare
    # characters do not survive encoding; the stream must still match the full decode.
    groups = split_random(ids, random.Random(seed))
    detok, _, _ = stream(tok, encode(tok, "Q: "), groups, SamplingParams(), allow_replacement="\ufffd" in full)
    assert detok.output_text == full


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), skip=st.booleans())
def test_arbitrary_token_ids_match_full_decode(tok, seed, skip):
    # Random ids include lone UTF-8 fragments and special tokens: the text may hold '\ufffd' but must
    # still equal the full decode once finished, and emitted text must never change.
    rng = random.Random(seed)
    byte_ids = list(range(3, 260))  # single-byte tokens and the rarer special tokens: the hard cases
    ids = [rng.choice(byte_ids) if rng.random() < 0.6 else rng.randrange(len(tok)) for _ in range(30)]
    ids += [rng.randrange(3) for _ in range(2)]
    rng.shuffle(ids)
    params = SamplingParams(skip_special_tokens=skip)
    detok, _, _ = stream(tok, [], split_random(ids, rng), params, allow_replacement=True)
    assert detok.output_text == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_kept_or_skipped(tok, skip):
    text = "<|im_start|>assistant\nHi 👋<|im_end|>\n<|endoftext|>"
    ids = encode(tok, text)
    assert {0, 1, 2} <= set(ids)
    detok, _, _ = stream(tok, [], [[t] for t in ids], SamplingParams(skip_special_tokens=skip))
    assert detok.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert detok.output_text == (text if not skip else "assistant\nHi 👋\n")


def ids_where_stop_spans(tok, text: str, stop: str, num_tokens: int) -> list[int]:
    """`text` encoded, checked to put `stop` across exactly `num_tokens` tokens."""
    ids = encode(tok, text)
    start = text.index(stop)
    ends = [len(tok.decode(ids[:i + 1])) for i in range(len(ids))]
    first = next(i for i, end in enumerate(ends) if end > start)
    last = next(i for i, end in enumerate(ends) if end >= start + len(stop))
    assert last - first + 1 == num_tokens, [tok.decode([t]) for t in ids]
    return ids


@pytest.mark.parametrize(
    ("text", "stop", "num_tokens"),
    [("The secret word is pineapple juice.", "apple ju", 2), ("Say Hello World now", "lo Wor", 2),
     ("Count: one two three four", "e two th", 3)],
)
def test_stop_string_across_tokens(tok, text, stop, num_tokens):
    ids = ids_where_stop_spans(tok, text, stop, num_tokens)
    detok, found, _ = stream(tok, [], [[t] for t in ids], SamplingParams(stop=stop))
    assert found == stop == detok.stop_reason
    assert detok.finished
    # Everything from the stop string on is dropped, including the rest of the last token.
    assert detok.output_text == text[:text.index(stop)]


def test_include_stop_str_in_output_ends_right_after_the_stop(tok):
    text = "The secret word is pineapple juice."
    ids = encode(tok, text)
    params = SamplingParams(stop="apple ju", include_stop_str_in_output=True)
    detok, found, deltas = stream(tok, [], [[t] for t in ids], params)
    assert found == "apple ju"
    assert detok.output_text == "The secret word is pineapple ju"
    assert "".join(deltas) == detok.output_text


def test_stop_string_in_prompt_does_not_stop(tok):
    params = SamplingParams(stop=["STOP"])
    ids = encode(tok, " and then it continued.")
    detok, found, _ = stream(tok, encode(tok, "Do not STOP"), [[t] for t in ids], params)
    assert found is None
    assert detok.output_text == " and then it continued."


def test_stop_string_straddling_prompt_and_output_does_not_stop(tok):
    detok, found, _ = stream(tok, encode(tok, "ST"), [[t] for t in encode(tok, "OP here")], SamplingParams(stop="STOP"))
    assert found is None and detok.output_text == "OP here"


@pytest.mark.parametrize("stops", [["world", "hello"], ["hello", "world"]])
def test_earliest_stop_wins_whatever_the_list_order(tok, stops):
    ids = encode(tok, "say hello to the world")
    for groups in ([[t] for t in ids], [ids]):
        detok, found, _ = stream(tok, [], groups, SamplingParams(stop=stops))
        assert found == "hello"
        assert detok.output_text == "say "


def test_overlapping_stops_resolve_the_same_for_any_grouping(tok):
    # "bc" completes before "abcd": a stream stops at the first stop string to complete.
    ids = encode(tok, "xx abcd yy")
    rng = random.Random(0)
    for groups in ([[t] for t in ids], [ids], split_random(ids, rng), split_random(ids, rng)):
        detok, found, _ = stream(tok, [], groups, SamplingParams(stop=["abcd", "bc"]))
        assert (found, detok.output_text) == ("bc", "xx a")


def test_stop_before_an_unfinished_character_is_found_at_once(tok):
    text = "done. 🤖"
    ids = encode(tok, text)
    cut = next(i for i in range(len(ids)) if tok.decode(ids[:i + 1]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop="done"))
    assert detok.update(ids[:cut + 1]) == "done"
    assert detok.output_text == "" and detok.get_delta() == ""


def test_partial_stop_is_held_back_then_released(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop="abc"))
    deltas = []
    for piece in ("x", "ab", "d", " ok"):
        assert detok.update(encode(tok, piece)) is None
        deltas.append(detok.get_delta())
    assert deltas == ["x", "", "abd", " ok"]
    assert detok.output_text == "xabd ok"


def test_held_back_text_is_released_by_finish(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["abc", "zzz"]))
    detok.update(encode(tok, "tail ab"))
    assert detok.get_delta() == "tail "
    detok.finish()
    assert detok.finished and detok.stop_reason is None
    assert detok.get_delta() == "ab"
    assert detok.get_delta() == ""


def test_unfinished_character_is_released_by_finish(tok):
    ids = encode(tok, "robot 🤖")
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    detok.update(ids[:-1])
    assert "\ufffd" not in detok.get_delta()
    detok.finish()
    assert detok.output_text == tok.decode(ids[:-1])
    assert detok.output_text.endswith("\ufffd")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16))
def test_deltas_never_contain_any_part_of_a_stop(tok, seed):
    rng = random.Random(seed)
    stop = rng.choice(["</s>", "###", "\n\n", "END", "ab"])
    words = ["a", "b", "ab", "#", "##", "E", "EN", "END", "<", "</", "s", ">", "\n", " ", "x", "é", "🤖"]
    text = "".join(rng.choice(words) for _ in range(rng.randint(5, 30)))
    ids = encode(tok, text)
    params = SamplingParams(stop=stop)
    detok, found, deltas = stream(tok, [], split_random(ids, rng), params, finish=False)
    emitted = "".join(deltas)
    assert stop not in emitted and stop not in detok.output_text
    if found is None:
        # Exactly the longest tail that could still start the stop string is held back.
        text_so_far = detok.output_text
        held = max(k for k in range(len(stop)) if text_so_far.endswith(stop[:k]))
        assert emitted == text_so_far[:len(text_so_far) - held]
        detok.finish()
        assert emitted + detok.get_delta() == detok.output_text == text
    else:
        assert found == stop and detok.output_text == text[:text.index(stop)]


def test_each_step_decodes_a_short_window(tok):
    class CountingTokenizer:
        def __init__(self) -> None:
            self.longest = 0

        def decode(self, token_ids, skip_special_tokens=False):
            self.longest = max(self.longest, len(token_ids))
            return tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    counting = CountingTokenizer()
    ids = encode(tok, " ".join(TEXTS) * 3)
    assert len(ids) > 300
    detok, _, _ = stream(counting, encode(tok, "a long prompt " * 20), [[t] for t in ids], SamplingParams())
    assert detok.output_text == tok.decode(ids)
    assert counting.longest <= 12


def test_the_bundled_tokenizer_streams_through_decode_stream_with_no_python_decode_per_token(tok):
    class Counting:
        """The bundled tokenizer, counting the Python-side decodes."""

        backend_tokenizer = tok.backend_tokenizer
        clean_up_tokenization_spaces = tok.clean_up_tokenization_spaces
        calls = 0

        def decode(self, token_ids, skip_special_tokens=False):
            Counting.calls += 1
            return tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    ids = encode(tok, " ".join(TEXTS))
    assert len(ids) > 100
    detok, _, _ = stream(Counting(), encode(tok, "a prompt"), [[t] for t in ids], SamplingParams())
    assert detok.output_text == tok.decode(ids)
    assert Counting.calls == 1  # the prompt's tail, once, to see whether it ends inside a character


def test_update_after_finish_is_an_error(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop="b"))
    assert detok.update(encode(tok, "a b c")) == "b"
    with pytest.raises(RuntimeError, match="finished"):
        detok.update(encode(tok, "d"))
    detok.finish()  # already finished: harmless
    assert detok.output_text == "a "


def test_no_tokenizer_yields_no_text_and_rejects_stop_strings():
    detok = IncrementalDetokenizer(None, [1, 2], SamplingParams())
    assert detok.update([5, 6]) is None
    detok.finish()
    assert detok.output_text == detok.get_delta() == ""
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        IncrementalDetokenizer(None, [1], SamplingParams(stop="x"))
