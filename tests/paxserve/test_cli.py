"""`paxserve generate` as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from paxserve.server.cli import main
from tests.helpers import real_model_env


def test_generate_streams_a_greedy_answer_from_the_default_model() -> None:
    env = real_model_env()  # the run's cache directory (tests/conftest.py): a second start, as users mostly see
    proc = subprocess.run(
        [sys.executable, "-m", "paxserve.server.cli", "generate", "--chat", "--prompt", "What is the capital of France?",
         "--max-tokens", "12"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "loaded SmolLM2-135M-Instruct" in proc.stderr  # the log says what was loaded


def test_generate_rejects_a_missing_model_path_with_a_clear_error(tmp_path, capsys) -> None:
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    assert "nor a Hugging Face Hub id" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["generate", "--prompt", "x", "--max-tokens", "0"],
                                  ["generate", "--prompt", "x", "--block-size", "12"],
                                  ["generate"]])
def test_generate_rejects_bad_flags(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_attention_backend_flag_is_validated(capsys) -> None:
    from paxserve.server.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x", "--attention-backend", "reference"])
    assert args.attention_backend == "reference"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--attention-backend", "cuda"])
    assert "invalid choice" in capsys.readouterr().err


def test_serve_refuses_lora_modules_it_cannot_serve_before_loading_anything(tmp_path, capsys) -> None:
    assert main(["serve", "--lora-modules", f"sql={tmp_path}"]) == 2
    assert "add --enable-lora" in capsys.readouterr().err
    assert main(["serve", "--enable-lora", "--lora-modules", f"sql={tmp_path}"]) == 2
    assert "adapter_config.json and adapter_model.safetensors not found" in capsys.readouterr().err
    assert main(["serve", "--enable-lora", "--served-model-name", "sql", "--lora-modules", f"sql={tmp_path}"]) == 2
    assert "names two models" in capsys.readouterr().err
