"""Tools served by MCP servers, through the official `mcp` SDK (the `mcp` extra: `pip install -e '.[mcp]'` in the checkout).

    engine_mcp_servers:
      - python my_server.py --flag      # a command line: the server speaks MCP over its stdin/stdout
      - http://127.0.0.1:8000/mcp       # an http(s) URL: MCP's streamable HTTP transport

At start each server's tools are listed (`register_servers`) and registered under their own
names, so each gets its state (`TOOL_<NAME>`) like any tool, and the model is offered their
schemas. A name taken by another tool, or by another server's tool, is one error naming both.
A tool whose name cannot be a state, or whose input schema is not a JSON object schema, is
skipped with one warning.

Calls go through the SDK, bounded by the tool timeout. Each server has one connection per
event loop, opened at the first call and owned by a task of its own (the SDK's transports are
anyio task groups, which must be left by the task that entered them). A server that dies or
hangs answers that call with an error observation; the connection is dropped, and the next
call starts the server again. `close_connections` ends them (the runtime calls it when it closes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import shlex
import threading
import weakref
from typing import Any

from engine.tools.registry import _NAME, Tool, ToolError, ToolResult, call_timeout, get, register, unregister

log = logging.getLogger(__name__)
CLOSE_SECONDS = 5.0  # how long a closing connection may take before its task is cancelled
LIST_SECONDS = 60.0  # the least time a server has to start and list its tools at start-up


def _sdk() -> Any:
    try:
        import mcp
    except ImportError:
        raise ValueError("engine_mcp_servers needs the MCP SDK: pip install 'mcp>=2,<3' "
                         "(or, in the engine's checkout, pip install -e '.[mcp]')") from None
    return mcp


def describe(spec: str) -> str:
    """A server as messages name it."""
    return f"MCP server {spec!r}"


@contextlib.asynccontextmanager
async def _open_session(spec: str) -> Any:
    """An initialized `ClientSession` to the server `spec` (a URL or a command line)."""
    mcp = _sdk()
    async with contextlib.AsyncExitStack() as stack:
        if spec.startswith(("http://", "https://")):
            from mcp.client.streamable_http import streamable_http_client

            streams = await stack.enter_async_context(streamable_http_client(spec))
        else:
            argv = shlex.split(spec)
            if not argv:
                raise ValueError("an empty MCP server command line")
            params = mcp.StdioServerParameters(command=argv[0], args=argv[1:])
            streams = await stack.enter_async_context(mcp.stdio_client(params))
        session = await stack.enter_async_context(mcp.ClientSession(streams[0], streams[1]))
        await session.initialize()
        yield session


class Connection:
    """One server's session on one event loop, held open by a task of its own until closed."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self._session: Any = None
        self._owner: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._lock = asyncio.Lock()

    async def session(self, timeout: float) -> Any:
        """The open session, starting the server if none is (within `timeout` seconds)."""
        async with self._lock:
            if self._session is not None and self._owner is not None and not self._owner.done():
                return self._session
            await self._close_owner()
            ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._stop = asyncio.Event()
            self._owner = asyncio.create_task(self._own(ready, self._stop))
            try:
                self._session = await asyncio.wait_for(asyncio.shield(ready), timeout)
            except BaseException:
                await self._close_owner()
                raise
            return self._session

    async def _own(self, ready: asyncio.Future[Any], stop: asyncio.Event) -> None:
        try:
            async with _open_session(self.spec) as session:
                await _prime(session)
                ready.set_result(session)
                await stop.wait()
        except BaseException as exc:  # the server could not start, or died: whoever waits hears it
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(f"{describe(self.spec)} stopped"))
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def reset(self) -> None:
        """Drop the session (its server is ended); the next call starts it again."""
        async with self._lock:
            await self._close_owner()

    async def _close_owner(self) -> None:
        owner, self._owner, self._session = self._owner, None, None
        if owner is None:
            return
        if self._stop is not None:
            self._stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(owner), CLOSE_SECONDS)
        except BaseException:  # it would not close in time (or failed): cancel it, which kills the process
            owner.cancel()
            with contextlib.suppress(BaseException):
                await owner


