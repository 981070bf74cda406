"""The Responses and Messages APIs' insides, in-process: how a turn's output (reasoning, text, tool
calls, streamed in arbitrary cuts) becomes each API's items and events, how their bodies become chat
requests, what they refuse, and the response store's bounds and owners. The live endpoints are
tested through their SDKs in test_responses_api.py and test_messages_api.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from conftest import MAX_MODEL_LEN, MODEL_NAME, VOCAB_SIZE
from paxserve.outputs import CompletionOutput, RequestOutput
from paxserve.server.chat_turn import TurnUsage, turn_pieces
from paxserve.server.errors import ProtocolError, anthropic_envelope
from paxserve.server.generation_spec import GenerationSpec
from paxserve.server.messages_events import MessageBuilder
from paxserve.server.messages_handler import parse_messages_request
from paxserve.server.parsers.reasoning import get_reasoning_parser
from paxserve.server.parsers.tool_calls import HermesToolParser
from paxserve.server.response_store import ResponseStore, StoredResponse
from paxserve.server.responses_events import ResponseBuilder
from paxserve.server.responses_handler import parse_responses_request
from paxserve.server.settings import ServerSettings
from paxserve.server.tools import ChatOutputParsers
from paxserve.sampling_params import SamplingParams

SETTINGS = ServerSettings(served_model_names=[MODEL_NAME], max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB_SIZE,
                          enable_auto_tool_choice=True, tool_call_parser="hermes")
OUTPUT = ('<think>The user wants the weather.</think>Let me check the weather in Paris.'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


class _Run:
    """The engine outputs of one choice, cut where the test says (what GenerationRun.next yields)."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs = outputs

    async def next(self) -> tuple[int, RequestOutput]:
        return 0, self.outputs.pop(0)


def _outputs(text: str, cuts: list[int], finish_reason: str = "stop") -> list[RequestOutput]:
    bounds = [0, *cuts, len(text)]
    outs = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        last = k == len(bounds) - 2
        outs.append(RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, text[a:b], [7], finish_reason=(
            finish_reason if last else None))], finished=last, num_cached_tokens=1))
    return outs


def _pieces(text: str, cuts: list[int], finish_reason: str = "stop") -> list:
    spec = GenerationSpec("chat", MODEL_NAME, SamplingParams(max_tokens=8),
                          output=ChatOutputParsers(get_reasoning_parser("qwen3"), HermesToolParser()))
    outs = _outputs(text, cuts, finish_reason)
    run = _Run(outs[1:])

    async def collect() -> list:
        return [p async for p in turn_pieces(spec, run, (0, outs[0]))]

    return asyncio.run(collect())


CUTS = [[], [3, 10, 40, 60, 80, 100, 120], list(range(1, len(OUTPUT)))]


