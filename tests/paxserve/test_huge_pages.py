"""The start-up log line that says which pages host buffers get, and how to opt in to huge pages."""

from __future__ import annotations

from pathlib import Path

import pytest

import paxserve.server.huge_pages as huge_pages
from paxserve.server.huge_pages import thp_mode


@pytest.mark.parametrize(("text", "mode"), [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                            ("always madvise [never]", "never"), ("", None)])
def test_reads_the_kernel_mode(tmp_path: Path, text: str, mode: str | None) -> None:
    (tmp_path / "enabled").write_text(text)
    assert thp_mode(tmp_path / "enabled") == mode
    assert thp_mode(tmp_path / "missing") is None


def test_the_log_line_says_which_pages_and_how_to_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert huge_pages.describe() == ("memory: 4 KiB pages for host buffers (transparent_hugepage=madvise, "
                                     "GLIBC_TUNABLES=unset; GLIBC_TUNABLES=glibc.malloc.hugetlb=1 opts in to huge pages)")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
    assert "use transparent huge pages" in huge_pages.describe()
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    assert huge_pages.describe().startswith("memory: 4 KiB pages") and "opts in" not in huge_pages.describe()