# Connections per event loop (sessions are bound to the loop that opened them), per server.
_connections: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Connection]] = weakref.WeakKeyDictionary()


def connection(spec: str) -> Connection:
    """The running loop's connection to `spec`."""
    per_loop = _connections.setdefault(asyncio.get_running_loop(), {})
    conn = per_loop.get(spec)
    if conn is None:
        conn = per_loop[spec] = Connection(spec)
    return conn


async def close_connections() -> None:
    """End every MCP server this event loop started (the run is over)."""
    per_loop = _connections.pop(asyncio.get_running_loop(), {})
    for conn in per_loop.values():
        await conn.reset()


def _text(result: Any) -> str:
    """A `CallToolResult` as the model reads it: its text blocks, structured content otherwise."""
    parts = []
    for block in getattr(result, "content", None) or []:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')} content]")
    if not parts and getattr(result, "structured_content", None) is not None:
        import json

        parts.append(json.dumps(result.structured_content, ensure_ascii=False, default=str))
    return "\n".join(parts)


class McpTool(Tool):
    """A tool one MCP server lists, called through the SDK."""

    def __init__(self, spec: str, name: str, description: str, parameters: dict[str, Any], timeout: float) -> None:
        self.spec = spec
        self.timeout = timeout  # the tool timeout it was registered under: a call's limit outside the engine's calls
        self.name = name  # type: ignore[misc]
        self.description = description  # type: ignore[misc]
        self.parameters = parameters  # type: ignore[misc]

    async def execute(self, state: Any, **arguments: Any) -> ToolResult:
        seconds = call_timeout(self.timeout)
        conn = connection(self.spec)
        try:
            session = await conn.session(seconds)
            result = await asyncio.wait_for(session.call_tool(self.name, arguments), seconds)
        except asyncio.TimeoutError:
            await conn.reset()  # a hung server is ended; the next call starts it again
            raise ToolError("timeout", f"{self.name} timed out after {seconds:g} seconds") from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the server died, refused, or broke the protocol
            await conn.reset()
            leaf = _leaf(exc)
            raise ToolError("server_error", f"{self.name}: {describe(self.spec)} failed: {type(leaf).__name__}: {leaf}") from None
        text = _text(result)
        if getattr(result, "is_error", False) or getattr(result, "isError", False):
            return ToolResult(f"Error: {text}", "tool_error")
        return ToolResult(text)


def schema_problem(schema: Any) -> str | None:
    """None when `schema` can be a tool's arguments schema (a JSON object schema), else why not."""
    if not isinstance(schema, dict):
        return f"its input schema is a {type(schema).__name__}, not an object"
    if schema.get("type") != "object":
        return f"its input schema has type {schema.get('type')!r}, not 'object'"
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(p, dict) for p in props.values()):
        return "its input schema's properties are not a mapping of schemas"
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return "its input schema's required is not a list of names"
    return None


async def list_tools(spec: str, timeout: float) -> list[tuple[str, str, Any]]:
    """(name, description, input schema) of every tool the server lists; raises ValueError if it cannot."""
    async def listing() -> list[tuple[str, str, Any]]:
        mcp = _sdk()
        async with _open_session(spec) as session:
            found, cursor = [], None
            while True:
                params = mcp.types.PaginatedRequestParams(cursor=cursor) if cursor else None
                page = await _list_page(session, params)
                tools = page.get("tools")
                if not isinstance(tools, list):
                    raise ValueError(f"{describe(spec)} answered tools/list without a list of tools")
                found += [(t.get("name"), t.get("description") or "", t.get("inputSchema", t.get("input_schema")))
                          if isinstance(t, dict) else (None, "", None) for t in tools]
                cursor = page.get("nextCursor")
                if not cursor:
                    return found

    try:
        return await asyncio.wait_for(listing(), timeout)
    except asyncio.TimeoutError:
        raise ValueError(f"{describe(spec)} did not list its tools within {timeout:g} seconds") from None
    except ValueError:
        raise
    except Exception as exc:
        leaf = _leaf(exc)
        raise ValueError(f"{describe(spec)} cannot be reached: {type(leaf).__name__}: {leaf}") from None


