"""When `paxserve serve` restarts itself so that malloc asks for transparent huge pages."""

from __future__ import annotations

from pathlib import Path

import pytest

from paxserve.server.huge_pages import huge_pages_env, thp_mode

GLIBC = ("glibc", "2.36")


def test_restarts_with_the_tunable_only_where_it_changes_something() -> None:
    assert huge_pages_env({"PATH": "/bin"}, GLIBC, "madvise") == {"PATH": "/bin",
                                                                  "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    # Other tunables the user set are kept.
    env = huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, GLIBC, "madvise")
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    # The user's own choice, either way, is never overridden (and the restarted process stops here).
    assert huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, GLIBC, "madvise") is None
    assert huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, GLIBC, "madvise") is None
    # Huge pages for everything or for nothing already: nothing to ask for.
    assert huge_pages_env({}, GLIBC, "always") is None
    assert huge_pages_env({}, GLIBC, "never") is None
    assert huge_pages_env({}, GLIBC, None) is None
    # glibc before 2.35 has no such tunable; musl has none at all.
    assert huge_pages_env({}, ("glibc", "2.34"), "madvise") is None
    assert huge_pages_env({}, ("", ""), "madvise") is None


@pytest.mark.parametrize(("text", "mode"), [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                            ("always madvise [never]", "never"), ("", None)])
def test_reads_the_kernel_mode(tmp_path: Path, text: str, mode: str | None) -> None:
    (tmp_path / "enabled").write_text(text)
    assert thp_mode(tmp_path / "enabled") == mode
    assert thp_mode(tmp_path / "missing") is None


def test_a_restart_that_cannot_happen_leaves_the_command_running(monkeypatch: pytest.MonkeyPatch) -> None:
    import paxserve.server.huge_pages as huge_pages

    calls = []

    def refuse(*args: object) -> None:
        calls.append(args)
        raise PermissionError("exec not allowed here")

    monkeypatch.setattr(huge_pages.sys, "platform", "linux")
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(huge_pages.platform, "libc_ver", lambda: GLIBC)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(huge_pages.os, "execve", refuse)
    huge_pages.restart_with_huge_pages()  # returns instead of raising
    assert len(calls) == 1 and calls[0][2]["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
