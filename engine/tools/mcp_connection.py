"""One MCP server's connection on one event loop, every wait of it bounded.

A call starts the server when none runs and then calls it, both within the call's time limit
(the tool timeout); what a failure costs afterwards is bounded too (SHUTDOWN_SECONDS: a ping to
tell a slow call from a hung server, then the kill). A server that does not answer a ping in
time, dies, or breaks the connection is ended (its whole process group killed: see
`mcp_stdio`), and the next call starts it again; a server that answers the ping keeps serving
the other samples' calls. The caller's own cancellation (its timeout, Ctrl-C, slime's abort) is
never held up: nothing here waits on the server without a deadline.

Each start of the server (a `Life`) is held open by a task of its own, because the SDK's
session is an anyio task group that must be left by the task that entered it. Failures are
`ServerFailure`s whose messages name the server by its name and mask its secrets; the tool
decides whether the model reads them (see `mcp_servers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import textwrap
from typing import Any

import attrs

from engine.logs import log_once
from engine.tools.mcp_spec import MissingVariable, ServerSpec
from engine.tools.mcp_stdio import REAP_SECONDS, ServerProcess, exit_text
from engine.tools.registry import ToolError

log = logging.getLogger(__name__)
PING_SECONDS = 1.0  # after a call timed out: how long the server has to show it is alive
SHUTDOWN_SECONDS = 2.0  # what a failed call may add to the tool timeout (the ping, the kill, the reap)
EXIT_SECONDS = 0.25  # after the connection broke: how long the process has to show how it ended
CLOSE_GRACE = 1.0  # at the end of the run: stdin closed, SIGTERM half-way, then SIGKILL
CLOSE_SECONDS = CLOSE_GRACE + 2 * REAP_SECONDS  # the most one connection's close may take
INVALID_PARAMS = -32602  # JSON-RPC: the call's arguments were refused (the model's error, not the server's)
CONNECTION_CLOSED = -32000  # the SDK's code for a connection that ended under a waiting request


class ServerFailure(Exception):
    """The server could not answer: it did not start, hung, died or broke the protocol.

    `kind`: "timeout" or "server_error" (the kinds the model reads when failures are its to see).
    The message says what happened, after "MCP server '<name>'".
    """

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


@attrs.frozen
class Listing:
    """What a server lists at start: its own name, its tools as sent (dicts), and whether the SDK
    refused the listing (a tool with an invalid schema), so calls skip the SDK's result check."""

    server_name: str | None
    tools: tuple[dict[str, Any], ...]
    lenient: bool


