"""The OpenAI-compatible API of `paxserve serve`, driven by the official openai client (and raw HTTP
where the client cannot express a case). Every text comparison uses greedy decoding."""

from __future__ import annotations

import json
import time

import pytest

from conftest import MAX_LOGPROBS, MAX_MODEL_LEN, MODEL_NAME, VOCAB_SIZE, assert_error, metric_value, sse_payloads

PROMPT = "Hello, my name is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0.0}


def assert_usage(usage, prompt_tokens: int | None = None, completion_tokens: int | None = None) -> None:
    assert usage is not None
    assert usage.prompt_tokens > 0 and usage.completion_tokens >= 0
    assert usage.prompt_tokens + usage.completion_tokens == usage.total_tokens
    if prompt_tokens is not None:
        assert usage.prompt_tokens == prompt_tokens
    if completion_tokens is not None:
        assert usage.completion_tokens == completion_tokens


def tokenize(server, text: str) -> list[int]:
    resp = server.post("/tokenize", {"model": MODEL_NAME, "prompt": text})
    assert resp.status == 200, resp
    return resp.json()["tokens"]


def collect_completion_stream(stream) -> tuple[dict[int, str], dict[int, str], list, object]:
    """Texts and finish reasons per choice index, the chunks, and the usage chunk's usage."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(stream)
    usage = None
    for i, chunk in enumerate(chunks):
        assert chunk.object == "text_completion"
        assert chunk.id == chunks[0].id and chunk.model == MODEL_NAME
        if chunk.usage is not None:
            assert i == len(chunks) - 1 and chunk.choices == [], "usage comes in one extra, last chunk"
            usage = chunk.usage
        for c in chunk.choices:
            assert c.index not in finish, f"choice {c.index} got a chunk after its finish_reason"
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, chunks, usage


def collect_chat_stream(stream) -> tuple[dict[int, str], dict[int, str], list, object]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(stream)
    usage = None
    for i, chunk in enumerate(chunks):
        assert chunk.object == "chat.completion.chunk"
        assert chunk.id == chunks[0].id and chunk.id.startswith("chatcmpl-") and chunk.model == MODEL_NAME
        if chunk.usage is not None:
            assert i == len(chunks) - 1 and chunk.choices == [], "usage comes in one extra, last chunk"
            usage = chunk.usage
        for c in chunk.choices:
            assert c.index not in finish, f"choice {c.index} got a chunk after its finish_reason"
            if c.index not in texts:
                assert c.delta.role == "assistant", f"the first delta of choice {c.index} carries the role"
                texts[c.index] = ""
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, chunks, usage


# ---- models, health, version, tokenizer ------------------------------------------------------------


def test_models_list_names_the_served_model_with_its_context_length(server, client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].object == "model" and models.data[0].owned_by
    raw = server.get("/v1/models").json()
    assert raw["object"] == "list"
    assert raw["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_health_and_version(server) -> None:
    assert server.get("/health", auth=False).status == 200
    version = server.get("/version", auth=False)
    assert version.status == 200
    assert isinstance(version.json()["version"], str) and version.json()["version"]


def test_tokenize_and_detokenize_round_trip(server) -> None:
    resp = server.post("/tokenize", {"model": MODEL_NAME, "prompt": "Hello world"})
    assert resp.status == 200, resp
    body = resp.json()
    assert body["tokens"] and all(isinstance(t, int) for t in body["tokens"])
    assert body["count"] == len(body["tokens"])
    back = server.post("/detokenize", {"model": MODEL_NAME, "tokens": body["tokens"]})
    assert back.status == 200, back
    assert back.json()["prompt"] == "Hello world"


# ---- /v1/completions -------------------------------------------------------------------------------


def test_completion_has_openai_shape_and_usage(server, client) -> None:
    before = int(time.time())
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, **GREEDY)
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert before - 1 <= out.created <= time.time() + 1
    assert out.model == MODEL_NAME
    assert len(out.choices) == 1 and out.choices[0].index == 0
    choice = out.choices[0]
    assert choice.text and choice.finish_reason == "length" and choice.logprobs is None
    assert_usage(out.usage, prompt_tokens=len(tokenize(server, PROMPT)), completion_tokens=8)
    # Each request gets its own id.
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1).id != out.id


def test_completion_max_tokens_defaults_to_16(client) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_completion_prompt_forms_give_the_same_greedy_text(server, client) -> None:
    ids = tokenize(server, PROMPT)
    other = "The capital of France is"
    single = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, **GREEDY)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == single.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)

    several = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, other], max_tokens=6, **GREEDY)
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[0].text == single.choices[0].text
    other_alone = client.completions.create(model=MODEL_NAME, prompt=other, max_tokens=6, **GREEDY)
    assert several.choices[1].text == other_alone.choices[0].text
    assert_usage(several.usage, prompt_tokens=len(ids) + len(tokenize(server, other)),
                 completion_tokens=single.usage.completion_tokens + other_alone.usage.completion_tokens)

    id_lists = client.completions.create(model=MODEL_NAME, prompt=[ids, tokenize(server, other)], max_tokens=6,
                                         **GREEDY)
    assert [c.text for c in id_lists.choices] == [c.text for c in several.choices]


def test_completion_echo_prepends_the_prompt(client) -> None:
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, **GREEDY)
    echoed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens


def test_completion_stop_string_cuts_the_text(client) -> None:
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, **GREEDY).choices[0].text
    words = full.split()
    assert len(words) >= 4, full
    stop = words[2]
    cut = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, stop=[stop, "\u2603"], **GREEDY)
    assert cut.choices[0].text == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 16


def test_logit_bias_and_stop_token_ids(server, client) -> None:
    [hello] = tokenize(server, "hello")
    forced = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, logit_bias={str(hello): 100},
                                       **GREEDY)
    assert forced.choices[0].text == "hello" * 4
    stopped = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4,
                                        logit_bias={str(hello): 100}, extra_body={"stop_token_ids": [hello]},
                                        **GREEDY)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == ""  # the stop token itself is not part of the text
    assert stopped.usage.completion_tokens == 1


def test_completion_logprobs(client) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, logprobs=3, **GREEDY)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == choice.text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4  # the top 3, plus the sampled token when it is not among them
        assert token in top and top[token] == pytest.approx(value, abs=1e-4)
        assert value == pytest.approx(max(top.values()), abs=1e-4)  # greedy takes the most likely token


def test_completion_n2_seeded_samples_are_reproducible(client) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, n=2, temperature=1.0, seed=1234,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.choices[0].text != first.choices[1].text, "the n samples must not be copies of each other"
    assert_usage(first.usage, completion_tokens=24)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens


def test_a_negative_seed_is_accepted_as_vllm_does_and_is_its_own_reproducible_stream(client) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                  extra_body={"ignore_eos": True})
    negative = [client.completions.create(**kwargs, seed=-7).choices[0].text for _ in range(2)]
    assert negative[0] == negative[1]
    assert negative[0] != client.completions.create(**kwargs, seed=7).choices[0].text


def test_continuous_usage_stats_put_usage_on_every_chat_chunk_the_role_chunk_too(client) -> None:
    stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=5, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is not None for c in chunks), [c.usage for c in chunks]
    assert chunks[0].usage.completion_tokens == 0 and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0  # the server runs --enable-prompt-tokens-details


def test_prompt_logprobs_is_null_when_not_asked_for_as_vllm_sends_it(server) -> None:
    completion = server.post("/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}).json()
    assert "prompt_logprobs" in completion["choices"][0] and completion["choices"][0]["prompt_logprobs"] is None
    chat = server.post("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 2,
                                                "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert "prompt_logprobs" in chat and chat["prompt_logprobs"] is None


def test_a_custom_role_goes_to_the_chat_template_as_vllm_does(server, client) -> None:
    messages = [{"role": "narrator", "content": "The night was dark."}, {"role": "user", "content": "Go on."}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3)
    assert out.choices[0].finish_reason == "length"
    tokens = server.post("/tokenize", {"model": MODEL_NAME, "messages": messages}).json()["tokens"]
    text = server.post("/detokenize", {"model": MODEL_NAME, "tokens": tokens}).json()["prompt"]
    assert "<|im_start|>narrator\nThe night was dark." in text, text


def test_a_named_tool_call_cut_short_by_max_tokens_is_no_call_as_vllm_and_openai_answer(client) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}}}
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0)
    cut = client.chat.completions.create(max_tokens=2, **kwargs).choices[0]
    assert cut.finish_reason == "length" and not cut.message.tool_calls
    whole = client.chat.completions.create(max_tokens=60, **kwargs).choices[0]
    assert [c.function.name for c in whole.message.tool_calls] == ["get_weather"]
    assert "city" in json.loads(whole.message.tool_calls[0].function.arguments)


def test_tool_choice_required_takes_parameters_that_use_refs_into_their_defs(client) -> None:
    """vLLM's own case: a tool whose parameters `$ref` their `$defs` (as pydantic writes them)."""
    params = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
              "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                  "required": ["city"]}}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                         tools=[tool], tool_choice="required", max_tokens=80,
                                         temperature=0).choices[0]
    assert out.finish_reason == "tool_calls"
    call = out.message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["where"]["city"], str)


