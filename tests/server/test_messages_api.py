"""Anthropic's POST /v1/messages and /v1/messages/count_tokens through the `anthropic` SDK: text,
streams, tools and tool results, stop sequences, the output limit, Anthropic's error shape and its
`x-api-key` header. Each answer is checked against the chat completion of the same conversation
(greedy), which is what the endpoint translates it into."""

from __future__ import annotations

import json

import anthropic
import pytest

from conftest import API_KEY, MODEL_NAME

# Anthropic's current SDK no longer has sampling arguments; older clients send them in the body.
GREEDY = {"extra_body": {"temperature": 0.0}}
QUESTION = "What is the capital of France?"
SYSTEM = "You are a terse geography assistant."
WEATHER_TOOL = {"name": "get_weather", "description": "The current weather in a city.",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                                 "additionalProperties": False}}
CHAT_WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": WEATHER_TOOL["description"],
                                                      "parameters": WEATHER_TOOL["input_schema"]}}


@pytest.fixture(scope="module")
def claude(server):
    """Anthropic's client, sending the key as `x-api-key` (as it always does)."""
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120.0)


def chat(client, messages: list[dict], max_tokens: int, **kwargs):
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0.0,
                                          **kwargs)


def test_a_message_is_the_chat_completion_of_its_system_and_messages(claude, client) -> None:
    m = claude.messages.create(model=MODEL_NAME, system=SYSTEM, max_tokens=24,
                               messages=[{"role": "user", "content": QUESTION}], **GREEDY)
    r = chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], 24)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL_NAME
    [block] = m.content
    assert block.type == "text" and block.text == r.choices[0].message.content and "Paris" in block.text
    assert m.stop_reason == ("end_turn" if r.choices[0].finish_reason == "stop" else "max_tokens")
    # Anthropic counts prompt tokens read from the cache apart.
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == r.usage.prompt_tokens
    assert m.usage.output_tokens == r.usage.completion_tokens
    count = claude.messages.count_tokens(model=MODEL_NAME, system=SYSTEM,
                                         messages=[{"role": "user", "content": QUESTION}])
    assert count.input_tokens == r.usage.prompt_tokens


def test_the_stream_sends_anthropics_events_and_builds_the_same_message(claude) -> None:
    kwargs = dict(model=MODEL_NAME, max_tokens=24, messages=[{"role": "user", "content": [
        {"type": "text", "text": QUESTION}]}], **GREEDY)
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = [e for e in stream if e.type not in ("text", "thinking", "input_json", "signature")]
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.content[0].text
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_and_the_output_limit_set_the_stop_reason(claude) -> None:
    m = claude.messages.create(model=MODEL_NAME, max_tokens=24, stop_sequences=["Paris"],
                               messages=[{"role": "user", "content": QUESTION}], **GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris" and "Paris" not in m.content[0].text
    m = claude.messages.create(model=MODEL_NAME, max_tokens=3, messages=[{"role": "user", "content": QUESTION}],
                               **GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_tool_use_then_a_tool_result_turn(claude, client) -> None:
    question = [{"role": "user", "content": "What's the weather in Paris?"}]
    m = claude.messages.create(model=MODEL_NAME, max_tokens=40, tools=[WEATHER_TOOL], tool_choice={"type": "any"},
                               messages=question, **GREEDY)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert set(uses[0].input) == {"city"} and isinstance(uses[0].input["city"], str)
    use = uses[0]
    turn = question + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                     "content": "Sunny, 22 C"}]}]
    with claude.messages.stream(model=MODEL_NAME, max_tokens=20, tools=[WEATHER_TOOL], tool_choice={"type": "none"},
                                messages=turn, **GREEDY) as stream:
        answer = stream.get_final_message()
    r = chat(client, question + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 22 C"}], 20, tools=[CHAT_WEATHER_TOOL],
        tool_choice="none")
    assert answer.content[0].text == r.choices[0].message.content


def test_a_streamed_named_tool_sends_its_input_as_json_deltas(claude) -> None:
    with claude.messages.stream(model=MODEL_NAME, max_tokens=40, tools=[WEATHER_TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Rome?"}], **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    parts = [e.delta.partial_json for e in events if e.type == "content_block_delta"
             and e.delta.type == "input_json_delta"]
    [use] = final.content
    assert use.type == "tool_use" and use.name == "get_weather" and final.stop_reason == "tool_use"
    assert json.loads("".join(parts)) == use.input


@pytest.mark.parametrize("kwargs, status, kind, mentions", [
    ({"model": "claude-unknown"}, 404, "not_found_error", "claude-unknown"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     400, "invalid_request_error", "image"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, 400, "invalid_request_error",
     "tool_use_id"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error", "custom tools"),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, 400, "invalid_request_error", None),
    ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error", "role"),
], ids=["unknown model", "image", "malformed tool_result", "server tool", "too long", "zero max_tokens", "bad role"])
def test_bad_requests_get_anthropics_error_shape(claude, kwargs, status, kind, mentions) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **kwargs}
    with pytest.raises(anthropic.APIStatusError) as exc:
        claude.messages.create(**body)
    assert exc.value.status_code == status
    err = exc.value.body
    assert err["type"] == "error" and err["error"]["type"] == kind, err
    if mentions is not None:
        assert mentions in err["error"]["message"], err


def test_a_wrong_key_is_anthropics_authentication_error(server) -> None:
    bad = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        bad.messages.create(model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert exc.value.body["error"]["type"] == "authentication_error"
