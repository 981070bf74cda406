"""OpenAI `tools` / `tool_choice` checks, and the JSON schemas that guide output when tool_choice
forces a call (the output is then read by guided.py's parsers)."""

from __future__ import annotations

import copy
import re
from typing import Any

FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule
TOOL_CHOICE_STRINGS = ("none", "auto", "required")
_TOOL_CHOICE_SHAPES = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    if params is None:
        return {"type": "object", "properties": {}}
    return copy.deepcopy(params)  # the caller may edit the schema; the request stays as sent


def named_tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The schema of the function's arguments: tool_choice named it, so the output is its arguments."""
    return _parameters(tool)


def required_tools_schema(tools: list[dict[str, Any]], parallel_tool_calls: bool) -> dict[str, Any]:
    """An array of one or more `{"name", "parameters"}` calls to any of tools (tool_choice="required").
    A tool's parameters that use `$ref` (into its own `$defs`, or itself) sit under the root's
    `$defs` with their pointers moved there: nested in the array, "#/$defs/X" would point nowhere."""
    defs: dict[str, Any] = {}
    variants = []
    for i, tool in enumerate(tools):
        params = _parameters(tool)
        if _has_ref(params):
            defs[f"tool{i}"] = _move_refs(params, f"#/$defs/tool{i}")
            params = {"$ref": f"#/$defs/tool{i}"}
        variants.append({
            "type": "object",
            "properties": {"name": {"const": tool["function"]["name"]}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1}
    if defs:
        schema["$defs"] = defs
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    schema["items"] = {"anyOf": variants}
    return schema


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return isinstance(node.get("$ref"), str) or any(_has_ref(v) for v in node.values())
    return isinstance(node, list) and any(_has_ref(v) for v in node)


def _move_refs(node: Any, root: str) -> Any:
    """`node` with every local pointer ("#", "#/...") now relative to `root`."""
    if isinstance(node, dict):
        out = {k: _move_refs(v, root) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = root + ref[1:]
        return out
    if isinstance(node, list):
        return [_move_refs(v, root) for v in node]
    return node


def validate_tools(value: Any) -> list[dict[str, Any]]:
    """The request's `tools` (None: none), checked; raises ValueError naming the field."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError("tools must be an array of tools")
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where} must be an object")
        if tool.get("type") != "function":
            raise ValueError(f"{where}.type must be 'function'")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name must be a non-empty string")
        if not FUNCTION_NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name[:80]!r}")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"{where}.function.strict must be a boolean")
    return value


def validate_tool_choice(value: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    """The request's `tool_choice` against its (validated) tools; None gives OpenAI's default
    ("auto" with tools, "none" without). Raises ValueError naming the field."""
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in TOOL_CHOICE_STRINGS:
            raise ValueError(f"tool_choice must be {_TOOL_CHOICE_SHAPES}, got {value[:80]!r}")
        if value == "required" and not tools:
            raise ValueError("tool_choice 'required' needs at least one tool in tools")
        return value
    if not isinstance(value, dict) or value.get("type") != "function":
        raise ValueError(f"tool_choice must be {_TOOL_CHOICE_SHAPES}")
    function = value.get("function")
    if not isinstance(function, dict):
        raise ValueError("tool_choice.function must be an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("tool_choice.function.name must be a non-empty string")
    if not any(tool["function"]["name"] == name for tool in tools):
        raise ValueError(f"tool_choice names function {name[:80]!r}, which is not in tools")
    return value
