"""Packages only some features need (the GPU image has neither `gguf` nor `llguidance`): the engine
and server import without them, and using the feature fails with an error naming the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from paxserve.models.optional_import import MissingPackageError

ROOT = Path(__file__).resolve().parents[2]


def test_engine_server_and_gpu_check_import_without_gguf_or_llguidance() -> None:
    # A fresh interpreter where both packages are absent (a None entry in sys.modules is what an
    # uninstalled package looks like to import and to importlib.util.find_spec).
    code = ("import sys; sys.modules.update(gguf=None, llguidance=None)\n"
            "import paxserve.engine.llm_engine, paxserve.engine.async_engine, server.serve, paxserve.server.cli, models.loader\n"
            "import benchmarks.gpu_check, benchmarks.gpu_check_kernels, benchmarks.gpu_check_e2e\n"
            "print('imported')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-3000:]


def test_reading_a_gguf_file_without_gguf_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from paxserve.models.gguf_io import GGUFCheckpoint

    monkeypatch.setitem(sys.modules, "gguf", None)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(MissingPackageError, match=r"reading GGUF files needs the Python package `gguf`.*pip install gguf"):
        GGUFCheckpoint(path)


def test_a_constraint_without_llguidance_is_a_grammar_error_naming_it(smollm2_tokenizer, monkeypatch) -> None:  # noqa: ANN001
    from paxserve.engine.grammar import GrammarCompiler, GrammarError
    from paxserve.structured_outputs import StructuredOutputsParams

    monkeypatch.setitem(sys.modules, "llguidance", None)
    compiler = GrammarCompiler(smollm2_tokenizer, 49152)
    with pytest.raises(GrammarError, match=r"structured outputs .* needs the Python package `llguidance`"):
        compiler.compile(StructuredOutputsParams(regex="[a-z]+"))
