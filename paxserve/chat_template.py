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
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import inspect
import json
import math
import re
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


if _version(importlib.metadata.version("jinja2")) < (3, 1, 6):  # older releases have known sandbox escapes
    raise ImportError("paxserve.chat_template needs jinja2>=3.1.6 (earlier versions have sandbox escapes)")

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


# ---------------------------------------------------------------------------------------------- limits

_MAX_INT_BITS = 1 << 20  # ints past ~315k digits cannot be printed anyway and cost real time to build
_MAX_JSON_INDENT = 1024
_CHECK_EVERY = 64  # loop items between deadline checks (power of two)
_MAX_MESSAGE_CHARS = 1000


class _Aborted(Exception):
    """A limit was hit. Deliberately not a ValueError/TypeError/LookupError, so jinja never swallows it."""


class _NotRendering(Exception):
    """Raised by guarded filters outside a render: stops jinja from folding them at compile time."""


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """What `raise_exception(message)` raises (a TemplateError, as in transformers)."""


class _RenderState:
    __slots__ = ("deadline", "limits", "failure")

    def __init__(self, limits: RenderLimits, start: float) -> None:
        self.limits = limits
        self.deadline = start + limits.timeout_s
        self.failure: str | None = None

    def fail(self, message: str) -> None:
        self.failure = self.failure or message  # remembered, in case something swallows the exception
        raise _Aborted(self.failure)

    def check_deadline(self) -> None:
        if time.monotonic() > self.deadline:
            self.fail(f"chat template rendering exceeded the time limit of {self.limits.timeout_s:g} s "
                      "(RenderLimits.timeout_s)")

    def check_size(self, size: int, what: str = "intermediate value") -> None:
        if size > self.limits.max_output_chars:
            self.fail(f"chat template {what} would hold {size} characters or items, over the limit of "
                      f"{self.limits.max_output_chars} (RenderLimits.max_output_chars)")

    def check_value(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple)):
            self.check_size(len(value))
        elif isinstance(value, types.GeneratorType):
            return _guarded_generator(value, self)
        return value


_ACTIVE: ContextVar[_RenderState | None] = ContextVar("paxserve_chat_template_render", default=None)


def _guarded_generator(inner: Iterator[Any], state: _RenderState) -> Iterator[Any]:
    for i, item in enumerate(inner):
        if not i & (_CHECK_EVERY - 1):
            state.check_deadline()
        yield item


class _GuardedIterable:
    """What every `{% for %}` iterates: the original iterable, with a deadline check every 64 items.

    `__len__` delegates (raising TypeError when the original has no length), so `loop.length` and
    `loop.last` behave exactly as on the original."""

    __slots__ = ("_inner",)

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __iter__(self) -> Iterator[Any]:
        state = _ACTIVE.get()
        if state is None:
            return iter(self._inner)
        return _guarded_generator(iter(self._inner), state)

    def __len__(self) -> int:
        return len(self._inner)

    def __bool__(self) -> bool:
        return bool(self._inner)


def _guard_loop(iterable: Any) -> _GuardedIterable:
    return _GuardedIterable(iterable)


# ------------------------------------------------------------------------------- amplifier pre-checks

_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:((?:[^{}]|\{[^{}]*\})*)\}")


def _as_width(digits: str) -> int:
    return int(digits) if len(digits) <= 18 else 10**18


def _format_width(fmt: str, args: Any, brace: bool) -> int:
    """Largest field width or precision a format string can ask for (a heuristic upper bound)."""
    widest, from_args = 0, False
    if brace:
        for spec in _BRACE_SPEC.findall(fmt):
            from_args |= "{" in spec
            widest = max([widest, *(_as_width(d) for d in re.findall(r"\d+", spec))])
    else:
        for width, precision in _PERCENT_SPEC.findall(fmt):
            for part in (width, precision):
                from_args |= part == "*"
                if part.isdigit():
                    widest = max(widest, _as_width(part))
    if from_args:  # widths taken from the arguments: any int argument may be one
        values = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, (list, tuple)) else [args]
        for v in values:
            for x in (v.values() if isinstance(v, Mapping) else [v]):
                if isinstance(x, int):
                    widest = max(widest, x)
    return widest


