"""Structured outputs and tool calling against a real `paxserve serve` on the bundled SmolLM2, driven
by the official openai client and by LangChain's ChatOpenAI. Every answer is checked against its
schema; sampled ones over several seeds."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from conftest import API_KEY, MODEL_NAME, assert_error, sse_payloads

ASK = [{"role": "user", "content": "Describe a fictional person."}]


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    city: Literal["Paris", "Rome", "Oslo"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["zone"], "additionalProperties": False,
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def assert_valid_call(call) -> None:
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ---- response_format and vLLM's guided fields, official client ----------------------------------------

def test_json_schema_through_the_clients_parse_helper_over_seeds(client: openai.OpenAI) -> None:
    out = client.chat.completions.parse(model=MODEL_NAME, messages=ASK, response_format=Person, n=2,
                                        temperature=1.0, seed=11, max_tokens=80)
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person), choice.message.content
    assert len({c.message.content for c in out.choices}) > 1


def test_streamed_json_schema_with_logprobs_is_the_same_valid_answer(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema(),
                                                  "strict": True}}
    whole = client.chat.completions.create(model=MODEL_NAME, messages=ASK, response_format=fmt, temperature=0,
                                           max_tokens=80, logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=ASK, response_format=fmt, temperature=0,
                                                 max_tokens=80, logprobs=True, top_logprobs=2, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    Person.model_validate_json(text)
    assert len(whole.choices[0].logprobs.content) == whole.usage.completion_tokens


def test_json_object_and_guided_choice_and_regex(client: openai.OpenAI) -> None:
    obj = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Give a cat's name and color as a JSON object."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=60)
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    pick = client.completions.create(model=MODEL_NAME, prompt="The best color is", max_tokens=10, temperature=1.0,
                                     seed=4, n=4, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert all(c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in pick.choices)
    date = client.completions.create(model=MODEL_NAME, prompt="Today's date:", max_tokens=20, temperature=0,
                                     extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    assert len(date.choices[0].text) == 10 and date.choices[0].text.startswith("20")


# ---- tools, official client ------------------------------------------------------------------------------

def test_a_named_tool_choice_is_always_a_valid_call(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed in (1, 2):
        out = client.chat.completions.create(model=MODEL_NAME, messages=ask, tools=[WEATHER, TIME], seed=seed,
                                             tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                             temperature=0.8, max_tokens=60)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert_valid_call(call)


def test_required_tool_calls_stream_as_argument_fragments(server, client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Weather in Rome, and the time in CET?"}]
    body = {"model": MODEL_NAME, "messages": ask, "tools": [WEATHER, TIME], "tool_choice": "required",
            "temperature": 0, "max_tokens": 120, "stream": True}
    resp = server.post("/v1/chat/completions", body)
    assert resp.status == 200, resp
    deltas = [json.loads(p)["choices"] for p in sse_payloads(resp.text) if p != "[DONE]"]
    calls: dict[int, dict] = {}
    fragments = 0
    finish = None
    for choices in deltas:
        for c in choices:
            finish = c["finish_reason"] or finish
            for tc in c["delta"].get("tool_calls", []):
                fragments += 1
                entry = calls.setdefault(tc["index"], {"name": None, "arguments": ""})
                if "id" in tc:
                    assert tc["type"] == "function" and tc["function"]["name"] and entry["name"] is None
                    entry["name"] = tc["function"]["name"]
                entry["arguments"] += tc["function"]["arguments"]
    assert finish == "tool_calls" and calls
    assert fragments > len(calls) + 1  # arguments arrive in pieces, not once at the end
    whole = client.chat.completions.create(**{k: v for k, v in body.items() if k != "stream"})
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == \
        [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    for call in whole.choices[0].message.tool_calls:
        assert_valid_call(call)


def test_auto_tool_choice_parses_the_models_hermes_calls_and_a_tool_result_goes_back(client: openai.OpenAI) -> None:
    # Guided into Hermes' format, so the small model writes a call the auto parser must find.
    hermes = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}' \
             r'\n</tool_call>'
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=ask, tools=[WEATHER], temperature=0,
                                         max_tokens=60, extra_body={"guided_regex": hermes})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert_valid_call(call)
    history = [*ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=[WEATHER], temperature=0,
                                            max_tokens=12)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls in (None, [])


# ---- LangChain -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=server.url + "/v1", api_key=API_KEY, model=MODEL_NAME, temperature=0, max_tokens=80,
                      max_retries=0, timeout=120)


@pytest.mark.parametrize("method", ["json_schema", "json_mode"])
def test_langchain_structured_output(chat, method: str) -> None:
    question = "Describe a fictional person as JSON with name, age and city (Paris, Rome or Oslo)."
    for temperature in ((0.9,) if method == "json_schema" else (0.0,)):
        llm = chat.bind(temperature=temperature, seed=5)
        result = llm.with_structured_output(Person, method=method, include_raw=True).invoke(question)
        if method == "json_schema":  # the schema itself guides decoding
            assert isinstance(result["parsed"], Person), result
        else:  # JSON mode promises a JSON object, not the schema (as OpenAI's)
            assert isinstance(json.loads(result["raw"].content), dict), result


def test_langchain_forced_and_streamed_tool_calls(chat) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage

    forced = chat.bind_tools([WEATHER, TIME], tool_choice="get_time")
    msg = forced.invoke("What time is it in Berlin?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_time" and call["args"]["zone"] in ("UTC", "CET")
    streamed = None
    for chunk in chat.bind_tools([WEATHER, TIME], tool_choice="required").bind(temperature=0.7, seed=3).stream(
            "Weather in Oslo?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls and streamed.response_metadata["finish_reason"] == "tool_calls"
    for c in streamed.tool_calls:
        jsonschema.validate(c["args"], SCHEMAS[c["name"]])
    reply = chat.invoke([HumanMessage("What time is it in Berlin?"), msg,
                         ToolMessage('{"time": "12:00"}', tool_call_id=call["id"])])
    assert isinstance(reply.content, str) and reply.content


# ---- errors: a clear 400, and the server goes on ----------------------------------------------------------

@pytest.mark.parametrize("change,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}}},
     "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"}, "response_format"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
])
def test_bad_constraints_are_a_400_and_the_server_keeps_serving(server, client, change: dict, param: str) -> None:
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4, **change}
    assert_error(server.post("/v1/chat/completions", body), 400, param=param)


def test_a_schema_past_the_grammar_limits_is_a_400(server, client: openai.OpenAI) -> None:
    # Nested 300 deep: past llguidance's limits. The server answers at once, and goes on serving.
    schema: dict = {"type": "integer"}
    for _ in range(300):
        schema = {"type": "array", "items": schema}
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4, "guided_json": schema}
    assert_error(server.post("/v1/chat/completions", body), 400, param="guided_json")
    ok = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason == "length"
