"""The installed package: everything under `paxserve`, nothing squatting on a generic top-level name,
and a checkout importable the same way without installing it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from paxserve.worker.programs import source_fingerprint

ROOT = Path(__file__).resolve().parent.parent
# Folder in the checkout -> its installed package.
FOLDERS = {"paxserve": "paxserve", "models": "paxserve/models", "pallas_kernels": "paxserve/kernels",
           "server": "paxserve/server"}
IMPORTS = ("import models, server, pallas_kernels; import paxserve.models, paxserve.kernels, paxserve.server.cli; "
           "from paxserve import Engine, AsyncEngine, SamplingParams; "
           "assert (models.WHO, server.WHO, pallas_kernels.WHO) == ('user',) * 3; "
           "print(paxserve.__file__, paxserve.models.__file__, paxserve.kernels.__file__, paxserve.server.__file__); "
           "from paxserve.worker.programs import source_fingerprint; print(source_fingerprint())")


def _user_project(tmp_path: Path) -> Path:
    """A project of a user's with its own `models.py`, `server/` and `pallas_kernels.py`."""
    project = tmp_path / "project"
    (project / "server").mkdir(parents=True)
    (project / "models.py").write_text("WHO = 'user'\n")
    (project / "pallas_kernels.py").write_text("WHO = 'user'\n")
    (project / "server" / "__init__.py").write_text("WHO = 'user'\n")
    return project


def _run(code: str, cwd: Path, pythonpath: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_the_wheel_holds_every_source_file_under_paxserve_and_imports_beside_a_user_s_models_and_server(
    tmp_path: Path,
) -> None:
    source = tmp_path / "source"  # a copy: building leaves build/ and egg-info behind
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        if name.split("/")[0] in (*FOLDERS, "pyproject.toml", "README.md"):
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("paxserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")} == {"paxserve"}
    expected = {FOLDERS[name.split("/")[0]] + name[len(name.split("/")[0]):] for name in tracked
                if name.split("/")[0] in FOLDERS and name.endswith((".py", ".cc", ".h"))}
    assert not expected - names, f"source files missing from the wheel: {sorted(expected - names)[:10]}"

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    # `bin/` holds the `paxserve` command; no other top-level name.
    assert {p.name for p in site.iterdir() if not p.name.endswith(".dist-info")} - {"bin"} == {"paxserve"}
    *found, fingerprint = _run(IMPORTS, _user_project(tmp_path), site)
    assert all(Path(path).is_relative_to(site / "paxserve") for path in found), found
    # Stored programs are keyed by the source: installed this way it is the checkout's.
    assert fingerprint == source_fingerprint()


def test_a_plain_checkout_imports_under_the_installed_names_through_its_import_root(tmp_path: Path) -> None:
    """What gpu_check.sh does on the GPU image, where nothing is installed: `benchmarks/checkout.py`."""
    root = Path(subprocess.run([sys.executable, str(ROOT / "benchmarks" / "checkout.py")], capture_output=True,
                               text=True, check=True).stdout.strip())
    # -S: no site-packages .pth, so no editable-install finder; the dependencies come back by path.
    site_packages = next(p for p in sys.path if p.endswith("site-packages"))
    code = f"import sys; sys.path.append({site_packages!r}); " + IMPORTS
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=_user_project(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    *found, fingerprint = done.stdout.split()
    assert fingerprint == source_fingerprint()
    assert [Path(path).resolve() for path in found] == [
        ROOT / "paxserve" / "__init__.py", ROOT / "models" / "__init__.py",
        ROOT / "pallas_kernels" / "__init__.py", ROOT / "server" / "__init__.py"]
