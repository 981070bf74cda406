"""Which pages the serving process's large host buffers (a CPU KV cache) get, said in one log line.

Where the kernel gives transparent huge pages only to memory that asks for them
(`transparent_hugepage/enabled` = madvise, the common default), glibc's `glibc.malloc.hugetlb=1`
tunable makes malloc ask. That is the user's choice, made when Python starts
(`GLIBC_TUNABLES=glibc.malloc.hugetlb=1 paxserve serve ...`): on the developer machine it once made
the 4 GiB KV cache's zeroing and decode faster, and later made every allocation fault in 2 MiB pages
so slowly that start-up took 3x longer with no faster decode (benchmarks/RESULTS.md), so paxserve no
longer restarts itself with it.
"""

from __future__ import annotations

import os
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


def describe() -> str:
    """One log line: whether large host buffers get huge pages, and why."""
    mode = thp_mode()
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if mode == "always":
        return "memory: the kernel gives every large buffer transparent huge pages (transparent_hugepage=always)"
    if mode == "madvise" and f"{TUNABLE}=1" in tunables.split(":"):
        return f"memory: large host buffers (the CPU KV cache) use transparent huge pages ({TUNABLE}=1 in GLIBC_TUNABLES)"
    hint = (f"; GLIBC_TUNABLES={TUNABLE}=1 opts in to huge pages" if mode == "madvise" else "")
    return f"memory: 4 KiB pages for host buffers (transparent_hugepage={mode or 'unknown'}, " \
           f"GLIBC_TUNABLES={tunables or 'unset'}{hint})"
