"""A raw HTTP/1.1 server on a real loopback socket, for faults that live in the transport.

respx replaces the transport, so a server that drips bytes, sends a Retry-After or a
redirect must be a real socket for the test to mean anything. Each `/generate` request is
answered by the next handler of a script: a coroutine given the stream writer, free to write
any bytes at any pace. Model-info GETs get a 404 unless `info` says otherwise.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs

Handler = Callable[[asyncio.StreamWriter], Awaitable[None]]


@attrs.define
class Seen:
    """One request the server read: when it arrived, its method, path, headers and body."""

    at: float
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


def response_bytes(status: int, body: bytes = b"", headers: dict[str, str] | None = None, reason: str = "X") -> bytes:
    """A whole HTTP/1.1 response with a Content-Length."""
    head = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def send(status: int, body: bytes | dict[str, Any] = b"", headers: dict[str, str] | None = None) -> Handler:
    """A handler that answers at once."""
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    extra = {"Content-Type": "application/json", **(headers or {})} if isinstance(body, dict) else headers

    async def handler(writer: asyncio.StreamWriter) -> None:
        writer.write(response_bytes(status, raw, extra))
        await writer.drain()

    return handler


def drip(prefix: bytes, byte: bytes = b"x", every: float = 0.05) -> Handler:
    """A handler that writes `prefix`, then one byte every `every` seconds, forever."""

    async def handler(writer: asyncio.StreamWriter) -> None:
        writer.write(prefix)
        await writer.drain()
        while True:
            await asyncio.sleep(every)
            writer.write(byte)
            await writer.drain()

    return handler


class LoopbackServer:
    """`async with LoopbackServer(script) as server:`; `server.url` is the engine's server URL."""

    def __init__(self, script: list[Handler], *, repeat_last: bool = False, info: dict[str, Any] | None = None) -> None:
        self.script = list(script)
        self.repeat_last = repeat_last
        self.info = info
        self.seen: list[Seen] = []
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def generates(self) -> list[Seen]:
        return [s for s in self.seen if s.path.endswith("/generate")]

    async def __aenter__(self) -> LoopbackServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while True:
                seen = await self._read(reader)
                if seen is None:
                    return
                self.seen.append(seen)
                await self._answer(seen)(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:  # the server is closing: end quietly (asyncio logs a cancelled handler)
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    def _answer(self, seen: Seen) -> Handler:
        if not seen.path.endswith("/generate"):
            return send(200, self.info) if self.info is not None and seen.path.endswith("/model_info") else send(404, b"")
        if not self.script:
            raise AssertionError(f"unexpected request #{len(self.generates)}")
        return self.script[0] if self.repeat_last and len(self.script) == 1 else self.script.pop(0)

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> Seen | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        return Seen(time.monotonic(), method, path, headers, body)
