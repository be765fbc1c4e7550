"""Arguments a format writes as text (`<arg_value>7</arg_value>`), read by their parameter's JSON schema.

The schema is read whole: `$ref` into the tool's `$defs`/`definitions`, `type` (one or a list),
`nullable`, `const`, `enum` of any types, `anyOf`/`oneOf` (alternatives, in order) and `allOf`
(all must hold). Together they give the value's *branches*, in order: a type, maybe with the
values it may take. The text is read as the first branch it fits: a number only where a number
is admitted, JSON only where an object or array is, and the text itself where a string is. Text
that fits no branch raises `BadArgument` naming the argument.

Families differ where the schema leaves a choice, and each reads as SGLang's detector of that
family does there (`Reading`): whether a string written as a JSON string literal loses its
quotes, whether a union tries its typed branches before its string one, how an argument the
schema does not type is read.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import attrs

_NOTHING = attrs.NOTHING
_NULL_WORDS = ("null", "none", "nil")
_KINDS = ("string", "integer", "number", "boolean", "null", "array", "object")


class BadArgument(ValueError):
    """A value that does not fit its argument's schema; the message names the argument."""


@attrs.frozen
class Reading:
    """How a family reads values written as text where the schema leaves a choice."""

    unquote: bool = False  # a string written as a JSON string literal ("hi") is read without its quotes (GLM)
    typed_first: bool = False  # a union tries its typed branches before its string one, whatever the order (GLM-4.7, MiniMax)
    undeclared: Literal["string", "json", "literal"] = "string"  # an argument the schema does not type: kept, or
    # JSON where it parses (also escaped JSON; "literal": Python literals too)
    null_words: tuple[str, ...] = ("null",)  # what the family reads as null (lower case), before a string where null is admitted
    loose_booleans: bool = False  # yes/no, on/off, 1/0 for a boolean (MiniMax)
    integral_floats: bool = False  # an integral JSON number written as a float (7.0, 1e3) is an integer (GLM)
    string_unions: bool = False  # an anyOf/oneOf with a string branch reads text as that string first (Qwen3-Coder, GLM-4.5)


@attrs.frozen
class Branch:
    """One way a value may fit: a JSON type, and the values it may take (None: any of that type)."""

    kind: str
    values: tuple[Any, ...] | None = None


def property_schema(params: Any, key: str, within: list[Any] | None = None) -> Any:
    """The schema of argument `key` in a tool's `parameters` (None when it declares none).

    Where the root is itself a union or an intersection of object schemas (`oneOf` of objects),
    the argument's schema is the same combination of the schemas its branches give it; `within`:
    only those root branches (`matching_branches`).
    """
    if within is None:
        return _property(params, params, key, frozenset())
    parts = [p for p in (_property(b, params, key, frozenset()) for b in within) if p is not None]
    return None if not parts else parts[0] if len(parts) == 1 else {"anyOf": parts}


def matching_branches(params: Any, pairs: list[tuple[str, str]], reading: Reading) -> list[Any] | None:
    """The root `anyOf`/`oneOf` branches of a tool's `parameters` that the call's discriminators
    (arguments a branch pins to a `const` or an `enum`, like `kind`) allow; None when the root is
    no union or none is allowed (then every branch is read, and the value that fits none says so)."""
    root = params
    target = _resolve(root.get("$ref"), root) if isinstance(root, dict) else None
    root = target if isinstance(target, dict) else root
    options = _list(root.get("anyOf") or root.get("oneOf")) if isinstance(root, dict) else []
    if not options:
        return None
    kept = []
    for option in options:
        option = _resolve(option.get("$ref"), params) or option if isinstance(option, dict) else option
        fits = True
        for key, raw in pairs:
            schema = _property(option, params, key.strip(), frozenset())
            pinned = branches_of(schema, params)
            if pinned and all(b.values is not None for b in pinned):
                try:
                    read_value(key, raw, schema, params, reading)
                except BadArgument:
                    fits = False
                    break
        if fits:
            kept.append(option)
    return kept or None


def _property(node: Any, root: Any, key: str, seen: frozenset[int]) -> Any:
    if not isinstance(node, dict) or id(node) in seen:
        return None
    seen = seen | {id(node)}
    props = node.get("properties")
    if isinstance(props, dict) and key in props:
        return props[key]
    target = _resolve(node.get("$ref"), root)
    if target is not None:
        found = _property(target, root, key, seen)
        if found is not None:
            return found
    for keyword, combined in (("anyOf", "anyOf"), ("oneOf", "anyOf"), ("allOf", "allOf")):
        parts = [p for p in (_property(b, root, key, seen) for b in _list(node.get(keyword))) if p is not None]
        if parts:
            return parts[0] if len(parts) == 1 else {combined: parts}
    return None


