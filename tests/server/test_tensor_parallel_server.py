"""A real `paxserve serve --tensor-parallel-size 2` (on two of the four simulated CPU devices the
test process starts, see tests/conftest.py) driven by the openai client: streaming, n > 1, seeds,
every sampler feature and logprobs give what the single-device engine gives for the same requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import start_server
from paxserve import Engine, SamplingParams
from tests.helpers import make_tiny_llama
from tests.paxserve.tiny_checkpoints import MODEL_VOCAB, save_byte_tokenizer

MESSAGES = [{"role": "user", "content": "Name three colours"}]
ENGINE_ARGS = dict(max_model_len=128, kv_cache_memory_bytes=32 * 2**20, warmup=False, log_stats_interval=0,
                   compilation_cache_dir="")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-tp-server")
    make_tiny_llama(directory, seed=5, vocab_size=MODEL_VOCAB, num_key_value_heads=2, max_position_embeddings=256)
    return save_byte_tokenizer(directory)


def test_serve_tensor_parallel_2_streams_seeded_n_2_as_one_device_would(model_dir: Path) -> None:
    single = Engine(str(model_dir), **ENGINE_ARGS)
    # Every sampler feature at once, on the gathered full-vocabulary logits every device samples alike.
    sampled = SamplingParams(n=2, seed=5, temperature=1.0, top_p=0.95, top_k=100, min_p=0.01, repetition_penalty=1.2,
                             presence_penalty=0.3, frequency_penalty=0.1, logit_bias={65: 3.0}, max_tokens=8,
                             ignore_eos=True)
    want_chat = [s.text for s in single.chat(MESSAGES, sampled, use_tqdm=False)[0].outputs]
    greedy = single.generate("The sky is", SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert want_chat[0] != want_chat[1]  # the two samples are independent draws

    srv = start_server(["--model", str(model_dir), "--tensor-parallel-size", "2", "--max-model-len", "128",
                        "--no-warmup", "--kv-cache-memory-bytes", "32MiB"])
    try:
        log = srv.stderr_text()
        assert "tensor parallel over 2 devices" in log and "on each of 2 devices" in log, log
        client = srv.client()
        request = dict(model=str(model_dir), messages=MESSAGES, n=2, seed=5, temperature=1.0, top_p=0.95,
                       presence_penalty=0.3, frequency_penalty=0.1, logit_bias={"65": 3.0}, max_tokens=8,
                       extra_body={"ignore_eos": True, "top_k": 100, "min_p": 0.01, "repetition_penalty": 1.2})
        streamed = ["", ""]
        finish = [None, None]
        for chunk in client.chat.completions.create(**request, stream=True):
            for choice in chunk.choices:
                streamed[choice.index] += choice.delta.content or ""
                finish[choice.index] = choice.finish_reason or finish[choice.index]
        assert streamed == want_chat and finish == ["length", "length"]
        whole = client.chat.completions.create(**request)
        assert [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)] == want_chat

        out = client.completions.create(model=str(model_dir), prompt="The sky is", max_tokens=8, temperature=0.0,
                                        logprobs=2, extra_body={"ignore_eos": True})
        assert out.choices[0].text == greedy.text
        got = out.choices[0].logprobs.token_logprobs
        want = [lp[t].logprob for lp, t in zip(greedy.logprobs, greedy.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
        assert srv.get("/health").status == 200
    finally:
        assert srv.stop() == 0
