"""Chat templates in killable worker processes: the same text as an in-process render, and a render
the sandbox's cooperative checks cannot interrupt (one long call into C) stopped at the limit."""

from __future__ import annotations

import time

import pytest

from paxserve.engine.chat_template import pool as pool_module
from paxserve.engine.chat_template.pool import KILL_GRACE_S, RenderPool
from paxserve.engine.chat_template.template import ChatTemplateError, RenderLimits, render_chat_template

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
# Summing lists with `start=[]` is quadratic and runs inside one C call: the sandbox checks its
# deadline only after it returns (about a minute here), whatever the limit.
UNINTERRUPTIBLE = "{{ ([[1]] * 100000)|sum(start=[])|length }}"


@pytest.fixture
def pool():
    p = RenderPool(num_workers=1, limits=RenderLimits(timeout_s=1.0))
    yield p
    p.close()


def test_the_pool_renders_what_the_sandbox_renders(pool, smollm2_tokenizer) -> None:
    template = smollm2_tokenizer.chat_template
    for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": False},
                   {"continue_final_message": True}, {"template_kwargs": {"bos_token": "<s>"}}):
        assert pool.render(template, MESSAGES, **kwargs) == render_chat_template(template, MESSAGES, **kwargs)
    with pytest.raises(ChatTemplateError, match="syntax error"):
        pool.render("{% for %}", MESSAGES)
    with pytest.raises(ChatTemplateError, match="raised an error: no tools"):
        pool.render("{{ raise_exception('no tools') }}", MESSAGES)
    assert pool.num_killed == 0  # template errors are answers, not crashes


def test_a_render_stuck_in_one_long_call_is_killed_at_the_limit(pool) -> None:
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="ran past its time limit of 1s and was stopped"):
        pool.render(UNINTERRUPTIBLE, MESSAGES)
    took = time.perf_counter() - start
    assert took < 1.0 + KILL_GRACE_S + 5.0, took  # not the minute the call itself takes
    assert pool.num_killed == 1
    assert pool.render("{{ messages[1].content }}", MESSAGES) == "What is 2 + 2?"  # a fresh worker serves on


def test_a_render_over_the_memory_cap_fails_alone() -> None:
    pool = RenderPool(num_workers=1, limits=RenderLimits(timeout_s=10.0), memory_limit_bytes=32 * 2**20)
    try:
        with pytest.raises(ChatTemplateError, match="(?i)memory|stopped its renderer"):
            pool.render("{{ ([0] * 8000000)|length }}", MESSAGES)  # within the size limit, 64 MB of list
        assert pool.render("{{ messages|length }}", MESSAGES) == "2"
    finally:
        pool.close()


def test_a_workers_start_up_never_counts_against_a_render_limit(monkeypatch) -> None:
    """An interpreter takes longer to start (0.25 s here) than this limit and no grace is left: renders
    on a cold pool and on a started one both succeed, because the clock starts once the worker has
    said it is ready."""
    monkeypatch.setattr(pool_module, "KILL_GRACE_S", 0.0)
    limits = RenderLimits(timeout_s=0.1)
    cold = RenderPool(num_workers=1, limits=limits)
    started = RenderPool(num_workers=2, limits=limits)
    try:
        assert cold.render("{{ messages|length }}", MESSAGES) == "2"
        started.start()
        assert [started.render("{{ messages[0].role }}", MESSAGES) for _ in range(3)] == ["system"] * 3
        assert cold.num_killed == started.num_killed == 0
    finally:
        cold.close()
        started.close()