def branches_of(schema: Any, root: Any = None) -> list[Branch] | None:
    """The branches of `schema`, in order; None when it says nothing about the value's type.

    `root` is the document `$ref`s point into (the tool's `parameters`).
    """
    return _branches(schema, schema if root is None else root, frozenset())


def _branches(schema: Any, root: Any, seen: frozenset[int]) -> list[Branch] | None:
    if not isinstance(schema, dict) or id(schema) in seen:
        return None
    seen = seen | {id(schema)}
    constraints: list[list[Branch]] = []
    kind = schema.get("type")
    if isinstance(kind, str) or isinstance(kind, list) and kind:
        kinds = [k for k in ([kind] if isinstance(kind, str) else kind) if k in _KINDS]
        if schema.get("nullable") is True and "null" not in kinds:
            kinds.append("null")
        constraints.append([Branch(k) for k in dict.fromkeys(kinds)])
    for keyword in ("anyOf", "oneOf"):
        options = [_branches(b, root, seen) for b in _list(schema.get(keyword))]
        if options and all(o is not None for o in options):
            constraints.append([b for o in options for b in o])  # type: ignore[union-attr]
    target = _resolve(schema.get("$ref"), root)
    if target is not None:
        found = _branches(target, root, seen)
        if found is not None:
            constraints.append(found)
    for branch in _list(schema.get("allOf")):
        found = _branches(branch, root, seen)
        if found is not None:
            constraints.append(found)
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list) and values:
        by_kind: dict[str, list[Any]] = {}
        for value in values:
            by_kind.setdefault(json_kind(value), []).append(value)
        constraints.append([Branch(k, tuple(v)) for k, v in by_kind.items()])
    if not constraints:
        if "properties" in schema or "additionalProperties" in schema:
            return [Branch("object")]
        if "items" in schema:
            return [Branch("array")]
        return None
    found = constraints[0]
    for other in constraints[1:]:
        found = _intersect(found, other)
    return found


def _intersect(mine: list[Branch], other: list[Branch]) -> list[Branch]:
    """The branches of `mine` that `other` admits too, in `mine`'s order."""
    out: list[Branch] = []
    for branch in mine:
        for o in other:
            kind = _common_kind(branch.kind, o.kind)
            if kind is None:
                continue
            if branch.values is None and o.values is None:
                values = None
            else:
                pool = [v for v in (branch.values if branch.values is not None else o.values) or () if fits_kind(v, kind)]
                if branch.values is not None and o.values is not None:
                    pool = [v for v in pool if any(json_equal(v, w) for w in o.values)]
                if not pool:
                    continue
                values = tuple(pool)
            merged = Branch(kind, values)
            if merged not in out:
                out.append(merged)
    return out


def _common_kind(a: str, b: str) -> str | None:
    if a == b:
        return a
    if {a, b} == {"integer", "number"}:
        return "integer"
    return None


def _resolve(ref: Any, root: Any) -> Any:
    """The schema a local `$ref` ("#/$defs/Name", "#/definitions/Name", "#") points to, or None."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    target = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        try:
            target = target[int(part)] if isinstance(target, list) else target[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
    return target


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def json_kind(value: Any) -> str:
    """The JSON type of a Python value read from JSON."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def fits_kind(value: Any, kind: str) -> bool:
    """Whether `value` is of JSON type `kind` (an integer is a number too)."""
    found = json_kind(value)
    return found == kind or kind == "number" and found == "integer"


