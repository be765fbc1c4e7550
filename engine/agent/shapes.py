"""Checks of a request's JSON shared by the protocol modules, and what the door answers instead of a reply.

A protocol module reads the fields it uses through these checks: a field of the wrong type, a
value out of range or a part the door cannot carry becomes `BadRequest`, whose `Problem` names the
field by its path (`messages[2].content[0].type`), so a harness's author sees what to mend. What
the door does not read is left alone: the SDKs add fields faster than any server follows them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from engine.agent.calls import CallMade, CallRefused, Message, ModelCall, Part

try:  # the reuse of a history's read needs orjson's exact JSON text; without it every call reads it all
    import orjson as _orjson
except ImportError:  # pragma: no cover - exercised where orjson is absent
    _orjson = None

CHUNK_CHARS = 64  # characters per streamed delta: the answer is whole before the first byte


@attrs.frozen
class Problem:
    """What the door answers instead of a reply: a status and a message the protocol shapes.

    `kind` is a `CallRefused` kind, or the door's own "too_large" (413: the body is over the
    limit) and "internal" (500: the session failed; the SDKs retry it). `code` and `param` fill
    OpenAI's error fields where the door knows them.
    """

    status: int
    kind: str
    message: str
    code: str | None = None
    param: str | None = None

    @classmethod
    def refused(cls, refusal: CallRefused) -> Problem:
        """A session's refusal, at its own status."""
        return cls(refusal.status, refusal.kind, refusal.message)

    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str | None = None) -> Problem:
        """A request the protocol refuses (400)."""
        return cls(400, "invalid_request", message, code=code, param=param)


class BadRequest(Exception):
    """A request the door refuses before any session sees it (`code`: the error code an SDK acts on, if any)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.problem = Problem.invalid(message, param, code)


@attrs.frozen
class Asked:
    """A request read by its protocol module: the call for the session and how to answer it.

    `echo` holds what the reply repeats of the request (Responses echoes its tools, tool choice
    and sampling settings). `history` is what was read of its history's items, for the session's
    next request to reuse (None without orjson).
    """

    call: ModelCall
    stream: bool = False
    usage_in_stream: bool = False
    echo: dict[str, Any] = attrs.field(factory=dict)
    history: History | None = None


# ---- a session's history, read once ---------------------------------------------------------

def loads(raw: bytes) -> tuple[Any, bool]:
    """A request body's JSON, and whether orjson read it: only then are its items' texts exact
    (`History`); what only the standard library reads (`NaN`, a number past 64 bits) is read
    whole and kept nowhere. Raises ValueError (or UnicodeDecodeError) for a body that is not JSON,
    also for one nested past the parser's stack (the standard library's RecursionError)."""
    if _orjson is not None:
        try:
            return _orjson.loads(raw), True
        except ValueError:
            pass
    try:
        return json.loads(raw), False
    except RecursionError:  # orjson refuses past 1024 levels too; aiohttp answered it with a 500
        raise ValueError("JSON nested too deep to read") from None


@attrs.frozen(eq=False)
class History:
    """What was read of one request's history items, kept for the session's next request.

    A harness sends its whole history with every call, the earlier items as it sent them
    before: an item whose JSON text is the same as the one at its place last time is read the
    same, so its messages are taken from here and only what the call adds is read. `texts` are
    the items' JSON texts as orjson writes them (exact: a text reads back as the very value, so
    `1` and `1.0` or `true` differ); `marks[i]` is how many messages the first `i` items made,
    or -1 where a message was still open after them (a Responses turn gathers several items).
    """

    texts: tuple[bytes, ...]
    marks: tuple[int, ...]
    messages: tuple[Message, ...]

    def repeated(self, texts: list[bytes]) -> tuple[int, int]:
        """(items, messages): how many of `texts` at the start repeat this history's and were read
        whole, and the messages they made."""
        mine, limit, n = self.texts, min(len(texts), len(self.texts)), 0
        while n < limit and texts[n] == mine[n]:
            n += 1
        while self.marks[n] < 0:  # marks[0] is 0: the start is always whole
            n -= 1
        return n, self.marks[n]


# Reads `items` from index `start` on: appends their messages to `messages` and, after each item,
# its mark (how many messages so far, or -1 while one is open) to `marks`.
ItemReader = Callable[[list[Any], int, list[Message], list[int]], None]


def read_items(items: list[Any], last: History | None, read_from: ItemReader) -> tuple[list[Message], History | None]:
    """The messages of a request's history `items`, those of the items `last` read taken from it,
    and what was read, for the next request (None without orjson or for items it cannot write)."""
    texts = _texts(items)
    start, made = last.repeated(texts) if last is not None and texts is not None else (0, 0)
    messages = list(last.messages[:made]) if start else []
    marks = list(last.marks[:start + 1]) if start else [0]
    read_from(items, start, messages, marks)
    return messages, None if texts is None else History(tuple(texts), tuple(marks), tuple(messages))


def _texts(items: list[Any]) -> list[bytes] | None:
    if _orjson is None:
        return None
    try:
        return [_orjson.dumps(item) for item in items]
    except TypeError:  # a value orjson does not write (an integer past 64 bits): nothing is reused
        return None


# ---- field checks -------------------------------------------------------------------------

def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def obj(value: Any, where: str) -> dict[str, Any]:
    """`value` as a JSON object, or BadRequest."""
    if not isinstance(value, dict):
        raise BadRequest(f"{where or 'the body'} must be an object, not {_kind(value)}", where or None)
    return value


def array(body: dict[str, Any], key: str, where: str, *, required: bool = False) -> list[Any]:
    """An array field ([] when absent or null and not required)."""
    value = body.get(key)
    if value is None:
        if required:
            raise BadRequest(f"{_at(where, key)} is required", _at(where, key))
        return []
    if not isinstance(value, list):
        raise BadRequest(f"{_at(where, key)} must be an array, not {_kind(value)}", _at(where, key))
    return value


def text(body: dict[str, Any], key: str, where: str, *, required: bool = False) -> str | None:
    """A string field (None when absent or null and not required)."""
    value = body.get(key)
    if value is None:
        if required:
            raise BadRequest(f"{_at(where, key)} is required", _at(where, key))
        return None
    if not isinstance(value, str):
        raise BadRequest(f"{_at(where, key)} must be a string, not {_kind(value)}", _at(where, key))
    return value


def flag(body: dict[str, Any], key: str, where: str, default: bool = False) -> bool:
    """A boolean field."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{_at(where, key)} must be a boolean, not {_kind(value)}", _at(where, key))
    return value


