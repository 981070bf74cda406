"""Tool-call parsers: whole-output extraction, streaming fragments, guided schemas and request checks.

The central property: any split of an output into deltas streams exactly what extract() reads from
the whole output, with argument text going out as it arrives and never taken back.
"""

from __future__ import annotations

import json
import re
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paxserve.server.parsers.tool_calls import (TOOL_PARSERS, ExtractedToolCalls, NamedToolParser, RequiredToolParser,
                                 StreamDelta, ToolParser, assemble, get_tool_parser, named_tool_schema,
                                 required_tools_schema, validate_tool_choice, validate_tools)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------- helpers


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])] or [""]


def stream_all(parser: ToolParser, pieces: list[str]) -> tuple[list[StreamDelta], ExtractedToolCalls]:
    """Feeds pieces, checks the fragment rules on the way, and returns the deltas and what a client
    rebuilds from them."""
    stream = parser.stream()
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    args_so_far: dict[int, str] = {}
    for delta in deltas:
        for frag in delta.tool_calls:
            if frag.index not in args_so_far:
                assert frag.index == len(args_so_far), "calls are numbered in order of appearance"
                assert frag.id and frag.name, "a call's first fragment carries its id and name"
                args_so_far[frag.index] = ""
            else:
                assert frag.id is None and frag.name is None, "only the first fragment names the call"
            args_so_far[frag.index] += frag.arguments
    return deltas, assemble(deltas)


def assert_same(streamed: ExtractedToolCalls, whole: ExtractedToolCalls) -> None:
    assert (streamed.content or "").strip() == (whole.content or "").strip()
    assert [c.name for c in streamed.tool_calls] == [c.name for c in whole.tool_calls]
    assert [c.arguments for c in streamed.tool_calls] == [c.arguments for c in whole.tool_calls]
    assert [json.loads(c.arguments) for c in streamed.tool_calls] == [json.loads(c.arguments) for c in whole.tool_calls]


def no_ws(text: str | None) -> str:
    return "".join((text or "").split())


def assert_expected(got: ExtractedToolCalls, content: str, calls: list[tuple[str, dict]]) -> None:
    assert no_ws(got.content) == no_ws(content)
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls
    assert len({c.id for c in got.tool_calls}) == len(got.tool_calls)


# ---------------------------------------------------------------- strategies

TRICKY = st.sampled_from(['"', "\\", "{", "}", "[", "]", ";", "</tool_call>", "<tool_call>", "[TOOL_CALLS]",
                          "[ARGS]", "\n", "é", "😀", "\\u00e9"])
STRINGS = st.lists(st.text(max_size=4) | TRICKY, max_size=4).map("".join)
LEAVES = (st.none() | st.booleans() | st.integers(-10**9, 10**9)
          | st.floats(allow_nan=False, allow_infinity=False) | STRINGS)
VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(STRINGS, inner, max_size=3),
                      max_leaves=8)
ARGS = st.dictionaries(STRINGS, VALUES, max_size=4)
NAMES = st.from_regex(r"[a-zA-Z0-9_-]{1,16}", fullmatch=True)
CONTENT = st.text(alphabet=string.ascii_letters + string.digits + " \n.,!?:-'<>/|_[]é😀", max_size=30)
WS = st.sampled_from(["", " ", "\n", "\n\n", " \n  "])


@st.composite
def json_text(draw: st.DrawFn, value: object) -> str:
    indent = draw(st.sampled_from([None, None, 2]))
    separators = draw(st.sampled_from([None, (",", ":"), (", ", ": ")]))
    return json.dumps(value, ensure_ascii=draw(st.booleans()), indent=indent, separators=separators)


@st.composite
def call_object(draw: st.DrawFn, name: str, args: dict, key: str) -> str:
    pairs = [("name", name), (key, args)]
    if draw(st.booleans()):
        pairs.reverse()  # arguments first: nothing may go out before the name is known
    if draw(st.integers(0, 3)) == 0:
        pairs.insert(draw(st.integers(0, 2)), ("id", draw(VALUES)))
    return draw(json_text(dict(pairs)))


@st.composite
def calls(draw: st.DrawFn, min_size: int = 1) -> list[tuple[str, dict]]:
    return draw(st.lists(st.tuples(NAMES, ARGS), min_size=min_size, max_size=3))


