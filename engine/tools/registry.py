"""The tool protocol and the registry that the engine's machine builder reads.

A tool is registered by name, once per process, and from then on it has its own state
in the rollout machine (`TOOL_<NAME>`), its own edges in the diagrams and in the
edge-coverage test. This module knows nothing of the engine: arrows run one way.

Two ways to write one:

    @tool
    async def word_count(text: str) -> str:
        '''Count the words of a text.'''
        return str(len(text.split()))

or, for a tool that keeps state per trajectory, subclass `Tool` and override
`create`/`release` (see `engine/tools/python_session.py`).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import re
import types
import typing
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, ClassVar

import attrs


class ToolError(Exception):
    """Raised by a tool for a failure the model should read as an error observation.

    `kind` is counted per sample (e.g. "bad_arguments", "timeout", "crash").
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class ToolUnavailable(Exception):
    """Raised by a tool whose infrastructure cannot work here (not the model's fault).

    Unlike `ToolError`, this is no observation for the model to learn from: the engine ends
    the sample with a recorded reason (slime) or stops the run (CLI). The message says why.
    """


@attrs.frozen
class ToolResult:
    """What a tool call produced. `error` names the error kind, None on success.

    `reward`: the tool's score of the turn that called it (a game move, a SQL answer); kept with
    that model turn in `metadata["fsm"]["turns"]`, summed over the turn's calls.
    """

    text: str
    error: str | None = None
    reward: float | None = None


class Tool:
    """Base class of a tool. Subclasses set `name`, `description`, and implement `execute`.

    `parameters` (a JSON schema of the arguments) is derived from `execute`'s type hints
    when not given. `execute` receives the per-trajectory state made by `create`
    (None by default) and the call's arguments as keywords.

    `Settings`, when set, is the tool's own settings class (`engine.settings.settings`, under its
    own prefix, e.g. `engine_mytool_`): the engine reads it from slime's args, the YAML and `run`'s
    flags, checks it as it checks its own, and hands the instance to `setup`.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    parameters: ClassVar[dict[str, Any] | None] = None
    Settings: ClassVar[type | None] = None

    def setup(self, cfg: Any, settings: Any = None) -> Tool:
        """The tool one engine runtime calls, by default this one (override to read settings or open clients).

        Called once per runtime with the engine's settings (`cfg`: e.g. `cfg.tool_timeout`) and, for a
        tool that declares `Settings`, its own; return a tool of the same name and schema.
        """
        return self

    async def create(self) -> Any:
        """Make the per-trajectory state; called before a trajectory's first call."""
        return None

    async def release(self, state: Any) -> None:
        """Free what `create` made; called once when the trajectory ends."""

    async def check(self) -> str | None:
        """None when the tool can work on this host, else the reason it cannot.

        The engine calls it before rolling out; the default says every tool can work."""
        return None

    async def execute(self, state: Any, **arguments: Any) -> str | ToolResult:  # pragma: no cover
        raise NotImplementedError

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function spec the prompt shows the model."""
        params = self.parameters if self.parameters is not None else schema_from_signature(self.execute)
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": params},
        }


# The statistics of the call running in this context (see `count`); None outside a call.
_call_stats: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("tool_call_stats", default=None)


def count(key: str, amount: float = 1) -> None:
    """Add `amount` to statistic `key` of the running call; the engine sums them into the sample's `tool_stats`.

    For what a call's answer does not show: a retry, the time spent waiting for a worker.
    Outside a call (no `call_stats` block) it does nothing.
    """
    stats = _call_stats.get()
    if stats is not None:
        stats[key] = stats.get(key, 0) + amount


@contextlib.contextmanager
def call_stats() -> Iterator[dict[str, float]]:
    """Collect what `count` adds during the block, tasks started inside it included."""
    stats: dict[str, float] = {}
    token = _call_stats.set(stats)
    try:
        yield stats
    finally:
        _call_stats.reset(token)


_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def _json_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_type(options[0]) if len(options) == 1 else {}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(annotation))}
    if origin in (list, tuple):
        args = typing.get_args(annotation)
        return {"type": "array", "items": _json_type(args[0])} if args else {"type": "array"}
    base = origin or annotation
    return {"type": _JSON_TYPES[base]} if base in _JSON_TYPES else {}


def schema_from_signature(fn: Callable[..., Any]) -> dict[str, Any]:
    """A JSON schema for `fn`'s keyword parameters, from its type hints and defaults."""
    hints = typing.get_type_hints(fn)
    props: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if pname in ("self", "state") or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        props[pname] = _json_type(hints.get(pname, Any))
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    return {"type": "object", "properties": props, "required": required}


_TYPE_CHECKS = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def check_arguments(schema: dict[str, Any], arguments: Any) -> dict[str, Any]:
    """Validate call arguments against the schema's names and basic types; raise ToolError."""
    if not isinstance(arguments, dict):
        raise ToolError("bad_arguments", f"arguments must be a JSON object, got {type(arguments).__name__}")
    props = schema.get("properties", {})
    missing = [n for n in schema.get("required", []) if n not in arguments]
    if missing:
        raise ToolError("bad_arguments", f"missing argument(s): {', '.join(missing)}")
    unknown = [n for n in arguments if props and n not in props]
    if unknown:
        raise ToolError("bad_arguments", f"unknown argument(s): {', '.join(unknown)}")
    for name, value in arguments.items():
        expected = props.get(name, {}).get("type")
        ok = expected not in _TYPE_CHECKS or (isinstance(value, _TYPE_CHECKS[expected]) and not (expected in ("integer", "number") and isinstance(value, bool)))
        if not ok:
            raise ToolError("bad_arguments", f"argument {name!r} must be of type {expected}")
    return arguments


