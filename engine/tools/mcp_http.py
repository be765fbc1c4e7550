"""The HTTP client an MCP server over streamable HTTP is asked through: the SDK's client kind
(`httpx2`), with every message capped.

The SDK reads a JSON reply whole (`aread`) and an event stream line by line, with no bound: a
server that answered with 400 MB held the engine at 2 GB. Here no run of bytes without a line
break may pass `LINE_LIMIT` (the cap on a stdio server's lines): past it the reply's stream
raises `httpx2.StreamError`, which the SDK turns into an error answer to the request (a JSON
reply) or a broken connection (an event stream), so the call fails at once and nothing more of
the reply is read.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx2

from engine.tools.mcp_stdio import LINE_LIMIT

TIMEOUT = 30.0  # connect, write and pool limits; no read limit: a server may hold an event stream open


class CappedStream(httpx2.AsyncByteStream):
    """A reply's bytes, refused past `limit` bytes without a line break."""

    def __init__(self, inner: httpx2.AsyncByteStream, limit: int = LINE_LIMIT) -> None:
        self.inner = inner
        self.limit = limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        run = 0  # bytes since the last line break
        async for chunk in self.inner:
            newline = chunk.rfind(b"\n")
            run = len(chunk) - newline - 1 if newline >= 0 else run + len(chunk)
            if run > self.limit:
                raise httpx2.StreamError(f"a message of the reply runs past {self.limit} bytes; not read further")
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


class CappedTransport(httpx2.AsyncBaseTransport):
    """httpx2's own transport, each reply's stream capped (`CappedStream`)."""

    def __init__(self, limit: int = LINE_LIMIT) -> None:
        self.inner = httpx2.AsyncHTTPTransport()
        self.limit = limit

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        return httpx2.Response(response.status_code, headers=response.headers, request=request,
                               stream=CappedStream(response.stream, self.limit), extensions=response.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


def client(headers: dict[str, str], limit: int = LINE_LIMIT) -> Any:
    """An `httpx2.AsyncClient` for one server: its headers, replies capped at `limit` bytes a message."""
    return httpx2.AsyncClient(headers=headers or None, timeout=httpx2.Timeout(TIMEOUT, read=None),
                              transport=CappedTransport(limit))