@st.composite
def hermes_output(draw: st.DrawFn) -> tuple[str, str, list[tuple[str, dict]]]:
    parts, content, expected = [], [], []
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            text = draw(CONTENT.filter(lambda t: "tool_call>" not in t))
            parts.append(text)
            content.append(text)
        else:
            name, args = draw(NAMES), draw(ARGS)
            body = draw(call_object(name, args, "arguments"))
            parts.append(f"<tool_call>{draw(WS)}{body}{draw(WS)}</tool_call>")
            expected.append((name, args))
    return "".join(parts), "".join(content), expected


@st.composite
def llama3_output(draw: st.DrawFn) -> tuple[str, str, list[tuple[str, dict]]]:
    if draw(st.integers(0, 3)) == 0:
        text = draw(CONTENT.filter(lambda t: t.strip() and not t.lstrip().startswith(("{", "<|python_tag|>"))))
        return text, text, []
    expected = draw(calls())
    key = draw(st.sampled_from(["parameters", "arguments"]))
    bodies = [draw(call_object(name, args, key)) for name, args in expected]
    sep = draw(st.sampled_from(["; ", ";", ";\n", " ; "]))
    tail = draw(CONTENT.filter(lambda t: not t.lstrip().startswith((";", "{"))))
    tag = draw(st.sampled_from(["", "<|python_tag|>"]))
    return draw(WS) + tag + sep.join(bodies) + tail, tail, expected


@st.composite
def mistral_output(draw: st.DrawFn) -> tuple[str, str, list[tuple[str, dict]]]:
    head = draw(CONTENT.filter(lambda t: "[TOOL_CALLS]" not in t))
    tail = draw(CONTENT.filter(lambda t: "[TOOL_CALLS]" not in t and not t.startswith("[")))
    expected = draw(calls())
    if draw(st.booleans()):
        array = draw(json_text([{"name": n, "arguments": a} for n, a in expected]))
        body = "[TOOL_CALLS]" + draw(WS) + array
    else:
        body = "".join(f"[TOOL_CALLS]{n}[ARGS]{draw(json_text(a))}" for n, a in expected)
    return head + body + tail, head + tail, expected


@st.composite
def required_output(draw: st.DrawFn) -> tuple[str, str, list[tuple[str, dict]]]:
    expected = draw(calls())
    array = draw(json_text([{"name": n, "parameters": a} for n, a in expected]))
    return draw(WS) + array + draw(WS), "", expected


OUTPUTS = {"hermes": hermes_output(), "llama3_json": llama3_output(), "mistral": mistral_output()}

# ---------------------------------------------------------------- the streaming property


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@SETTINGS
@given(data=st.data())
def test_any_split_streams_what_extract_reads(name: str, data: st.DataObject) -> None:
    text, content, expected = data.draw(OUTPUTS[name])
    parser = get_tool_parser(name)
    whole = parser.extract(text)
    assert_expected(whole, content, expected)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=15))
    _, streamed = stream_all(parser, split(text, cuts))
    assert_same(streamed, whole)


@SETTINGS
@given(data=st.data())
def test_required_any_split(data: st.DataObject) -> None:
    text, content, expected = data.draw(required_output())
    whole = RequiredToolParser().extract(text)
    assert_expected(whole, content, expected)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=15))
    _, streamed = stream_all(RequiredToolParser(), split(text, cuts))
    assert_same(streamed, whole)


@SETTINGS
@given(data=st.data())
def test_named_any_split(data: st.DataObject) -> None:
    args = data.draw(ARGS)
    text = data.draw(WS) + data.draw(json_text(args)) + data.draw(WS)
    whole = NamedToolParser("f").extract(text)
    assert whole.content is None and [c.name for c in whole.tool_calls] == ["f"]
    assert json.loads(whole.tool_calls[0].arguments) == args
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=15))
    deltas, streamed = stream_all(NamedToolParser("f"), split(text, cuts))
    assert_same(streamed, whole)
    assert deltas[0].tool_calls[0].name == "f", "the first feed names the call"


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_one_character_at_a_time(name: str, data: st.DataObject) -> None:
    text, _, _ = data.draw(OUTPUTS[name])
    parser = get_tool_parser(name)
    _, streamed = stream_all(parser, list(text))
    assert_same(streamed, parser.extract(text))


