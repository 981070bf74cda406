"""Every error a client can provoke: the OpenAI envelope {"error": {message, type, param, code}} with
the right status, and the server still serving afterwards."""

from __future__ import annotations

import openai
import pytest

from conftest import API_KEY, MAX_LOGPROBS, MAX_MODEL_LEN, MODEL_NAME, VOCAB_SIZE, assert_error

COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def assert_names(err: dict, field: str | tuple[str, ...]) -> None:
    """The message (or param) names the offending field, so the client can fix it."""
    names = (field,) if isinstance(field, str) else field
    assert any(n in err["message"] or err["param"] == n for n in names), err


@pytest.fixture(autouse=True)
def still_serving(server):
    """After each bad request the engine loop is alive and a real request completes."""
    yield
    assert server.get("/health", auth=False).status == 200, server.stderr_tail()
    ok = server.post("/v1/completions", {**COMPLETION, "max_tokens": 1, "temperature": 0})
    assert ok.status == 200, (ok, server.stderr_tail())
    assert ok.json()["usage"]["completion_tokens"] == 1


# ---- 400: the body itself --------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw", [b'{"model": "x", "prompt": ', b"not json at all", b"", b"[1, 2]", b'"a string"',
                                 b"42", b"null"], ids=["truncated", "text", "empty", "array", "string", "number",
                                                       "null"])
def test_malformed_or_non_object_json_is_400(server, path: str, raw: bytes) -> None:
    assert_error(server.post(path, None, raw=raw), 400)


# ---- 400: completions fields -----------------------------------------------------------------------

BAD_COMPLETIONS = {
    "missing prompt": ({"prompt": None}, "prompt"),
    "empty prompt": ({"prompt": ""}, "prompt"),
    "empty token list": ({"prompt": []}, "prompt"),
    "empty inner token list": ({"prompt": [[]]}, "prompt"),
    "prompt of wrong type": ({"prompt": 5}, "prompt"),
    "temperature below 0": ({"temperature": -0.5}, "temperature"),
    "temperature above 2": ({"temperature": 2.5}, "temperature"),
    "temperature not a number": ({"temperature": "hot"}, "temperature"),
    "top_p 0": ({"top_p": 0}, "top_p"),
    "top_p above 1": ({"top_p": 1.5}, "top_p"),
    "top_k below -1": ({"top_k": -5}, "top_k"),
    "min_p above 1": ({"min_p": 1.5}, "min_p"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ({"max_tokens": -3}, "max_tokens"),
    "n 0": ({"n": 0}, "n"),
    "logprobs above max": ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    "presence_penalty above 2": ({"presence_penalty": 2.5}, "presence_penalty"),
    "frequency_penalty below -2": ({"frequency_penalty": -2.5}, "frequency_penalty"),
    "repetition_penalty 0": ({"repetition_penalty": 0}, "repetition_penalty"),
    "negative token id": ({"prompt": [1, -1, 2]}, "prompt"),
    "token id at vocab size": ({"prompt": [1, VOCAB_SIZE]}, "prompt"),
    "token id beyond vocab in a batch": ({"prompt": [[1, 2], [3, VOCAB_SIZE + 100]]}, "prompt"),
    "stop_token_ids beyond vocab": ({"stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids"),
    "logit_bias key beyond vocab": ({"logit_bias": {str(VOCAB_SIZE): 1}}, "logit_bias"),
    "logit_bias value out of range": ({"logit_bias": {"5": 500}}, "logit_bias"),
    "stream_options without stream": ({"stream_options": {"include_usage": True}}, "stream_options"),
    "stream_options with stream false": ({"stream": False, "stream_options": {"include_usage": True}},
                                         "stream_options"),
    "invalid values with stream true": ({"stream": True, "temperature": 9}, "temperature"),
}


@pytest.mark.parametrize("change,field", BAD_COMPLETIONS.values(), ids=BAD_COMPLETIONS.keys())
def test_bad_completion_fields_are_400(server, change: dict, field: str) -> None:
    body = {**COMPLETION, **change}
    body = {k: v for k, v in body.items() if v is not None}
    err = assert_error(server.post("/v1/completions", body), 400)
    assert_names(err, field)


@pytest.mark.parametrize("path,base,change", [
    ("/v1/completions", COMPLETION, {"prompt": [5, -1]}),
    ("/v1/completions", COMPLETION, {"stop_token_ids": [-1]}),
    ("/v1/chat/completions", CHAT, {"stop_token_ids": [-1]}),
    ("/v1/chat/completions", CHAT, {"stop_token_ids": [VOCAB_SIZE]}),
], ids=["completion prompt", "completion stop_token_ids", "chat stop_token_ids", "chat stop_token_ids too big"])
def test_token_id_errors_state_a_real_vocabulary_range(server, path: str, base: dict, change: dict) -> None:
    err = assert_error(server.post(path, {**base, **change}), 400)
    assert "None" not in err["message"] and str(VOCAB_SIZE) in err["message"], err


def test_prompt_that_leaves_no_room_is_400_with_vllms_wording(server) -> None:
    for prompt in ([7] * MAX_MODEL_LEN, [7] * (MAX_MODEL_LEN + 50), "hello " * (MAX_MODEL_LEN + 10)):
        err = assert_error(server.post("/v1/completions", {**COMPLETION, "prompt": prompt}), 400)
        assert f"This model's maximum context length is {MAX_MODEL_LEN} tokens" in err["message"], err
    chat = {**CHAT, "messages": [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]}
    err = assert_error(server.post("/v1/chat/completions", chat), 400)
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"], err


def test_the_official_client_sees_a_bad_request_error(client) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt="Hello", temperature=3.0)
    assert exc.value.status_code == 400 and "temperature" in exc.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                       stream=True, top_p=0)