def test_return_token_ids_gives_the_prompts_and_the_outputs_ids_streamed_or_not(server, client) -> None:
    ids = server.post("/tokenize", {"model": MODEL_NAME, "prompt": "The capital of France is"}).json()["tokens"]
    kwargs = dict(model=MODEL_NAME, prompt="The capital of France is", max_tokens=8, temperature=0,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = client.completions.create(**kwargs).choices[0]
    assert choice.model_extra["prompt_token_ids"] == ids and len(choice.model_extra["token_ids"]) == 8
    text = server.post("/detokenize", {"model": MODEL_NAME, "tokens": choice.model_extra["token_ids"]}).json()
    assert text["prompt"] == choice.text
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert chunks[0].model_extra["prompt_token_ids"] == ids
    assert [t for c in chunks for t in c.model_extra["token_ids"]] == choice.model_extra["token_ids"]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          extra_body={"return_token_ids": True})
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens


def test_allowed_token_ids_limits_what_is_sampled_greedy_or_not(client) -> None:
    allowed = [28, 253, 314, 1000]
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        out = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=6,
                                        extra_body={"allowed_token_ids": allowed, "return_token_ids": True,
                                                    "ignore_eos": True}, **sampling)
        ids = out.choices[0].model_extra["token_ids"]
        assert len(ids) == 6 and set(ids) <= set(allowed), ids