# ---------------------------------------------------------------- arguments go out as they arrive

WEATHER = '{"name": "f", "arguments": {"city": "Paris", "days": 3}}'
STREAMED_CASES = {
    "hermes": (get_tool_parser("hermes"), f"Sure.\n<tool_call>\n{WEATHER}\n</tool_call>"),
    "llama3_json": (get_tool_parser("llama3_json"), WEATHER.replace("arguments", "parameters")),
    "mistral_array": (get_tool_parser("mistral"), f"[TOOL_CALLS][{WEATHER}]"),
    "mistral_args": (get_tool_parser("mistral"), '[TOOL_CALLS]f[ARGS]{"city": "Paris", "days": 3}'),
    "required": (RequiredToolParser(), f"[{WEATHER.replace('arguments', 'parameters')}]"),
    "named": (NamedToolParser("f"), '{"city": "Paris", "days": 3}'),
}


@pytest.mark.parametrize("case", sorted(STREAMED_CASES))
def test_arguments_stream_before_the_call_closes(case: str) -> None:
    parser, text = STREAMED_CASES[case]
    final = parser.extract(text).tool_calls[0].arguments
    assert json.loads(final) == {"city": "Paris", "days": 3}
    closing = text.rindex("}")  # the character that closes the call
    stream = parser.stream()
    fragments_before_close = 0
    so_far = ""
    for i, c in enumerate(text):
        for frag in stream.feed(c).tool_calls:
            so_far += frag.arguments
            fragments_before_close += i < closing and bool(frag.arguments)
        assert final.startswith(so_far), "nothing sent is ever contradicted"
    for frag in stream.finish().tool_calls:
        so_far += frag.arguments
    assert so_far == final
    assert fragments_before_close >= 5


def test_arguments_first_waits_for_the_name() -> None:
    text = '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>'
    stream = get_tool_parser("hermes").stream()
    name_end = text.index('"get_weather"') + len('"get_weather"')
    for i, c in enumerate(text):
        frags = stream.feed(c).tool_calls
        if i < name_end - 1:
            assert frags == []
        elif i == name_end - 1:
            assert [(f.name, f.arguments) for f in frags] == [("get_weather", '{"city": "Paris"}')]
            assert frags[0].id is not None


def test_header_waits_for_arguments_to_start() -> None:
    stream = get_tool_parser("hermes").stream()
    assert stream.feed('<tool_call>{"name": "f", ').tool_calls == []
    first = stream.feed('"arguments": {"a"').tool_calls
    assert [(f.index, f.name, f.arguments) for f in first] == [(0, "f", '{"a"')]
    assert [f.arguments for f in stream.feed(": 1}}</tool_call>").tool_calls] == [": 1}"]


# ---------------------------------------------------------------- hermes


def test_hermes_content_and_several_calls() -> None:
    text = ('Let me check.\n\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')
    got = get_tool_parser("hermes").extract(text)
    assert got.content == "Let me check."
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("a", '{"x": 1}'), ("b", "{}")]
    assert all(c.id.startswith("chatcmpl-tool-") for c in got.tool_calls)


def test_hermes_no_calls_is_plain_content() -> None:
    assert get_tool_parser("hermes").extract("Just text.\n") == ExtractedToolCalls("Just text.\n", [])
    assert get_tool_parser("hermes").extract("  \n") == ExtractedToolCalls(None, [])


def test_hermes_holds_a_partial_marker() -> None:
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Hi <tool").content == "Hi"
    assert stream.feed("kit> done").content == " <toolkit> done"
    assert stream.finish().content == ""
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("a <tool_ca").content == "a"
    assert stream.finish().content == " <tool_ca"


def test_hermes_unterminated_but_complete_call_is_a_call() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
    got = get_tool_parser("hermes").extract(text)
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("f", '{"a": 1}')]
    _, streamed = stream_all(get_tool_parser("hermes"), [text[:20], text[20:]])
    assert_same(streamed, got)


def test_hermes_missing_arguments_means_none() -> None:
    got = get_tool_parser("hermes").extract('<tool_call>{"name": "now"}</tool_call>')
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("now", "{}")]


