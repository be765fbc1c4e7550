"""A stdio MCP server as a process group the engine owns, bridged to the SDK's session.

The server starts in a session of its own, so it and everything it starts (the children of a
wrapper such as `uvx`, `npx`, `sh -c` or a relay) share one process group, whose id is the
server's pid: the engine can end all of it with one signal, at any time, without asking the
SDK. Lines the server writes are handed to the session as messages; the session's messages are
written to the server's stdin through an unbounded queue, so neither a call nor the SDK's
courtesy cancel ever waits on a server that stopped reading.

`stop` ends it the polite way (stdin closed, SIGTERM half-way through the grace, then SIGKILL to
the group, whatever answered); `kill` sends SIGKILL to the group at once and is synchronous, so a
cancelled call, a closing runtime and the interpreter's exit (an atexit backstop for a loop that
is never closed) can all use it. A process that leaves the group (a daemon calling setsid)
escapes, as from any process-group kill. The server's stdout is a pipe the engine opens and
closes itself: a daemon that escaped with it still open leaves no descriptor (nor a transport)
behind in the engine, however often the server is started again.

Its stderr, where MCP servers log, is a pipe of the engine's too (`ErrorLog`): each line goes to
this module's log at INFO, its secrets masked, up to STDERR_LOG_LIMIT bytes a start (a server
that floods it costs a counter, not the job's log), and its last lines are kept, to be logged
with the failure when the server dies or cannot start.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import math
import os
import re
import signal
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
LINE_LIMIT = 16 << 20  # bytes of one message line; a longer one ends the connection
REAP_SECONDS = 0.5  # how long a killed server has to be reaped before it is left to init
STDERR_LOG_LIMIT = 64 << 10  # bytes of a server's stderr logged per start; past it they are only counted
STDERR_TAIL = 2 << 10  # bytes of the end of its stderr kept, for the line that says how it ended
STDERR_LINE = 1000  # characters of one stderr line logged; the rest of a longer line is dropped
_POLL_SECONDS = 0.02

_live: set[int] = set()  # process groups started and not yet killed (the atexit backstop's list)
_atexit_armed = False


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def kill_all() -> None:
    """SIGKILL every server group still alive (at interpreter exit: a loop that was never closed)."""
    for pgid in list(_live):
        _signal_group(pgid, signal.SIGKILL)
        _live.discard(pgid)


def exit_text(returncode: int | None) -> str:
    """How a process ended, in words."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def unreadable_reply(line: bytes, error: ValueError) -> Any:
    """A reply to a request (it has the request's id) that the SDK cannot read, as an error reply
    to that request, so the call fails now, saying why, instead of waiting out its timeout; None
    for a line that is no reply. The standard library reads what the SDK refuses: a lone
    surrogate such as "\\udcff" (Python's json.dumps of text read with surrogateescape). A reply
    nested deeper than any parser here reads is known by its outermost keys (`_shallow_id`)."""
    from mcp.types import PARSE_ERROR, ErrorData, JSONRPCError

    try:
        data = json.loads(line)
    except ValueError:
        return None
    except RecursionError:
        data = _shallow_id(line)
    if not isinstance(data, dict) or "method" in data or not ("result" in data or "error" in data):
        return None
    request = data.get("id")
    if type(request) not in (int, str):
        return None
    why = str(error).splitlines()
    reason = next((text.strip() for text in why[1:] if text.strip()), why[0] if why else "")
    reason = reason.split(" [type=")[0]  # pydantic then quotes the line: the server's data, not the reason
    return JSONRPCError(jsonrpc="2.0", id=request, error=ErrorData(
        code=PARSE_ERROR, message=f"a reply that is not JSON-RPC the MCP SDK reads ({reason[:200]})"))


_ID = rb'(-?\d+|"(?:[^"\\]|\\.)*")'
# A reply's outermost keys as the SDKs write them: `jsonrpc` and `id` before `result` or `error`
# (Python's), or the `id` last (TypeScript's); read without descending into the nesting.
_REPLY_HEAD = re.compile(rb'\A\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?(?:"id"\s*:\s*' + _ID +
                         rb'\s*,\s*)?(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?"(?:result|error)"\s*:')