def test_same_seed_twice_gives_the_same_text(client) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=7, **kwargs).choices[0].text
    assert client.completions.create(seed=7, **kwargs).choices[0].text == a
    chat = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=16,
                temperature=1.0)
    b = client.chat.completions.create(seed=11, **chat).choices[0].message.content
    assert client.chat.completions.create(seed=11, **chat).choices[0].message.content == b


def test_truncating_samplers_reduce_to_greedy(client) -> None:
    greedy = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, **GREEDY).choices[0].text
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3,
                                        extra_body=extra)
        assert out.choices[0].text == greedy, extra
    tiny_top_p = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                           top_p=1e-6, seed=3)
    assert tiny_top_p.choices[0].text == greedy


def test_penalties_change_a_repetitive_continuation(client) -> None:
    prompt = "a a a a a a a a"
    base = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, **GREEDY).choices[0].text
    penalised = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, frequency_penalty=2.0,
                                          presence_penalty=0.5, **GREEDY).choices[0].text
    repetition = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10,
                                           extra_body={"repetition_penalty": 2.0}, **GREEDY).choices[0].text
    assert penalised != base and repetition != base


def test_max_tokens_beyond_the_room_left_is_a_400_with_vllms_wording(server, client) -> None:
    ids = [28120] * (MAX_MODEL_LEN - 10)
    resp = server.post("/v1/completions", {"model": MODEL_NAME, "prompt": ids, "max_tokens": 100})
    err = assert_error(resp, 400, param="max_tokens")
    assert err["message"] == (f"'max_tokens' or 'max_completion_tokens' is too large: 100. This model's maximum "
                              f"context length is {MAX_MODEL_LEN} tokens and your request has {MAX_MODEL_LEN - 10} "
                              f"input tokens (100 > {MAX_MODEL_LEN} - {MAX_MODEL_LEN - 10}).")
    resp = server.post("/v1/chat/completions", {"model": MODEL_NAME, "messages": QUESTION,
                                                "max_completion_tokens": MAX_MODEL_LEN})
    assert_error(resp, 400, param="max_completion_tokens", mentions="is too large")
    # Exactly the room left is fine, and so is no max_tokens at all (chat: the room left).
    out = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=10, extra_body={"ignore_eos": True},
                                    **GREEDY)
    assert out.choices[0].finish_reason == "length"
    assert_usage(out.usage, prompt_tokens=MAX_MODEL_LEN - 10, completion_tokens=10)


