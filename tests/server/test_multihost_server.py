"""`paxserve serve` over two processes on this machine (2 simulated CPU devices each, loopback, gloo):
node rank 0 serves the API and schedules, node rank 1 runs headless. Driven by the openai client, it
answers what transformers gives; killing the worker mid-request ends the request with an error, new
requests get 503 and rank 0 exits with status 1 on its own."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from conftest import ServerProcess, free_port, paxserve_command
from transformers import AutoTokenizer
from tests.helpers import make_tiny_llama
from tests.paxserve.tiny_checkpoints import MODEL_VOCAB, save_byte_tokenizer

ENGINE_FLAGS = ["--tensor-parallel-size", "4", "--max-model-len", "256", "--block-size", "32", "--no-warmup",
                "--kv-cache-memory-bytes", "32MiB", "--no-compile-in-background", "--distributed-init-timeout", "60",
                "--distributed-heartbeat-timeout", "5"]
PROMPT = "The sky is"


def _two_device_env() -> dict[str, str]:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    return {"XLA_FLAGS": " ".join([*flags, "--xla_force_host_platform_device_count=2"])}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    directory = tmp_path_factory.mktemp("tiny-multihost-server")
    hf = make_tiny_llama(directory, seed=6, vocab_size=MODEL_VOCAB, num_key_value_heads=2, max_position_embeddings=512)
    return hf, save_byte_tokenizer(directory)


def test_two_hosts_serve_transformers_answer_and_a_killed_worker_ends_in_503s_and_exit(
        model_dir: tuple[Any, Path]) -> None:
    hf, directory = model_dir
    # transformers' greedy tokens (no engine compile in this process: the two ranks need the cores).
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = tokenizer.decode(ref[0, len(ids):].tolist())
    port = free_port()
    hosts = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env = {**os.environ, **_two_device_env()}
    worker = subprocess.Popen([*paxserve_command(), "serve", "--model", str(directory), *ENGINE_FLAGS, *hosts,
                               "--node-rank", "1", "--headless"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, errors="replace", env=env)
    srv = ServerProcess(["--model", str(directory), *ENGINE_FLAGS, *hosts, "--node-rank", "0"], env=_two_device_env())
    try:
        srv.start()
        log = srv.stderr_text()
        assert "node rank 1 joined" in log and "node rank 0 of 2; KV cache of" in log, log
        assert "tensor parallel over 4 devices" in log, log
        client = srv.client(timeout=60)
        out = client.completions.create(model=str(directory), prompt=PROMPT, max_tokens=12, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == want

        # Two long streams, both running; then the worker is killed.
        streams = [iter(client.completions.create(model=str(directory), prompt=PROMPT, max_tokens=150,
                                                  temperature=0.0, stream=True, extra_body={"ignore_eos": True}))
                   for _ in range(2)]
        for stream in streams:
            next(stream)
        worker.kill()
        killed_at = time.monotonic()
        for stream in streams:
            with pytest.raises(openai.APIError, match="The engine has stopped and cannot serve requests"):
                for _ in stream:
                    pass
        # Until it has gone, rank 0 refuses new work with 503 (then connections are refused).
        try:
            client.completions.create(model=str(directory), prompt=PROMPT, max_tokens=2)
            raise AssertionError("a request to a server whose worker died was answered")
        except openai.APIStatusError as e:
            assert e.status_code == 503, e
        except openai.APIConnectionError:
            pass
        assert srv.wait(timeout=30) == 1
        elapsed = time.monotonic() - killed_at
        assert elapsed < 20, f"rank 0 took {elapsed:.0f}s to exit after its worker died"
        assert "the engine died" in srv.stderr_text(), srv.stderr_tail()
    finally:
        srv.kill()
        if worker.poll() is None:
            worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)


def test_worker_flags_are_checked_before_anything_starts() -> None:
    done = subprocess.run([*paxserve_command(), "serve", "--nnodes", "2", "--node-rank", "0", "--headless",
                           "--tensor-parallel-size", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--headless is for node ranks 1..nnodes-1" in done.stderr, done.stderr
    done = subprocess.run([*paxserve_command(), "serve", "--nnodes", "2", "--node-rank", "1",
                           "--tensor-parallel-size", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "must be a multiple of nnodes" in done.stderr, done.stderr


def test_rank_0_alone_gives_up_naming_the_rank_that_never_came() -> None:
    start = time.monotonic()
    done = subprocess.run([*paxserve_command(), "serve", "--nnodes", "2", "--node-rank", "0", "-tp", "2",
                           "--master-port", str(free_port()), "--distributed-init-timeout", "2"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **_two_device_env()})
    assert done.returncode == 1, done.stderr[-3000:]
    assert "paxserve: error: node rank(s) 1 of 2 did not join within 2s" in done.stderr, done.stderr[-3000:]
    assert time.monotonic() - start < 60
