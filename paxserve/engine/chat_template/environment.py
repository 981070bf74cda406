"""The Jinja environment chat templates render in: transformers' sandbox, with paxserve's checks wired in.

Why this is its own module: it is the one place that says what a template can reach. It reproduces
the environment transformers' `render_jinja_template` builds (`ImmutableSandboxedEnvironment`,
`trim_blocks`, `lstrip_blocks`, loop controls, `{% generation %}`, its `tojson` and globals) and
routes every sandbox hook, filter and `{% for %}` iterable through `paxserve.engine.chat_template.guards`.
Rendering, caching and the public API live in `paxserve.engine.chat_template.template`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import re
import types
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

from paxserve.engine.chat_template.guards import (ACTIVE, format_width, guard_filter, guard_loop, precheck_binop,
                                           precheck_str_method)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


if _version(importlib.metadata.version("jinja2")) < (3, 1, 6):  # older releases have known sandbox escapes
    raise ImportError("paxserve.engine.chat_template.template needs jinja2>=3.1.6 (earlier versions have sandbox escapes)")

__all__ = ["GuardedEnvironment", "TemplateRaised"]


class TemplateRaised(jinja2.exceptions.TemplateError):
    """What `raise_exception(message)` raises (a TemplateError, as in transformers)."""


def _raise_exception(message: Any) -> None:
    raise TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Plain json.dumps: Jinja's own tojson escapes <, >, & and ' for HTML, which chat templates must not do.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    state = ACTIVE.get()
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


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment, with deadline and size checks in the sandbox hooks."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _GuardedCodeGenerator

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.paxserve_guard_loop = guard_loop
        self.filters["tojson"] = _tojson
        self.filters = {name: guard_filter(name, f) for name, f in self.filters.items()}
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                            namespace=_TemplateNamespace, lipsum=_lipsum)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        state = ACTIVE.get()
        if state is None:
            return super().call(__context, __obj, *args, **kwargs)
        state.check_deadline()
        if isinstance(__obj, types.BuiltinMethodType) and isinstance(getattr(__obj, "__self__", None), str):
            precheck_str_method(state, __obj.__self__, __obj.__name__, args, kwargs)
        return state.check_value(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        state = ACTIVE.get()
        if state is None:
            return super().getattr(obj, attribute)
        state.check_deadline()
        return state.check_value(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        state = ACTIVE.get()
        if state is None:
            return super().getitem(obj, argument)
        state.check_deadline()
        return state.check_value(super().getitem(obj, argument))

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        state = ACTIVE.get()
        if state is None:
            return super().call_binop(context, operator, left, right)
        state.check_deadline()
        precheck_binop(state, operator, left, right)
        return state.check_value(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None
        template: str = value.__self__

        @functools.wraps(fmt)
        def checked(*args: Any, **kwargs: Any) -> str:
            state = ACTIVE.get()
            if state is not None:
                state.check_size(len(template) + format_width(template, [*args, *kwargs.values()], brace=True),
                                 "formatted string")
            return fmt(*args, **kwargs)

        return checked
