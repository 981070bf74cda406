"""The request fields that constrain output: OpenAI's `response_format` and vLLM's
`structured_outputs` / `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.

At most one constraint per request; the result names the field it came from, so a schema that
fails to compile later gets a 400 blaming that field.
"""

from __future__ import annotations

import json
from typing import Any

from paxserve.server.errors import ProtocolError
from paxserve.server.protocol import SamplingFields
from paxserve.structured_outputs import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _params(field: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        message = str(e).replace("StructuredOutputsParams.", f"{field}: ")
        raise ProtocolError(message, param=field) from None


def _from_response_format(value: Any) -> StructuredOutputsParams | None:
    field = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ProtocolError("`response_format` must be an object with a string `type` (text, json_object or "
                            "json_schema)", param=field)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _params(field, json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ProtocolError("`response_format.json_schema` must be an object with a `schema` (and a `name`)",
                                param=field)
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise ProtocolError("`response_format.json_schema.schema` is required", param=field)
        if not isinstance(schema, dict):
            raise ProtocolError("`response_format.json_schema.schema` must be a JSON schema object", param=field)
        return _params(field, json=schema)
    raise ProtocolError(f"`response_format.type` {kind!r} is not supported: use text, json_object or json_schema",
                        param=field)


def _from_structured_outputs(value: Any) -> StructuredOutputsParams:
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise ProtocolError("`structured_outputs` must be an object with one of "
                            f"{', '.join(_STRUCTURED_KEYS)}", param=field)
    unknown = sorted(k for k, v in value.items() if k not in _STRUCTURED_KEYS and v not in (None, False))
    if unknown:
        raise ProtocolError(f"`structured_outputs` fields {unknown} are not supported; use one of "
                            f"{', '.join(_STRUCTURED_KEYS)}", param=field)
    return _params(field, **{k: value[k] for k in _STRUCTURED_KEYS if k in value and value[k] is not None})


def _guided(name: str, value: Any) -> StructuredOutputsParams:
    kind = _GUIDED[name]
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ProtocolError(f"`{name}` must be a JSON schema (an object, or its JSON text)", param=name) from None
    return _params(name, **{kind: value})


def parse_structured_outputs(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from (None, None when unconstrained)."""
    found: list[tuple[StructuredOutputsParams | None, str]] = []
    if req.response_format is not None:
        found.append((_from_response_format(req.response_format), "response_format"))
    if req.structured_outputs not in (None, {}):
        found.append((_from_structured_outputs(req.structured_outputs), "structured_outputs"))
    for name in _GUIDED:
        value = getattr(req, name)
        if value not in (None, [], ""):
            found.append((_guided(name, value), name))
    found = [(c, f) for c, f in found if c is not None]
    if len(found) > 1:
        names = ", ".join(f for _, f in found)
        raise ProtocolError(f"only one output constraint per request; got {names}", param=found[1][1])
    return found[0] if found else (None, None)
