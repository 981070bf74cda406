"""Sandboxed, time- and size-limited chat-template rendering.

Why this exists: chat templates are Jinja programs that arrive from model repositories and, through
the `chat_template` request field, from clients. `tokenizer.apply_chat_template(tokenize=False)`
renders them in Jinja's sandbox, which blocks attribute escapes but not cost: a two-deep
`range(15000)` loop runs for minutes and `'x' * 10**10` asks for 10 GB. `render_chat_template`
produces the same text as transformers for ordinary templates and refuses, with
`ChatTemplateError`, a render that runs past `RenderLimits.timeout_s` or builds more than
`RenderLimits.max_output_chars` characters.

What it matches in transformers (`apply_chat_template` -> `render_jinja_template`): an
`ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks`, the loop-controls extension and a
`{% generation %}` tag whose body renders as written; `tojson` without HTML escaping
(`ensure_ascii=False`, `indent`, `separators`, `sort_keys`); the globals `raise_exception`,
`strftime_now`, a restricted `dict` and a `namespace` that refuses underscore names; message keys whose
value is None are dropped; all template data is rebuilt from plain JSON types; `reasoning_content` /
`thinking` / `reasoning` are aliased; special tokens are passed as variables and request kwargs
override them; `continue_final_message` cuts the text after the final message (same error cases).

How limits are enforced: cooperatively, in the rendering thread. Output pieces from
`Template.generate` are counted and timed; the sandbox hooks that compiled templates call for every
function call, attribute, item lookup and intercepted operator (`* ** + %`) check the deadline first;
every `{% for %}` iterable is wrapped so the deadline is checked every 64 items even when the body
has no output and no calls; strings and lists returned by calls, filters, lookups and operators are
size-checked, and the known amplifiers (string/list repetition, `**`, `center`/`ljust`/`rjust`/
`zfill`, `replace`, `join`, `indent`, `batch`, format widths, `lipsum`, `tojson(indent=...)`) are
refused *before* they allocate.

What cooperative checks cannot interrupt: one long call into Python or C that makes no hooked calls
itself, for example sorting or summing a huge list (`sum(start=[])` over many lists is quadratic),
`wordwrap`/`urlize`/`pprint` on large inputs, or big-integer arithmetic under the bit cap; such a
call runs to completion and the limit fires at the next check. Output captured into a variable
(`{% set %}...{% endset %}`, macro bodies, `{% filter %}` and `{% generation %}` bodies) is only
size-checked when the capture ends, so it can grow at loop speed until the deadline. Compiling a
template is not time-limited (it is roughly linear in the template's length; callers should cap that
length), though compile time counts against the render's budget. Nothing outside the rendering
thread can stop a render; the checks run inside it.

Known differences from transformers: tools must be JSON-schema dicts (no Python callables);
`template_kwargs` that name `messages`, `tools`, `documents` or `add_generation_prompt` are refused
rather than raising TypeError; error messages are worded differently (same cases, all
ChatTemplateError); a lazy filter result printed as-is (`{{ xs|map('upper') }}`) shows a differently
named generator repr.

Where the pieces live: this module holds the public API (`ChatTemplateError`, `RenderLimits`,
`render_chat_template`), the compiled-template cache, input preparation and `continue_final_message`;
`paxserve.engine.chat_template.environment` builds the sandboxed Jinja environment; `paxserve.engine.chat_template.guards`
holds the per-render deadline and size checks the environment calls.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
import numpy as np

from paxserve.engine.chat_template.environment import GuardedEnvironment, TemplateRaised
from paxserve.engine.chat_template.guards import ACTIVE, Aborted, RenderState

__all__ = ["ChatTemplateError", "RenderLimits", "render_chat_template"]


class ChatTemplateError(ValueError):
    """The template could not render these messages (syntax error, raise_exception(), too slow, too large)."""


@dataclass(frozen=True, slots=True)
class RenderLimits:
    """Budget for one render; both limits include everything the template builds along the way."""

    timeout_s: float = 5.0  # wall-clock budget for one render (compile included)
    max_output_chars: int = 8 * 2**20  # rendered text (or any intermediate string/list) larger than this is refused

    def __post_init__(self) -> None:
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"RenderLimits.timeout_s must be a positive, finite number of seconds, got {t!r}")
        n = self.max_output_chars
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"RenderLimits.max_output_chars must be a positive int, got {n!r}")


# ---------------------------------------------------------------------------------------------- cache

_ENV = GuardedEnvironment()
_CACHE_SIZE = 64
_cache: OrderedDict[str, jinja2.Template] = OrderedDict()
_cache_lock = threading.Lock()


def _compile(source: str) -> jinja2.Template:
    with _cache_lock:
        compiled = _cache.get(source)
        if compiled is not None:
            _cache.move_to_end(source)
            return compiled
    try:
        compiled = _ENV.from_string(source)  # outside the lock: two threads may compile one template twice
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error on line {e.lineno}: {_clean(e.message)}") from None
    except Exception as e:  # noqa: BLE001 - e.g. RecursionError on absurd nesting
        raise ChatTemplateError(f"chat template could not be compiled: {_describe(e)}") from None
    with _cache_lock:
        _cache[source] = compiled
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return compiled


# ------------------------------------------------------------------------------------------- messages

_MAX_MESSAGE_CHARS = 1000

_ADDRESS = re.compile(r"\s+at\s+0x[0-9a-fA-F]+")
_HEX = re.compile(r"\b0x[0-9a-fA-F]{8,}\b")
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][\w.\-]+)+\.pyc?\b")


def _clean(message: Any, own_text: bool = False) -> str:
    """An exception message without memory addresses or file paths, cut to a readable length."""
    text = _ADDRESS.sub("", str(message))
    if not own_text:  # the template's own raise_exception() text keeps any hex it chose to print
        text = _PATH.sub("<file>", _HEX.sub("0x...", text))
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[:_MAX_MESSAGE_CHARS] + "..."


def _template_line(e: BaseException) -> int | None:
    tb, line = e.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _describe(e: BaseException) -> str:
    text = _clean(e) or "(no message)"
    return f"{type(e).__name__}: {text}"


# --------------------------------------------------------------------------------------- input data

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def _plain(value: Any) -> Any:
    """Rebuild template data from plain JSON-like types; anything else becomes a `<TypeName>` placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _prepare_chat(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation: pass at least one message")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        chat.append(_with_reasoning_aliases(_plain({k: v for k, v in message.items() if v is not None})))
    return chat


def _tag_final_message(chat: list[dict[str, Any]], template: str, field: str) -> str:
    """Append the continue tag to the final message's `field`; returns the text the render must contain."""
    last = chat[-1]
    final = last.get(field)
    if final is None:
        raise ChatTemplateError(f"continue_final_message is set, but the final message has no {field!r} to continue")
    fields = [field]
    if field in _REASONING_FIELDS:  # reasoning is copied under several names: tag each copy
        fields = [f for f in _REASONING_FIELDS if last.get(f) == final]
    if not any(f in template for f in fields):
        raise ChatTemplateError(f"continue_final_message is set to {field!r}, but the chat template never reads it")
    try:
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ChatTemplateError("continue_final_message is set, but the final message has no text block")
        else:
            for f in fields:
                last[f] = last[f] + _CONTINUE_TAG
        final.strip()
    except (TypeError, AttributeError) as e:
        raise ChatTemplateError(f"continue_final_message cannot continue this final message: {_describe(e)}") from None
    return final


def _cut_after_final(rendered: str, final: str) -> str:
    marker = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or marker not in rendered:
        raise ChatTemplateError(
            "continue_final_message is set, but the rendered chat does not contain the final message "
            f"(the template changes or drops it). Final message: {_clean(final.strip())!r}; "
            f"rendered chat: {_clean(rendered)!r}")
    at = rendered.rindex(marker)
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing whitespace


# --------------------------------------------------------------------------------------------- render

def _run(compiled: jinja2.Template, variables: dict[str, Any], state: RenderState) -> str:
    pieces: list[str] = []
    total = 0
    token = ACTIVE.set(state)
    gen = compiled.generate(**variables)
    try:
        state.check_deadline()  # compile time counts against the budget
        for piece in gen:
            total += len(piece)
            if total > state.limits.max_output_chars:
                state.fail(f"chat template output exceeds the limit of {state.limits.max_output_chars} characters "
                           "(RenderLimits.max_output_chars)")
            state.check_deadline()
            pieces.append(piece)
        if state.failure is not None:  # a check fired but something in between swallowed it
            raise Aborted(state.failure)
    except Aborted as e:
        raise ChatTemplateError(str(e)) from None
    except TemplateRaised as e:
        raise ChatTemplateError(f"chat template raised an error: {_clean(e.message, own_text=True)}") from None
    except Exception as e:  # noqa: BLE001 - anything jinja or the template's data raise
        if state.failure is not None:
            raise ChatTemplateError(state.failure) from None
        line = _template_line(e)
        where = f" on line {line}" if line is not None else ""
        raise ChatTemplateError(f"chat template failed to render{where}: {_describe(e)}") from None
    finally:
        gen.close()
        ACTIVE.reset(token)
    return "".join(pieces)


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    special_tokens: dict[str, str] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    limits: RenderLimits = RenderLimits(),
) -> str:
    """Render `messages` with `template` exactly as `apply_chat_template(..., tokenize=False)` would.

    `continue_final_message` may be True (continue `content`) or a field name such as
    `"reasoning_content"`. `special_tokens` (bos_token, eos_token, ...) and then `template_kwargs`
    become template variables. Raises ChatTemplateError for bad inputs, template errors
    (syntax, undefined names, `raise_exception`), and renders past `limits`."""
    start = time.monotonic()
    if not isinstance(template, str):
        raise ChatTemplateError(f"the chat template must be a string, got {type(template).__name__}")
    if not isinstance(limits, RenderLimits):
        raise ChatTemplateError(f"limits must be a RenderLimits, got {type(limits).__name__}")
    chat = _prepare_chat(messages)
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set: the first "
                                "continues the final message, the second starts a new assistant message")
    compiled = _compile(template)
    if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools)):
        raise ChatTemplateError("tools must be a list of JSON-schema dicts")
    if documents is not None and (not isinstance(documents, (list, tuple))
                                  or not all(isinstance(d, Mapping) for d in documents)):
        raise ChatTemplateError("documents must be a list of dicts (with 'title' and 'text' keys)")
    extra = {**(special_tokens or {}), **(template_kwargs or {})}
    clash = sorted(_RESERVED & extra.keys())
    if clash:
        raise ChatTemplateError(f"template kwargs may not set {', '.join(clash)}: these are set by the renderer")
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = _tag_final_message(chat, template, field)
    variables = {"messages": chat, "tools": _plain(tools), "documents": _plain(documents),
                 "add_generation_prompt": add_generation_prompt, **_plain(extra)}
    rendered = _run(compiled, variables, RenderState(limits, start))
    return rendered if final is None else _cut_after_final(rendered, final)
