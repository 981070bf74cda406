"""The model flags vLLM users pass (--generation-config, --tokenizer, --trust-remote-code,
--revision & co): parsing and their EngineConfig mapping in-process, the HTTP protocol's use of the
model's sampling defaults, then one real `paxserve serve` on a tiny random Llama."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import start_server
from paxserve.config import EngineConfig
from paxserve.server.cli import build_parser, main
from paxserve.server.generation_spec import parse_chat_request, parse_completion_request
from paxserve.server.serve import engine_kwargs
from paxserve.server.settings import ServerSettings
from tests.paxserve.tiny_checkpoints import make_model, save_byte_tokenizer

# top_k=1 makes the default sampling greedy-equal whatever the seed: a visible consequence of the file.
GENERATION_CONFIG = {"do_sample": True, "temperature": 0.9, "top_k": 1, "max_new_tokens": 6}
MESSAGES = [{"role": "user", "content": "Tell me a story"}]


def test_serve_flags_map_onto_engine_config_and_are_explained_in_help(capsys: pytest.CaptureFixture) -> None:
    args = build_parser().parse_args(["serve", "--model", "/m", "--tokenizer", "/tok", "--generation-config", "/gc",
                                      "--trust-remote-code"])
    kwargs = engine_kwargs(args)
    assert (kwargs["tokenizer"], kwargs["generation_config"], kwargs["trust_remote_code"]) == ("/tok", "/gc", True)
    config = EngineConfig(model=args.model, **kwargs)
    assert (config.tokenizer, config.generation_config, config.trust_remote_code) == ("/tok", "/gc", True)
    defaults = engine_kwargs(build_parser().parse_args(["serve"]))
    assert (defaults["tokenizer"], defaults["generation_config"], defaults["trust_remote_code"]) == \
        (None, "auto", False)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("--tokenizer PATH load the tokenizer from this local directory",
                  "--generation-config auto|vllm|DIR where the sampling defaults of requests come from, as in vLLM",
                  "its do_sample is ignored", "vllm: ignore the file",
                  "--trust-remote-code accepted for vLLM compatibility, with a warning: paxserve never runs code",
                  "--revision REV the model's revision on the Hugging Face Hub", "--tokenizer-revision REV",
                  "--download-dir DIR", "--code-revision REV refused"):
        assert words in text, words


@pytest.mark.parametrize("flag,words", [("--revision", "applies to a model given as a Hugging Face Hub id"),
                                        ("--tokenizer-revision", "applies to a tokenizer given as a Hugging Face"),
                                        ("--code-revision", "'main': paxserve never runs code")])
def test_serve_refuses_a_revision_it_cannot_honour_at_start(flag: str, words: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--model", "/nowhere", flag, "main"]) == 2  # before any model is looked at
    assert words in capsys.readouterr().err


def test_fields_absent_from_the_body_take_the_models_defaults_and_present_ones_win() -> None:
    settings = ServerSettings(sampling_defaults={"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                                 "repetition_penalty": 1.1, "max_tokens": 64},
                              max_model_len=512, vocab_size=320)
    params = parse_chat_request({"messages": MESSAGES}, settings).params
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == \
        (0.6, 0.9, 20, 0.05, 1.1)
    assert params.max_tokens is None  # the input processor applies max_new_tokens, capped by the room left
    params = parse_chat_request({"messages": MESSAGES, "temperature": 0, "top_k": None, "top_p": 1,
                                 "max_tokens": 9}, settings).params
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.0, 20, 1.0, 9)  # null = unset
    params = parse_completion_request({"prompt": "x"}, settings).params
    assert (params.temperature, params.top_k, params.max_tokens) == (0.6, 20, 16)  # completions keep OpenAI's 16
    plain = parse_chat_request({"messages": MESSAGES}, ServerSettings(max_model_len=512, vocab_size=320)).params
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (1.0, 1.0, 0, 1.0)


def test_real_server_applies_the_generation_config_and_requests_override_it(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", generation_config=GENERATION_CONFIG)
    tok = save_byte_tokenizer(tmp_path / "tok")
    srv = start_server(["--max-model-len", "128", "--no-warmup", "--kv-cache-memory-bytes", "32MiB",
                        "--no-enable-prefix-caching", "--model", str(model), "--tokenizer", str(tok),
                        "--trust-remote-code"])
    try:
        log = srv.stderr_text()
        assert f"sampling defaults from {model}/generation_config.json: temperature=0.9, top_k=1, max_tokens=6 " \
               "(from max_new_tokens) (requests override them; --generation-config vllm ignores the file)" in log, log
        assert "paxserve never runs code from a checkpoint" in log
        client = srv.client()

        def chat(**kwargs):
            extra = {k: kwargs.pop(k) for k in ("top_k", "top_p") if k in kwargs}
            out = client.chat.completions.create(model=str(model), messages=MESSAGES,
                                                 extra_body={"ignore_eos": True, **extra}, **kwargs)
            return out.choices[0].message.content, out.usage.completion_tokens

        # No temperature, top_k or max_tokens in the body: the file's top_k=1 makes any seed give the
        # same tokens, and its max_new_tokens=6 is the length.
        first, n = chat(seed=1)
        assert n == 6 and chat(seed=2) == (first, 6)
        # Fields the request sets win: its own max_tokens, and without top_k (top_p keeps the same
        # compiled sampler) seeded sampling at temperature 1 leaves the top-1 path.
        assert chat(seed=1, max_tokens=3)[1] == 3
        free, n = chat(seed=1, temperature=1.0, top_k=0, top_p=0.99)
        assert n == 6 and free != first
    finally:
        srv.stop()


def test_speculative_config_flag_reaches_the_engine_config_and_a_bad_one_is_a_usage_error(capsys) -> None:
    """vLLM's JSON, as a shell passes it: parsed at the command line, so a typo fails before any load."""
    from paxserve.spec_decode.config import SpeculativeConfig

    args = build_parser().parse_args(["serve", "--async-scheduling", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'])
    config = EngineConfig(model=args.model, **engine_kwargs(args))
    assert config.speculative_config == SpeculativeConfig("ngram", 3, prompt_lookup_max=4)
    assert config.async_scheduling is True  # speculation runs under async scheduling too
    for text, words in (('{"method": "medusa", "num_speculative_tokens": 2}', "not available in paxserve yet"),
                        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                        ('{"method": "eagle3", "num_speculative_tokens": 2}', "is required for method 'eagle3'")):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["serve", "--speculative-config", text])
        assert exc.value.code == 2 and words in capsys.readouterr().err, text