def test_a_full_context_of_large_token_ids_is_not_too_large_a_body(client) -> None:
    # The body limit must let max_model_len token ids through; the longest prompt that fits still works.
    ids = [VOCAB_SIZE - 1] * (MAX_MODEL_LEN - 1)
    out = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1, **GREEDY)
    assert_usage(out.usage, prompt_tokens=MAX_MODEL_LEN - 1, completion_tokens=1)


def test_an_unknown_field_is_a_400_and_tracking_fields_pass(server) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "user": "me"}
    resp = server.post("/v1/completions", body)
    assert resp.status == 200 and resp.json()["usage"]["completion_tokens"] == 2, resp
    # A misspelt field must not silently generate with the default (16 tokens here).
    assert_error(server.post("/v1/completions", {**body, "max_token": 40}), 400, param="max_token",
                 mentions="Unknown field")


def test_logprob_token_ids_list_those_tokens_logprobs_as_vllm_does(client) -> None:
    top = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=2, logprobs=True,
                                         top_logprobs=MAX_LOGPROBS, **GREEDY,
                                         extra_body={"return_tokens_as_token_ids": True})
    ranked = {int(t.token.split(":")[1]): t.logprob for t in top.choices[0].logprobs.content[0].top_logprobs}
    chosen = list(ranked)[::-1][:3]  # the least likely of the top ones first
    out = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=2, logprobs=True, **GREEDY,
                                         extra_body={"logprob_token_ids": chosen, "return_tokens_as_token_ids": True})
    first = out.choices[0].logprobs.content[0]
    assert [int(t.token.split(":")[1]) for t in first.top_logprobs] == chosen
    assert [t.logprob for t in first.top_logprobs] == pytest.approx([ranked[t] for t in chosen], abs=1e-4)
    cmpl = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, **GREEDY,
                                     extra_body={"logprob_token_ids": chosen, "return_tokens_as_token_ids": True})
    assert {f"token_id:{t}" for t in chosen} <= set(cmpl.choices[0].logprobs.top_logprobs[0])


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client) -> None:
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, logprobs=2, **GREEDY,
                                    extra_body=extra)
    ids = out.choices[0].model_extra["token_ids"]
    assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in out.choices[0].logprobs.top_logprobs for k in top)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=4, logprobs=True,
                                          top_logprobs=2, **GREEDY, extra_body=extra)
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].model_extra["token_ids"]]
    assert content[0].bytes == list(content[0].token.encode())


# ---- /v1/chat/completions --------------------------------------------------------------------------


def test_chat_has_openai_shape_and_answers_through_the_template(client) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=24, **GREEDY)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == MODEL_NAME
    assert abs(out.created - time.time()) < 60
    [choice] = out.choices
    assert choice.index == 0 and choice.finish_reason in ("stop", "length")
    assert choice.message.role == "assistant" and choice.message.refusal is None
    assert "Paris" in choice.message.content
    assert_usage(out.usage)
    assert out.usage.prompt_tokens > 8  # the template wraps the question


