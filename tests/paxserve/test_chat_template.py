"""paxserve.engine.chat_template.template: same text as transformers' apply_chat_template, plus time and size limits."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import jinja2
import pytest

from paxserve.engine.chat_template.template import ChatTemplateError, RenderLimits, render_chat_template

FAST = RenderLimits(timeout_s=0.5)

CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Héllo, ünïcode ✓ <b>&</b>"},
    {"role": "assistant", "content": "Hi there. "},
    {"role": "user", "content": "Another question?"},
]
TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {"name": "get_weather", "description": "Wetter für eine Stadt",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}]
DOCS: list[dict[str, Any]] = [{"title": "Doc one", "text": "Alpha"}, {"title": "Doc two", "text": "Beta"}]


@pytest.fixture(scope="module")
def tok() -> Any:
    from paxserve.models.bundled import default_model_path
    from paxserve.models.gguf_io import GGUFCheckpoint
    from paxserve.models.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(GGUFCheckpoint(default_model_path()))


def ours(tok: Any, template: str, messages: list[dict[str, Any]], **kw: Any) -> str:
    template_kwargs = kw.pop("template_kwargs", None)
    return render_chat_template(template, messages, special_tokens=tok.special_tokens_map,
                                template_kwargs=template_kwargs, **kw)


def theirs(tok: Any, template: str, messages: list[dict[str, Any]], **kw: Any) -> str:
    extra = kw.pop("template_kwargs", None) or {}
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kw, **extra)


def assert_same(tok: Any, template: str, messages: list[dict[str, Any]], **kw: Any) -> str:
    expected = theirs(tok, template, messages, **dict(kw))
    got = ours(tok, template, messages, **dict(kw))
    assert got == expected
    return got


# ------------------------------------------------------------------------------------------- parity

@pytest.mark.parametrize("agp", [False, True])
@pytest.mark.parametrize("chat", [CHAT, CHAT[1:], CHAT[1:2], CHAT[:3]], ids=["sys", "nosys", "one", "ends-assistant"])
def test_bundled_template_matches(tok: Any, chat: list[dict[str, Any]], agp: bool) -> None:
    text = assert_same(tok, tok.chat_template, chat, add_generation_prompt=agp)
    assert text.endswith("<|im_start|>assistant\n") == agp


def test_bundled_template_continue_final_message(tok: Any) -> None:
    chat = [*CHAT[1:], {"role": "assistant", "content": "The answer is "}]
    text = assert_same(tok, tok.chat_template, chat, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe answer is ")


HAND_WRITTEN: dict[str, str] = {
    "loop_controls": (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "[{{ loop.index }}/{{ loop.length }} {{ m.role }}]{% if loop.index >= 2 %}{% break %}{% endif %}{% endfor %}"),
    "tojson": (
        "{{ messages|tojson }}\n{{ tools|tojson(indent=2) }}\n{{ tools|tojson(indent='\\t', sort_keys=True) }}\n"
        "{{ {'b': 1, 'a': 'ü<&>'}|tojson(sort_keys=True, separators=(',', ':')) }}"),
    "bos_eos": "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}{{ pad_token }}",
    "tools": (
        "{%- if tools %}\n<tools>\n{%- for tool in tools %}\n{{ tool.function.name }}={{ tool|tojson }}\n"
        "{%- endfor %}\n</tools>\n{%- endif %}\n"
        "{%- for m in messages %}\n  <{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"),
    "namespace": (
        "{% set ns = namespace(last_user=-1, count=0, text='') %}{% for m in messages %}"
        "{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% set ns.count = ns.count + 1 %}{% endif %}"
        "{% set ns.text = ns.text ~ m.role[0] %}{% endfor %}{{ ns.last_user }} {{ ns.count }} {{ ns.text }}"),
    "loop_attrs": (
        "{% for m in messages %}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}{{ loop.last }}"
        "{{ loop.cycle('a', 'b') }}{{ loop.previtem.role if loop.previtem else '-' }}"
        "{% if not loop.last %},{% endif %}{% endfor %}"
        "{% for m in messages if m.role == 'user' %}{{ loop.length }}{{ loop.last }}{% endfor %}"
        "{% for x in [] %}no{% else %}empty{% endfor %}"
        "{% for k, v in tools[0].function.parameters|dictsort %}{{ k }}={{ v|length }};{% endfor %}"),
    "recursive": (
        "{% for item in tree recursive %}<{{ item.name }}{% if item.children %}:{{ loop(item.children) }}{% endif %}>"
        "{% endfor %}"),
    "generation": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}"
        "{% endgeneration %}{% else %}{{ m.role }}:{{ m.content }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"),
    "whitespace": (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n        U: {{ m.content }}\n    {% else %}\n"
        "        O: {{ m.content }}\n    {% endif %}\n{% endfor %}\n{%- if add_generation_prompt -%}\n  A:\n{%- endif %}"),
    "macros_filters_ops": (
        "{% macro wrap(x, tag='b') %}<{{ tag }}>{{ x|upper }}</{{ tag }}>{% endmacro %}{{ wrap('hi') }}{{ wrap('yo', 'i') }}"
        "|{{ 'a b a'|replace('a', 'c') }}|{{ [1, 2, 3]|join(', ') }}|{{ 'x'|center(5) }}|{{ '%05d'|format(42) }}"
        "|{{ '{:>4}|{}'.format('a', 7) }}|{{ 'ab' * 3 }}|{{ 2 ** 10 }}|{{ 7 % 3 }}|{{ '%s-%d' % ('a', 3) }}"
        "|{{ [1] + [2] }}|{{ 'a' + 'b' }}|{{ 1.5 * 2 }}|{{ messages|map(attribute='role')|join('/') }}"
        "|{{ messages|selectattr('role', 'equalto', 'user')|list|length }}|{{ 'abc'.upper().center(7, '*') }}"
        "|{{ (messages|last).content|trim }}|{{ 'line1\\nline2'|indent(2) }}|{{ range(3)|list }}|{{ 5 // 2 }}"
        "|{% filter upper %}inner {{ messages[0].role }}{% endfilter %}|{% set cap %}captured{% endset %}{{ cap }}"),
    "dict_global": "{% set d = dict(a=1, b='two') %}{{ d|tojson }}{{ dict.fromkeys(['x', 'y'], 0)|tojson }}{{ d.a }}",
    "kwargs": (
        "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}"
        "{{ custom|default('none') }}{% for m in messages %}{{ m.content }}{% endfor %}"),
    "reasoning_alias": (
        "{% for m in messages %}{{ m.role }}|{{ m.reasoning_content|default('-') }}|{{ m.thinking|default('-') }}"
        "|{{ 'tool_calls' in m }}|{{ m|list|join(',') }}\n{% endfor %}"),
    "documents": "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}",
    "content_blocks": (
        "{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}{% else %}"
        "{% for b in m.content %}{% if b.type == 'text' %}{{ b.text }}{% else %}<{{ b.type }}>{% endif %}{% endfor %}"
        "{% endif %}\n{% endfor %}"),
}

REASONING_CHAT = [
    {"role": "user", "content": "q", "tool_calls": None},
    {"role": "assistant", "content": "a", "reasoning": "because", "tool_calls": None},
]
BLOCKS_CHAT = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "It is "}]},
]


@pytest.mark.parametrize("name", sorted(HAND_WRITTEN))
@pytest.mark.parametrize("agp", [False, True])
def test_hand_written_templates_match(tok: Any, name: str, agp: bool) -> None:
    chat = REASONING_CHAT if name == "reasoning_alias" else BLOCKS_CHAT if name == "content_blocks" else CHAT
    kw: dict[str, Any] = {"add_generation_prompt": agp, "tools": TOOLS}
    if name == "documents":
        kw["documents"] = DOCS
    if name == "kwargs":
        kw["template_kwargs"] = {"enable_thinking": False, "custom": "Ω"}
    if name == "recursive":
        kw["template_kwargs"] = {"tree": [{"name": "a", "children": [{"name": "b", "children": []}, {"name": "c"}]},
                                          {"name": "d"}]}
    assert_same(tok, HAND_WRITTEN[name], chat, **kw)


# A reduced Llama-3.1-style tool template: whitespace control, slicing, tool calls, tojson(indent).
LLAMA_LIKE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
TOOL_CHAT = [*CHAT, {"role": "assistant", "content": None,
                     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
             {"role": "tool", "content": "sunny"}]


@pytest.mark.parametrize("tools", [TOOLS, None])
@pytest.mark.parametrize("agp", [False, True])
def test_llama_like_tool_template_matches(tok: Any, tools: Any, agp: bool) -> None:
    text = assert_same(tok, LLAMA_LIKE, TOOL_CHAT, tools=tools, add_generation_prompt=agp,
                       template_kwargs={"date_string": "26 Jul 2024"})
    assert ('"name": "get_weather"' in text) and (("Environment: ipython" in text) == (tools is not None))
    assert_same(tok, LLAMA_LIKE, TOOL_CHAT[1:4], tools=tools, add_generation_prompt=agp)  # date from strftime_now


def test_tojson_is_not_html_escaped_and_keeps_unicode(tok: Any) -> None:
    text = ours(tok, HAND_WRITTEN["tojson"], CHAT, tools=TOOLS)
    assert "Héllo, ünïcode ✓ <b>&</b>" in text and "\\u" not in text
    assert '\n  {\n    "type": "function"' in text  # indent=2


def test_kwargs_override_special_tokens(tok: Any) -> None:
    assert_same(tok, HAND_WRITTEN["bos_eos"], CHAT, template_kwargs={"bos_token": "<BOS>"})


def test_strftime_now_format(tok: Any) -> None:
    template = "{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %B %Y') }}"
    pattern = r"\d{4}-\d{2}-\d{2}\|\d{2} [A-Z][a-z]+ \d{4}"
    assert re.fullmatch(pattern, theirs(tok, template, CHAT))
    assert re.fullmatch(pattern, ours(tok, template, CHAT))


@pytest.mark.parametrize("field,chat,template", [
    ("content", [*CHAT[1:3]], "{% for m in messages %}<{{ m.role }}>{{ m.content|trim }}</s>\n{% endfor %}"),
    ("content", BLOCKS_CHAT, HAND_WRITTEN["content_blocks"] + "<end>"),
    ("reasoning_content", [CHAT[1], {"role": "assistant", "content": "", "reasoning": "Let me think"}],
     "{% for m in messages %}{{ m.role }}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
     "{% endif %}{{ m.content }}<eot>{% endfor %}"),
])
def test_continue_final_message_matches(tok: Any, field: str, chat: list[dict[str, Any]], template: str) -> None:
    cfm: bool | str = True if field == "content" else field
    assert_same(tok, template, chat, continue_final_message=cfm)


@pytest.mark.parametrize("chat,template,cfm,agp", [
    ([CHAT[1], {"role": "assistant"}], "{{ messages }}", True, False),  # no content to continue
    (CHAT[1:3], "{% for m in messages %}{{ m.role }}{% endfor %}", True, False),  # template never reads content
    (CHAT[1:3], "{% for m in messages %}{{ m.content[:2] }}{% endfor %}", True, False),  # template cuts content
    (CHAT[1:3], "{{ messages[0].content }}", True, True),  # both flags
    ([], "{{ messages }}", False, False),  # empty conversation
])
def test_continue_final_message_and_input_errors_match(tok: Any, chat: list[dict[str, Any]], template: str,
                                                       cfm: bool, agp: bool) -> None:
    with pytest.raises(ValueError):
        theirs(tok, template, chat, continue_final_message=cfm, add_generation_prompt=agp)
    with pytest.raises(ChatTemplateError):
        ours(tok, template, chat, continue_final_message=cfm, add_generation_prompt=agp)


def test_does_not_modify_callers_messages(tok: Any) -> None:
    chat = [{"role": "user", "content": "x", "name": None}, {"role": "assistant", "content": "y"}]
    before = repr(chat)
    ours(tok, tok.chat_template, chat, continue_final_message=True)
    assert repr(chat) == before


# ------------------------------------------------------------------------------------------- errors

def test_raise_exception_message_comes_through(tok: Any) -> None:
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with user') }}{% endif %}ok"
    with pytest.raises(jinja2.exceptions.TemplateError, match="must start with user"):
        theirs(tok, template, CHAT)
    with pytest.raises(ChatTemplateError, match="Conversations must start with user"):
        ours(tok, template, CHAT)
    assert ours(tok, template, CHAT[1:]) == "ok"


@pytest.mark.parametrize("template,expect", [
    ("{% for m in messages %}{{ m.content }}", "syntax error on line 1"),
    ("hello\n{{ 1 + }}", "syntax error on line 2"),
    ("{% generation %}x", "syntax error"),
    ("{{ nope.attr }}", "'nope' is undefined"),
    ("line\n{{ messages[0].content.missing.deeper }}", "on line 2"),
    ("{{ messages.append(1) }}", "unsafe"),
    ("{{ ''.__class__.__mro__ }}", "unsafe"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "may not start with '_'"),
    ("{{ x|no_such_filter }}", "no_such_filter"),
    ("{{ raise_exception(strftime_now) }}", "raised an error"),
    ("{{ messages|tojson(nope=1) }}", "TypeError"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
])
def test_errors_are_clean(template: str, expect: str) -> None:
    with pytest.raises(ChatTemplateError) as info:
        render_chat_template(template, CHAT, limits=FAST)
    message = str(info.value)
    assert expect in message
    assert "0x" not in message and "Traceback" not in message and ".py" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_bad_arguments() -> None:
    for bad in ([1], "text", [{"role": "user"}, "x"]):
        with pytest.raises(ChatTemplateError):
            render_chat_template("{{ messages }}", bad)  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError, match="tools"):
        render_chat_template("x", CHAT, tools=[print])  # type: ignore[list-item]
    with pytest.raises(ChatTemplateError, match="documents"):
        render_chat_template("x", CHAT, documents=["a"])  # type: ignore[list-item]
    with pytest.raises(ChatTemplateError, match="messages"):
        render_chat_template("x", CHAT, template_kwargs={"messages": []})


@pytest.mark.parametrize("kwargs", [{"timeout_s": 0}, {"timeout_s": -1.0}, {"timeout_s": float("inf")},
                                    {"timeout_s": "5"}, {"max_output_chars": 0}, {"max_output_chars": 1.5},
                                    {"max_output_chars": True}])
def test_limits_validation(kwargs: dict[str, Any]) -> None:
    field = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"RenderLimits.{field}"):
        RenderLimits(**kwargs)


# ------------------------------------------------------------------------------------------- limits

def timed_error(template: str, limits: RenderLimits = FAST) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as info:
        render_chat_template(template, CHAT, limits=limits)
    return str(info.value), time.monotonic() - start


def test_nested_loop_with_output_times_out() -> None:
    message, elapsed = timed_error("{% for i in range(15000) %}{% for j in range(15000) %}x{% endfor %}{% endfor %}")
    assert "time limit of 0.5 s" in message and "timeout_s" in message
    assert elapsed < FAST.timeout_s + 1.0


@pytest.mark.parametrize("template", [
    # no output, a method call every iteration (the call hook checks)
    "{% for i in range(15000) %}{% for j in range(15000) %}{% set _ = 'a'.upper() %}{% endfor %}{% endfor %}",
    # no output and no calls in the inner loop over a pre-built list (the loop guard checks)
    "{% set r = range(100000)|list %}{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}",
    # output captured inside a macro, a set block and a generation block
    "{% macro m() %}{% for i in range(15000) %}{% for j in range(15000) %}x{% endfor %}{% endfor %}{% endmacro %}{{ m() }}",
    "{% set s %}{% for i in range(15000) %}{% for j in range(15000) %}{{ j }}{% endfor %}{% endfor %}{% endset %}",
    "{% generation %}{% for i in range(15000) %}{% for j in range(15000) %}{% endfor %}{% endfor %}{% endgeneration %}",
    # loop over a lazy filter result
    "{% for i in range(100000) %}{% for j in range(100000)|map('string') %}{% endfor %}{% endfor %}",
])
def test_silent_loops_time_out(template: str) -> None:
    message, elapsed = timed_error(template)
    assert "time limit" in message
    assert elapsed < FAST.timeout_s + 1.0


def test_large_output_is_refused_quickly() -> None:
    limits = RenderLimits(timeout_s=30.0, max_output_chars=10_000)
    message, elapsed = timed_error("{% for i in range(100000) %}{{ 'abcdefghij' }}{{ i }}{% endfor %}", limits)
    assert "max_output_chars" in message and "10000" in message
    assert elapsed < 0.5
    assert render_chat_template("{{ 'x' * 10000 }}", CHAT, limits=limits) == "x" * 10000


@pytest.mark.parametrize("template", [
    "{{ 'x' * 10**10 }}", "{{ ['x'] * 10**10 }}", "{{ 'x'|center(10**10) }}", "{{ 'x'.ljust(10**10) }}",
    "{{ ('x' * 5000)|replace('x', 'y' * 5000) }}", "{{ ('x' * 5000).replace('x', 'y' * 5000) }}",
    "{{ ('a\n' * 5000)|indent(5000) }}", "{{ '%10000000000d' % 1 }}", "{{ '%*d' % (10**10, 1) }}",
    "{{ '%10000000000d'|format(1) }}", "{{ '{:>10000000000}'.format(1) }}", "{{ '{:>{}}'.format(1, 10**10) }}",
    "{{ ('y' * 5000).join(['a'] * 5000) }}", "{{ [1]|batch(10**10, 0)|list }}", "{{ lipsum(10**7) }}",
    "{{ 7 ** (10 ** 9) }}", "{{ (2 ** 900000) * (2 ** 900000) }}", "{{ messages|tojson(indent=10**9) }}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
])
def test_amplifiers_are_refused_before_they_allocate(template: str) -> None:
    message, elapsed = timed_error(template, RenderLimits(timeout_s=30.0))
    assert "max_output_chars" in message or "bits" in message or "indent" in message
    assert elapsed < 0.5


def test_compiled_templates_are_cached() -> None:
    from paxserve.engine.chat_template import template as ct

    template = "{{ messages|length }} cached"
    assert render_chat_template(template, CHAT) == "4 cached"
    first = ct._compile(template)
    assert ct._compile(template) is first


def test_concurrent_renders_are_isolated() -> None:
    n_threads, rounds = 8, 15
    templates = [f"T{i}:{{% for m in messages %}}{{{{ m.content|length * {i} }}}},{{% endfor %}}{{{{ extra }}}}"
                 for i in range(n_threads)]
    hostile = "{% for i in range(15000) %}{% for j in range(15000) %}{% endfor %}{% endfor %}"
    results: dict[int, list[str]] = {i: [] for i in range(n_threads)}
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads + 1)

    def worker(i: int) -> None:
        barrier.wait()
        try:
            for r in range(rounds):
                results[i].append(render_chat_template(templates[i], CHAT, template_kwargs={"extra": f"{i}/{r}"}))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def hostile_worker() -> None:
        barrier.wait()
        try:
            render_chat_template(hostile, CHAT, limits=RenderLimits(timeout_s=0.3))
            errors.append(AssertionError("the hostile template was not stopped"))
        except ChatTemplateError as e:
            if "time limit" not in str(e):
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    threads.append(threading.Thread(target=hostile_worker))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    for i in range(n_threads):
        body = "".join(f"{len(m['content']) * i}," for m in CHAT)
        assert results[i] == [f"T{i}:{body}{i}/{r}" for r in range(rounds)]
