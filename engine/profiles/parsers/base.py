"""What a tool-call parser is, and the reading every family shares: JSON calls, schema typing."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from engine.profiles.base import ToolCall
from engine.profiles.parsers.values import BadArgument, Reading, arguments_schema, matching_branches, property_schema, read_value

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
    # Optional (read with a default of ()): special tokens other than the one the chat template
    # closes a turn with that also end the model's turn with calls (Llama 3.1's `<|eom_id|>`
    # beside the template's `<|eot_id|>`). A turn the server ended with one keeps it, and the
    # tool results follow it without the template's closing token.
    turn_ends: tuple[str, ...]

    def parse(self, text: str, schemas: Schemas) -> ParsedTurn:
        """Read one turn (what the reasoning parser leaves of it). Never raises on any text."""
        ...


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


def calls_from_json_text(body: str, what: str) -> list[ToolCall]:
    """The calls of one JSON text: an object `{"name", "arguments"|"parameters"}`, or an array of them."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        return [malformed(f"{what} is not valid JSON: {exc}")]
    if isinstance(data, list):
        if not data:
            return [malformed(f"{what} is an empty array")]
        return [_named_call(item, what) for item in data]
    return [_named_call(data, what)]


def _named_call(data: Any, what: str) -> ToolCall:
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return malformed(f'{what} must be a JSON object {{"name": ..., "arguments": {{...}}}} (or an array of them)')
    arguments = data["arguments"] if "arguments" in data else data.get("parameters", {})
    return json_call(data["name"], arguments)


def properties_of(schemas: Schemas, tool: str) -> dict[str, Any]:
    """The parameters `tool` declares: its schema's `properties`, or, for a root `anyOf`/`oneOf`/`allOf`
    of object schemas, every branch's (the first declaration of a name wins)."""
    return _properties(schemas.get(tool))


def _properties(schema: Any) -> dict[str, Any]:
    if not isinstance(schema, dict):
        return {}
    props = schema.get("properties")
    if isinstance(props, dict):
        return props
    merged: dict[str, Any] = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(keyword) if isinstance(schema.get(keyword), list) else ():
            for key, value in _properties(branch).items():
                merged.setdefault(key, value)
    return merged


def call_from_json_text(body: str, what: str, name: str | None = None, call_id: str | None = None) -> ToolCall:
    """A call from JSON text: `{"name", "arguments"|"parameters"}`, or the arguments of `name`."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        return malformed(f"{what} is not valid JSON: {exc}", name or "")
    if name is not None:
        return json_call(name, data, call_id)
    return _named_call(data, what)


_AS_WRITTEN = Reading()


def typed_call(name: str, pairs: list[tuple[str, str]], schemas: Schemas, reading: Reading = _AS_WRITTEN) -> ToolCall:
    """A call whose arguments the format wrote as (name, text) pairs, each read by its parameter's
    schema (`engine.profiles.parsers.values`) as `reading` says this family does."""
    name = name.strip()
    if not name:
        return malformed("a tool call needs a function name")
    params = arguments_schema(schemas, name)
    within = matching_branches(params, pairs, reading)  # a root union of object shapes: the ones this call picks
    arguments: dict[str, Any] = {}
    try:
        for key, raw in pairs:
            key = key.strip()
            if key in arguments:
                raise BadArgument(f"argument {key!r} is given twice")
            arguments[key] = read_value(key, raw, property_schema(params, key, within), params, reading)
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
