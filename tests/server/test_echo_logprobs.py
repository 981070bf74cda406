"""Completions `echo` with `logprobs` (the prompt's own tokens scored, as OpenAI returns them and
lm-evaluation-harness' loglikelihood tasks read them) and vLLM's `prompt_logprobs`, checked against
transformers' log-softmax on the same bundled model."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest

from conftest import MODEL_NAME, sse_payloads

PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def reference(hf_smollm2, server) -> tuple[list[int], np.ndarray]:
    """The prompt's token ids (the server's tokenizer) and transformers' log-probability of each
    token given the ones before it."""
    import torch

    ids = server.post("/tokenize", {"model": MODEL_NAME, "prompt": PROMPT}).json()["tokens"]
    model, _ = hf_smollm2
    with torch.no_grad():
        logits = model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return ids, np.array([float(logprobs[j - 1, ids[j]]) for j in range(1, len(ids))])


def test_lm_eval_loglikelihood_request_gets_the_prompts_logprobs(client: openai.OpenAI, reference) -> None:
    ids, expected = reference
    # lm-evaluation-harness' local-completions loglikelihood payload, as it sends it.
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1,
                                    temperature=0, seed=1234)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], expected, atol=2e-3)
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(lp.tokens))]
    # lm-eval's greedy check compares each token with its top-1 alternative: the greedy answer's token is it.
    top = lp.top_logprobs[-1]
    assert max(top, key=top.get) == lp.tokens[-1]


def test_streamed_echo_starts_with_the_prompts_tokens(server, reference) -> None:
    ids, expected = reference
    body = {"model": MODEL_NAME, "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0,
            "stream": True}
    resp = server.post("/v1/completions", body)
    assert resp.status == 200, resp
    chunks = [json.loads(p)["choices"] for p in sse_payloads(resp.text) if p != "[DONE]"]
    first = chunks[0][0]
    assert first["text"].startswith(PROMPT)
    assert first["logprobs"]["token_logprobs"][0] is None
    np.testing.assert_allclose(first["logprobs"]["token_logprobs"][1:len(ids)], expected, atol=2e-3)
    text = "".join(c[0]["text"] for c in chunks if c)
    tokens = sum(len(c[0]["logprobs"]["tokens"]) for c in chunks if c and c[0]["logprobs"])
    assert text.startswith(PROMPT) and tokens == len(ids) + 3


def test_vllm_prompt_logprobs_field(server, reference) -> None:
    ids, expected = reference
    body = {"model": MODEL_NAME, "prompt": PROMPT, "prompt_logprobs": 2, "max_completion_tokens": 2, "temperature": 0}
    resp = server.post("/v1/completions", body)
    assert resp.status == 200, resp
    assert resp.json()["usage"]["completion_tokens"] <= 2  # the newer name works on completions too
    entries = resp.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    got = [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], entries[1:])]
    np.testing.assert_allclose(got, expected, atol=2e-3)
    assert all(sum(1 for v in e.values() if v["rank"] is not None and v["rank"] <= 2) >= 2 for e in entries[1:])
    chat = server.post("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
                                                "prompt_logprobs": 0, "max_completion_tokens": 2})
    assert chat.status == 200, chat
    assert chat.json()["prompt_logprobs"][0] is None and len(chat.json()["prompt_logprobs"]) > 5
    assert chat.json()["usage"]["completion_tokens"] <= 2
