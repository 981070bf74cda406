"""Transparent huge pages for the serving process's large host buffers (Linux with glibc >= 2.35).

On a CPU the KV cache is GiBs of host memory that XLA fills with zeros at start-up, one 4 KiB page
fault at a time: 1.3-3 s for the default 4 GiB on the 2-core developer machine. Where the kernel
gives huge pages only to memory that asks for them (`transparent_hugepage/enabled` = madvise, the
common default), glibc's `glibc.malloc.hugetlb=1` tunable makes malloc ask, so those buffers fault
in 2 MiB at a time (start-up measured in benchmarks/RESULTS.md). glibc reads its tunables only when a
process starts, so the command line restarts itself once with the tunable set, before anything heavy
is imported. An explicit `glibc.malloc.hugetlb` in the user's GLIBC_TUNABLES is always left alone
(`glibc.malloc.hugetlb=0` opts out).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = _THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None if unknown."""
    try:
        text = path.read_text()
    except OSError:
        return None
    chosen = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
    return chosen[0] if chosen else None


def _glibc_at_least(version: str, wanted: tuple[int, int] = (2, 35)) -> bool:
    try:
        return tuple(int(part) for part in version.split(".")[:2]) >= wanted
    except ValueError:
        return False


def huge_pages_env(environ: Mapping[str, str], libc: tuple[str, str], mode: str | None) -> dict[str, str] | None:
    """The environment to restart with so that malloc asks for huge pages, or None when a restart
    would change nothing: not glibc >= 2.35, the kernel gives huge pages to everything or to
    nothing, or the user already chose the tunable."""
    name, version = libc
    tunables = environ.get("GLIBC_TUNABLES", "")
    if name != "glibc" or not _glibc_at_least(version) or mode != "madvise":
        return None
    if any(item.split("=", 1)[0] == TUNABLE for item in tunables.split(":") if item):
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"}


def restart_with_huge_pages() -> None:
    """Replace this process (same PID, same arguments and streams) with one whose malloc asks for
    huge pages, when that changes anything (see `huge_pages_env`); else return."""
    if not sys.platform.startswith("linux") or not sys.executable or not sys.orig_argv:
        return  # an embedded interpreter cannot be started again; it runs on with 4 KiB pages
    env = huge_pages_env(os.environ, platform.libc_ver(), thp_mode())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        pass  # not allowed here (a sandbox, a deleted interpreter): serve as is; `describe` logs the pages


def describe() -> str:
    """One log line: whether large host buffers get huge pages, and why."""
    mode = thp_mode()
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if mode == "always":
        return "memory: the kernel gives every large buffer transparent huge pages (transparent_hugepage=always)"
    if mode == "madvise" and f"{TUNABLE}=1" in tunables.split(":"):
        return (f"memory: large host buffers (the CPU KV cache) use transparent huge pages ({TUNABLE}=1 in "
                f"GLIBC_TUNABLES; set {TUNABLE}=0 there to opt out)")
    return f"memory: 4 KiB pages for host buffers (transparent_hugepage={mode or 'unknown'}, " \
           f"GLIBC_TUNABLES={tunables or 'unset'})"
