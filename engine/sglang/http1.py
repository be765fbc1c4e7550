"""The engine's own HTTP/1.1 client: keep-alive connections on asyncio's transports, nothing else.

Why it exists: a `/generate` turn needs one POST with a body that is already bytes and one
reply read whole. aiohttp's client spends ~80 us of CPU per such request on request and
response objects, header multidicts, payload registries and timers; this client writes one
buffer and parses the reply with a few `bytes` methods (bench: `engine_http_transport=asyncio`
against `aiohttp_direct`). It needs no package.

What it does not do, on purpose: redirects (reported, never followed), compression (the
reply is read as sent), proxies, cookies, HTTP/2, `Expect: 100-continue`. What it bounds,
because the server may be hostile: the header block (`MAX_HEAD` bytes), every chunk-size
line, and the body (`max_body`, `ReplyTooLarge` past it). Malformed replies raise
`httpx.RemoteProtocolError`, lost connections `httpx.ReadError`, refused connects
`httpx.ConnectError`: the `httpx.RequestError`s `HttpPool` already retries.
"""

from __future__ import annotations

import asyncio
import math
import ssl
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import attrs
import httpx

from engine.sglang.wire import dumps

MAX_HEAD = 64 * 1024  # bytes of status line and headers; SGLang sends a few hundred
MAX_CHUNK_LINE = 1024  # bytes of one chunk-size line (hex size and extensions)
IDLE_SECONDS = 4.0  # an idle connection older than this is closed, not reused: uvicorn drops them at 5 s
MAX_INTERIM = 8  # 1xx replies accepted before the real one


class ReplyTooLarge(Exception):
    """A reply declared or sent more bytes than `engine_max_reply_bytes`; it was not read further."""

    def __init__(self, status: int, limit: int, declared: int | None = None) -> None:
        size = f"declared {declared} bytes" if declared is not None else f"ran past {limit} bytes"
        super().__init__(f"HTTP {status} reply {size}, over engine_max_reply_bytes={limit}")
        self.status = status


class RequestTimeout(httpx.TimeoutException):
    """The whole request (connect to last byte) took longer than its budget."""

    @classmethod
    def after(cls, limit: float) -> RequestTimeout:
        return cls(f"no complete reply within {limit:.3g}s (connect to last byte)")


@attrs.frozen
class RawResponse:
    """The part of `httpx.Response` the engine reads: status, headers (case-insensitive), body."""

    status_code: int
    headers: Any
    content: bytes


Hooks = dict[str, list[Callable[..., Any]]]
# A request body made when it is written: nothing need hold a large body while its reply is awaited.
BodySource = Callable[[], bytes]


def json_body(value: Any, headers: dict[str, str] | None) -> tuple[bytes, dict[str, str]]:
    """A `json=` argument as the bytes to send and the headers that say so (encoded once, so
    hooks and the wire see the same bytes)."""
    return dumps(value), {"Content-Type": "application/json", **(headers or {})}


async def request_hooks(hooks: Hooks, method: str, url: str, content: bytes | None,
                        headers: dict[str, str] | None) -> httpx.Request | None:
    """Run httpx "request" hooks on an `httpx.Request` built for them; None (nothing built) without hooks."""
    if not (hooks["request"] or hooks["response"]):
        return None
    request = httpx.Request(method, url, content=content, headers=headers)
    for hook in hooks["request"]:
        await hook(request)
    return request


async def response_hooks(hooks: Hooks, raw: RawResponse, request: httpx.Request | None) -> None:
    """Run httpx "response" hooks on an `httpx.Response` built from `raw` (only when there are some)."""
    if hooks["response"]:
        response = httpx.Response(raw.status_code, headers=list(raw.headers.items()), content=raw.content,
                                  request=request)
        for hook in hooks["response"]:
            await hook(response)


class Headers(dict[str, str]):
    """Reply headers, names lower-cased; `get`, `in` and `[]` take any case."""

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return dict.get(self, key.lower(), default)

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key.lower() if isinstance(key, str) else key)

    def __getitem__(self, key: str) -> str:
        return dict.__getitem__(self, key.lower())


class _Reply:
    """One response being read: framing from the head, the body as it comes (one buffer, so a
    server sending a million tiny chunks costs no more memory than one large one)."""

    __slots__ = ("status", "headers", "length", "chunked", "chunk", "body", "keep_alive")

    def __init__(self, status: int, headers: Headers, length: int | None, chunked: bool, keep_alive: bool) -> None:
        self.status, self.headers, self.length, self.chunked = status, headers, length, chunked
        self.keep_alive = keep_alive
        self.chunk: int | None = None  # chunked: bytes of the chunk being read; None at a size line
        self.body = bytearray()


class Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time (the pool never shares one).

    Memory held for one reply: the head (at most `MAX_HEAD`), the body (at most `max_body`), and
    for a moment at the end a second copy of the body as the `bytes` handed back.
    """

    def __init__(self, origin: tuple[str, str, int]) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.reply: _Reply | None = None
        self.waiter: asyncio.Future[_Reply] | None = None
        self.max_body = 1 << 30
        self.closed = False
        self.idle_since = 0.0
        self.answered = False  # a byte of the reply came: the request is never sent again
        self.interim = 0  # 1xx replies before the real one

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():  # bytes nobody asked for: the connection is unusable
            self.close()
            return
        self.answered = True
        self.buffer += data
        try:
            self._advance()
        except Exception as exc:
            self._fail(exc)

    def eof_received(self) -> bool:
        reply = self.reply
        if reply is not None and reply.length is None and not reply.chunked and not self.buffer:
            self.closed = True  # body delimited by the close: this is its end
            self._complete(reply)
        return False  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        if self.waiter is not None and not self.waiter.done():
            reply = self.reply
            if reply is not None and reply.length is None and not reply.chunked:
                self._complete(reply)  # read until close: the close ends it
            else:
                got = "mid-reply" if self.answered else "before any reply"
                self.waiter.set_exception(httpx.ReadError(f"the server closed the connection {got}"))

    # parsing
    def _advance(self) -> None:
        while self.reply is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0 and len(self.buffer) > MAX_HEAD or end > MAX_HEAD:
                raise httpx.RemoteProtocolError(f"reply head longer than {MAX_HEAD} bytes")
            if end < 0:
                return
            head = bytes(self.buffer[:end])
            del self.buffer[: end + 4]
            reply = _parse_head(head, self.max_body)
            if reply.status >= 200:
                self.reply = reply
            elif reply.status == 101 or self.interim >= MAX_INTERIM:  # never asked for: no upgrade, no flood
                raise httpx.RemoteProtocolError(f"unexpected interim reply {reply.status} (#{self.interim + 1})")
            else:
                self.interim += 1  # 100 Continue and the like: the real reply follows
        reply = self.reply
        if reply.chunked:
            self._advance_chunked(reply)
        elif reply.length is not None:
            self._take(reply, min(len(self.buffer), reply.length - len(reply.body)))
            if len(reply.body) == reply.length:
                self._complete(reply)
        else:  # until close, capped
            self._take(reply, len(self.buffer))

    def _take(self, reply: _Reply, n: int) -> None:
        """Move `n` bytes from the buffer to the body, refusing to grow it past `max_body`."""
        if len(reply.body) + n > self.max_body:
            raise ReplyTooLarge(reply.status, self.max_body)
        if n:
            with memoryview(self.buffer) as view:
                reply.body += view[:n]
            del self.buffer[:n]

    def _advance_chunked(self, reply: _Reply) -> None:
        while True:
            if reply.chunk is None:  # at a chunk-size line
                end = self.buffer.find(b"\r\n")
                if end < 0:
                    if len(self.buffer) > MAX_CHUNK_LINE:
                        raise httpx.RemoteProtocolError("chunk-size line too long")
                    return
                size_text = bytes(self.buffer[:end]).split(b";", 1)[0].strip()
                if not 0 < len(size_text) <= 16 or size_text.strip(b"0123456789abcdefABCDEF"):
                    raise httpx.RemoteProtocolError(f"bad chunk size {size_text[:20]!r}")
                del self.buffer[: end + 2]
                size = int(size_text, 16)
                if len(reply.body) + size > self.max_body:
                    raise ReplyTooLarge(reply.status, self.max_body)
                reply.chunk = size if size else -1  # -1: the last chunk; trailers follow
            if reply.chunk == -1:  # trailer lines until an empty one
                end = self.buffer.find(b"\r\n")
                if end < 0:
                    if len(self.buffer) > MAX_HEAD:
                        raise httpx.RemoteProtocolError("chunked trailers too long")
                    return
                del self.buffer[: end + 2]
                if end == 0:
                    self._complete(reply)
                    return
                continue
            size = reply.chunk
            if len(self.buffer) < size + 2:
                return
            if self.buffer[size : size + 2] != b"\r\n":
                raise httpx.RemoteProtocolError("chunk not followed by CRLF")
            self._take(reply, size)
            del self.buffer[:2]
            reply.chunk = None

    def _complete(self, reply: _Reply) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            if self.buffer:  # bytes past the reply: never trust this connection again
                reply.keep_alive = False
            waiter.set_result(reply)

    def _expire(self, limit: float | None) -> None:
        self._fail(RequestTimeout.after(limit or 0.0))

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        self.close()

    def close(self) -> None:
        """Drop the connection at once (no graceful shutdown: nothing is owed to the server)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    async def exchange(self, pending: list[bytes], max_body: int, deadline: float | None, limit: float | None) -> _Reply:
        """Write one request (taken out of `pending`, so no frame keeps it), wait for its whole
        reply; `RequestTimeout` at `deadline` (loop time).

        Once written, the bytes are the transport's alone, until the socket has taken them all.
        The deadline is one timer on the loop that fails the wait, cheaper per request than a
        timeout scope around it.
        """
        assert self.transport is not None
        self.max_body = max_body
        self.reply = None
        self.answered, self.interim = False, 0
        self.buffer.clear()
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        timer = loop.call_at(deadline, self._expire, limit) if deadline is not None else None
        try:
            self.transport.write(pending.pop())
            return await self.waiter
        finally:
            self.waiter = None
            self.reply = None  # an idle connection keeps no reply body
            if timer is not None:
                timer.cancel()