@pytest.mark.parametrize("cuts", CUTS, ids=["whole", "some cuts", "every character"])
def test_a_responses_stream_builds_reasoning_then_message_then_call(cuts) -> None:
    builder = ResponseBuilder("resp_x", {"model": MODEL_NAME}, TurnUsage(3))
    events = builder.start()
    finish = None
    for piece in _pieces(OUTPUT, cuts):
        events += builder.feed(piece)
        finish = piece.finish_reason or finish
    events += builder.finish(finish, None)
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["status"] == "completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    reasoning, message, call = final["output"]
    assert reasoning["content"][0]["text"] == "The user wants the weather."
    assert message["content"][0]["text"] == "Let me check the weather in Paris."
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    # Every item is added before its deltas and done after them; the deltas add up to the item.
    for index, item in enumerate(final["output"]):
        mine = [e for e in events if e.get("output_index") == index]
        assert mine[0]["type"] == "response.output_item.added" and mine[-1]["type"] == "response.output_item.done"
        assert mine[-1]["item"] == item
        text = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        assert text == (item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"])
    assert final["usage"]["output_tokens"] == len(cuts) + 1 and final["usage"]["input_tokens"] == 3


@pytest.mark.parametrize("cuts", CUTS, ids=["whole", "some cuts", "every character"])
def test_a_messages_stream_builds_thinking_then_text_then_tool_use(cuts) -> None:
    builder = MessageBuilder(MODEL_NAME, TurnUsage(3, cached_tokens=1))
    events = builder.start()
    finish = None
    for piece in _pieces(OUTPUT, cuts):
        events += builder.feed(piece)
        finish = piece.finish_reason or finish
    events += builder.finish(finish, None)
    message = builder.final()
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    thinking, text, use = message["content"]
    assert thinking["thinking"] == "The user wants the weather." and text["text"].endswith("in Paris.")
    assert use["name"] == "get_weather" and use["input"] == {"city": "Paris"}
    assert message["stop_reason"] == "tool_use" and events[-2]["delta"]["stop_reason"] == "tool_use"
    assert message["usage"]["input_tokens"] == 2 and message["usage"]["cache_read_input_tokens"] == 1
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    for index, block in enumerate(message["content"]):
        mine = [e for e in events if e.get("index") == index]
        assert mine[0]["type"] == "content_block_start" and mine[-1]["type"] == "content_block_stop"
        deltas = "".join(next(v for k, v in e["delta"].items() if k != "type") for e in mine
                         if e["type"] == "content_block_delta")
        assert deltas == (json.dumps(block["input"]) if block["type"] == "tool_use" else block[block["type"]])


def test_an_output_cut_inside_a_call_is_incomplete_in_both_apis() -> None:
    cut = OUTPUT[:OUTPUT.index('"Paris"')]
    pieces = _pieces(cut, [60, 110], finish_reason="length")
    responses = ResponseBuilder("resp_x", {}, TurnUsage(3))
    messages = MessageBuilder(MODEL_NAME, TurnUsage(3))
    for piece in pieces:
        responses.feed(piece)
        messages.feed(piece)
    events = responses.finish("length", None)
    assert events[-1]["type"] == "response.incomplete"
    assert responses.response()["incomplete_details"] == {"reason": "max_output_tokens"}
    assert responses.output[-1]["status"] == "incomplete"
    messages.finish("length", None)
    assert messages.final()["stop_reason"] == "max_tokens"


def test_a_failed_response_says_why() -> None:
    builder = ResponseBuilder("resp_x", {}, TurnUsage(3))
    [event] = builder.fail(ProtocolError("the engine stopped", status=503))
    assert event["type"] == "response.failed" and event["response"]["error"]["message"] == "the engine stopped"
    assert anthropic_envelope(ProtocolError("overloaded", status=503))["error"]["type"] == "api_error"


# ---- bodies -> chat requests -------------------------------------------------------------------------

def _responses(body: dict, store: ResponseStore | None = None, owner: str = "me"):
    state = SimpleNamespace(responses=store, settings=SETTINGS)
    return parse_responses_request(json.loads(json.dumps({"model": MODEL_NAME, **body})), state, owner)


def test_responses_items_fold_into_chat_messages() -> None:
    _, spec, _ = _responses({"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Check."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
        {"role": "developer", "content": "Use metric units."}],
        "text": {"format": {"type": "json_object"}}, "max_output_tokens": 9, "reasoning": {"effort": "low"}})
    assert [m["role"] for m in spec.messages] == ["system", "user", "assistant", "tool", "assistant", "system"]
    assert spec.messages[2]["reasoning_content"] == "Check."
    assert spec.messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert spec.messages[3]["tool_call_id"] == "c1" and spec.messages[4]["content"] == "It is sunny."
    assert spec.params.max_tokens == 9 and spec.params.structured_outputs is not None
    assert spec.chat_template_kwargs == {"reasoning_effort": "low"}


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
])
def test_bad_responses_bodies_name_their_field(body, param) -> None:
    with pytest.raises(ProtocolError) as exc:
        _responses(body)
    assert exc.value.status == 400 and exc.value.param == param, exc.value.message


def test_the_store_keeps_the_newest_and_each_keys_own() -> None:
    store = ResponseStore(2)
    for i in range(3):
        store.put("alice", StoredResponse({"id": f"resp_{i}", "output": []}, [{"role": "user", "content": str(i)}]))
    assert store.get("alice", "resp_0") is None and len(store) == 2
    assert store.get("bob", "resp_1") is None  # another key's response is not there for it
    _, spec, conversation = _responses({"input": "next", "previous_response_id": "resp_2"}, store, "alice")
    assert [m["content"] for m in conversation] == ["2", "next"]
    with pytest.raises(ProtocolError) as exc:
        _responses({"input": "next", "previous_response_id": "resp_2"}, store, "bob")
    assert exc.value.status == 404


def _messages(body: dict):
    return parse_messages_request(json.loads(json.dumps({"model": MODEL_NAME, "max_tokens": 16, **body})), SETTINGS)


