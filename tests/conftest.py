"""Shared fixtures. Parity figures recorded by tests are printed at the end of the run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS_ONLY_XLA_FLAG = "--xla_backend_optimization_level=0"

# Four simulated CPU devices for the tensor-parallel tests, set before JAX starts its backend (the
# library never reads this; single-device code runs on device 0 as before).
NUM_TEST_DEVICES = 4
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={NUM_TEST_DEVICES}").strip()
# Most of a cold run is XLA compiling hundreds of small programs; LLVM's most expensive passes cut
# ~13% of compile time here and no measurable run time of these tiny models (server subprocesses
# inherit it). Not the library's setting: users' programs compile with XLA's defaults.
if "xla_llvm_disable_expensive_passes" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_llvm_disable_expensive_passes=true"
# The tests' own process runs tiny models whose programs compile far longer than they run: LLVM's
# -O0 code generation compiles ~35% faster (test_families + test_engine + test_smollm2: 241 -> 206 s).
# Only here: processes serving the real model (servers, the CLI) start with the flags above alone,
# since there -O0 doubles the decode time (tests.helpers.real_model_env).
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += f" {TESTS_ONLY_XLA_FLAG}"

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import load_hf_smollm2, release_compiled_programs  # noqa: E402 (needs the path above)

# The Mosaic GPU kernels' tests need Python 3.12 + JAX 0.11.2 (GPU interpret mode): they run in their
# own lane, tests/mosaic_gpu/lane.sh, which the README's test command (tests/run_all.sh) runs beside this suite.
collect_ignore = ["mosaic_gpu"]

# Parity and timing figures: (test name, description) -> value, shown in the terminal summary.
REPORT: list[tuple[str, str]] = []


@pytest.fixture
def report(request: pytest.FixtureRequest):
    """Record a figure (e.g. max logit error) so the run's summary lists it. Kept in the test's
    user_properties, which pytest-xdist carries from its workers to the process that prints."""

    def record(what: str) -> None:
        request.node.user_properties.append((_FIGURE, what))

    return record


_FIGURE = "paxserve figure"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        REPORT.extend((report.nodeid.rsplit("::", 1)[-1], what) for key, what in report.user_properties
                      if key == _FIGURE)


# Tests that time their clients, race timeouts or signal servers run alone, after the rest has run
# on two workers (`-m "not serial"` with pytest-xdist, then `-m serial`): under a second busy
# process their timings would measure the machine, not paxserve.
SERIAL_FILES = ("test_robustness.py", "test_lifecycle.py", "test_watchdog.py", "test_fault_injection.py",
                "test_transport.py", "test_async_engine.py", "test_chat_template.py", "test_serving_benchmark.py",
                "test_soak_benchmark.py")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`-m serial` runs whole files (SERIAL_FILES): leave the others unimported, since collecting the
    whole suite (torch, transformers, lm-eval, LangChain...) costs about 25 s before the first test."""
    if (config.getoption("markexpr") == "serial" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_") and collection_path.name not in SERIAL_FILES):
        return True
    return None


# The longest files of the parallel part (seconds of test time on one worker, fresh clone of eb8433e,
# 2026-12-04) go to the workers first, longest first: with whole files as the unit of work
# (`--dist loadfile`), a long file that starts last keeps one worker busy after the other is done
# (the run's last 2% of tests took its last 2.5 minutes). Only the order changes, never what runs.
LONGEST_FIRST = ("models/test_families.py", "models/test_gguf_real.py", "paxserve/test_engine.py",
                 "server/test_openai_api.py", "models/test_smollm2.py", "server/test_structured_server.py",
                 "models/test_tensor_parallel.py", "paxserve/test_multihost.py", "server/test_multihost_server.py",
                 "paxserve/test_async_scheduling.py", "server/test_lm_eval.py", "paxserve/test_programs.py",
                 "models/test_compressed_tensors.py")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    present = {path.name for path in here.rglob("test_*.py")}
    missing = set(SERIAL_FILES) - present
    assert not missing, f"tests/conftest.py SERIAL_FILES names files that do not exist: {sorted(missing)}"
    missing = [name for name in LONGEST_FIRST if not (here / name).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names files that do not exist: {missing}"
    for item in items:
        if Path(str(item.path)).name in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)
    rank = {str(here / name): i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(str(Path(str(item.path)).resolve()), len(rank)))  # stable: files stay whole


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs_per_module():
    yield
    release_compiled_programs()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The bundled SmolLM2 tokenizer (reading the GGUF metadata takes seconds: once per run)."""
    from paxserve.models.bundled import default_model_path
    from paxserve.models.gguf_io import GGUFCheckpoint
    from paxserve.models.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(GGUFCheckpoint(default_model_path()))


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own SmolLM2 from the bundled GGUF and its tokenizer (once per worker, for the
    model tests that compare against it; `load_hf_smollm2`)."""
    return load_hf_smollm2()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001
    if REPORT:
        terminalreporter.section("paxserve figures")
        for name, what in REPORT:
            terminalreporter.write_line(f"{name}: {what}")


def pytest_configure(config: pytest.Config) -> None:
    # Tests must not leave multi-GB caches in the home directory of whoever runs them.
    os.environ.setdefault("XDG_CACHE_HOME", str(Path(config.rootpath) / ".pytest_cache" / "xdg"))
    # One persistent compilation cache for the whole run: every module drops its compiled programs
    # (release_compiled_programs) and later modules running the same model and buckets load them
    # back instead of compiling again. Engines built with compilation_cache_dir="" use it too.
    import jax

    jax.config.update("jax_compilation_cache_dir", str(Path(os.environ["XDG_CACHE_HOME"]) / "paxserve" / "xla-tests"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
