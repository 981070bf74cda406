"""The deadline and size checks that the chat-template sandbox calls while a template renders.

Why this is its own module: the checks are the part of `paxserve.engine.chat_template.template` that decides what a
template may cost, and they are the same for every hook that calls them (sandbox call/attribute/item/
operator hooks, `{% for %}` iterables, filters). Keeping them apart from the Jinja environment and the
public render function keeps each piece small enough to audit. The render in progress is found
through a context variable, so concurrent renders in different threads never see each other's
budget, and code that runs outside a render (compile-time constant folding) is left alone or refused.
"""

from __future__ import annotations

import functools
import inspect
import re
import time
import types
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only for annotations: chat_template imports this module
    from paxserve.engine.chat_template.template import RenderLimits

__all__ = ["ACTIVE", "Aborted", "RenderState", "format_width", "guard_filter", "guard_loop", "precheck_binop",
           "precheck_str_method"]

_MAX_INT_BITS = 1 << 20  # ints past ~315k digits cannot be printed anyway and cost real time to build
_MAX_JSON_INDENT = 1024
_CHECK_EVERY = 64  # loop items between deadline checks (power of two)


class Aborted(Exception):
    """A limit was hit. Deliberately not a ValueError/TypeError/LookupError, so jinja never swallows it."""


class _NotRendering(Exception):
    """Raised by guarded filters outside a render: stops jinja from folding them at compile time."""


class RenderState:
    """The deadline and size budget of the render running in this context; every check reads it."""

    __slots__ = ("deadline", "limits", "failure")

    def __init__(self, limits: RenderLimits, start: float) -> None:
        self.limits = limits
        self.deadline = start + limits.timeout_s
        self.failure: str | None = None

    def fail(self, message: str) -> None:
        self.failure = self.failure or message  # remembered, in case something swallows the exception
        raise Aborted(self.failure)

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


ACTIVE: ContextVar[RenderState | None] = ContextVar("paxserve_chat_template_render", default=None)


def _guarded_generator(inner: Iterator[Any], state: RenderState) -> Iterator[Any]:
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
        state = ACTIVE.get()
        if state is None:
            return iter(self._inner)
        return _guarded_generator(iter(self._inner), state)

    def __len__(self) -> int:
        return len(self._inner)

    def __bool__(self) -> bool:
        return bool(self._inner)


def guard_loop(iterable: Any) -> _GuardedIterable:
    return _GuardedIterable(iterable)


# ------------------------------------------------------------------------------- amplifier pre-checks

_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:((?:[^{}]|\{[^{}]*\})*)\}")


def _as_width(digits: str) -> int:
    return int(digits) if len(digits) <= 18 else 10**18


def format_width(fmt: str, args: Any, brace: bool) -> int:
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


def precheck_binop(state: RenderState, op: str, left: Any, right: Any) -> None:
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
        state.check_size(len(left) + format_width(left, right, brace=False), "formatted string")


def precheck_str_method(state: RenderState, s: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
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


def _pre_center(state: RenderState, a: dict[str, Any]) -> None:
    state.check_size(_width_of(a.get("width", 80)), "center result")


def _pre_indent(state: RenderState, a: dict[str, Any]) -> None:
    s = _text(a.get("s"))
    state.check_size(len(s) + (s.count("\n") + 1) * _width_of(a.get("width", 4)), "indent result")


def _pre_replace(state: RenderState, a: dict[str, Any]) -> None:
    s, old, new = _text(a.get("s")), _text(a.get("old")), _text(a.get("new"))
    count = s.count(old) if old else len(s) + 1
    if isinstance(a.get("count"), int) and a["count"] >= 0:
        count = min(count, a["count"])
    state.check_size(len(s) + count * len(new), "replace result")


def _pre_format(state: RenderState, a: dict[str, Any]) -> None:
    value = _text(a.get("value"))
    state.check_size(len(value) + format_width(value, a.get("kwargs") or a.get("args", ()), brace=False), "format result")


def _pre_join(state: RenderState, a: dict[str, Any]) -> None:
    value, sep = a.get("value"), a.get("d", "")
    if isinstance(value, (list, tuple)) and isinstance(sep, str):
        state.check_size(len(sep) * len(value), "join result")


def _pre_batch(state: RenderState, a: dict[str, Any]) -> None:
    if a.get("fill_with") is not None and isinstance(a.get("linecount"), int):
        state.check_size(a["linecount"], "batch result")


def _pre_tojson(state: RenderState, a: dict[str, Any]) -> None:
    if _width_of(a.get("indent")) > _MAX_JSON_INDENT:
        state.fail(f"chat template tojson indent is larger than {_MAX_JSON_INDENT}")


def _pre_wordwrap(state: RenderState, a: dict[str, Any]) -> None:
    s, wrap, width = _text(a.get("s")), a.get("wrapstring"), a.get("width", 79)
    if isinstance(wrap, str) and len(wrap) > 1:
        lines = len(s) // max(width if isinstance(width, int) else 1, 1) + s.count(" ") + s.count("\n") + 1
        state.check_size(len(s) + lines * len(wrap), "wordwrap result")


_FILTER_PRECHECKS: dict[str, Callable[[RenderState, dict[str, Any]], None]] = {
    "center": _pre_center, "indent": _pre_indent, "replace": _pre_replace, "format": _pre_format,
    "join": _pre_join, "batch": _pre_batch, "tojson": _pre_tojson, "wordwrap": _pre_wordwrap,
}


def guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    precheck = _FILTER_PRECHECKS.get(name)
    signature = inspect.signature(func) if precheck is not None else None

    @functools.wraps(func)  # copies `jinja_pass_arg`, so jinja still passes context/eval_ctx/environment
    def guarded(*args: Any, **kwargs: Any) -> Any:
        state = ACTIVE.get()
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
