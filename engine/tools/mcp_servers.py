"""Tools served by MCP servers, through the official `mcp` SDK (the `mcp` extra: `pip install -e '.[mcp]'` in the checkout).

    engine_mcp_servers:
      - python my_server.py --flag      # a command line: the server speaks MCP over its stdin/stdout
      - http://127.0.0.1:8000/mcp       # an http(s) URL: MCP's streamable HTTP transport
      - name: search                    # or a mapping: a name, a command or url, env or headers
        command: npx -y search-server
        env: {API_KEY: "${SEARCH_KEY}"} # taken from the job's environment by name (`mcp_spec`)

At start the servers are listed at once (`register_servers`, each within `engine_mcp_list_timeout`)
and their tools registered under their own names, so each gets its state (`TOOL_<NAME>`) like any tool,
and the model is offered their schemas. A name taken by another tool, or by another server's
tool, is one error naming both. A tool whose name cannot be a state, or whose input schema is
not a JSON object schema, is skipped with one warning.

Calls go through the SDK (`mcp_connection`): starting the server when none runs and the call
itself share the tool timeout; a failure costs at most SHUTDOWN_SECONDS more. The server's
answer is the model's to read, its own error result (`isError`) included. A server that cannot
answer (it does not start, hangs, dies or breaks the protocol) is not the model's error: the
sample ends untrained (`ToolUnavailable`: `tool_unavailable`), unless `engine_mcp_failures:
observation` says coping with a failing server is part of the task. A hung or dead server is
ended (its whole process group) and started again by the next call. Messages name a server by
its name, never its command line or URL. `close_connections` ends the servers of a loop (the
runtime calls it when it closes); an atexit backstop kills any left when a loop never closes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import threading
import weakref
from typing import Any

from engine.settings import Flag, Kind, setting, settings
from engine.settings.core import DAY, TOOLS
from engine.settings.declare import default_of
from engine.tools.mcp_connection import Connection, Listing, ServerFailure
from engine.tools.mcp_spec import ServerSpec, parse_servers
from engine.tools.registry import (
    _NAME,
    Tool,
    ToolError,
    ToolResult,
    ToolUnavailable,
    call_timeout,
    get,
    register,
    unregister,
)

log = logging.getLogger(__name__)


@settings(prefix="engine_mcp_")
class McpSettings:
    """MCP servers: whose tools are offered, and what a server that cannot answer means."""

    servers: tuple[Any, ...] = setting(
        (), kind=Kind("a list of MCP servers, each a command line, an http(s) URL or a mapping (name, command or url, env or "
                      "headers)", parse_servers, quote=False),  # an env or a header may hold a secret: never quoted
        flag=Flag("--mcp-server", "CMD_OR_URL", TOOLS, repeatable=True, dest="mcp_servers",
                  help="offer the tools of this MCP server: a command line (stdio) or an http(s) URL"),
        help="MCP servers whose tools are offered: each a command line (stdio), an http(s) URL, or a mapping with name, "
             "command or url, env or headers (values from the job's environment as ${NAME})")
    list_timeout: float = setting(90.0, low=0, high=DAY, above_low=True,  # room for uvx or npx to fetch a server once
                                  help="seconds an MCP server has to start and list its tools when the job starts")
    failures: str = setting("unavailable", choices=("unavailable", "observation"),
                            help="an MCP server that cannot answer (down, hung, crashed): end the sample untrained "
                                 "(unavailable: tool_unavailable), or show the model an error (observation: coping is part of the task)")


def _sdk() -> Any:
    try:
        import mcp
    except ImportError:
        raise ValueError("engine_mcp_servers needs the MCP SDK: pip install 'mcp>=2,<3' "
                         "(or, in the engine's checkout, pip install -e '.[mcp]')") from None
    return mcp


def describe(name: str) -> str:
    """A server as messages name it."""
    return f"MCP server {name!r}"


# Connections per event loop (a session is bound to the loop that opened it), per server.
_connections: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[ServerSpec, Connection]] = weakref.WeakKeyDictionary()


def connection(spec: ServerSpec) -> Connection:
    """The running loop's connection to `spec`."""
    per_loop = _connections.setdefault(asyncio.get_running_loop(), {})
    conn = per_loop.get(spec)
    if conn is None:
        conn = per_loop[spec] = Connection(spec)
    return conn