def test_messages_blocks_fold_into_chat_messages() -> None:
    _, spec = _messages({"system": [{"type": "text", "text": "Be brief."}], "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Check.", "signature": "s"},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "Sunny"}]}, {"type": "text", "text": "Thanks. Metric?"}]}],
        "stop_sequences": ["END"], "thinking": {"type": "disabled"}, "tool_choice": {"type": "any"},
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]})
    assert [m["role"] for m in spec.messages] == ["system", "user", "assistant", "tool", "user"]
    assert spec.messages[2]["reasoning_content"] == "Check." and spec.messages[3]["content"] == "Sunny"
    assert spec.params.stop == ["END"] and spec.chat_template_kwargs == {"enable_thinking": False}
    assert spec.params.structured_outputs is not None  # "any" forces a call


def test_what_claude_code_and_the_beta_api_send_is_accepted() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    _, spec = _messages({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}],
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "cache_control": {"type": "ephemeral"}, "context_management": {"edits": []}, "user_profile_id": "u",
        "workspace_id": "w", "speed": "standard", "metadata": {"user_id": "x"},
        "output_format": {"type": "json_schema", "schema": schema}, "output_config": {"effort": "high"}})
    assert spec.params.structured_outputs is not None and spec.chat_template_kwargs == {"reasoning_effort": "high"}
    assert spec.messages[0] == {"role": "system", "content": "Be brief."}


def test_priority_reaches_the_engine_from_both_apis() -> None:
    # (Under fcfs the input processor refuses a nonzero priority, as for chat; see test_priority_server.)
    _, spec = parse_messages_request({"model": MODEL_NAME, "max_tokens": 4, "priority": -3,
                                      "messages": [{"role": "user", "content": "Hi"}]}, SETTINGS)
    assert spec.priority == -3
    _, spec, _ = _responses({"input": "Hi", "priority": 5})
    assert spec.priority == 5


@pytest.mark.parametrize("body, mentions", [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "document"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]}]}, "tool_use"),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "budget_tokens"),
    ({"max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 4000}}, "budget_tokens"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"temperature": 1.5}, "temperature"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"output_config": {"format": {"type": "regex"}}}, "output_config"),
    ({"compaction": {"type": "auto"}}, "compaction"),
    ({"max_tokenz": 5}, "Unknown field"),
])
def test_bad_messages_bodies_name_their_field(body, mentions) -> None:
    full = {"messages": [{"role": "user", "content": "Hi"}], **body}
    with pytest.raises(ProtocolError) as exc:
        _messages({k: v for k, v in full.items()})
    assert exc.value.status == 400 and mentions in exc.value.message, exc.value.message


def test_per_request_times_are_split_at_first_scheduling_and_first_token() -> None:
    from paxserve.server.metrics import ServerMetrics

    metrics = ServerMetrics(MODEL_NAME, MAX_MODEL_LEN)
    tracker = metrics.tracker(arrival=10.0, n=1, max_tokens=8)
    first = RequestOutput("r", None, [1, 2, 3, 4], [CompletionOutput(0, "a", [5])], num_cached_tokens=1)
    tracker.on_output(first, now=12.0)
    last = RequestOutput("r", None, [1, 2, 3, 4], [CompletionOutput(0, "bc", [6, 7], finish_reason="length")],
                         finished=True, num_cached_tokens=1, first_scheduled_time=11.0, num_preemptions=2)
    tracker.on_output(last, now=16.0)

    def total(name: str) -> float:
        return metrics.registry.get_sample_value(f"paxserve:{name}_sum", {"model_name": MODEL_NAME})

    assert total("request_queue_time_seconds") == 1.0  # arrival -> first scheduled
    assert total("request_prefill_time_seconds") == 1.0  # first scheduled -> first token
    assert total("request_decode_time_seconds") == 4.0  # first token -> last
    assert total("request_inference_time_seconds") == 5.0
    assert total("request_time_per_output_token_seconds") == 2.0  # 4 s over the 2 tokens after the first
    assert total("request_num_preemptions") == 2 and total("request_prefill_kv_computed_tokens") == 3
    assert total("request_params_max_tokens") == 8 and total("request_max_num_generation_tokens") == 3
    text = metrics.render().decode()
    assert 'vllm:request_queue_time_seconds_sum{model_name="smol-test"} 1.0' in text