def _precheck_binop(state: _RenderState, op: str, left: Any, right: Any) -> None:
    seq = (str, list, tuple)
    if op == "*":
        if isinstance(left, seq) and isinstance(right, int):
            state.check_size(len(left) * max(right, 0), "repetition")
        elif isinstance(right, seq) and isinstance(left, int):
            state.check_size(len(right) * max(left, 0), "repetition")
        elif isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > _MAX_INT_BITS:
            state.fail(f"chat template integer product would exceed {_MAX_INT_BITS} bits")
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if left.bit_length() * right > _MAX_INT_BITS:
                state.fail(f"chat template power would exceed {_MAX_INT_BITS} bits")
    elif op == "+":
        if isinstance(left, seq) and isinstance(right, seq):
            state.check_size(len(left) + len(right), "concatenation")
    elif op == "%" and isinstance(left, str):
        state.check_size(len(left) + _format_width(left, right, brace=False), "formatted string")


def _precheck_str_method(state: _RenderState, s: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        state.check_size(args[0], f"str.{name}() result")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = s.count(args[0]) if args[0] else len(s) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            count = min(count, args[2])
        state.check_size(len(s) + count * len(args[1]), "str.replace() result")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            state.check_size(len(s) + s.count("\t") * max(size, 0), "str.expandtabs() result")
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        items = args[0]
        state.check_size(len(s) * len(items) + sum(len(x) for x in items if isinstance(x, str)), "str.join() result")


def _width_of(value: Any) -> int:
    return len(value) if isinstance(value, str) else value if isinstance(value, int) else 0


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _pre_center(state: _RenderState, a: dict[str, Any]) -> None:
    state.check_size(_width_of(a.get("width", 80)), "center result")


def _pre_indent(state: _RenderState, a: dict[str, Any]) -> None:
    s = _text(a.get("s"))
    state.check_size(len(s) + (s.count("\n") + 1) * _width_of(a.get("width", 4)), "indent result")


def _pre_replace(state: _RenderState, a: dict[str, Any]) -> None:
    s, old, new = _text(a.get("s")), _text(a.get("old")), _text(a.get("new"))
    count = s.count(old) if old else len(s) + 1
    if isinstance(a.get("count"), int) and a["count"] >= 0:
        count = min(count, a["count"])
    state.check_size(len(s) + count * len(new), "replace result")


def _pre_format(state: _RenderState, a: dict[str, Any]) -> None:
    value = _text(a.get("value"))
    state.check_size(len(value) + _format_width(value, a.get("kwargs") or a.get("args", ()), brace=False), "format result")


def _pre_join(state: _RenderState, a: dict[str, Any]) -> None:
    value, sep = a.get("value"), a.get("d", "")
    if isinstance(value, (list, tuple)) and isinstance(sep, str):
        state.check_size(len(sep) * len(value), "join result")


def _pre_batch(state: _RenderState, a: dict[str, Any]) -> None:
    if a.get("fill_with") is not None and isinstance(a.get("linecount"), int):
        state.check_size(a["linecount"], "batch result")


def _pre_tojson(state: _RenderState, a: dict[str, Any]) -> None:
    if _width_of(a.get("indent")) > _MAX_JSON_INDENT:
        state.fail(f"chat template tojson indent is larger than {_MAX_JSON_INDENT}")


def _pre_wordwrap(state: _RenderState, a: dict[str, Any]) -> None:
    s, wrap, width = _text(a.get("s")), a.get("wrapstring"), a.get("width", 79)
    if isinstance(wrap, str) and len(wrap) > 1:
        lines = len(s) // max(width if isinstance(width, int) else 1, 1) + s.count(" ") + s.count("\n") + 1
        state.check_size(len(s) + lines * len(wrap), "wordwrap result")


_FILTER_PRECHECKS: dict[str, Callable[[_RenderState, dict[str, Any]], None]] = {
    "center": _pre_center, "indent": _pre_indent, "replace": _pre_replace, "format": _pre_format,
    "join": _pre_join, "batch": _pre_batch, "tojson": _pre_tojson, "wordwrap": _pre_wordwrap,
}


def _guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    precheck = _FILTER_PRECHECKS.get(name)
    signature = inspect.signature(func) if precheck is not None else None

    @functools.wraps(func)  # copies `jinja_pass_arg`, so jinja still passes context/eval_ctx/environment
    def guarded(*args: Any, **kwargs: Any) -> Any:
        state = _ACTIVE.get()
        if state is None:
            raise _NotRendering(name)
        state.check_deadline()
        if precheck is not None and signature is not None:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                pass  # the call itself will report the bad arguments
            else:
                precheck(state, bound.arguments)
        return state.check_value(func(*args, **kwargs))

    return guarded


# -------------------------------------------------------------------------------- environment pieces

def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Plain json.dumps: Jinja's own tojson escapes <, >, & and ' for HTML, which chat templates must not do.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    state = _ACTIVE.get()
    if state is not None and isinstance(n, int) and isinstance(max, int):
        state.check_size(n * max * 12, "lipsum result")
    return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)


