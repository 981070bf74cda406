"""Every bad request body a client can send, checked in-process (milliseconds each) through what the
server runs for it: the pydantic body (server/protocol.py), the spec (generation_spec.py) and the
one input-processor call (prompts.py) with the real SmolLM2 tokenizer and the shared server's
limits. The error is what the client would get: the status, the OpenAI envelope and the field it
names. test_errors.py sends a few of these over HTTP to a live server."""

from __future__ import annotations

import json

import pytest

from conftest import MAX_LOGPROBS, MAX_MODEL_LEN, MODEL_NAME, VOCAB_SIZE
from paxserve.engine.input_processor import InputProcessor
from paxserve.server.errors import ProtocolError
from paxserve.server.generation_spec import GenerationSpec, parse_chat_request, parse_completion_request
from paxserve.server.prompts import PromptInput, process_prompts
from paxserve.server.protocol import parse_json_body
from paxserve.server.settings import ServerSettings

COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
SETTINGS = ServerSettings(served_model_names=[MODEL_NAME], max_logprobs=MAX_LOGPROBS, max_model_len=MAX_MODEL_LEN,
                          vocab_size=VOCAB_SIZE, enable_auto_tool_choice=True, tool_call_parser="hermes")


@pytest.fixture(scope="module")
def inputs(smollm2_tokenizer) -> InputProcessor:
    return InputProcessor(smollm2_tokenizer, VOCAB_SIZE, (smollm2_tokenizer.eos_token_id,), MAX_MODEL_LEN, seed=0)


def serve(inputs: InputProcessor, path: str, body: dict) -> tuple[GenerationSpec, list[PromptInput]]:
    """What the server does with a JSON body before the engine sees it."""
    body = json.loads(json.dumps(body))  # as it arrives: JSON types only
    parse = parse_chat_request if path.endswith("chat/completions") else parse_completion_request
    spec = parse(body, SETTINGS)
    return spec, process_prompts(inputs, spec, None, "cmpl-test", 0.0)


def refused(inputs: InputProcessor, path: str, body: dict, status: int = 400) -> dict:
    """The error envelope's inner object for a body the server must refuse with `status`."""
    with pytest.raises(ProtocolError) as exc:
        serve(inputs, path, body)
    err = exc.value
    assert err.status == status, err
    envelope = err.envelope()
    assert set(envelope) == {"error"} and set(envelope["error"]) == {"message", "type", "param", "code"}, envelope
    assert envelope["error"]["message"].strip() and envelope["error"]["code"] == status, envelope
    return envelope["error"]


# ---- the body itself -------------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [b'{"model": "x", "prompt": ', b"not json at all", b"", b"  ", b"[1, 2]",
                                 b'"a string"', b"42", b"null", b'{"prompt": NaN}', b'{"prompt": Infinity}'],
                         ids=["truncated", "text", "empty", "blank", "array", "string", "number", "null", "NaN",
                              "Infinity"])
def test_malformed_or_non_object_json_is_400(raw: bytes) -> None:
    with pytest.raises(ProtocolError) as exc:
        parse_json_body(raw)
    assert exc.value.status == 400 and exc.value.message


# ---- completions fields ----------------------------------------------------------------------------