async def close_connections() -> None:
    """End every MCP server this event loop started (the run is over), all at once and bounded.

    Gracefully (stdin closed, then SIGTERM, then SIGKILL); when the task closing them is being
    cancelled (Ctrl-C), at once.
    """
    per_loop = _connections.pop(asyncio.get_running_loop(), {})
    task = asyncio.current_task()
    at_once = task is not None and task.cancelling() > 0
    await asyncio.gather(*(conn.close(at_once) for conn in per_loop.values()))


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
    """A tool one MCP server lists, called through the SDK.

    `server`: how messages name its server; `lenient`: the SDK refused the server's listing (a
    tool with an invalid schema), so results are not checked against listed output schemas;
    `timeout`: a call's limit outside the engine's calls (which carry the tool timeout);
    `failures`: "unavailable" (a failing server ends the sample untrained) or "observation" (None: the default).
    A runtime calls the copy `setup` makes with its own settings.
    """

    def __init__(self, spec: ServerSpec, name: str, description: str, parameters: dict[str, Any], *,
                 server: str, timeout: float, lenient: bool = False, failures: str | None = None) -> None:
        self.spec = spec
        self.name = name  # type: ignore[misc]
        self.description = description  # type: ignore[misc]
        self.parameters = parameters  # type: ignore[misc]
        self.server = server
        self.timeout = timeout
        self.lenient = lenient
        self.failures = failures or default_of(McpSettings, "failures")

    Settings = McpSettings

    def setup(self, cfg: Any, settings: McpSettings | None = None) -> McpTool:
        """This tool under one runtime's settings: its tool timeout, and whose a failing server is."""
        made = copy.copy(self)
        made.timeout = cfg.tool_timeout
        made.failures = (settings or McpSettings()).failures
        return made

    async def execute(self, state: Any, **arguments: Any) -> ToolResult:
        seconds = call_timeout(self.timeout)
        try:
            result = await connection(self.spec).call(self.name, arguments, seconds, lenient=self.lenient)
        except ServerFailure as failure:
            message = f"{describe(self.server)} {failure.reason}"
            if self.failures == "observation":
                raise ToolError(failure.kind, f"{self.name}: {message}") from None
            raise ToolUnavailable(message) from None
        text = _text(result)
        if getattr(result, "is_error", False):
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


async def list_server(spec: ServerSpec, timeout: float) -> Listing:
    """Start the server, list its tools and end it, within `timeout` seconds (plus its close).

    Raises ValueError naming the server (never its command line, URL or secrets) when it cannot.
    """
    _sdk()
    missing = spec.missing()
    if missing:
        raise ValueError(f"{describe(spec.where)}: its env or headers name {', '.join(missing)}, "
                         "which the job's environment does not set")
    conn = Connection(spec)
    try:
        return await conn.list_tools(timeout)
    except ServerFailure as failure:
        raise ValueError(f"{describe(conn.name)} {failure.reason}") from None
    except ToolError as refused:  # an error answer to tools/list
        raise ValueError(f"{describe(conn.name)} refused to list its tools: {refused.message}") from None
    finally:
        await conn.close()


_registered: dict[ServerSpec, list[McpTool]] = {}  # server -> the tools registered from it
_lock = threading.Lock()


def register_servers(specs: Any, list_timeout: float, tool_timeout: float) -> list[str]:
    """List each server's tools (once per process) and register them; returns every name registered.

    `specs`: `engine_mcp_servers` entries (ServerSpecs, command lines, URLs or mappings). The
    servers are listed at once, each with `list_timeout` seconds to start and list its tools.
    Blocking: the listing runs on an event loop of its own in a worker thread, so it may be
    called from inside a running loop (the runtime is built there). Raises ValueError for a
    server that cannot be listed and for a name another tool (or server) already has.
    """
    names: list[str] = []
    servers = parse_servers(specs) if not isinstance(specs, ServerSpec) else (specs,)
    with _lock:
        new = list(dict.fromkeys(s for s in servers if s not in _registered))
        if new:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                listings = pool.submit(asyncio.run, _list_all(new, list_timeout)).result()
            for spec in new:  # in the order given, so a clash names the later one
                if isinstance(listings[spec], BaseException):
                    raise listings[spec]
                _registered[spec] = _register(spec, listings[spec], tool_timeout)
        for spec in servers:
            names += [t.name for t in _registered[spec]]
    return names


async def _list_all(specs: list[ServerSpec], timeout: float) -> dict[ServerSpec, Listing | BaseException]:
    """Every server listed at once (each within `timeout`): its listing, or why it has none."""
    done = await asyncio.gather(*(list_server(spec, timeout) for spec in specs), return_exceptions=True)
    return dict(zip(specs, done))


def _register(spec: ServerSpec, listing: Listing, timeout: float) -> list[McpTool]:
    server = spec.name or listing.server_name or spec.where
    chosen: list[McpTool] = []
    for entry in listing.tools:
        name = entry.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            log.warning("%s: tool %r skipped: a tool name is lowercase letters, digits and _, starting with a letter",
                        describe(server), name)
            continue
        schema = entry.get("inputSchema")
        problem = schema_problem(schema)
        if problem is not None:
            log.warning("%s: tool %r skipped: %s", describe(server), name, problem)
            continue
        existing = get(name) or next((t for t in chosen if t.name == name), None)
        if existing is not None:
            owner = describe(existing.server) if isinstance(existing, McpTool) else f"the tool {_origin(existing)}"
            raise ValueError(f"tool name clash: {describe(server)} lists {name!r}, which {owner} already has; "
                             "rename one or drop a server from engine_mcp_servers")
        chosen.append(McpTool(spec, name, entry.get("description") or "", schema, server=server, timeout=timeout,
                              lenient=listing.lenient))
    for tool in chosen:
        register(tool)
    return chosen


def _origin(tool: Tool) -> str:
    """Where a Python tool is defined, as `module.name`."""
    fn = getattr(tool, "_fn", None)  # a tool made by @tool
    where = fn if fn is not None else type(tool)
    return f"{where.__module__}.{where.__qualname__}"


def unregister_servers() -> None:
    """Forget every server's tools (tests undo their registrations with it)."""
    with _lock:
        for tools in _registered.values():
            for tool in tools:
                if get(tool.name) is tool:
                    unregister(tool.name)
        _registered.clear()