class _TemplateDict:
    """The `dict` global: builds dicts, but exposes nothing of the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)`, refusing underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - `namespace(self=...)` must still work
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attributes may not start with '_' (got {name!r})")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks assistant text for training masks; renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _GuardedCodeGenerator(CodeGenerator):
    """Compiles `{% for x in it %}` as `for x in guard_loop(it)` (through the sandbox's call hook)."""

    def visit_For(self, node: jinja2.nodes.For, frame: Frame) -> None:
        it = node.iter
        if not (isinstance(it, jinja2.nodes.Call) and isinstance(it.node, jinja2.nodes.EnvironmentAttribute)
                and it.node.name == "paxserve_guard_loop"):
            guard = jinja2.nodes.EnvironmentAttribute("paxserve_guard_loop", lineno=it.lineno)
            node.iter = jinja2.nodes.Call(guard, [it], [], None, None, lineno=it.lineno)
        super().visit_For(node, frame)


class _GuardedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment, with deadline and size checks in the sandbox hooks."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _GuardedCodeGenerator

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.paxserve_guard_loop = _guard_loop
        self.filters["tojson"] = _tojson
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                            namespace=_TemplateNamespace, lipsum=_lipsum)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        state = _ACTIVE.get()
        if state is None:
            return super().call(__context, __obj, *args, **kwargs)
        state.check_deadline()
        if isinstance(__obj, types.BuiltinMethodType) and isinstance(getattr(__obj, "__self__", None), str):
            _precheck_str_method(state, __obj.__self__, __obj.__name__, args, kwargs)
        return state.check_value(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        state = _ACTIVE.get()
        if state is None:
            return super().getattr(obj, attribute)
        state.check_deadline()
        return state.check_value(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        state = _ACTIVE.get()
        if state is None:
            return super().getitem(obj, argument)
        state.check_deadline()
        return state.check_value(super().getitem(obj, argument))

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        state = _ACTIVE.get()
        if state is None:
            return super().call_binop(context, operator, left, right)
        state.check_deadline()
        _precheck_binop(state, operator, left, right)
        return state.check_value(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None
        template: str = value.__self__

        @functools.wraps(fmt)
        def checked(*args: Any, **kwargs: Any) -> str:
            state = _ACTIVE.get()
            if state is not None:
                state.check_size(len(template) + _format_width(template, [*args, *kwargs.values()], brace=True),
                                 "formatted string")
            return fmt(*args, **kwargs)

        return checked


# ---------------------------------------------------------------------------------------------- cache

_ENV = _GuardedEnvironment()
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

def _run(compiled: jinja2.Template, variables: dict[str, Any], state: _RenderState) -> str:
    pieces: list[str] = []
    total = 0
    token = _ACTIVE.set(state)
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
            raise _Aborted(state.failure)
    except _Aborted as e:
        raise ChatTemplateError(str(e)) from None
    except _TemplateRaised as e:
        raise ChatTemplateError(f"chat template raised an error: {_clean(e.message, own_text=True)}") from None
    except Exception as e:  # noqa: BLE001 - anything jinja or the template's data raise
        if state.failure is not None:
            raise ChatTemplateError(state.failure) from None
        line = _template_line(e)
        where = f" on line {line}" if line is not None else ""
        raise ChatTemplateError(f"chat template failed to render{where}: {_describe(e)}") from None
    finally:
        gen.close()
        _ACTIVE.reset(token)
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
    rendered = _run(compiled, variables, _RenderState(limits, start))
    return rendered if final is None else _cut_after_final(rendered, final)
