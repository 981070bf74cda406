"""Reasoning parsers: whole-output split, and streams that give the same split for any deltas."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paxserve.server.parsers.reasoning import REASONING_PARSERS, get_reasoning_parser

# Outputs built from pieces that stress the tags: whole tags, partial tags, newlines.
PIECES = st.sampled_from(["<think>", "</think>", "<thi", "</th", "<", ">", "\n", "\n\n", "think", "ok ", "é😀"])
OUTPUTS = st.lists(PIECES | st.text(max_size=5), max_size=10).map("".join)


def stream_split(name: str, pieces: list[str]) -> tuple[str, str]:
    stream = get_reasoning_parser(name).stream()
    parts = [stream.feed(p) for p in pieces] + [stream.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@settings(max_examples=100, deadline=None)
@given(text=OUTPUTS, cuts=st.lists(st.integers(0, 60), max_size=10))
def test_any_split_streams_what_extract_reads(name: str, text: str, cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:])]
    reasoning, content = get_reasoning_parser(name).extract(text)
    assert stream_split(name, pieces) == (reasoning or "", content or "")
    assert stream_split(name, list(text)) == (reasoning or "", content or "")


@pytest.mark.parametrize("text, expected", [
    ("<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "\n\nParis.")),
    ("Let me see.</think>Paris.", ("Let me see.", "Paris.")),  # <think> was in the prompt
    ("Still thinking when cut off", ("Still thinking when cut off", None)),
    ("<think>cut off", ("cut off", None)),
    ("</think>Paris.", (None, "Paris.")),
    ("x</think>", ("x", None)),
    ("", (None, None)),
])
def test_deepseek_r1_extract(text: str, expected: tuple[str | None, str | None]) -> None:
    assert get_reasoning_parser("deepseek_r1").extract(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "Paris.")),
    ("<think>\n\n</think>\n\nParis.", ("\n\n", "Paris.")),
    ("<think></think>Paris.", (None, "Paris.")),
    ("Paris.", (None, "Paris.")),  # thinking disabled
    ("Paris.</think> more", (None, "Paris.</think> more")),  # no opening tag: not reasoning
    ("<think>cut off while thinking", ("cut off while thinking", None)),
    ("<think>done</think>\n\n", ("done", None)),
    ("", (None, None)),
])
def test_qwen3_extract(text: str, expected: tuple[str | None, str | None]) -> None:
    assert get_reasoning_parser("qwen3").extract(text) == expected


def test_deepseek_r1_stream_reasons_at_once_and_holds_partial_tags() -> None:
    stream = get_reasoning_parser("deepseek_r1").stream()
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>Hmm") == ("Hmm", "")
    assert stream.feed(" so</thi") == (" so", "")
    assert stream.feed("nk>\n\nAnswer") == ("", "\n\nAnswer")
    assert stream.feed(" </think>") == ("", " </think>")
    assert stream.finish() == ("", "")


def test_qwen3_stream() -> None:
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("<think>") == ("", "")
    assert stream.feed("Hmm") == ("Hmm", "")
    assert stream.feed("</think>\n") == ("", "")
    assert stream.feed("\nParis") == ("", "Paris")
    assert stream.feed("\n") == ("", "\n")
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("Paris") == ("", "Paris"), "no <think> at the start: content at once"
    assert stream.feed("<think>x</think>") == ("", "<think>x</think>")
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("<th") == ("", "")
    assert stream.finish() == ("", "<th")


def test_registry() -> None:
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("granite")