_TAIL_ID = re.compile(rb',\s*"id"\s*:\s*' + _ID + rb'\s*\}\s*\Z')


def _shallow_id(line: bytes) -> dict[str, Any] | None:
    """`{"id": ..., "result": None}` for a line whose outermost object opens as a reply and names
    its id first or last (the key right before the closing brace is an outermost one); None else."""
    head = _REPLY_HEAD.match(line)
    found = head.group(1) if head is not None else None
    if head is not None and found is None:
        tail = _TAIL_ID.search(line[-512:])
        found = tail.group(1) if tail is not None else None
    if found is None:
        return None
    return {"id": json.loads(found), "result": None}


class ErrorLog(asyncio.Protocol):
    """A server's stderr, read as it comes: lines logged at INFO with its secrets masked (`redact`),
    up to STDERR_LOG_LIMIT bytes, then counted only; its last STDERR_TAIL bytes kept (`tail`)."""

    def __init__(self, name: str, redact: Callable[[str], str]) -> None:
        self.name, self.redact = name, redact
        self.total = 0
        self._pending = b""  # the start of a line not yet ended
        self._skipping = False  # inside a line longer than STDERR_LINE bytes: its rest is dropped
        self._tail = b""

    def data_received(self, data: bytes) -> None:
        """Keep the tail; log the lines that ended, while under the limit."""
        before, self.total = self.total, self.total + len(data)
        if before < STDERR_LOG_LIMIT:
            self._take(data[:STDERR_LOG_LIMIT - before])
        if before <= STDERR_LOG_LIMIT < self.total:  # said once, also when a chunk ended right at the limit
            log.info("MCP server %r: its stderr past %d KiB is not logged", self.name, STDERR_LOG_LIMIT >> 10)
        self._tail = (self._tail + data[-STDERR_TAIL:])[-STDERR_TAIL:]  # a flood's chunk is not copied whole

    def _take(self, data: bytes) -> None:
        *lines, self._pending = (self._pending + data).split(b"\n")
        for line in lines:
            if not self._skipping:
                self._log(line)
            self._skipping = False
        if len(self._pending) > 4 * STDERR_LINE:  # a line without end: its start is logged, the rest dropped
            if not self._skipping:
                self._log(self._pending)
            self._pending, self._skipping = b"", True

    def _log(self, line: bytes) -> None:
        text = self.redact(line.decode("utf-8", errors="replace")).rstrip()
        if text:
            log.info("MCP server %r: %s", self.name, text[:STDERR_LINE])

    def tail(self) -> str:
        """The last whole lines of what the server wrote to stderr (secrets masked), '' for none."""
        kept = self._tail
        if self.total > len(kept) and b"\n" in kept:  # cut: start at a whole line
            kept = kept.split(b"\n", 1)[1]
        return self.redact(kept.decode("utf-8", errors="replace")).strip()


