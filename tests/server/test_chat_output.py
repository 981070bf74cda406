"""A chat choice's text -> `message` / stream deltas through the reasoning and tool-call parsers
together, and the request side: tools and tool messages parsed and rendered by a chat template."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paxserve.engine.chat_template.template import render_chat_template
from paxserve.server.errors import ProtocolError
from paxserve.server.generation_spec import parse_chat_request
from paxserve.server.parsers.reasoning import get_reasoning_parser
from paxserve.server.settings import ServerSettings
from paxserve.server.parsers.tool_calls import get_tool_parser
from paxserve.server.tools import ChatOutputParsers

TEXT = ('<think>The user wants weather.\nCall the tool.</think>\n\nLet me check.<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>')
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
PARSERS = ChatOutputParsers(get_reasoning_parser("qwen3"), get_tool_parser("hermes"))


def test_the_message_has_reasoning_content_and_tool_calls() -> None:
    message = PARSERS.message(TEXT)
    assert message["reasoning"] == "The user wants weather.\nCall the tool."
    assert message["content"] == "Let me check."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": [1, 2]}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(TEXT)), max_size=12))
def test_any_split_of_the_stream_rebuilds_the_same_message(cuts: list[int]) -> None:
    bounds = sorted({0, len(TEXT), *cuts})
    stream = PARSERS.stream()
    deltas = [stream.feed(TEXT[a:b], final=b == len(TEXT)) for a, b in zip(bounds, bounds[1:])]
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], {"name": None, "arguments": ""})
            if "id" in c:
                entry["name"] = c["function"]["name"]
            entry["arguments"] += c["function"]["arguments"]
    whole = PARSERS.message(TEXT)
    assert reasoning == whole["reasoning"] and content.strip() == whole["content"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]]
    assert stream.made_calls


def test_plain_text_stays_plain_content() -> None:
    message = ChatOutputParsers(None, None).message("Hello there")
    assert message == {"role": "assistant", "content": "Hello there", "refusal": None, "tool_calls": []}


SETTINGS = ServerSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")


def _chat(**body) -> dict:
    return {"model": SETTINGS.model_name, "messages": [{"role": "user", "content": "hi"}], **body}


def test_forced_choices_are_guided_and_auto_needs_the_server_flag() -> None:
    named = parse_chat_request(_chat(tools=[TOOL], tool_choice={"type": "function",
                                                               "function": {"name": "get_weather"}}), SETTINGS)
    assert named.params.structured_outputs.json == {"type": "object"} and named.structured_param == "tool_choice"
    required = parse_chat_request(_chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False), SETTINGS)
    assert required.params.structured_outputs.json["maxItems"] == 1
    auto = parse_chat_request(_chat(tools=[TOOL]), SETTINGS)
    assert auto.params.structured_outputs is None and auto.output.tools is not None
    with pytest.raises(ProtocolError, match="enable-auto-tool-choice") as e:
        parse_chat_request(_chat(tools=[TOOL]), ServerSettings())
    assert e.value.param == "tool_choice"
    none = parse_chat_request(_chat(tools=[TOOL], tool_choice="none"), ServerSettings())
    assert none.output.tools is None and none.tools == [TOOL]


QWEN_LIKE = """{%- if tools %}<|im_start|>system
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.content %}{{ m.content }}{% endif %}{% for c in m.tool_calls or [] %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endfor %}<|im_start|>assistant
"""


def test_tool_calls_and_tool_results_in_the_history_reach_the_template() -> None:
    spec = parse_chat_request(_chat(tools=[TOOL], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21.", "reasoning_content": "easy"}]), SETTINGS)
    text = render_chat_template(QWEN_LIKE, spec.messages, add_generation_prompt=True, tools=spec.tools)
    assert '"name": "get_weather"' in text.split("# Tools")[1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<|im_start|>tool\n{"temp": 21}<|im_end|>' in text
    assert spec.messages[3]["reasoning_content"] == "easy"