def json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON sees it: true is not 1, 1.0 is 1."""
    if json_kind(a) != json_kind(b) and not (fits_kind(a, "number") and fits_kind(b, "number")):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(json_equal(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def read_value(argument: str, raw: str, schema: Any, root: Any, reading: Reading) -> Any:
    """The value of `argument` written as `raw`, read by its parameter's `schema` (`root`: the tool's
    `parameters`, for `$ref`s). Raises `BadArgument` when the text fits no branch.

    The text is read as written first (a JSON literal of the branch's type, or the text itself for
    a string); only where that fits no branch is it read leniently (a quoted number, `True`,
    `None`, escaped or Python-literal JSON), so a schema that admits a string keeps such text.
    """
    found = branches_of(schema, root)
    if found is None:
        return _undeclared(raw, reading)
    if raw.strip().lower() in reading.null_words and any(b.kind == "null" for b in found):
        return None  # null where null is admitted, before any string branch
    order = found
    if reading.string_unions and isinstance(schema, dict) and ("anyOf" in schema or "oneOf" in schema):
        order = sorted(found, key=lambda b: b.kind != "string")
    elif reading.typed_first:
        order = sorted(found, key=lambda b: b.kind == "string")
    for lenient in (False, True):
        for branch in order:
            for value in _readings(raw, branch.kind, reading, lenient):
                if branch.values is None or any(json_equal(value, v) for v in branch.values):
                    return value
    raise BadArgument(f"argument {argument!r} must be {describe(found)}, got {_short(raw)}")


def _undeclared(raw: str, reading: Reading) -> Any:
    if reading.undeclared == "string" and raw.strip().lower() in reading.null_words:
        return None
    if reading.undeclared != "string":
        value = _json(raw, literals=reading.undeclared == "literal")
        if value is not _NOTHING:
            return value
    return next(_readings(raw, "string", reading, False))


def _readings(raw: str, kind: str, reading: Reading, lenient: bool) -> Iterator[Any]:
    """The ways `raw` reads as a value of JSON type `kind`: as written, or (`lenient`) as a model
    writes it loosely."""
    text = raw.strip()
    if kind == "string":
        unquoted = _unquoted(raw)
        if lenient:  # a const or enum string the model quoted (or one it did not, where the family unquotes)
            yield raw if reading.unquote else unquoted
        else:
            yield unquoted if reading.unquote else raw
    elif kind == "null":
        if text.lower() in (_NULL_WORDS if lenient else ("null",)):
            yield None
    elif kind == "boolean":
        word = text if not lenient else text.lower()
        if word in ("true", "false"):
            yield word == "true"
        elif lenient and reading.loose_booleans and word in ("yes", "on", "1", "no", "off", "0"):
            yield word in ("yes", "on", "1")
    elif kind in ("integer", "number"):
        value = _number(text)
        if lenient and value is _NOTHING:
            quoted = _json(text)  # "7": a number the model quoted
            value = _number(quoted) if isinstance(quoted, str) else _NOTHING
        if value is not _NOTHING and (kind == "number" or isinstance(value, int)
                                      or (lenient or reading.integral_floats) and value.is_integer()):
            yield int(value) if kind == "integer" else value
    else:
        value = _json(raw, literals=True) if lenient else _json(raw, escaped=False)
        if value is not _NOTHING and json_kind(value) == kind:
            yield value


def _unquoted(raw: str) -> str:
    """A JSON string literal ("hi") as its string; other text as it is."""
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':
        try:
            value = json.loads(raw)
        except ValueError:
            return raw
        if isinstance(value, str):
            return value
    return raw


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _number(text: str) -> Any:
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return _NOTHING
    if isinstance(value, bool) or not isinstance(value, (int, float)) or isinstance(value, float) and not math.isfinite(value):
        return _NOTHING
    return value


def _json(raw: str, *, literals: bool = False, escaped: bool = True) -> Any:
    """`raw` as JSON; else as JSON whose quotes the model escaped (`[{\\"id\\": 1}]`); else (with
    `literals`) as a Python literal (`{'a': 1}`); else _NOTHING."""
    text = raw.strip()
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        pass
    if escaped and '\\"' in text:
        try:
            return json.loads(json.loads(f'"{text}"', strict=False), parse_constant=_reject_constant)
        except ValueError:
            pass
    if literals:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return _NOTHING
        return value if _plain(value) else _NOTHING
    return _NOTHING


def _plain(value: Any) -> bool:
    """Whether a Python literal is also JSON (no tuples, sets, bytes or non-string keys)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (str, bool, int)) or isinstance(value, float) and math.isfinite(value)


def describe(found: list[Branch]) -> str:
    """The branches in words: "an integer", "a string or null", "one of 'a', 'b'"."""
    words = []
    for branch in found:
        if branch.values is not None:
            words.append("one of " + ", ".join(json.dumps(v, ensure_ascii=False) for v in branch.values))
        else:
            words.append({"integer": "an integer", "object": "a JSON object", "array": "a JSON array",
                          "boolean": "true or false", "null": "null"}.get(branch.kind, f"a {branch.kind}"))
    return " or ".join(dict.fromkeys(words)) or "nothing (the schema admits no value)"


def _short(raw: str, limit: int = 60) -> str:
    return repr(raw if len(raw) <= limit else raw[:limit] + "...")


def arguments_schema(schemas: Mapping[str, Any], tool: str) -> Any:
    """The `parameters` schema of `tool` ({} for a tool not offered)."""
    params = schemas.get(tool)
    return params if isinstance(params, dict) else {}