@pytest.mark.parametrize("text", [
    "<tool_call>not json</tool_call>",
    '<tool_call>{"arguments": {"a": 1}}</tool_call>',
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    'Before <tool_call>{"name": "f", "argu',
    "<tool_call>",
])
def test_hermes_malformed_is_content(text: str) -> None:
    parser = get_tool_parser("hermes")
    assert parser.extract(text) == ExtractedToolCalls(text, [])
    for pieces in ([text], list(text)):
        stream = parser.stream()
        deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
        assert stream.malformed
        assert all(not d.tool_calls for d in deltas), "nothing was announced before the problem showed"
        assert "".join(d.content for d in deltas) == text


@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "Par'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}'),
    ("mistral", 'x [TOOL_CALLS]f[ARGS]{"a": '),
])
def test_problem_inside_announced_call(name: str, text: str) -> None:
    """Extract sees the whole text and calls it content; a stream had already announced the call
    when the problem showed (cut off, or a bad literal) and can only report it."""
    assert get_tool_parser(name).extract(text) == ExtractedToolCalls(text, [])
    stream = get_tool_parser(name).stream()
    sent = [stream.feed(c) for c in text] + [stream.finish()]
    assert stream.malformed
    assert [f.name for d in sent for f in d.tool_calls if f.name] == ["f"]


# ---------------------------------------------------------------- llama3_json


def test_llama3_calls() -> None:
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [2]}}'
    got = get_tool_parser("llama3_json").extract(text)
    assert got.content is None
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("a", '{"x": 1}'), ("b", '{"y": [2]}')]


@pytest.mark.parametrize("text", ['{"city": "Paris"}', '{"name": "Bob", "age": 3}', "Hello there", "[1, 2]",
                                  '{"name": "f", "parameters": 3}', '{"name": "f"'])
def test_llama3_non_calls_are_content(text: str) -> None:
    parser = get_tool_parser("llama3_json")
    assert parser.extract(text) == ExtractedToolCalls(text, [])
    _, streamed = stream_all(parser, list(text))
    assert streamed == ExtractedToolCalls(text, [])


def test_llama3_decides_on_the_first_character() -> None:
    stream = get_tool_parser("llama3_json").stream()
    assert stream.feed("\n ") == StreamDelta()
    assert stream.feed("<|python") == StreamDelta()
    assert stream.feed("_tag|> ") == StreamDelta()
    assert stream.feed("Hi").content == "\n <|python_tag|> Hi"
    stream = get_tool_parser("llama3_json").stream()
    assert stream.feed("Sure").content == "Sure"


# ---------------------------------------------------------------- mistral


def test_mistral_both_formats_and_ids() -> None:
    parser = get_tool_parser("mistral")
    assert parser.keep_special_tokens
    old = parser.extract('Checking. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]')
    new = parser.extract('Checking. [TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}')
    for got in (old, new):
        assert got.content == "Checking."
        assert [(c.name, c.arguments) for c in got.tool_calls] == [("a", '{"x": 1}'), ("b", "{}")]
        assert all(re.fullmatch(r"[a-zA-Z0-9]{9}", c.id) for c in got.tool_calls), "Mistral templates need 9-char ids"


@pytest.mark.parametrize("text", ["[TOOL_CALLS]not a name[ARGS]{}", "[TOOL_CALLS]f[ARGS][1]", "[TOOL_CALLS][{]",
                                  "x [TOOL_CALLS]f[ARGS]", "[TOOL_CALLS][{\"arguments\": {}}]"])
def test_mistral_malformed_is_content(text: str) -> None:
    parser = get_tool_parser("mistral")
    assert parser.extract(text) == ExtractedToolCalls(text, [])
    _, streamed = stream_all(parser, list(text))
    assert streamed.content == text.strip() and streamed.tool_calls == []


# ---------------------------------------------------------------- guided formats


def test_named_stream_names_at_once_and_trims() -> None:
    stream = NamedToolParser("get_weather").stream()
    first = stream.feed("  ")
    assert [(f.index, f.name, f.arguments) for f in first.tool_calls] == [(0, "get_weather", "")]
    assert first.tool_calls[0].id
    assert [f.arguments for f in stream.feed(' {"city": ').tool_calls] == ['{"city":']
    assert [f.arguments for f in stream.feed('"Paris"}\n').tool_calls] == [' "Paris"}']
    assert stream.finish() == StreamDelta()


