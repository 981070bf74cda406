"""POST /v1/responses through the clients that speak it: the openai SDK's responses.create,
responses.stream and responses.parse, and the OpenAI Agents SDK running an agent with a function
tool. Each answer is checked against the chat completion of the same conversation (greedy), which
is what the endpoint translates it into."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Literal

import agents  # openai-agents
import pytest
from pydantic import BaseModel

from conftest import MODEL_NAME, assert_error

GREEDY = {"temperature": 0.0}
QUESTION = "What is the capital of France?"
INSTRUCTIONS = "You are a terse geography assistant."
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                               "additionalProperties": False}}
CHAT_WEATHER_TOOL = {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}


def chat_text(client, messages: list[dict], max_tokens: int, **kwargs) -> tuple[str, str, int]:
    """(text, finish_reason, prompt tokens) of the greedy chat completion of `messages`."""
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens, **GREEDY, **kwargs)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.prompt_tokens


def test_a_response_is_the_chat_completion_of_its_instructions_and_input(client) -> None:
    r = client.responses.create(model=MODEL_NAME, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=24,
                                **GREEDY)
    text, finish, prompt_tokens = chat_text(client, [{"role": "system", "content": INSTRUCTIONS},
                                                     {"role": "user", "content": QUESTION}], 24)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL_NAME
    assert r.output_text == text and "Paris" in text
    assert r.status == ("completed" if finish == "stop" else "incomplete")
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert r.usage.input_tokens == prompt_tokens and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == INSTRUCTIONS and r.max_output_tokens == 24 and r.temperature == 0.0


def test_the_stream_sends_openais_events_and_builds_the_same_response(client) -> None:
    kwargs = dict(model=MODEL_NAME, input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
                  max_output_tokens=24, **GREEDY)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(d.delta for d in deltas) == whole.output_text
    assert {d.item_id for d in deltas} == {final.output[0].id}
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens and final.id != whole.id


def test_max_output_tokens_cut_makes_the_response_incomplete(client) -> None:
    r = client.responses.create(model=MODEL_NAME, input="Write a long story about a dragon.", max_output_tokens=5,
                                **GREEDY)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"


class Country(BaseModel):
    country: Literal["France", "Germany", "Italy"]
    is_capital: bool


def test_structured_output_through_responses_parse(client) -> None:
    r = client.responses.parse(model=MODEL_NAME, input="Paris: which country, and is it the capital? JSON.",
                               text_format=Country, max_output_tokens=40, **GREEDY)
    assert isinstance(r.output_parsed, Country)
    assert r.text.format.type == "json_schema"


def test_a_two_turn_function_calling_loop(client) -> None:
    first = client.responses.create(model=MODEL_NAME, input="What's the weather in Paris?", tools=[WEATHER_TOOL],
                                    tool_choice="required", max_output_tokens=40, **GREEDY)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls) and first.status == "completed"
    call = calls[0]
    assert set(json.loads(call.arguments)) == {"city"} and call.call_id and call.id.startswith("fc_")
    # The second turn replays the call and its output; it is the chat completion of that conversation.
    items = ["What's the weather in Paris?", call, {"type": "function_call_output", "call_id": call.call_id,
                                                    "output": "Sunny, 22 C"}]
    items[0] = {"role": "user", "content": items[0]}
    items[1] = call.model_dump(exclude_none=True)
    with client.responses.stream(model=MODEL_NAME, input=items, tools=[WEATHER_TOOL], tool_choice="none",
                                 max_output_tokens=20, **GREEDY) as stream:
        # The last event carries the response: response.completed, or response.incomplete when the
        # 20 tokens ran out (the SDK's get_final_response() only takes the former).
        second = list(stream)[-1].response
    text, _, _ = chat_text(client, [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 22 C"}], 20, tools=[CHAT_WEATHER_TOOL],
        tool_choice="none")
    assert second.output_text == text and text


def test_a_streamed_forced_call_sends_argument_deltas(client) -> None:
    with client.responses.stream(model=MODEL_NAME, input="Weather in Rome?", tools=[WEATHER_TOOL],
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                 **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    [call] = final.output
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert call.type == "function_call" and call.name == "get_weather"
    assert "".join(deltas) == done.arguments == call.arguments and isinstance(json.loads(call.arguments), dict)


def test_previous_response_id_continues_a_stored_conversation(server, client) -> None:
    first = client.responses.create(model=MODEL_NAME, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=12,
                                    **GREEDY)
    assert first.store is True
    second = client.responses.create(model=MODEL_NAME, input="And of Germany?", previous_response_id=first.id,
                                     max_output_tokens=12, **GREEDY)
    # Instructions are not carried over (OpenAI's rule); the earlier turn is.
    text, _, _ = chat_text(client, [{"role": "user", "content": QUESTION},
                                    {"role": "assistant", "content": first.output_text},
                                    {"role": "user", "content": "And of Germany?"}], 12)
    assert second.output_text == text and second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(second.id)
    assert_error(server.get(f"/v1/responses/{second.id}"), 404, param="response_id")
    assert_error(server.post("/v1/responses", {"model": MODEL_NAME, "input": "x", "previous_response_id": "resp_nope"}),
                 404, param="previous_response_id")


@pytest.mark.parametrize("body, param, mentions", [
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input", "web_search_call"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input",
     "input_image"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", None),
    ({"input": "x" * 5000}, "input", None),
    ({"input": "x", "background": True}, "background", None),
    ({"input": 5}, "input", None),
], ids=["unknown item", "hosted tool", "image", "zero tokens", "too long", "background", "wrong type"])
def test_bad_input_is_a_400_envelope_naming_the_field(server, body, param, mentions) -> None:
    assert_error(server.post("/v1/responses", {"model": MODEL_NAME, **body}), 400, param=param, mentions=mentions)


def test_bad_requests_to_both_apis_leave_a_running_stream_undisturbed(server, client) -> None:
    kwargs = dict(model=MODEL_NAME, input=QUESTION, max_output_tokens=24, **GREEDY)
    alone = client.responses.create(**kwargs).output_text
    with client.responses.stream(**kwargs) as stream:
        events = iter(stream)
        text = "".join(e.delta for e in itertools.islice(events, 6) if e.type == "response.output_text.delta")
        for path, body in (("/v1/responses", {"model": MODEL_NAME, "input": [{"type": "nope"}]}),
                           ("/v1/messages", {"model": MODEL_NAME, "max_tokens": 4, "messages": "Hi"}),
                           ("/v1/messages", {"model": MODEL_NAME, "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "x " * 900}]})):
            assert 400 <= server.post(path, body).status < 500
        text += "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == alone


def test_an_agent_with_a_function_tool_runs_through_the_server(server) -> None:
    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"The weather in {city} is sunny, 22 C."

    model = agents.OpenAIResponsesModel(model=MODEL_NAME, openai_client=server.async_client())
    agent = agents.Agent(name="weather", instructions="Answer weather questions with the get_weather tool.",
                         tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=32))

    async def run() -> tuple[object, object]:
        result = await agents.Runner.run(agent, "What's the weather in Paris?", max_turns=3)
        streamed = agents.Runner.run_streamed(agent, "What's the weather in Paris?", max_turns=3)
        async for _ in streamed.stream_events():
            pass
        return result, streamed

    result, streamed = asyncio.run(run())
    # The forced first turn calls the tool; after it the agent resets tool_choice and the model answers.
    assert cities == ["Paris", "Paris"]
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds
    assert isinstance(result.final_output, str) and result.final_output
    assert streamed.final_output == result.final_output