def test_chat_system_and_assistant_turns(client) -> None:
    messages = [{"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "Say hi."},
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, **GREEDY)
    assert out.choices[0].message.content
    short = client.chat.completions.create(model=MODEL_NAME, messages=messages[-1:], max_tokens=16, **GREEDY)
    assert out.usage.prompt_tokens > short.usage.prompt_tokens  # every turn reaches the model


def test_chat_max_tokens_and_max_completion_tokens(client) -> None:
    for kw in ({"max_tokens": 4}, {"max_completion_tokens": 3}):
        out = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, extra_body={"ignore_eos": True},
                                             **GREEDY, **kw)
        assert out.usage.completion_tokens == next(iter(kw.values())), kw
        assert out.choices[0].finish_reason == "length"


def test_chat_min_tokens_holds_back_eos(client) -> None:
    hi = [{"role": "user", "content": "Hi"}]
    short = client.chat.completions.create(model=MODEL_NAME, messages=hi, max_tokens=40, **GREEDY)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 30
    held = client.chat.completions.create(model=MODEL_NAME, messages=hi, max_tokens=40,
                                          extra_body={"min_tokens": 40}, **GREEDY)
    assert held.usage.completion_tokens == 40 and held.choices[0].finish_reason == "length"


def test_chat_logprobs(client) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=5, logprobs=True,
                                         top_logprobs=3, extra_body={"ignore_eos": True}, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and isinstance(t.bytes, list)
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)  # greedy
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=2, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_chat_n2(client) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=6, n=2, temperature=1.0,
                                         seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in out.choices)
    assert_usage(out.usage, completion_tokens=12)


# ---- streaming -------------------------------------------------------------------------------------


def test_streamed_completion_equals_the_non_streamed_one(client) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, **GREEDY)
    whole = client.completions.create(**kwargs)
    texts, finish, chunks, usage = collect_completion_stream(client.completions.create(stream=True, **kwargs))
    assert texts == {0: whole.choices[0].text}
    assert finish == {0: whole.choices[0].finish_reason}
    assert usage is None and all(c.usage is None for c in chunks)
    assert len(chunks) > 2, "tokens must arrive as they are generated, not in one piece"


def test_streamed_completion_with_stop_n2_and_usage(client) -> None:
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, **GREEDY).choices[0].text
    stop = full.split()[4]
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, stop=stop, **GREEDY)
    whole = client.completions.create(**kwargs)
    texts, finish, _, usage = collect_completion_stream(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert texts == {0: whole.choices[0].text} and finish == {0: "stop"}
    assert_usage(usage, prompt_tokens=whole.usage.prompt_tokens, completion_tokens=whole.usage.completion_tokens)

    sampled = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=10, n=2, temperature=0.8, seed=21,
                   extra_body={"ignore_eos": True})
    whole = client.completions.create(**sampled)
    texts, finish, _, usage = collect_completion_stream(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **sampled))
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {0: "length", 1: "length"}
    assert_usage(usage, completion_tokens=20)


def test_streamed_chat_equals_the_non_streamed_one(client) -> None:
    kwargs = dict(model=MODEL_NAME, messages=QUESTION, max_tokens=24, **GREEDY)
    whole = client.chat.completions.create(**kwargs)
    texts, finish, chunks, usage = collect_chat_stream(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert texts == {0: whole.choices[0].message.content}
    assert finish == {0: whole.choices[0].finish_reason}
    assert_usage(usage, prompt_tokens=whole.usage.prompt_tokens, completion_tokens=whole.usage.completion_tokens)
    assert all(c.usage is None for c in chunks[:-1])

    texts, finish, _, usage = collect_chat_stream(client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, max_tokens=5, n=2, temperature=1.0, stream=True,
        extra_body={"ignore_eos": True}))
    assert sorted(texts) == [0, 1] and finish == {0: "length", 1: "length"} and usage is None