def test_named_empty_output_still_names_the_call() -> None:
    stream = NamedToolParser("f").stream()
    assert [(f.name, f.arguments) for f in stream.finish().tool_calls] == [("f", "")]


def test_required_calls_and_non_array() -> None:
    got = RequiredToolParser().extract('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]')
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("a", '{"x": 1}'), ("b", "{}")]
    assert RequiredToolParser().extract("sorry") == ExtractedToolCalls("sorry", [])


# ---------------------------------------------------------------- registry


def test_registry() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_tool_parser("pythonic")


# ---------------------------------------------------------------- schemas and request checks

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "now"}}


def test_named_tool_schema() -> None:
    schema = named_tool_schema(WEATHER_TOOL)
    assert schema == WEATHER_TOOL["function"]["parameters"]
    schema["properties"]["x"] = {}
    assert "x" not in WEATHER_TOOL["function"]["parameters"]["properties"], "the request is not edited"
    assert named_tool_schema(TIME_TOOL) == {"type": "object", "properties": {}}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tools_schema(parallel: bool) -> None:
    schema = required_tools_schema([WEATHER_TOOL, TIME_TOOL], parallel)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert ("maxItems" in schema) == (not parallel) and schema.get("maxItems", 1) == 1
    first, second = schema["items"]["anyOf"]
    assert first == {"type": "object",
                     "properties": {"name": {"const": "get_weather"},
                                    "parameters": WEATHER_TOOL["function"]["parameters"]},
                     "required": ["name", "parameters"], "additionalProperties": False}
    assert second["properties"] == {"name": {"const": "now"}, "parameters": {"type": "object", "properties": {}}}


def test_validate_tools_accepts() -> None:
    assert validate_tools([WEATHER_TOOL, TIME_TOOL]) == [WEATHER_TOOL, TIME_TOOL]
    assert validate_tools(None) == []


@pytest.mark.parametrize("tools, message", [
    ({"type": "function"}, "tools must be an array"),
    ([WEATHER_TOOL, "x"], r"tools\[1\] must be an object"),
    ([{"type": "code_interpreter"}], r"tools\[0\].type must be 'function'"),
    ([{"type": "function"}], r"tools\[0\].function must be an object"),
    ([WEATHER_TOOL, TIME_TOOL, {"type": "function", "function": {"name": ""}}],
     r"tools\[2\].function.name must be a non-empty string"),
    ([{"type": "function", "function": {"name": "get weather"}}], r"tools\[0\].function.name must match"),
    ([{"type": "function", "function": {"name": "x" * 65}}], r"tools\[0\].function.name must match"),
    ([{"type": "function", "function": {"name": "f", "parameters": "object"}}],
     r"tools\[0\].function.parameters must be a JSON schema object"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], r"tools\[0\].function.description"),
])
def test_validate_tools_rejects(tools: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_tools(tools)


def test_validate_tool_choice() -> None:
    tools = [WEATHER_TOOL, TIME_TOOL]
    assert validate_tool_choice(None, tools) == "auto"
    assert validate_tool_choice(None, []) == "none"
    for choice in ("none", "auto", "required"):
        assert validate_tool_choice(choice, tools) == choice
    named = {"type": "function", "function": {"name": "now"}}
    assert validate_tool_choice(named, tools) == named


@pytest.mark.parametrize("choice, message", [
    ("any", 'tool_choice must be "none", "auto", "required" or'),
    (3, "tool_choice must be"),
    ({"type": "function"}, "tool_choice.function must be an object"),
    ({"type": "function", "function": {"name": ""}}, "tool_choice.function.name must be a non-empty string"),
    ({"type": "function", "function": {"name": "x"}}, "tool_choice names function 'x', which is not in tools"),
])
def test_validate_tool_choice_rejects(choice: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_tool_choice(choice, [WEATHER_TOOL])


def test_required_without_tools_is_rejected() -> None:
    with pytest.raises(ValueError, match="tool_choice 'required' needs"):
        validate_tool_choice("required", [])