def _leaf(exc: BaseException) -> BaseException:
    """The first real error inside the SDK's task-group exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _why(exc: BaseException) -> str:
    """An error in a few words: its type and message (an OSError's reason, not its file name)."""
    leaf = _leaf(exc)
    if isinstance(leaf, OSError) and leaf.strerror:
        return f"{type(leaf).__name__}: {leaf.strerror}"
    text = str(leaf)
    return f"{type(leaf).__name__}: {text}" if text else type(leaf).__name__


class Life:
    """One start of a server: the task holding its session open, and how to end it."""

    def __init__(self, spec: ServerSpec, start_seconds: float, *, tap: bool = False) -> None:
        self.spec = spec
        self.ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.stop = asyncio.Event()
        self.process: ServerProcess | None = None
        self.server_name: str | None = None
        self.tap = Tap() if tap else None
        self.owner = asyncio.ensure_future(self._own(start_seconds))

    async def _own(self, start_seconds: float) -> None:
        # One deadline, moved as the life goes on: the start has `start_seconds`, the session then
        # lives until stopped, and leaving it (the session, then the transport) has CLOSE_SECONDS.
        # The contexts are left with whatever ended them, as the SDK's task groups need.
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(start_seconds) as deadline:
                async with contextlib.AsyncExitStack() as stack:
                    session = await self._open(stack)
                    deadline.reschedule(None)
                    self.ready.set_result(session)
                    await self._wait_for_the_end()
                    deadline.reschedule(loop.time() + CLOSE_SECONDS)
        except BaseException as exc:  # it could not start, or not close in time: whoever waits hears why
            if not self.ready.done():
                if self.process is not None and isinstance(exc, Exception):
                    await self.process.exited(EXIT_SECONDS)  # to say how it ended, when it did
                failure = self._start_failure(exc, start_seconds)
                self.tell_its_account(failure.reason)
                self.ready.set_exception(failure)
                self.ready.exception()  # retrieved: nobody may be waiting any more
            else:
                log.debug("MCP server %r: closing its session: %s", self.name, _why(exc))
            if not isinstance(exc, Exception):
                raise
        finally:
            self.kill()  # whatever happened above, nothing of the server outlives its session

    async def _wait_for_the_end(self) -> None:
        """Until stopped, or until the server's output ends (it exited)."""
        ended = [asyncio.ensure_future(self.stop.wait())]
        if self.process is not None:
            ended.append(asyncio.ensure_future(self.process.ended.wait()))
        try:
            await asyncio.wait(ended, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in ended:
                waiter.cancel()

    async def _open(self, stack: contextlib.AsyncExitStack) -> Any:
        import mcp

        if self.spec.url is not None:
            from mcp.client.streamable_http import streamable_http_client

            from engine.tools import mcp_http  # the SDK's client kind, its replies capped

            client = await stack.enter_async_context(mcp_http.client(self.spec.resolved_headers()))
            read, write = await stack.enter_async_context(streamable_http_client(self.spec.url, http_client=client))
        else:
            from mcp.client.stdio import get_default_environment

            env = get_default_environment() | self.spec.resolved_env()
            self.process = await ServerProcess.start(self.spec.command, env, name=self.name, redact=self.spec.redact)
            stack.push_async_callback(self.process.stop, CLOSE_GRACE)
            read, write = self.process.read_stream, self.process.write_stream
        if self.tap is not None:
            read, write = self.tap.reads(read), self.tap.writes(write)
        session = await stack.enter_async_context(mcp.ClientSession(read, write))
        init = await session.initialize()
        self.server_name = getattr(getattr(init, "server_info", None), "name", None)
        return session

    def _start_failure(self, exc: BaseException, seconds: float) -> ServerFailure:
        if isinstance(exc, TimeoutError):
            return ServerFailure("timeout", f"did not start within {seconds:g} seconds")
        if isinstance(exc, asyncio.CancelledError):
            return ServerFailure("server_error", "was stopped while it started")
        if isinstance(_leaf(exc), MissingVariable):
            return ServerFailure("server_error", f"cannot start: {_leaf(exc)}")
        return ServerFailure("server_error", self.spec.redact(f"could not start ({self.status(_why(exc))})"))

    @property
    def name(self) -> str:
        """How messages name the server: its entry's name, else the name it gave itself."""
        return self.spec.name or self.server_name or self.spec.where

    def tell_its_account(self, what: str) -> None:
        """Log, once per text, what went wrong and the last lines of the server's stderr (its own
        account of it, secrets masked): the engine's log only, never the model's context."""
        tail = self.process.errors.tail() if self.process is not None else ""
        if tail:
            log_once(f"MCP server {self.name!r} {what}; the last of its stderr:\n{textwrap.indent(tail, '    ')}",
                     logger=log)

    def status(self, fallback: str) -> str:
        """How the server's process ended, when it did; `fallback` otherwise."""
        if self.process is not None and self.process.returncode is not None:
            return exit_text(self.process.returncode)
        return fallback

    def kill(self) -> None:
        """End it now: SIGKILL its process group, and let its task unwind."""
        if self.process is not None:
            self.process.kill()
        self.stop.set()

    async def close(self, at_once: bool) -> None:
        """End it (gracefully, or `at_once`) and wait for its task, never longer than CLOSE_SECONDS + REAP_SECONDS."""
        if at_once:
            self.kill()
            if not self.ready.done():
                self.owner.cancel()  # still starting: nothing to wait for
        self.stop.set()
        try:
            _, pending = await asyncio.wait([self.owner], timeout=CLOSE_SECONDS)
            if pending:
                self.kill()
                self.owner.cancel()
                _, pending = await asyncio.wait([self.owner], timeout=REAP_SECONDS)
                if pending:
                    log.warning("MCP server %r: its connection did not close in time; left to end on its own", self.name)
        except asyncio.CancelledError:
            self.kill()
            self.owner.cancel()
            raise


class Connection:
    """One server's connection on one event loop: started on first use, started again after it ends."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self._life: Life | None = None
        self._ending: list[Life] = []  # ended lives whose task may still be unwinding

    def _current(self, start_seconds: float, *, tap: bool = False) -> Life:
        if self._life is None or self._life.owner.done() or self._life.stop.is_set():
            if self._life is not None:
                self._ending = [life for life in (*self._ending, self._life) if not life.owner.done()]
            self._life = Life(self.spec, start_seconds, tap=tap)
        return self._life

    async def call(self, tool: str, arguments: dict[str, Any], seconds: float, *, lenient: bool = False) -> Any:
        """The `CallToolResult` of one call, started and answered within `seconds`.

        Raises `ServerFailure` when the server cannot answer (at most SHUTDOWN_SECONDS later),
        `ToolError` when it refused the call's arguments. `lenient`: the SDK refused this server's
        listing, so the result is taken without the SDK's check against the listed output schema.
        """
        import mcp

        life = None
        try:
            async with asyncio.timeout(seconds):
                life = self._current(seconds)
                session = await asyncio.shield(life.ready)
                if lenient:
                    request = mcp.types.CallToolRequest(params=mcp.types.CallToolRequestParams(name=tool, arguments=arguments))
                    return await session.send_request(request, mcp.types.CallToolResult)
                return await session.call_tool(tool, arguments)
        except TimeoutError:
            if life is not None:
                await self._probe(life)
            raise ServerFailure("timeout", f"did not answer within {seconds:g} seconds") from None
        except ServerFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever broke, _failure says whose it is
            assert life is not None
            raise await self._failure(life, tool, exc) from None

    async def _probe(self, life: Life) -> None:
        """A call timed out: end the server unless it answers a ping within PING_SECONDS (then only
        that call was slow, and the other samples' calls go on)."""
        if not life.ready.done() or life.ready.exception() is not None:
            life.kill()  # it did not even start in time
            return
        try:
            async with asyncio.timeout(PING_SECONDS):
                await life.ready.result().send_ping()
        except Exception:  # noqa: BLE001 - silent or gone: end it; the next call starts it again
            life.kill()

    async def _failure(self, life: Life, tool: str, exc: Exception) -> Exception:
        """What an error of a call means: the model's (refused arguments) or the server's."""
        import pydantic
        from mcp import MCPError

        leaf = _leaf(exc)
        if isinstance(leaf, MCPError) and leaf.code == INVALID_PARAMS:
            return ToolError("bad_arguments", self.spec.redact(f"{tool}: {leaf.message}"))
        if isinstance(leaf, MCPError) and leaf.code != CONNECTION_CLOSED:
            return ServerFailure("server_error", self.spec.redact(f"answered error {leaf.code}: {leaf.message}"))
        if isinstance(leaf, (pydantic.ValidationError, RuntimeError)):  # it answered, wrongly: the connection stays
            return ServerFailure("server_error", self.spec.redact(f"answered with a result it may not send ({_why(leaf)})"))
        if life.process is not None:
            await life.process.exited(EXIT_SECONDS)  # to say how it ended, when it did
        life.kill()  # the connection broke: the next call starts the server again
        failure = ServerFailure("server_error", self.spec.redact(life.status(f"stopped answering ({_why(leaf)})")))
        life.tell_its_account(failure.reason)
        return failure

    async def list_tools(self, seconds: float) -> Listing:
        """Start the server and list its tools (every page), within `seconds`; raises `ServerFailure`.

        A page the SDK refuses (it validates every tool, so one bad schema fails the page) is
        taken as the server sent it, so that only the bad tool is skipped, not the server.
        """
        import mcp
        import pydantic

        life = self._current(seconds, tap=True)
        assert life.tap is not None
        found: list[dict[str, Any]] = []
        lenient, cursor = False, None
        try:
            async with asyncio.timeout(seconds):
                session = await asyncio.shield(life.ready)
                while True:
                    params = mcp.types.PaginatedRequestParams(cursor=cursor) if cursor else None
                    try:
                        result = await session.list_tools(params=params)
                        page = result.model_dump(by_alias=True, mode="json", exclude_none=True)
                    except pydantic.ValidationError:
                        page, lenient = life.tap.listing, True
                    tools = page.get("tools") if isinstance(page, dict) else None
                    if not isinstance(tools, list):
                        raise ServerFailure("server_error", "answered tools/list without a list of tools")
                    found += [t if isinstance(t, dict) else {} for t in tools]
                    cursor = page.get("nextCursor")
                    if not cursor:
                        return Listing(life.server_name, tuple(found), lenient)
        except TimeoutError:
            raise ServerFailure("timeout", f"did not list its tools within {seconds:g} seconds") from None
        except ServerFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever broke, _failure says whose it is
            raise await self._failure(life, "tools/list", exc) from None

    @property
    def name(self) -> str:
        """How messages name the server (its entry's name, else the name it gave itself when it last started)."""
        return self._life.name if self._life is not None else (self.spec.name or self.spec.where)

    async def close(self, at_once: bool = False) -> None:
        """End the server, if it runs, and wait for earlier starts still unwinding (bounded: see `Life.close`)."""
        lives = [life for life in (*self._ending, self._life) if life is not None]
        self._life, self._ending = None, []
        await asyncio.gather(*(life.close(at_once) for life in lives))


class Tap:
    """Keeps the result of the session's last tools/list as the server sent it (before the SDK checks it).

    It wraps the transport's two streams, which is all the SDK asks of a transport: requests
    going out are noted by id, and the answer to a noted one is kept.
    """

    def __init__(self) -> None:
        self._asked: set[Any] = set()
        self.listing: Any = None

    def writes(self, stream: Any) -> Any:
        """The write stream, noting each tools/list request."""
        return _Tapped(stream, self._sent)

    def reads(self, stream: Any) -> Any:
        """The read stream, keeping the answer to a noted request."""
        return _Tapped(stream, self._received)

    def _sent(self, item: Any) -> None:
        message = getattr(item, "message", None)
        if getattr(message, "method", None) == "tools/list" and hasattr(message, "id"):
            self._asked.add(message.id)

    def _received(self, item: Any) -> None:
        message = getattr(item, "message", None)
        if hasattr(message, "result") and getattr(message, "id", None) in self._asked:
            self._asked.discard(message.id)
            self.listing = message.result


class _Tapped:
    """A stream that shows every item to `see` on its way through; everything else is the stream's own."""

    def __init__(self, stream: Any, see: Any) -> None:
        self._stream = stream
        self._see = see

    async def send(self, item: Any) -> None:
        self._see(item)
        await self._stream.send(item)

    async def receive(self) -> Any:
        item = await self._stream.receive()
        self._see(item)
        return item

    def __aiter__(self) -> _Tapped:
        return self

    async def __anext__(self) -> Any:
        import anyio

        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def __aenter__(self) -> _Tapped:
        await self._stream.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> Any:
        return await self._stream.__aexit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