def number(body: dict[str, Any], key: str, where: str, low: float, high: float) -> float | None:
    """A number field within [low, high] (None when absent)."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{_at(where, key)} must be a number, not {_kind(value)}", _at(where, key))
    if not low <= value <= high:
        raise BadRequest(f"{_at(where, key)} must be between {low:g} and {high:g}, not {value:g}", _at(where, key))
    return value


def integer(body: dict[str, Any], key: str, where: str, *, low: int, required: bool = False) -> int | None:
    """An integer field of at least `low` (None when absent and not required)."""
    value = body.get(key)
    if value is None:
        if required:
            raise BadRequest(f"{_at(where, key)} is required", _at(where, key))
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{_at(where, key)} must be an integer, not {_kind(value)}", _at(where, key))
    if value < low:
        raise BadRequest(f"{_at(where, key)} must be at least {low}, not {value}", _at(where, key))
    return value


def one_of(value: Any, choices: tuple[str, ...], where: str) -> str:
    """A string among `choices`."""
    if not isinstance(value, str) or value not in choices:
        shown = json.dumps(value) if isinstance(value, str) else _kind(value)
        raise BadRequest(f"{where} must be one of {', '.join(choices)}, not {shown}", where)
    return value


def stops(body: dict[str, Any], key: str, where: str) -> list[str] | None:
    """Stop strings: one string or an array of strings."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise BadRequest(f"{_at(where, key)} must be a string or an array of strings", _at(where, key))


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def sampling(body: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """The sampling settings the request set, under SGLang's names (`names`: request key -> SGLang key)."""
    checks = {
        "max_new_tokens": lambda k: integer(body, k, "", low=1),
        "temperature": lambda k: number(body, k, "", 0.0, 2.0),
        "top_p": lambda k: number(body, k, "", 0.0, 1.0),
        "top_k": lambda k: integer(body, k, "", low=-1),
        "min_p": lambda k: number(body, k, "", 0.0, 1.0),
        "frequency_penalty": lambda k: number(body, k, "", -2.0, 2.0),
        "presence_penalty": lambda k: number(body, k, "", -2.0, 2.0),
        "repetition_penalty": lambda k: number(body, k, "", 0.0, 2.0),
        "stop": lambda k: stops(body, k, ""),
        "sampling_seed": lambda k: integer(body, k, "", low=-(2**63)),
    }
    found: dict[str, Any] = {}
    for key, name in names.items():
        value = checks[name](key)
        if value is not None and name not in found:  # the first of two spellings wins
            found[name] = value
    return found


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    """A function tool in OpenAI's chat shape, the one `ModelCall.tools` holds."""
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where}.name must be a non-empty string", f"{where}.name")
    function: dict[str, Any] = {"name": name}
    if description is not None:
        if not isinstance(description, str):
            raise BadRequest(f"{where}.description must be a string", f"{where}.description")
        function["description"] = description
    if parameters is not None:
        function["parameters"] = obj(parameters, f"{where}.parameters")
    return {"type": "function", "function": function}