def declared_length(value: str | None) -> int | None:
    """A Content-Length value as a number, or None unless it is ASCII digits (at most 18):
    `str.isdigit` takes "²" too, and `int` then raises."""
    text = value.strip() if value is not None else ""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def _parse_head(head: bytes, max_body: int) -> _Reply:
    """Status line and headers; the body's framing; `ReplyTooLarge` for a declared length past the cap."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    code = parts[1] if len(parts) > 1 else b""
    if parts[0] not in (b"HTTP/1.1", b"HTTP/1.0") or not (len(code) == 3 and code.isdigit() and b"100" <= code <= b"599"):
        raise httpx.RemoteProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(code)
    headers = Headers()
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or line[:1] in b" \t":
            raise httpx.RemoteProtocolError(f"malformed header line {line[:80]!r}")
        key = name.decode("latin-1").lower()
        text = value.strip().decode("latin-1")
        if key not in headers:
            headers[key] = text
        elif key == "content-length":  # repeated: only the same value is acceptable
            if dict.__getitem__(headers, key) != text:
                raise httpx.RemoteProtocolError("conflicting Content-Length headers")
        else:
            headers[key] = dict.__getitem__(headers, key) + ", " + text
    keep_alive = parts[0] == b"HTTP/1.1" and "close" not in headers.get("connection", "").lower()
    if status in (204, 304):  # never a body, whatever the headers say
        return _Reply(status, headers, 0, False, keep_alive)
    length, chunked = None, False
    codings = headers.get("transfer-encoding")
    if codings is not None:
        if codings.rsplit(",", 1)[-1].strip().lower() != "chunked":
            raise httpx.RemoteProtocolError(f"unsupported Transfer-Encoding {codings[:40]!r}")
        chunked = True
        if "content-length" in headers:  # both: chunked frames it, and the connection is not trusted again
            keep_alive = False
    elif "content-length" in headers:
        value = headers["content-length"]
        length = declared_length(value)
        if length is None:
            raise httpx.RemoteProtocolError(f"bad Content-Length {value[:30]!r}")
        if length > max_body:
            raise ReplyTooLarge(status, max_body, length)
    else:
        keep_alive = False  # the close delimits the body
    return _Reply(status, headers, length, chunked, keep_alive)


class AsyncioClient:
    """`HttpPool`'s calls of a client, on `Connection`s kept alive per origin (LIFO, warm first).

    The pool's gate bounds how many requests run at once; this keeps at most `connections`
    idle connections per origin and opens a new one whenever none is idle.
    """

    def __init__(self, connections: int, timeout: httpx.Timeout, tls: ssl.SSLContext) -> None:
        self.connections = connections
        self.timeout = timeout
        self.tls = tls
        self.event_hooks: Hooks = {"request": [], "response": []}
        self._idle: dict[tuple[str, str, int], list[Connection]] = {}
        self._heads: dict[tuple[str, str], tuple[tuple[str, str, int], bytes]] = {}
        self._closing = False

    def _target(self, method: str, url: str) -> tuple[tuple[str, str, int], bytes]:
        """(origin, request line + Host header) for a URL, cached: the engine posts to one URL."""
        key = (method, url)
        known = self._heads.get(key)
        if known is not None:
            return known
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise httpx.UnsupportedProtocol(f"cannot send to {url!r}: only http:// and https:// URLs")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname
        host_header = f"[{host}]" if ":" in host else host
        if parts.port:
            host_header += f":{parts.port}"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = f"{method} {target} HTTP/1.1\r\nHost: {host_header}\r\n".encode("latin-1")
        known = ((parts.scheme, host, port), head)
        if len(self._heads) < 64:
            self._heads[key] = known
        return known

    async def _connect(self, origin: tuple[str, str, int], deadline: float | None, limit: float | None) -> Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = self.tls if scheme == "https" else None
        seconds = self.timeout.connect if self.timeout.connect is not None else math.inf
        if deadline is not None and deadline - loop.time() < seconds:  # the request's budget runs out first
            seconds, error = max(deadline - loop.time(), 0.0), RequestTimeout.after(limit or 0.0)
        else:
            error = httpx.ConnectTimeout(f"no connection to {host}:{port} within {self.timeout.connect}s")
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: Connection(origin), host, port, ssl=tls,
                                       server_hostname=host if tls else None),
                None if math.isinf(seconds) else seconds,
            )
        except (asyncio.TimeoutError, TimeoutError):
            raise error from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from None
        return conn

    def _checkout(self, origin: tuple[str, str, int]) -> Connection | None:
        idle = self._idle.get(origin)
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing() \
                    and now - conn.idle_since < IDLE_SECONDS:
                return conn
            conn.close()
        return None

    def _checkin(self, conn: Connection) -> None:
        if self._closing or conn.closed:
            conn.close()
            return
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) >= self.connections:
            conn.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        idle.append(conn)

    async def request(self, method: str, url: str, *, content: bytes | BodySource | None = None, json: Any = None,
                      headers: dict[str, str] | None = None, max_body: int = 1 << 30,
                      limit: float | None = None) -> RawResponse:
        """Send and read the whole body, up to `max_body` bytes (`ReplyTooLarge` past it).

        `content` may be a `BodySource`: it is called for each write (once, or twice when a
        kept-alive connection turns out closed), so the body is not held while the reply is
        awaited. Event hooks see a request only with its bytes, so with hooks it is called once
        and the bytes kept. `limit` bounds the whole request in seconds, connect to last byte
        (`RequestTimeout`); without one, the client's read timeout does. HEAD is not supported
        (its reply's framing differs, and the engine never sends one).
        """
        if method == "HEAD":
            raise httpx.LocalProtocolError("this client does not send HEAD requests")
        if limit is None:
            limit = self.timeout.read
        deadline = None if limit is None else asyncio.get_running_loop().time() + max(limit, 0.0)
        if json is not None:
            content, headers = json_body(json, headers)
        if callable(content) and (self.event_hooks["request"] or self.event_hooks["response"]):
            content = content()
        request = await request_hooks(self.event_hooks, method, url, content, headers)  # type: ignore[arg-type]
        origin, head = self._target(method, url)
        lines = [head]
        for name, value in (headers or {}).items():
            if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
                raise httpx.LocalProtocolError(f"header {name!r} holds a line break")
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        if callable(content):
            source = content
            prefix = b"".join(lines)

            def data() -> bytes:
                body = source()
                return b"".join((prefix, b"Content-Length: %d\r\n\r\n" % len(body), body))
        else:
            body = content or b""
            if body or method != "GET":
                lines.append(b"Content-Length: %d\r\n" % len(body))
            lines.append(b"\r\n")
            lines.append(body)
            whole = b"".join(lines)

            def data() -> bytes:
                return whole
        reply = await self._send(origin, data, max_body, deadline, limit)
        content_bytes = bytes(reply.body)
        raw = RawResponse(reply.status, reply.headers, content_bytes)
        await response_hooks(self.event_hooks, raw, request)
        return raw

    async def _send(self, origin: tuple[str, str, int], data: BodySource, max_body: int, deadline: float | None,
                    limit: float | None) -> _Reply:
        """One exchange; once again on a fresh connection when a reused one was dropped before replying."""
        for fresh in (False, True):
            pending = [data()]  # made before a connection is taken: a body that cannot be made costs none
            conn = None if fresh else self._checkout(origin)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(origin, deadline, limit)
            done = False
            try:
                reply = await conn.exchange(pending, max_body, deadline, limit)
                done = True
            except httpx.ReadError:
                if reused and not conn.answered:  # the keep-alive race: not a byte came, try a new one
                    continue
                raise
            finally:
                if not done:
                    conn.close()
            if reply.keep_alive and not conn.closed:
                self._checkin(conn)
            else:
                conn.close()
            return reply
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        """Close every idle connection; ones in use close when their request ends."""
        self._closing = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