def test_streamed_chat_logprobs(client) -> None:
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=4, logprobs=True,
                                                 top_logprobs=2, stream=True, extra_body={"ignore_eos": True},
                                                 **GREEDY))
    entries = [t for c in chunks for ch in c.choices if ch.logprobs and ch.logprobs.content
               for t in ch.logprobs.content]
    assert len(entries) == 4 and all(len(t.top_logprobs) == 2 for t in entries)


def test_sse_wire_format(server) -> None:
    resp = server.post("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                           "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status == 200, resp
    assert resp.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(resp.text)
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])

    chat = server.post("/v1/chat/completions", {"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 3,
                                                "temperature": 0, "stream": True})
    assert chat.status == 200, chat
    payloads = sse_payloads(chat.text)
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    first = json.loads(payloads[0])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"


# ---- metrics ---------------------------------------------------------------------------------------


def test_metrics_count_what_was_served(server, client) -> None:
    before = server.metrics()
    prompt_before = metric_value(before, "paxserve:prompt_tokens")
    gen_before = metric_value(before, "paxserve:generation_tokens")
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True},
                                    **GREEDY)
    resp = server.get("/metrics", auth=False)
    assert resp.status == 200 and resp.headers["content-type"].startswith("text/plain")
    after = server.metrics()
    assert metric_value(after, "paxserve:generation_tokens") - gen_before == 5
    assert metric_value(after, "paxserve:prompt_tokens") - prompt_before >= 1  # cached prefix tokens may not count
    assert out.usage.prompt_tokens >= 1
    assert metric_value(after, "paxserve:request_success", 'finished_reason="length"') >= 1
    for name in ("paxserve:num_requests_running", "paxserve:num_requests_waiting", "paxserve:kv_cache_usage_perc",
                 "paxserve:prefix_cache_queries", "paxserve:prefix_cache_hits", "paxserve:num_preemptions"):
        metric_value(after, name)
    names = {n for n, _, _ in after}
    for hist in ("paxserve:time_to_first_token_seconds", "paxserve:inter_token_latency_seconds",
                 "paxserve:e2e_request_latency_seconds"):
        assert f"{hist}_count" in names and f"{hist}_bucket" in names, hist
        assert sum(v for n, _, v in after if n == f"{hist}_count") >= 1, hist
    assert metric_value(after, "paxserve:num_requests_running") == 0


def test_vllms_metrics_are_served_under_vllms_names_with_the_same_values(server, client) -> None:
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=2, seed=1,
                              extra_body={"ignore_eos": True})
    samples = server.metrics()
    names = {n for n, _, _ in samples}
    for hist in ("iteration_tokens_total", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_params_n", "request_params_max_tokens",
                 "request_max_num_generation_tokens", "request_prefill_kv_computed_tokens", "request_num_preemptions",
                 "time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens"):
        for prefix in ("paxserve:", "vllm:"):
            assert f"{prefix}{hist}_count" in names and f"{prefix}{hist}_bucket" in names, prefix + hist
    def exact(name: str, labels: str = "") -> float:
        return sum(v for n, lb, v in samples if n == name and labels in lb)

    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total", "prefix_cache_hits_total", "request_success_total",
                 "request_params_n_sum", "iteration_tokens_total_count", "request_decode_time_seconds_count"):
        assert exact(f"vllm:{name}") == exact(f"paxserve:{name}"), name
    assert exact("vllm:num_requests_waiting_by_reason", 'reason="capacity"') == 0
    # The n=2 request above is counted with n above 1.
    assert exact("vllm:request_params_n_bucket", 'le="1.0"') < exact("vllm:request_params_n_count")
    assert exact("vllm:iteration_tokens_total_sum") >= exact("vllm:generation_tokens_total") > 0


def test_prefix_cache_metrics_count_a_repeated_prompt(server, client) -> None:
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 8  # several full blocks
    queries, hits = server.metric("paxserve:prefix_cache_queries"), server.metric("paxserve:prefix_cache_hits")
    for _ in range(2):
        client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=1, **GREEDY)
    assert server.metric("paxserve:prefix_cache_queries") > queries
    assert server.metric("paxserve:prefix_cache_hits") > hits