BAD_COMPLETIONS = {
    "missing prompt": ({"prompt": None}, "prompt"),
    "empty prompt": ({"prompt": ""}, "prompt"),
    "empty token list": ({"prompt": []}, "prompt"),
    "empty inner token list": ({"prompt": [[]]}, "prompt"),
    "prompt of wrong type": ({"prompt": 5}, "prompt"),
    "prompt mixing text and ids": ({"prompt": [1, "a"]}, "prompt"),
    "token id that is a bool": ({"prompt": [1, True]}, "prompt"),
    "temperature below 0": ({"temperature": -0.5}, "temperature"),
    "temperature above 2": ({"temperature": 2.5}, "temperature"),
    "temperature not a number": ({"temperature": "hot"}, "temperature"),
    "temperature a bool": ({"temperature": True}, "temperature"),
    "top_p 0": ({"top_p": 0}, "top_p"),
    "top_p above 1": ({"top_p": 1.5}, "top_p"),
    "top_k below -1": ({"top_k": -5}, "top_k"),
    "top_k fractional": ({"top_k": 2.5}, "top_k"),
    "min_p above 1": ({"min_p": 1.5}, "min_p"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ({"max_tokens": -3}, "max_tokens"),
    "max_tokens a string": ({"max_tokens": "5"}, "max_tokens"),
    "max_tokens past the context": ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    "max_completion_tokens past the context": ({"max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
    "min_tokens above max_tokens": ({"min_tokens": 5}, "min_tokens"),
    "n 0": ({"n": 0}, "n"),
    "n above 128": ({"n": 129}, "n"),
    "best_of other than n": ({"best_of": 3}, "best_of"),
    "seed beyond a signed 64-bit integer": ({"seed": 2**63}, "seed"),
    "logprobs above max": ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    "logprobs negative": ({"logprobs": -1}, "logprobs"),
    "prompt_logprobs above max": ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
    "presence_penalty above 2": ({"presence_penalty": 2.5}, "presence_penalty"),
    "frequency_penalty below -2": ({"frequency_penalty": -2.5}, "frequency_penalty"),
    "repetition_penalty 0": ({"repetition_penalty": 0}, "repetition_penalty"),
    "negative token id": ({"prompt": [1, -1, 2]}, "prompt"),
    "token id at vocab size": ({"prompt": [1, VOCAB_SIZE]}, "prompt"),
    "token id beyond vocab in a batch": ({"prompt": [[1, 2], [3, VOCAB_SIZE + 100]]}, "prompt"),
    "stop_token_ids beyond vocab": ({"stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids"),
    "stop of wrong type": ({"stop": [1]}, "stop"),
    "stop string empty": ({"stop": [""]}, "stop"),
    "stop string too long": ({"stop": "x" * 1025}, "stop"),
    "logit_bias key not a token id": ({"logit_bias": {"a": 1}}, "logit_bias"),
    "logit_bias key beyond vocab": ({"logit_bias": {str(VOCAB_SIZE): 1}}, "logit_bias"),
    "logit_bias value out of range": ({"logit_bias": {"5": 500}}, "logit_bias"),
    "stream not a bool": ({"stream": "yes"}, "stream"),
    "stream_options without stream": ({"stream_options": {"include_usage": True}}, "stream_options"),
    "stream_options with stream false": ({"stream": False, "stream_options": {"include_usage": True}},
                                         "stream_options"),
    "invalid values with stream true": ({"stream": True, "temperature": 9}, "temperature"),
    "empty cache_salt": ({"cache_salt": ""}, "cache_salt"),
    "priority without --scheduling-policy priority": ({"priority": 3}, "priority"),
    "priority not an integer": ({"priority": 1.5}, "priority"),
    "allowed_token_ids empty": ({"allowed_token_ids": []}, "allowed_token_ids"),
    "allowed_token_ids beyond vocab": ({"allowed_token_ids": [5, VOCAB_SIZE]}, "allowed_token_ids"),
    "a bad JSON schema": ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
                          "response_format"),
    "two output constraints": ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
}


@pytest.mark.parametrize("change,field", BAD_COMPLETIONS.values(), ids=BAD_COMPLETIONS.keys())
def test_bad_completion_fields_are_400_naming_the_field(inputs, change: dict, field: str) -> None:
    body = {k: v for k, v in {**COMPLETION, **change}.items() if v is not None}
    assert refused(inputs, "/v1/completions", body)["param"] == field


@pytest.mark.parametrize("path,base,change", [
    ("/v1/completions", COMPLETION, {"prompt": [5, -1]}),
    ("/v1/completions", COMPLETION, {"stop_token_ids": [-1]}),
    ("/v1/chat/completions", CHAT, {"stop_token_ids": [-1]}),
    ("/v1/chat/completions", CHAT, {"stop_token_ids": [VOCAB_SIZE]}),
    ("/v1/chat/completions", CHAT, {"logit_bias": {"-3": 1}}),
], ids=["completion prompt", "completion stop_token_ids", "chat stop_token_ids", "chat stop_token_ids too big",
        "chat logit_bias negative"])
def test_token_id_errors_state_the_vocabulary_range(inputs, path: str, base: dict, change: dict) -> None:
    err = refused(inputs, path, {**base, **change})
    assert "None" not in err["message"] and f"[0, {VOCAB_SIZE})" in err["message"], err


def test_prompt_that_leaves_no_room_is_400_with_vllms_wording(inputs) -> None:
    for prompt in ([7] * MAX_MODEL_LEN, [7] * (MAX_MODEL_LEN + 50), "hello " * (MAX_MODEL_LEN + 10)):
        err = refused(inputs, "/v1/completions", {**COMPLETION, "prompt": prompt})
        assert f"This model's maximum context length is {MAX_MODEL_LEN} tokens" in err["message"], err
        assert err["param"] == "prompt"
    chat = {**CHAT, "messages": [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]}
    err = refused(inputs, "/v1/chat/completions", chat)
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"] and err["param"] == "messages", err


# ---- chat fields -----------------------------------------------------------------------------------

BAD_CHATS = {
    "missing messages": ({"messages": None}, "messages"),
    "empty messages": ({"messages": []}, "messages"),
    "messages not a list": ({"messages": "Hi"}, "messages"),
    "message not an object": ({"messages": [1]}, "messages"),
    "empty role": ({"messages": [{"role": "", "content": "x"}]}, "messages"),
    "a user message without content": ({"messages": [{"role": "user"}]}, "messages"),
    "a content part that is not text": ({"messages": [{"role": "user", "content": [{"type": "nope"}]}]}, "messages"),
    "an image content part": ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages"),
    "tool_call_id not a string": ({"messages": [{"role": "tool", "content": "1", "tool_call_id": 5}]}, "messages"),
    "assistant tool_calls without a name": ({"messages": [{"role": "user", "content": "Hi"}, {
        "role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]}, "messages"),
    "temperature above 2": ({"temperature": 3}, "temperature"),
    "top_p above 1": ({"top_p": 2}, "top_p"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "max_completion_tokens 0": ({"max_completion_tokens": 0}, "max_completion_tokens"),
    "n 0": ({"n": 0}, "n"),
    "logprobs not a bool": ({"logprobs": 3}, "logprobs"),
    "top_logprobs without logprobs": ({"top_logprobs": 2}, "top_logprobs"),
    "top_logprobs above max": ({"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    "presence_penalty below -2": ({"presence_penalty": -3}, "presence_penalty"),
    "stop_token_ids negative": ({"stop_token_ids": [-1]}, "stop_token_ids"),
    "stream_options without stream": ({"stream_options": {"include_usage": True}}, "stream_options"),
    "continue_final_message with add_generation_prompt": ({"continue_final_message": True}, "continue_final_message"),
    "a request chat template, untrusted": ({"chat_template": "{{ messages }}"}, "chat_template"),
    "tools not a list": ({"tools": {"type": "function"}}, "tools"),
    "tool_choice naming no tool": ({"tools": [{"type": "function", "function": {"name": "f"}}],
                                    "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    "forced tool with response_format": ({"tools": [{"type": "function", "function": {"name": "f"}}],
                                          "tool_choice": "required", "response_format": {"type": "json_object"}},
                                         "response_format"),
}


@pytest.mark.parametrize("change,field", BAD_CHATS.values(), ids=BAD_CHATS.keys())
def test_bad_chat_fields_are_400_naming_the_field(inputs, change: dict, field: str) -> None:
    body = {k: v for k, v in {**CHAT, **change}.items() if v is not None}
    assert refused(inputs, "/v1/chat/completions", body)["param"] == field


# ---- what paxserve does not implement, and models it does not serve --------------------------------

@pytest.mark.parametrize("path,change,field", [
    ("/v1/completions", {"suffix": " and that is all."}, "suffix"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"logits_processors": ["x"]}, "logits_processors"),
    ("/v1/completions", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("/v1/chat/completions", {"messages": [{"role": "function", "name": "f", "content": "1"}]}, "messages"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
], ids=["suffix", "beam search", "logits processors", "another guided backend", "deprecated function role",
        "functions", "audio output", "chat echo"])
def test_unimplemented_features_are_a_400_that_names_them(inputs, path: str, change: dict, field: str) -> None:
    base = CHAT if "chat" in path else COMPLETION
    err = refused(inputs, path, {**base, **change})
    assert err["param"] == field and ("not supported" in err["message"] or "not available" in err["message"]), err


@pytest.mark.parametrize("path,base", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_unknown_model_is_404_with_param_model(inputs, path: str, base: dict) -> None:
    err = refused(inputs, path, {**base, "model": "no-such-model"}, status=404)
    assert err["param"] == "model" and err["type"] == "NotFoundError", err


# ---- and what passes ---------------------------------------------------------------------------------

def test_a_valid_body_becomes_checked_engine_requests(inputs) -> None:
    spec, prompts = serve(inputs, "/v1/completions", {**COMPLETION, "prompt": ["Hello", "Bye"], "n": 2, "seed": 3,
                                                      "max_tokens": 4.0, "stop": "x", "logit_bias": {"5": -100}})
    assert spec.num_seqs == 4 and spec.params.max_tokens == 4 and spec.params.logit_bias == {5: -100.0}
    assert [p.request.request_id for p in prompts] == ["cmpl-test-0", "cmpl-test-1"]
    assert prompts[0].token_ids == inputs.tokenizer.encode("Hello") and prompts[0].request.max_tokens == 4
    spec, prompts = serve(inputs, "/v1/chat/completions", {**CHAT, "max_tokens": None})
    assert prompts[0].request.max_tokens == MAX_MODEL_LEN - len(prompts[0].token_ids)  # the room left
    with pytest.raises(Exception):  # frozen: nothing downstream can change a checked request's settings
        spec.params.temperature = 5.0  # type: ignore[misc]


# ---- vLLM's API to the letter -----------------------------------------------------------------------

@pytest.mark.parametrize("path,change,mentions", [
    ("/v1/completions", {"logit_bias": {"abc": 1, "7": 2}}, "Found token_id(s) ['abc'] in logit_bias"),
    ("/v1/completions", {"logit_bias": {str(VOCAB_SIZE): 1}},
     f"token_id(s) [{VOCAB_SIZE}] in logit_bias contain out-of-vocab token ids. Vocabulary size: {VOCAB_SIZE}"),
    ("/v1/chat/completions", {"allowed_token_ids": [VOCAB_SIZE + 1]}, "allowed_token_ids contain out-of-vocab"),
    ("/v1/chat/completions", {"logprobs": True, "logprob_token_ids": [VOCAB_SIZE]},
     "logprob_token_ids contain out-of-vocab"),
    ("/v1/chat/completions", {"logprob_token_ids": [5]}, "needs `logprobs: true`"),
    ("/v1/completions", {"logprob_token_ids": list(range(MAX_LOGPROBS + 1))}, "greater than max allowed"),
    ("/v1/completions", {"prompt": [5, VOCAB_SIZE + 3]}, f"Token id {VOCAB_SIZE + 3} is out of vocabulary"),
    ("/v1/completions", {"seed": 2**63}, "less than or equal to 9223372036854775807"),
    ("/v1/chat/completions", {"seed": -2**63 - 1}, "greater than or equal to -9223372036854775808"),
], ids=["logit_bias key not an integer", "logit_bias beyond vocab", "allowed_token_ids beyond vocab",
        "logprob_token_ids beyond vocab", "logprob_token_ids without logprobs", "too many logprob_token_ids",
        "prompt token beyond vocab", "seed too big", "seed too small"])
def test_error_texts_clients_match_are_vllms(inputs, path: str, change: dict, mentions: str) -> None:
    base = CHAT if "chat" in path else COMPLETION
    assert mentions in refused(inputs, path, {**base, **change})["message"]


@pytest.mark.parametrize("path,field", [("/v1/completions", "max_token"), ("/v1/chat/completions", "temprature"),
                                        ("/v1/chat/completions", "some_future_field")])
def test_an_unknown_field_is_a_400_naming_it_never_ignored(inputs, path: str, field: str) -> None:
    base = CHAT if "chat" in path else COMPLETION
    err = refused(inputs, path, {**base, field: 1})
    assert err["param"] == field and "Unknown field" in err["message"], err


@pytest.mark.parametrize("field,value", [("bad_words", ["x"]), ("request_id", "r1"),
                                         ("truncate_prompt_tokens", 5), ("length_penalty", 0.5), ("store", True),
                                         ("verbosity", "low"), ("documents", [{"text": "x"}])])
def test_known_fields_paxserve_cannot_honour_say_so(inputs, field: str, value) -> None:
    err = refused(inputs, "/v1/chat/completions", {**CHAT, field: value})
    assert err["param"] == field and "not supported" in err["message"], err


def test_tracking_fields_and_vllms_chat_switches_are_accepted_and_act(inputs) -> None:
    spec, prompts = serve(inputs, "/v1/chat/completions", {
        **CHAT, "user": "u1", "metadata": {"k": "v"}, "safety_identifier": "s", "prompt_cache_key": "p",
        "service_tier": "auto", "store": False, "reasoning_effort": "low", "include_reasoning": False,
        "add_special_tokens": True, "return_tokens_as_token_ids": True})
    assert spec.chat_template_kwargs == {"reasoning_effort": "low"} and spec.tokens_as_ids
    assert spec.add_special_tokens and spec.output.include_reasoning is False
    plain, _ = serve(inputs, "/v1/chat/completions", CHAT)
    assert not plain.add_special_tokens and not plain.tokens_as_ids


def test_include_reasoning_false_splits_the_thinking_off_and_drops_it() -> None:
    from paxserve.server.parsers.reasoning import get_reasoning_parser
    from paxserve.server.tools import ChatOutputParsers

    text = "<think>secret plan</think>The answer."
    kept, dropped = (ChatOutputParsers(get_reasoning_parser("qwen3"), None, flag) for flag in (True, False))
    assert kept.message(text)["reasoning"] == "secret plan" and kept.message(text)["content"] == "The answer."
    assert "reasoning" not in dropped.message(text) and dropped.message(text)["content"] == "The answer."
    stream = dropped.stream()
    deltas = [stream.feed(part) for part in ("<think>secret", " plan</think>The", " answer.")] + \
        [stream.feed("", final=True)]
    assert all("reasoning" not in d for d in deltas) and "".join(d.get("content", "") for d in deltas) == "The answer."


def test_the_whole_vocabulary_of_logprobs_as_vllm_takes_it(inputs) -> None:
    from dataclasses import replace

    from paxserve.server.cli import build_parser
    from paxserve.server.generation_spec import parse_chat_request, parse_completion_request
    from paxserve.server.responses import chat_logprobs
    from paxserve.outputs import Logprob

    # A cap of 8: -1 (every token) is more than that, and the error says so.
    err = refused(inputs, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1})
    assert "the whole vocabulary" in err["message"] and err["param"] == "top_logprobs", err
    # vLLM's --max-logprobs -1 (or a vocabulary-sized cap) lets it through to the engine.
    for cap in ("-1", str(VOCAB_SIZE)):
        assert build_parser().parse_args(["serve", "--max-logprobs", cap]).max_logprobs == int(cap)
        settings = replace(SETTINGS, max_logprobs=int(cap))
        assert parse_chat_request({**CHAT, "logprobs": True, "top_logprobs": -1}, settings).params.logprobs == -1
        assert parse_completion_request({**COMPLETION, "logprobs": 50}, settings).params.logprobs == 50
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-logprobs", "-2"])
    entry = {5: Logprob(-0.1, 1, "a"), 9: Logprob(-3.0, 2, "b"), 2: Logprob(-4.0, 3, "c")}
    assert len(chat_logprobs([entry], [5], -1)["content"][0]["top_logprobs"]) == 3  # -1: all of them
    with pytest.raises(ProtocolError, match="not supported"):  # prompt tokens: the top 20 at most
        parse_completion_request({**COMPLETION, "prompt_logprobs": -1}, replace(SETTINGS, max_logprobs=-1))
