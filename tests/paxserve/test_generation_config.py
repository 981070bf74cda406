"""--generation-config (vLLM's rules for a checkpoint's generation_config.json as request defaults),
--tokenizer, --trust-remote-code and the refused --revision flags: the parsing, the config, the
InputProcessor, then an Engine on a tiny random Llama."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from paxserve.config import EngineConfig
from paxserve.engine.generation_config import (default_sampling_params, generation_config_file, read_generation_config,
                                        resolve_sampling_defaults, sampling_defaults)
from paxserve.engine.input_processor import InputProcessor
from paxserve.sampling_params import SamplingParams
from tests.paxserve.tiny_checkpoints import make_model, save_byte_tokenizer, write_json

VOCAB = 320
ENGINE_ARGS = dict(warmup=False, log_stats_interval=0, compilation_cache_dir="", max_model_len=128,
                   kv_cache_memory_bytes=32 * 2**20)
PROMPT = [5, 17, 300, 40, 12]
# top_k=1 makes the file's default sampling greedy, whatever the temperature: a visible consequence.
FILE = {"do_sample": False, "temperature": 0.7, "top_k": 1, "top_p": None, "max_new_tokens": 5,
        "eos_token_id": 2, "bos_token_id": 1}


# ---- the file's fields -> defaults (no JAX) ------------------------------------------------------

def test_vllm_fields_become_defaults_and_do_sample_and_nulls_are_ignored() -> None:
    assert sampling_defaults(FILE, "gc.json") == {"temperature": 0.7, "top_k": 1, "max_tokens": 5}
    full = {"repetition_penalty": 1.05, "temperature": 0, "top_k": 20.0, "top_p": 0.8, "min_p": 0.05,
            "max_new_tokens": 64, "num_beams": 4, "max_length": 20}
    assert sampling_defaults(full, "gc.json") == {"repetition_penalty": 1.05, "temperature": 0.0, "top_k": 20,
                                                  "top_p": 0.8, "min_p": 0.05, "max_tokens": 64}
    assert sampling_defaults({"do_sample": True, "eos_token_id": [1, 2]}, "gc.json") == {}


@pytest.mark.parametrize("field,value,mentions", [
    ("top_p", 2, "(0, 1]"), ("top_p", 0, "(0, 1]"), ("temperature", -1, ">= 0"), ("min_p", 1.5, "[0, 1]"),
    ("repetition_penalty", 3.0, "(0, 2]"), ("top_k", -5, ">= 1"), ("top_k", 1.5, "an integer"),
    ("temperature", "hot", "a number"), ("top_p", True, "a number"), ("max_new_tokens", 0, ">= 1"),
])
def test_invalid_values_name_the_file_the_field_and_the_range(field: str, value: object, mentions: str) -> None:
    with pytest.raises(ValueError) as info:
        sampling_defaults({field: value}, "/ckpt/generation_config.json")
    message = str(info.value)
    assert message.startswith(f"/ckpt/generation_config.json: {field}="), message
    assert mentions in message and "--generation-config vllm" in message, message


def test_directory_mode_reads_the_file_and_refuses_a_missing_or_broken_one(tmp_path: Path) -> None:
    good = write_json(tmp_path / "good", {"top_p": 0.5})
    assert generation_config_file(good) == good / "generation_config.json"
    assert generation_config_file(good / "generation_config.json") == good / "generation_config.json"
    defaults, line = resolve_sampling_defaults(str(good), {"temperature": 0.1}, "/model")
    assert defaults == {"top_p": 0.5}  # the model's own file is not used
    assert line == f"sampling defaults from {good}/generation_config.json: top_p=0.5 (requests override them; " \
                   "--generation-config vllm ignores the file)"
    with pytest.raises(ValueError, match="not 'auto', 'vllm' or a local directory"):
        generation_config_file(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="the directory has no generation_config.json"):
        generation_config_file(tmp_path / "empty")
    broken = write_json(tmp_path / "broken", "{temperature: 0.6")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        resolve_sampling_defaults(str(broken), {}, "/model")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        read_generation_config(write_json(tmp_path / "list", [1]) / "generation_config.json")


def test_auto_uses_the_models_file_and_vllm_ignores_it(tmp_path: Path) -> None:
    defaults, line = resolve_sampling_defaults("auto", FILE, str(tmp_path))
    assert defaults == {"temperature": 0.7, "top_k": 1, "max_tokens": 5}
    assert line.startswith(f"sampling defaults from {tmp_path}/generation_config.json: temperature=0.7, top_k=1, "
                           "max_tokens=5 (from max_new_tokens) (")
    assert resolve_sampling_defaults("auto", {}, str(tmp_path)) == ({}, None)  # nothing to log
    assert resolve_sampling_defaults("vllm", FILE, str(tmp_path)) == ({}, None)


def test_input_processor_applies_defaults_to_requests_without_params_and_caps_max_tokens() -> None:
    ip = InputProcessor(None, VOCAB, (2,), 64, 0, sampling_defaults={"temperature": 0.7, "top_k": 1, "max_tokens": 5})
    assert ip.default_sampling_params() == SamplingParams(temperature=0.7, top_k=1, max_tokens=None)
    request = ip.process("a", PROMPT)
    assert request.sampling_params.top_k == 1 and request.max_tokens == 5
    assert ip.process("b", PROMPT, SamplingParams(max_tokens=9)).max_tokens == 9  # explicit wins
    assert ip.resolve_max_tokens(62, SamplingParams(max_tokens=None)) == 2  # never beyond the room left
    plain = InputProcessor(None, VOCAB, (2,), 64, 0)
    assert plain.default_sampling_params() == SamplingParams() and plain.process("c", PROMPT).max_tokens == 16
    assert default_sampling_params({}) == SamplingParams()


def test_engine_config_fields_are_validated() -> None:
    config = EngineConfig(generation_config="vllm", tokenizer="/tok", trust_remote_code=True)
    assert (config.generation_config, config.tokenizer, config.trust_remote_code) == ("vllm", "/tok", True)
    assert EngineConfig().generation_config == "auto"
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig(generation_config="")
    with pytest.raises(ValueError, match="EngineConfig.code_revision 'v2': paxserve never runs code"):
        EngineConfig(code_revision="v2")
    assert EngineConfig(model="org/name", revision="v2", tokenizer_revision="main").revision == "v2"


def test_cli_flags_parse_and_revisions_of_local_models_are_refused_before_loading(
        capsys: pytest.CaptureFixture) -> None:
    from paxserve.server.cli import build_parser, main

    args = build_parser().parse_args(["generate", "--prompt", "x", "--tokenizer", "/tok", "--generation-config",
                                      "vllm", "--trust-remote-code"])
    assert (args.tokenizer, args.generation_config, args.trust_remote_code) == ("/tok", "vllm", True)
    assert main(["generate", "--prompt", "x", "--code-revision", "refs/pr/1"]) == 2
    assert "--code-revision 'refs/pr/1': paxserve never runs code" in capsys.readouterr().err
    for flag, field in (("--revision", "model"), ("--tokenizer-revision", "tokenizer")):
        assert main(["generate", "--prompt", "x", flag, "refs/pr/1"]) == 2  # the bundled model is a local file
        err = capsys.readouterr().err
        assert f"applies to a {field} given as a Hugging Face Hub id" in err, err


# ---- an Engine on a tiny random Llama --------------------------------------------------------------
# Every request below samples with top-k/top-p (one compiled sampler variant), to keep compiles few.

@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """model: a tiny Llama whose generation_config.json is FILE and that has no tokenizer files;
    tok: a byte-level tokenizer; small: a model whose vocabulary is too small for that tokenizer."""
    root = tmp_path_factory.mktemp("gencfg")
    return {"model": make_model(root / "model", generation_config=FILE), "tok": save_byte_tokenizer(root / "tok"),
            "small": make_model(root / "small", vocab_size=128)}


@pytest.fixture(scope="module")
def engine(dirs: dict[str, Path]):
    from paxserve import Engine

    return Engine(str(dirs["model"]), tokenizer=str(dirs["tok"]), **ENGINE_ARGS)


def test_auto_defaults_apply_to_requests_without_sampling_params(engine) -> None:
    assert engine.sampling_defaults == {"temperature": 0.7, "top_k": 1, "max_tokens": 5}
    assert engine.get_default_sampling_params() == SamplingParams(temperature=0.7, top_k=1, max_tokens=None)

    def tokens(params: SamplingParams | None, prompt: object = PROMPT) -> list[int]:
        return list(engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)

    file_like = tokens(SamplingParams(temperature=0.7, top_k=1, max_tokens=5, seed=1))
    assert 1 <= len(file_like) <= 5
    # No SamplingParams: the file's temperature 0.7, top_k 1 (so the seed does not matter) and max_new_tokens 5.
    assert tokens(None) == file_like
    # Starting from the defaults and changing one field keeps the others.
    assert tokens(replace(engine.get_default_sampling_params(), seed=9)) == file_like
    # Explicit SamplingParams are used as given (vLLM's rule): no top_k here, so the tokens differ.
    free = tokens(SamplingParams(temperature=1.0, top_p=0.99, seed=3, max_tokens=5, ignore_eos=True))
    assert len(free) == 5 and free[:len(file_like)] != file_like
    # --tokenizer: the model directory has no tokenizer files, yet text prompts work.
    assert engine.tokenizer is not None and len(engine.tokenizer) == 257
    assert engine.generate("Hello", SamplingParams(top_k=1, max_tokens=3), use_tqdm=False)[0].outputs[0].text


def test_engine_modes_logs_and_errors(dirs, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from paxserve import Engine

    caplog.set_level(logging.INFO)
    eng = Engine(str(dirs["model"]), generation_config="vllm", trust_remote_code=True, **ENGINE_ARGS)
    assert eng.sampling_defaults == {} and eng.get_default_sampling_params() == SamplingParams()
    assert eng.tokenizer is None  # the model's own (it has none)
    assert "sampling defaults" not in caplog.text
    assert any(r.levelno == logging.WARNING and "never runs code" in r.getMessage() for r in caplog.records)
    caplog.clear()
    eng = Engine(str(dirs["model"]), **ENGINE_ARGS)
    assert f"sampling defaults from {dirs['model']}/generation_config.json: temperature=0.7, top_k=1, max_tokens=5 " \
           "(from max_new_tokens) (requests override them; --generation-config vllm ignores the file; its " \
           "do_sample=false is ignored, as in vLLM" in caplog.text
    caplog.clear()
    other = write_json(tmp_path / "other", {"top_p": 0.5, "repetition_penalty": 1.1})
    eng = Engine(str(dirs["model"]), generation_config=str(other), **ENGINE_ARGS)
    assert eng.sampling_defaults == {"top_p": 0.5, "repetition_penalty": 1.1}
    assert f"sampling defaults from {other}/generation_config.json: repetition_penalty=1.1, top_p=0.5 (requests " \
           "override them; --generation-config vllm ignores the file)\n" in caplog.text
    # Bad files fail at start; a bad directory file before any weights load.
    with pytest.raises(ValueError, match=r"bad/generation_config.json: top_p=2 is invalid: must be in \(0, 1\]"):
        Engine(str(dirs["model"]), generation_config=str(write_json(tmp_path / "bad", {"top_p": 2})), **ENGINE_ARGS)
    with pytest.raises(ValueError, match="the directory has no generation_config.json"):
        Engine(str(dirs["model"]), generation_config=str(tmp_path), **ENGINE_ARGS)
    saved = (dirs["small"] / "generation_config.json").read_text()
    try:
        write_json(dirs["small"], {"temperature": -0.5})
        with pytest.raises(ValueError, match="small/generation_config.json: temperature=-0.5 is invalid: must be >= 0"):
            Engine(str(dirs["small"]), **ENGINE_ARGS)
        write_json(dirs["small"], "{not json")
        with pytest.raises(ValueError, match="small/generation_config.json is not valid JSON"):
            Engine(str(dirs["small"]), **ENGINE_ARGS)
    finally:
        write_json(dirs["small"], saved)
    with pytest.raises(ValueError, match="nor a Hugging Face Hub id"):
        Engine(str(dirs["small"]), tokenizer=str(tmp_path / "missing-tok"), **ENGINE_ARGS)
    with pytest.raises(ValueError, match="has 257 tokens but the model's vocabulary has only 128"):
        Engine(str(dirs["small"]), tokenizer=str(dirs["tok"]), **ENGINE_ARGS)
