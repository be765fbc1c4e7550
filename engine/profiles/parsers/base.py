"""What a tool-call parser is, and the reading every family shares: JSON calls, schema typing."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from engine.profiles.base import ToolCall

Schemas = Mapping[str, Any]  # tool name -> its JSON schema `parameters` (what typing reads)


@attrs.frozen
class ParsedTurn:
    """A model turn read by a parser: the text outside the calls, and the calls in order.

    A call that could not be read is a `ToolCall` with `error` set (answered with an error
    observation), never dropped and never left in `content` as if it were an answer.
    """

    content: str
    calls: tuple[ToolCall, ...] = ()


class ToolParser(Protocol):
    """One family's tool-call format, under an SGLang `--tool-call-parser` name."""

    name: str
    reasoning: bool  # whether `<think>...</think>` is split off before `parse` (harmony has its own channels)
    # Optional (read with a default of ()): special tokens other than the one the chat template
    # closes a turn with that also end the model's turn with calls (Llama 3.1's `<|eom_id|>`
    # beside the template's `<|eot_id|>`). A turn the server ended with one keeps it, and the
    # tool results follow it without the template's closing token.
    turn_ends: tuple[str, ...]

    def parse(self, text: str, schemas: Schemas) -> ParsedTurn:
        """Read one turn (reasoning already split off). Never raises on any text."""
        ...


class BadArgument(ValueError):
    """A value that does not fit its argument's schema; the message names the argument."""


def malformed(detail: str, name: str = "") -> ToolCall:
    """A call that could not be read: the model gets `detail` as its error observation."""
    return ToolCall(name, error="malformed_call", detail=detail)


def json_call(name: Any, arguments: Any, call_id: Any = None) -> ToolCall:
    """A call whose arguments the format wrote as JSON (an object, or a string holding one);
    `call_id`, the id the format gave it, if any (a template may show it with the result)."""
    if not isinstance(name, str) or not name:
        return malformed("a tool call needs a function name")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            return malformed(f"the arguments of {name} are not valid JSON: {exc}", name)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return malformed(f"the arguments of {name} must be a JSON object, got {type(arguments).__name__}", name)
    return ToolCall(name, arguments, id=call_id if isinstance(call_id, str) and call_id else None)


def call_from_json_text(body: str, what: str, name: str | None = None, call_id: str | None = None) -> ToolCall:
    """A call from JSON text: `{"name", "arguments"|"parameters"}`, or the arguments of `name`."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        return malformed(f"{what} is not valid JSON: {exc}", name or "")
    if name is not None:
        return json_call(name, data, call_id)
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return malformed(f'{what} must be a JSON object {{"name": ..., "arguments": {{...}}}}')
    arguments = data["arguments"] if "arguments" in data else data.get("parameters", {})
    return json_call(data["name"], arguments)


def schema_type(prop: Any) -> str | None:
    """The JSON type a parameter's schema asks for (the first non-null one), or None if it says none."""
    if not isinstance(prop, dict):
        return None
    kind = prop.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if isinstance(kind, str):
        return kind
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in prop.get(key) or ():
            found = schema_type(branch)
            if found is not None and found != "null":
                return found
    enum = prop.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "string"
    if "properties" in prop:
        return "object"
    if "items" in prop:
        return "array"
    return None


def properties(schemas: Schemas, tool: str) -> dict[str, Any]:
    """The declared parameters of `tool` ({} for a tool not offered or a schema without any)."""
    params = schemas.get(tool)
    props = params.get("properties") if isinstance(params, dict) else None
    return props if isinstance(props, dict) else {}


def typed_value(argument: str, raw: str, prop: Any, *, undeclared_json: bool = False) -> Any:
    """A value the format wrote as text, typed by its parameter's schema.

    A string parameter keeps the text as written. Numbers, booleans, objects and arrays are
    read as JSON; a value that does not fit raises `BadArgument` naming the argument (SGLang
    keeps such a value as a string or coerces it; the engine tells the model instead).
    An undeclared parameter stays a string, or is read as JSON when it parses and the family
    does so (`undeclared_json`, GLM).
    """
    kind = schema_type(prop)
    if kind is None or kind == "string":
        if kind is None and undeclared_json:
            try:
                return json.loads(raw)
            except ValueError:
                return raw
        return raw
    text = raw.strip()
    if text.lower() == "null":
        return None
    if kind == "boolean":
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise BadArgument(f"argument {argument!r} must be true or false, got {_short(raw)}")
    try:
        value = json.loads(text)
    except ValueError:
        value = attrs.NOTHING
    if kind == "integer":
        if isinstance(value, float) and value.is_integer() and "." not in text and "e" not in text.lower():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise BadArgument(f"argument {argument!r} must be an integer, got {_short(raw)}")
    if kind == "number":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        raise BadArgument(f"argument {argument!r} must be a number, got {_short(raw)}")
    if kind == "object" and isinstance(value, dict) or kind == "array" and isinstance(value, list):
        return value
    if kind in ("object", "array"):
        raise BadArgument(f"argument {argument!r} must be a JSON {kind}, got {_short(raw)}")
    return raw if value is attrs.NOTHING else value  # a type the engine does not know: JSON if it parses


def typed_call(name: str, pairs: list[tuple[str, str]], schemas: Schemas, *, undeclared_json: bool = False) -> ToolCall:
    """A call whose arguments the format wrote as (name, text) pairs, typed by the tool's schema."""
    name = name.strip()
    if not name:
        return malformed("a tool call needs a function name")
    props = properties(schemas, name)
    arguments: dict[str, Any] = {}
    try:
        for key, raw in pairs:
            key = key.strip()
            if key in arguments:
                raise BadArgument(f"argument {key!r} is given twice")
            arguments[key] = typed_value(key, raw, props.get(key), undeclared_json=undeclared_json)
    except BadArgument as exc:
        return ToolCall(name, error="bad_arguments", detail=f"{name}: {exc}")
    return ToolCall(name, arguments)


def split_blocks(text: str, start: str, end: str) -> tuple[str, list[str], bool]:
    """Blocks `start`...`end` of `text`: (text outside them, their bodies, whether the last is left open)."""
    outside: list[str] = []
    bodies: list[str] = []
    pos = 0
    while True:
        s = text.find(start, pos)
        if s < 0:
            outside.append(text[pos:])
            return "".join(outside), bodies, False
        outside.append(text[pos:s])
        e = text.find(end, s + len(start))
        if e < 0:
            bodies.append(text[s + len(start):])
            return "".join(outside), bodies, True
        bodies.append(text[s + len(start):e])
        pos = e + len(end)


def _short(raw: str, limit: int = 60) -> str:
    return repr(raw if len(raw) <= limit else raw[:limit] + "...")