class ServerProcess:
    """One started stdio server: its process group, and the two streams the SDK's session reads and writes."""

    def __init__(self, proc: asyncio.subprocess.Process, stdout: asyncio.StreamReader,
                 pipes: list[asyncio.BaseTransport], errors: ErrorLog) -> None:
        import anyio

        self._proc = proc
        self._stdout = stdout
        self._pipes = pipes  # stdout's and stderr's: closed by `stop`
        self.errors = errors
        self.pid = proc.pid  # also the process group's id (a session of its own)
        self.ended = asyncio.Event()  # the server's stdout ended: it exited, or closed it
        self._to_session, self.read_stream = anyio.create_memory_object_stream[Any](0)
        self.write_stream, self._from_session = anyio.create_memory_object_stream[Any](math.inf)
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._write())]

    @classmethod
    async def start(cls, argv: tuple[str, ...], env: dict[str, str], *, name: str = "",
                    redact: Callable[[str], str] = str) -> ServerProcess:
        """Start the server; raises OSError when it cannot be started. `name` and `redact` are
        how its stderr's log lines name it and mask its secrets."""
        global _atexit_armed
        # stdout and stderr are pipes of our own, not asyncio's: asyncio closes its pipes only at
        # EOF, which a descendant that escaped the group (and kept the write ends) never sends
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=out_write, stderr=err_write, env=env,
                start_new_session=True)
        except BaseException:
            os.close(out_read)
            os.close(err_read)
            raise
        finally:
            os.close(out_write)
            os.close(err_write)
        _live.add(proc.pid)
        if not _atexit_armed:
            atexit.register(kill_all)
            _atexit_armed = True
        stdout = asyncio.StreamReader(limit=LINE_LIMIT)
        errors = ErrorLog(name, redact)
        files = [os.fdopen(out_read, "rb", buffering=0), os.fdopen(err_read, "rb", buffering=0)]
        pipes: list[asyncio.BaseTransport] = []
        loop = asyncio.get_running_loop()
        try:
            pipes.append((await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout), files[0]))[0])
            pipes.append((await loop.connect_read_pipe(lambda: errors, files[1]))[0])
        except BaseException:  # cancelled while connecting: nothing may own a server nobody reads
            _signal_group(proc.pid, signal.SIGKILL)
            _live.discard(proc.pid)
            for pipe in pipes:
                pipe.close()
            for file in files[len(pipes):]:
                file.close()
            raise
        return cls(proc, stdout, pipes, errors)

    @property
    def returncode(self) -> int | None:
        """The server's exit status (negative: the signal that killed it); None while it runs."""
        return self._proc.returncode

    async def _read(self) -> None:
        from mcp.shared.message import SessionMessage
        from mcp.types import jsonrpc_message_adapter

        try:
            while True:
                try:
                    line = await self._stdout.readline()
                except ValueError:  # a line over LINE_LIMIT: no server to keep talking to
                    log.warning("an MCP server wrote a line over %d bytes; its connection is ended", LINE_LIMIT)
                    self.kill()
                    return
                if not line:
                    return
                if not line.strip():
                    continue
                try:
                    message = jsonrpc_message_adapter.validate_json(line, by_name=False)
                except ValueError as exc:
                    message = unreadable_reply(line, exc)
                    if message is None:  # not JSON-RPC (a banner, a stray print): skipped
                        log.debug("an MCP server wrote a line that is not JSON-RPC; skipped")
                        continue
                await self._to_session.send(SessionMessage(message))
        except Exception:  # noqa: BLE001 - the session is gone (a closed stream), or the pipe broke: it ends
            return
        finally:
            self._to_session.close()  # the session's calls fail at once, instead of waiting
            self.ended.set()

    async def _write(self) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        try:
            async for item in self._from_session:
                data = item.message.model_dump_json(by_alias=True, exclude_unset=True)
                stdin.write(data.encode("utf-8") + b"\n")
                await stdin.drain()
        except Exception:  # noqa: BLE001 - the server closed its stdin or died: the reader ends the connection
            return

    async def exited(self, seconds: float) -> bool:
        """Whether the server's process exits within `seconds` (read from its status, not its pipes:
        a child that inherited them keeps them open after the server is gone)."""
        deadline = asyncio.get_running_loop().time() + seconds
        while self._proc.returncode is None:
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(_POLL_SECONDS)
        return True

    async def stop(self, grace: float) -> None:
        """Close stdin and give the server `grace` seconds (SIGTERM to the group half-way), then SIGKILL the group."""
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            if not await self.exited(grace / 2):
                _signal_group(self.pid, signal.SIGTERM)
                await self.exited(grace / 2)
        finally:
            self.kill()  # always: a wrapper's children may outlive the server it started
        try:
            await self.exited(REAP_SECONDS)
        finally:  # also when cancelled: whoever else holds the write ends (a daemon that escaped the group)
            for pipe in self._pipes:
                pipe.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.wait(self._tasks, timeout=REAP_SECONDS)

    def kill(self) -> None:
        """SIGKILL the whole process group now; synchronous, so it runs on every path."""
        _signal_group(self.pid, signal.SIGKILL)
        _live.discard(self.pid)