# ---- 400: chat fields ------------------------------------------------------------------------------

BAD_CHATS = {
    "missing messages": ({"messages": None}, "messages"),
    "empty messages": ({"messages": []}, "messages"),
    "messages not a list": ({"messages": "Hi"}, "messages"),
    "message not an object": ({"messages": [1]}, "messages"),
    "temperature above 2": ({"temperature": 3}, "temperature"),
    "top_p above 1": ({"top_p": 2}, "top_p"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "max_completion_tokens 0": ({"max_completion_tokens": 0}, ("max_completion_tokens", "max_tokens")),
    "n 0": ({"n": 0}, "n"),
    "top_logprobs above max": ({"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    "presence_penalty below -2": ({"presence_penalty": -3}, "presence_penalty"),
    "stop_token_ids negative": ({"stop_token_ids": [-1]}, "stop_token_ids"),
    "stream_options without stream": ({"stream_options": {"include_usage": True}}, "stream_options"),
}


@pytest.mark.parametrize("change,field", BAD_CHATS.values(), ids=BAD_CHATS.keys())
def test_bad_chat_fields_are_400(server, change: dict, field: str) -> None:
    body = {**CHAT, **change}
    body = {k: v for k, v in body.items() if v is not None}
    err = assert_error(server.post("/v1/chat/completions", body), 400)
    assert_names(err, field)


# ---- 400: valid OpenAI features paxserve does not implement ----------------------------------------

@pytest.mark.parametrize("path,change,names", [
    ("/v1/completions", {"suffix": " and that is all."}, ("suffix",)),
    ("/v1/chat/completions", {"messages": [{"role": "function", "name": "f", "content": "1"}]}, ("function",)),
], ids=["suffix", "deprecated function role"])
def test_unimplemented_openai_features_are_a_clear_400(server, path: str, change: dict, names: tuple) -> None:
    base = CHAT if "chat" in path else COMPLETION
    err = assert_error(server.post(path, {**base, **change}), 400)
    assert any(n in err["message"] for n in names), err


# ---- 404, 405, 413 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_unknown_model_is_404_with_param_model(server, client, path: str, body: dict) -> None:
    assert_error(server.post(path, {**body, "model": "no-such-model"}), 404, param="model")


def test_unknown_model_through_the_official_client(client) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="gpt-nope", prompt="Hi", max_tokens=1)
    assert exc.value.status_code == 404 and exc.value.param == "model"


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/v1/nope", 404), ("POST", "/v1/engines/x/completions", 404), ("GET", "/nowhere", 404),
    ("GET", "/v1/completions", 405), ("GET", "/v1/chat/completions", 405), ("POST", "/v1/models", 405),
    ("DELETE", "/v1/completions", 405),
])
def test_unknown_paths_and_wrong_methods_use_the_envelope(server, method: str, path: str, status: int) -> None:
    body = COMPLETION if method == "POST" else None
    assert_error(server.request(method, path, body), status)


def test_body_over_the_limit_is_413(server) -> None:
    huge = b'{"model": "%s", "prompt": "' % MODEL_NAME.encode() + b"a" * (32 * 2**20) + b'"}'
    assert_error(server.post("/v1/completions", None, raw=huge), 413)


# ---- 401 -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,path,body", [("GET", "/v1/models", None), ("POST", "/v1/completions", COMPLETION),
                                              ("POST", "/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("header", [None, "Bearer wrong-key", f"Bearer {API_KEY}x"],
                         ids=["no key", "wrong key", "key with a suffix"])
def test_v1_needs_the_api_key(server, method: str, path: str, body: dict | None, header: str | None) -> None:
    headers = {"Authorization": header} if header else {}
    assert_error(server.request(method, path, body, headers=headers, auth=False), 401)


def test_the_right_key_passes_and_health_and_metrics_stay_open(server) -> None:
    assert server.get("/v1/models").status == 200
    assert server.get("/health", auth=False).status == 200
    assert server.get("/metrics", auth=False).status == 200


def test_the_official_client_with_a_wrong_key_gets_401(server) -> None:
    with pytest.raises(openai.AuthenticationError) as exc:
        server.client(api_key="sk-wrong").completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1)
    assert exc.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="sk-wrong").models.list()