def tool_names(tools: tuple[dict[str, Any], ...]) -> set[str]:
    return {t["function"]["name"] for t in tools}


def named_choice(name: Any, tools: tuple[dict[str, Any], ...], where: str) -> str:
    """A tool choice naming one function: it must be among the tools offered."""
    if not isinstance(name, str) or name not in tool_names(tools):
        raise BadRequest(f"{where} names {json.dumps(name)}, which is not among the tools offered", where)
    return name


def openai_tool_choice(choice: Any, tools: tuple[dict[str, Any], ...], *, nested: bool) -> str:
    """OpenAI's `tool_choice`: none, auto, required, or one function, named under `function`
    (`nested`: Chat Completions) or beside its type (Responses)."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return one_of(choice, ("none", "auto", "required"), "tool_choice")
    choice = obj(choice, "tool_choice")
    if choice.get("type") != "function":
        raise BadRequest("tool_choice must be none, auto, required or a function", "tool_choice")
    if nested:
        return named_choice(obj(choice.get("function"), "tool_choice.function").get("name"), tools,
                            "tool_choice.function.name")
    return named_choice(choice.get("name"), tools, "tool_choice.name")


def image_part(url: Any, where: str) -> Part:
    """An image the harness sent by URL or data URL, kept as it came."""
    if not isinstance(url, str) or not url:
        raise BadRequest(f"{where} must be an image URL or data URL", where)
    return Part(kind="image", image=url)


def content(parts: list[Part]) -> str | tuple[Part, ...]:
    """A message's content: text alone is one string (its parts joined by newlines), else the parts."""
    if all(p.kind == "text" for p in parts):
        return "\n".join(p.text for p in parts)
    return tuple(parts)


def call_made(call_id: Any, name: Any, arguments: Any, where: str, prefix: str) -> CallMade:
    """A tool call of the history, its id back in the session's own spelling (see `wire_id`)."""
    if not isinstance(call_id, str) or not call_id:
        raise BadRequest(f"{where} needs an id (a non-empty string)", where)
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where} needs the tool's name (a non-empty string)", where)
    if not isinstance(arguments, str):
        raise BadRequest(f"{where}'s arguments must be JSON text (a string), not {_kind(arguments)}", where)
    return CallMade(id=session_id(call_id, prefix), name=name, arguments=arguments)


# ---- ids ----------------------------------------------------------------------------------

def wire_id(call_id: str, prefix: str) -> str:
    """A session's call id in a protocol's style: the prefix always added, so `session_id` undoes it."""
    return prefix + call_id


def session_id(wire: str, prefix: str) -> str:
    """The session's own id of a call id the harness sent back: one door prefix removed, if there."""
    return wire[len(prefix):] if wire.startswith(prefix) and len(wire) > len(prefix) else wire


# ---- streaming ----------------------------------------------------------------------------

def pieces(value: str) -> Iterator[str]:
    """`value` in streaming deltas of CHUNK_CHARS characters (nothing for an empty string)."""
    for start in range(0, len(value), CHUNK_CHARS):
        yield value[start:start + CHUNK_CHARS]


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event: a JSON payload (or `[DONE]`), named where the protocol names them."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


def arguments_object(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as an object, or None when the text is not a JSON object."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's stack
        return None
    return value if isinstance(value, dict) else None