class _FunctionTool(Tool):
    def __init__(self, fn: Callable[..., Awaitable[Any]], name: str, description: str) -> None:
        self._fn = fn
        self.name = name  # type: ignore[misc]
        self.description = description  # type: ignore[misc]
        self.parameters = schema_from_signature(fn)  # type: ignore[misc]

    async def execute(self, state: Any, **arguments: Any) -> str | ToolResult:
        return await self._fn(**arguments)


_CALL_TIMEOUT: contextvars.ContextVar[float | None] = contextvars.ContextVar("tool_call_timeout", default=None)


def call_timeout(default: float) -> float:
    """Seconds the running call may take, as the engine's settings say (`default` outside a call).

    A tool that enforces its own time limit reads it here; it travels with the call, so two
    runtimes with different settings in one process never overwrite each other's.
    """
    seconds = _CALL_TIMEOUT.get()
    return default if seconds is None else seconds


@contextlib.contextmanager
def call_timeout_set(seconds: float) -> Iterator[None]:
    """Run the block (one tool call) with `seconds` as its time limit (for `call_timeout`)."""
    token = _CALL_TIMEOUT.set(seconds)
    try:
        yield
    finally:
        _CALL_TIMEOUT.reset(token)


_REGISTRY: dict[str, Tool] = {}
_version = 0


_NAME = re.compile(r"[a-z][a-z0-9_]*")
# Checks a tool's name must pass besides its form; the engine's machine adds one (a tool's state
# may not be a core state). This module knows nothing of the engine: the arrow runs one way.
_name_checks: list[Callable[[str], None]] = []


def add_name_check(check: Callable[[str], None]) -> None:
    """Refuse, from now on, names for which `check` raises ValueError; tools registered already are checked now."""
    for name in _REGISTRY:
        check(name)
    _name_checks.append(check)


def register(tool: Tool, *, replace: bool = False) -> Tool:
    """Add a tool instance to the registry under `tool.name` (lowercase letters, digits, _)."""
    global _version
    name = tool.name
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"tool name must be lowercase letters, digits and _, starting with a letter; got {name!r}")
    for check in _name_checks:
        check(name)
    _check_async(tool)
    if name in _REGISTRY and not replace and _REGISTRY[name] is not tool:
        raise ValueError(f"a tool named {name!r} is already registered")
    _REGISTRY[name] = tool
    _version += 1
    return tool


_ASYNC_METHODS = ("create", "execute", "release")  # the engine awaits each of them


def _check_async(tool: Tool) -> None:
    """Refuse a tool whose `create`, `execute` or `release` is a plain `def`: awaited, it would fail
    every sample that calls the tool with "object ... can't be used in 'await' expression"."""
    for method in _ASYNC_METHODS:
        fn = getattr(tool, method, None)
        if fn is None:
            raise TypeError(f"tool {tool.name!r} has no {method}() method")
        plain = inspect.isfunction(fn) or inspect.ismethod(fn)  # a def of Python's; not a mock or other callable
        if plain and not inspect.iscoroutinefunction(fn):
            raise TypeError(f"tool {tool.name!r}: {method}() must be `async def` (the engine awaits it); "
                            f"it is a plain def in {type(tool).__qualname__}")


def unregister(name: str) -> None:
    """Remove a tool (tests use this to undo a registration)."""
    global _version
    if _REGISTRY.pop(name, None) is not None:
        _version += 1


@contextlib.contextmanager
def registered(replacement: Tool) -> Iterator[Tool]:
    """Register `replacement` for the block, then put back what was registered under its name."""
    original = _REGISTRY.get(replacement.name)
    register(replacement, replace=True)
    try:
        yield replacement
    finally:
        if original is not None:
            register(original, replace=True)
        else:
            unregister(replacement.name)


def tool(fn: Callable[..., Awaitable[Any]] | None = None, *, name: str | None = None, replace: bool = False) -> Any:
    """Decorator: register an async function as a stateless tool; its docstring describes it."""

    def wrap(f: Callable[..., Awaitable[Any]]) -> Tool:
        if not inspect.iscoroutinefunction(f):
            raise TypeError(f"tool {f.__name__} must be an async function")
        doc = inspect.getdoc(f) or ""
        return register(_FunctionTool(f, name or f.__name__, doc.split("\n\n")[0]), replace=replace)

    return wrap(fn) if fn is not None else wrap


def get(name: str) -> Tool | None:
    """The tool registered under `name`, or None."""
    return _REGISTRY.get(name)


def names() -> tuple[str, ...]:
    """Registered tool names, sorted, so machines and diagrams come out the same every time."""
    return tuple(sorted(_REGISTRY))


def version() -> int:
    """Bumped on every registration change; the engine rebuilds its machine when it moves."""
    return _version
