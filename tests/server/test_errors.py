"""Errors over HTTP from a live server: the OpenAI envelope {"error": {message, type, param, code}}
with the right status for each kind (400, 401, 404, 405, 413), and the server still serving after
each. Every bad body field is covered in-process by test_request_validation.py."""

from __future__ import annotations

import openai
import pytest

from conftest import API_KEY, MAX_MODEL_LEN, MODEL_NAME, VOCAB_SIZE, assert_error

COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(autouse=True)
def still_serving(server):
    """After each bad request the engine loop is alive and a real request completes."""
    yield
    assert server.get("/health", auth=False).status == 200, server.stderr_tail()
    ok = server.post("/v1/completions", {**COMPLETION, "max_tokens": 1, "temperature": 0})
    assert ok.status == 200, (ok, server.stderr_tail())
    assert ok.json()["usage"]["completion_tokens"] == 1


# ---- 400 ---------------------------------------------------------------------------------------------
# Every bad field is checked in-process by test_request_validation.py; these few go over HTTP to show
# what the client receives: the status, the envelope, the field, and a server still serving.

@pytest.mark.parametrize("path,raw", [("/v1/completions", b'{"model": "x", "prompt": '),
                                      ("/v1/chat/completions", b"[1, 2]")], ids=["truncated", "array"])
def test_malformed_or_non_object_json_is_400(server, path: str, raw: bytes) -> None:
    assert_error(server.post(path, None, raw=raw), 400)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**COMPLETION, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, VOCAB_SIZE]}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "top_p": 0}, "top_p"),
], ids=["type", "token id", "role", "renamed field", "streamed"])
def test_a_bad_field_is_400_naming_it(server, path: str, body: dict, param: str) -> None:
    assert_error(server.post(path, body), 400, param=param)


def test_prompt_that_leaves_no_room_is_400_with_vllms_wording(server) -> None:
    err = assert_error(server.post("/v1/completions", {**COMPLETION, "prompt": [7] * MAX_MODEL_LEN}), 400,
                       param="prompt")
    assert f"This model's maximum context length is {MAX_MODEL_LEN} tokens" in err["message"], err


def test_the_official_client_sees_a_bad_request_error(client) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt="Hello", temperature=3.0)
    assert exc.value.status_code == 400 and exc.value.param == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                       stream=True, top_p=0)


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
