"""What a request's output must match: vLLM's `StructuredOutputsParams` (one of a JSON schema, any
JSON object, a regular expression, a choice of strings, or a Lark/GBNF grammar)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# Kinds, in the order their fields are listed: exactly one is set.
KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1_000_000  # a megabyte of schema is a mistake, and would be held in the cache


def _fail(name: str, value: object, allowed: str) -> None:
    text = json.dumps(value, default=str)[:100] if not isinstance(value, str) else repr(value[:100])
    raise ValueError(f"StructuredOutputsParams.{name}={text} is invalid: {allowed}")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Exactly one constraint. `json` is a JSON schema (a dict or its JSON text), `json_object`
    any JSON object, `regex` a regular expression the whole output matches, `choice` a list of
    strings the output is one of, `grammar` a Lark (or llama.cpp GBNF) grammar."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    # (kind, canonical text), computed once: a schema of up to a megabyte is not re-serialized per use.
    key: tuple[str, str] = field(init=False, repr=False, compare=False, default=("", ""))

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"StructuredOutputsParams needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(set_kinds) or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    _fail("json", self.json, f"a JSON schema must be valid JSON ({e})")
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                _fail("json", self.json, "a JSON schema must be an object (or true/false)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            _fail("regex", self.regex, "must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            _fail("grammar", self.grammar, "must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    any(not isinstance(c, str) or not c for c in self.choice):
                _fail("choice", self.choice, "must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        object.__setattr__(self, "key", self._canonical())
        if len(self.key[1]) > MAX_SPEC_CHARS:
            raise ValueError(f"StructuredOutputsParams.{self.kind} is {len(self.key[1])} characters long; at most "
                             f"{MAX_SPEC_CHARS} are allowed")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def _canonical(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar."""
        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            # Not key-sorted: property order is the order the output writes them in.
            return kind, json.dumps(schema, separators=(",", ":"))
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        return kind, getattr(self, kind)