def _leaf(exc: BaseException) -> BaseException:
    """The first real error inside the SDK's task-group exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


async def _list_page(session: Any, params: Any) -> dict[str, Any]:
    """One page of tools/list as plain JSON.

    Through the SDK's `list_tools`; a page it refuses (the SDK validates every tool's schema, so
    one bad tool fails the page) is asked again as sent, from the SDK's dispatcher, so that only
    the bad tool is skipped (`_register`) and not the whole server.
    """
    import pydantic

    try:
        result = await session.list_tools(params=params)
    except pydantic.ValidationError as refused:
        raw = getattr(getattr(session, "_dispatcher", None), "send_raw_request", None)
        if raw is None:
            raise ValueError(f"a tool it lists has an invalid schema: {refused.errors()[0].get('loc')}") from None
        page = await raw("tools/list", params.model_dump(by_alias=True, exclude_none=True) if params else None, {})
        return page if isinstance(page, dict) else {}
    return result.model_dump(by_alias=True, mode="json", exclude_none=True)


async def _prime(session: Any) -> None:
    """List the tools on a new call connection, as the SDK checks each result against its tool's
    output schema and lists the tools itself otherwise. Where the SDK refuses the listing (a bad
    tool), the output schemas are recorded from the listing as sent, so calls to good tools work."""
    import pydantic

    try:
        await session.list_tools()
    except pydantic.ValidationError:
        page = await _list_page(session, None)
        cache = getattr(session, "_tool_output_schemas", None)
        if isinstance(cache, dict):
            for tool in page.get("tools") or []:
                if isinstance(tool, dict) and isinstance(tool.get("name"), str):
                    schema = tool.get("outputSchema")
                    cache[tool["name"]] = schema if isinstance(schema, dict) else None


_registered: dict[str, list[str]] = {}  # server -> the tool names registered from it
_lock = threading.Lock()


def register_servers(specs: tuple[str, ...], timeout: float) -> list[str]:
    """List each server's tools (once per process) and register them; returns every name registered.

    A server has `timeout` seconds (at least LIST_SECONDS) to start and list its tools.
    Blocking: the listing runs on an event loop of its own in a worker thread, so it may be
    called from inside a running loop (the runtime is built there). Raises ValueError for a
    server that cannot be listed and for a name another tool (or server) already has.
    """
    names: list[str] = []
    with _lock:
        for spec in specs:
            if spec not in _registered:
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    listed = pool.submit(asyncio.run, list_tools(spec, max(timeout, LIST_SECONDS))).result()
                _registered[spec] = _register(spec, listed, timeout)
            names += _registered[spec]
    return names


def _register(spec: str, listed: list[tuple[str, str, Any]], timeout: float) -> list[str]:
    chosen: list[McpTool] = []
    for name, description, schema in listed:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            log.warning("%s: tool %r skipped: a tool name is lowercase letters, digits and _, starting with a letter", describe(spec), name)
            continue
        problem = schema_problem(schema)
        if problem is not None:
            log.warning("%s: tool %r skipped: %s", describe(spec), name, problem)
            continue
        existing = get(name) or next((t for t in chosen if t.name == name), None)
        if existing is not None:
            owner = describe(existing.spec) if isinstance(existing, McpTool) else f"the tool {_origin(existing)}"
            raise ValueError(f"tool name clash: {describe(spec)} lists {name!r}, which {owner} already has; "
                             "rename one or drop a server from engine_mcp_servers")
        chosen.append(McpTool(spec, name, description, schema, timeout))
    for tool in chosen:
        register(tool)
    return [t.name for t in chosen]


def _origin(tool: Tool) -> str:
    """Where a Python tool is defined, as `module.name`."""
    fn = getattr(tool, "_fn", None)  # a tool made by @tool
    where = fn if fn is not None else type(tool)
    return f"{where.__module__}.{where.__qualname__}"


def unregister_servers() -> None:
    """Forget every server's tools (tests undo their registrations with it)."""
    with _lock:
        for names in _registered.values():
            for name in names:
                if isinstance(get(name), McpTool):
                    unregister(name)
        _registered.clear()
