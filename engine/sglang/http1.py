"""The transport under the engine's httpx client: HTTP/1.1 keep-alive connections on asyncio's transports.

`AsyncioTransport` is an `httpx.AsyncBaseTransport`: the engine's requests are `httpx.Request`s
sent by an `httpx.AsyncClient`, and its replies `httpx.Response`s, so anything that works above
httpx's transport interface (event hooks, respx's httpx mocker, a user's own transport) sees
the same requests production sends. Beneath it, a turn needs one POST of bytes that are already
encoded and one reply read whole: this writes one buffer and frames the reply with a few
`bytes` methods. The bench's figure 1 measures what that costs against general clients, and
docs/http.md why h11 does not do the framing here.

What it does not do, on purpose: redirects (the client is told not to follow them), proxies,
cookies, HTTP/2, `Expect: 100-continue`, transfer codings other than chunked. What it bounds,
because the server may be hostile: the header block (`MAX_HEAD` bytes), every chunk-size line,
the interim replies, the body (`max_body`, `ReplyTooLarge` past it; a gzip or deflate body, which
nobody asked for, is inflated only as far as `max_body`), and the whole exchange, connect to last
byte. The reply is read whole before it is handed up: `httpx.Response.aiter_bytes()` then yields it.

A request is written at most once. A kept-alive connection found closed before the write is
dropped and another one taken: nothing was sent on it. Once the bytes are written, any failure
(the connection dropped, a malformed reply, the time bound) is raised to the caller, whose retry
policy counts it: the server may have worked on the request, so sending it again is a decision,
never a reflex. Malformed replies raise `httpx.RemoteProtocolError`, lost connections
`httpx.ReadError`, refused connects `httpx.ConnectError`. A reply the engine does not take and would
get again if it asked again (too large, a transfer or content coding it does not read, line ends
that are not CRLF) raises `ReplyRefused`, a `RemoteProtocolError` the retry policy does not retry.
"""

from __future__ import annotations

import asyncio
import math
import select
import ssl
import zlib
from collections.abc import AsyncIterator, Callable, Iterator

import httpx

from engine.settings import EngineConfig
from engine.settings.declare import default_of

REPLY_BYTES = default_of(EngineConfig, "max_reply_bytes")  # the cap of a transport not told another
MAX_HEAD = 64 * 1024  # bytes of status line and headers; SGLang sends a few hundred
MAX_CHUNK_LINE = 1024  # bytes of one chunk-size line (hex size and extensions)
IDLE_SECONDS = 4.0  # an idle connection older than this is closed, not reused: uvicorn drops them at 5 s
MAX_INTERIM = 8  # 1xx replies accepted before the real one
LIMIT = "engine.limit"  # request extension: seconds for the whole exchange, connect to last byte
FRAMING = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection"})  # written by the transport
INFLATED = frozenset({b"gzip", b"x-gzip", b"deflate"})  # content codings read (zlib); any other is refused
BARE_LINE_END = "reply head has a line ending in a bare LF or CR, not CRLF"
# OpenSSL's reasons for a peer that answered the handshake with something that is not TLS
TLS_MISMATCH = frozenset({"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"})

# A request body made when it is written: nothing need hold a large body while its reply is awaited.
BodySource = Callable[[], bytes]


class ReplyRefused(httpx.RemoteProtocolError):
    """A reply the engine does not take, and would get again if it asked again: never retried.

    `status` is the reply's HTTP status when its status line was read, else None.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ReplyTooLarge(ReplyRefused):
    """A reply declared, sent or inflated to more bytes than `engine_max_reply_bytes`; it was not read further."""

    def __init__(self, status: int, limit: int, declared: int | None = None, *, inflated: bool = False) -> None:
        size = (f"declared {declared} bytes" if declared is not None
                else f"inflates past {limit} bytes" if inflated else f"ran past {limit} bytes")
        super().__init__(f"HTTP {status} reply {size}, over engine_max_reply_bytes={limit}", status)


class TLSRefused(httpx.ConnectError):
    """An https:// server whose TLS cannot work, and would not work on the next attempt either: its
    certificate is not trusted, or it speaks no TLS (a plain HTTP server answers the handshake)."""


class RequestTimeout(httpx.TimeoutException):
    """The whole request (connect to last byte) took longer than its budget."""

    @classmethod
    def after(cls, limit: float) -> RequestTimeout:
        return cls(f"no complete reply within {limit:.3g}s (connect to last byte)")


class BodyStream(httpx.AsyncByteStream, httpx.SyncByteStream):
    """A request body made from `source` each time it is read: an `httpx.Request(stream=...)` that
    holds no bytes while its reply is awaited. `AsyncioTransport` writes it with its length; any
    other reader (a mock, a hook calling `aread()`) gets the bytes as one chunk."""

    def __init__(self, source: BodySource) -> None:
        self.source = source

    def __iter__(self) -> Iterator[bytes]:
        yield self.source()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.source()


class ReplyStream(httpx.AsyncByteStream):
    """A reply's body, read whole, as the response's stream: one chunk. An iterator, not an async
    generator, which asyncio registers and finalizes one by one."""

    __slots__ = ("body", "done")

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.done = False

    def __aiter__(self) -> ReplyStream:
        return self

    async def __anext__(self) -> bytes:
        if self.done:
            raise StopAsyncIteration
        self.done = True
        return self.body


class _Reply:
    """One response being read: framing from the head, the body as it comes (one buffer, so a
    server sending a million tiny chunks costs no more memory than one large one)."""

    __slots__ = ("status", "reason", "headers", "length", "chunked", "chunk", "body", "keep_alive", "coding")

    def __init__(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], length: int | None,
                 chunked: bool, keep_alive: bool, coding: bytes | None = None) -> None:
        self.status, self.reason, self.headers, self.length, self.chunked = status, reason, headers, length, chunked
        self.keep_alive = keep_alive
        self.coding = coding  # gzip or deflate: the body is inflated once it is whole
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
        self.poll: Callable[[], bool] | None = None  # whether the socket has something to read (idle: EOF)
        self.buffer = bytearray()
        self.scanned = 0  # bytes of a head still arriving already checked for bare line ends
        self.reply: _Reply | None = None
        self.waiter: asyncio.Future[_Reply] | None = None
        self.max_body = REPLY_BYTES  # each exchange sets its transport's own cap
        self.closed = False
        self.idle_since = 0.0
        self.answered = False  # a byte of the reply came
        self.interim = 0  # 1xx replies before the real one
        # The request's time bound: one loop timer per connection, not one per request (see `exchange`).
        self.deadline: float | None = None  # loop time the request in flight must end by
        self.limit: float | None = None  # its seconds, for the message
        self.timer: asyncio.TimerHandle | None = None  # fires at or before `deadline`

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.poll = readable(sock.fileno())

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
        self.closed = True  # an idle connection is now known dead: it is never written to
        reply = self.reply
        if reply is not None and reply.length is None and not reply.chunked and not self.buffer:
            self._complete(reply)  # body delimited by the close: this is its end
        return False  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        if self.waiter is not None and not self.waiter.done():
            reply = self.reply
            if reply is not None and reply.length is None and not reply.chunked:
                self._complete(reply)  # read until close: the close ends it
            else:
                got = "mid-reply" if self.answered else "after the request was sent, before any reply"
                self.waiter.set_exception(httpx.ReadError(f"the server closed the connection {got}"))

    # parsing
    def _advance(self) -> None:
        while self.reply is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0 and len(self.buffer) > MAX_HEAD or end > MAX_HEAD:
                raise httpx.RemoteProtocolError(f"reply head longer than {MAX_HEAD} bytes")
            if end < 0:
                self._scan_head()
                return
            head = bytes(self.buffer[:end])
            del self.buffer[: end + 4]
            self.scanned = 0
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

    def _scan_head(self) -> None:
        """Refuse a head still arriving whose lines end in a bare LF or CR: it would never show the
        CRLF CRLF that ends a head, and the request would wait for its whole time bound."""
        buffer, start = self.buffer, self.scanned
        end = len(buffer) - 1 if buffer.endswith(b"\r") else len(buffer)  # its LF may be on the way
        pairs = buffer.count(b"\r\n", start, end)
        if buffer.count(b"\n", start, end) != pairs or buffer.count(b"\r", start, end) != pairs:
            raise ReplyRefused(BARE_LINE_END)
        self.scanned = end

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

    def _check_deadline(self, armed_for: float) -> None:
        """The timer fired at `armed_for`: fail the request in flight if that was its deadline, else
        arm again at its own (a later request's, which reused the timer)."""
        self.timer = None
        deadline = self.deadline
        if self.waiter is None or deadline is None:  # idle: the next request arms its own
            return
        if deadline <= armed_for:
            self._fail(RequestTimeout.after(self.limit or 0.0))
        else:
            self.timer = asyncio.get_running_loop().call_at(deadline, self._check_deadline, deadline)

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        self.close()

    def close(self) -> None:
        """Drop the connection at once (no graceful shutdown: nothing is owed to the server)."""
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    @property
    def usable(self) -> bool:
        """Open as far as this side knows: no close, EOF or error has been seen on it."""
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def alive(self) -> bool:
        """Usable, and nothing waiting on its socket: an idle connection that has something to read
        was closed (or written to) by the server, whose FIN the loop has not handed over yet."""
        return self.usable and not (self.poll is not None and self.poll())

    async def exchange(self, pending: list[bytes], max_body: int, deadline: float | None, limit: float | None) -> _Reply:
        """Write one request (taken out of `pending`, so no frame keeps it), wait for its whole
        reply; `RequestTimeout` at `deadline` (loop time).

        Once written, the bytes are the transport's alone, until the socket has taken them all.
        The deadline is a loop timer the connection keeps from request to request: a request
        whose deadline is no earlier than the armed timer's arms nothing, and the timer, when it
        fires before the request in flight is due, is armed again at that request's deadline.
        Deadlines are rarely reached (30 minutes by default), so a connection costs one timer
        every so often instead of a timer made, pushed on the loop's heap and cancelled per
        request (the cancelled ones stay on the heap until the loop sweeps them).
        """
        assert self.transport is not None
        self.max_body = max_body
        self.reply = None
        self.answered, self.interim, self.scanned = False, 0, 0
        self.buffer.clear()
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        self.deadline, self.limit = deadline, limit
        if deadline is not None and (self.timer is None or self.timer.when() > deadline):
            if self.timer is not None:
                self.timer.cancel()
            self.timer = loop.call_at(deadline, self._check_deadline, deadline)
        try:
            self.transport.write(pending.pop())
            return await self.waiter
        finally:
            self.waiter = None
            self.deadline = None
            self.reply = None  # an idle connection keeps no reply body


def declared_length(value: str | bytes | None) -> int | None:
    """A Content-Length value as a number, or None unless it is ASCII digits (at most 18):
    `str.isdigit` takes "²" too, and `int` then raises."""
    text = value.strip() if value is not None else ""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def readable(fd: int) -> Callable[[], bool]:
    """A check, without waiting, of whether `fd` has something to read (data, EOF or an error)."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI)
        return lambda: bool(poller.poll(0))
    return lambda: bool(select.select([fd], [], [], 0)[0])  # pragma: no cover - no poll (Windows)


def inflate(body: bytes, coding: bytes, max_body: int, status: int) -> bytes:
    """A gzip or deflate body inflated; `ReplyTooLarge` past `max_body` bytes (nothing more is inflated then)."""
    if coding == b"deflate":  # zlib's format, as HTTP names it; some servers send the raw stream
        try:
            return _inflate(body, 15, max_body, status)
        except zlib.error:
            pass
    try:
        return _inflate(body, -15 if coding == b"deflate" else 31, max_body, status)
    except zlib.error as exc:
        raise ReplyRefused(f"HTTP {status} {coding.decode()} reply does not inflate: {exc}", status) from None


def _inflate(body: bytes, wbits: int, max_body: int, status: int) -> bytes:
    inflater = zlib.decompressobj(wbits)
    data = inflater.decompress(body, max_body + 1)
    if len(data) > max_body:
        raise ReplyTooLarge(status, max_body, inflated=True)
    if not inflater.eof or inflater.unused_data:
        raise ReplyRefused(f"HTTP {status} compressed reply is cut short or has bytes past its end", status)
    return data


def _parse_head(head: bytes, max_body: int) -> _Reply:
    """Status line and headers; the body's framing; `ReplyTooLarge` for a declared length past the cap."""
    lines = head.split(b"\r\n")
    if head.count(b"\n") >= len(lines) or head.count(b"\r") >= len(lines):  # one of each per CRLF, no more
        raise ReplyRefused(BARE_LINE_END)
    parts = lines[0].split(b" ", 2)
    code = parts[1] if len(parts) > 1 else b""
    if parts[0] not in (b"HTTP/1.1", b"HTTP/1.0") or not (len(code) == 3 and code.isdigit() and b"100" <= code <= b"599"):
        raise httpx.RemoteProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(code)
    headers: list[tuple[bytes, bytes]] = []
    length_text: bytes | None = None
    codings: bytes | None = None
    coding: bytes | None = None
    connection = b""
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or line[:1] in b" \t":
            raise httpx.RemoteProtocolError(f"malformed header line {line[:80]!r}")
        value = value.strip()
        headers.append((name, value))
        key = name.lower()
        if key == b"content-length":
            if length_text is not None and length_text != value:  # repeated: only the same value is acceptable
                raise httpx.RemoteProtocolError("conflicting Content-Length headers")
            length_text = value
        elif key == b"transfer-encoding":
            codings = value if codings is None else codings + b", " + value
        elif key == b"connection":
            connection += value.lower()
        elif key == b"content-encoding" and value.lower() not in (b"", b"identity"):
            coding = value.lower() if coding is None else coding + b", " + value.lower()
    keep_alive = parts[0] == b"HTTP/1.1" and b"close" not in connection
    reason = parts[2] if len(parts) > 2 else b""
    if status in (204, 304) or status < 200:  # never a body, whatever the headers say
        return _Reply(status, reason, headers, 0, False, keep_alive)
    if coding is not None and coding not in INFLATED:  # refused before its body is read
        raise ReplyRefused(f"HTTP {status} reply in Content-Encoding {coding[:40].decode('latin-1')!r}: "
                           "the engine asks for identity and reads gzip or deflate only", status)
    length, chunked = None, False
    if codings is not None:
        if codings.strip().lower() != b"chunked":  # gzip, chunked and the like: the body would be the coding's bytes
            raise ReplyRefused(f"HTTP {status} reply in Transfer-Encoding {codings[:40].decode('latin-1')!r}: "
                               "chunked is the only transfer coding the engine reads", status)
        chunked = True
        if length_text is not None:  # both: chunked frames it, and the connection is not trusted again
            keep_alive = False
    elif length_text is not None:
        length = declared_length(length_text)
        if length is None:
            raise httpx.RemoteProtocolError(f"bad Content-Length {length_text[:30]!r}")
        if length > max_body:
            raise ReplyTooLarge(status, max_body, length)
    else:
        keep_alive = False  # the close delimits the body
    return _Reply(status, reason, headers, length, chunked, keep_alive, coding)


class AsyncioTransport(httpx.AsyncBaseTransport):
    """`Connection`s kept alive per origin (LIFO: the warmest first), one request on each at a time.

    The caller bounds how many requests run at once (`HttpPool`'s gate); this keeps at most
    `connections` idle connections per origin and opens a new one whenever none is idle.
    Timeouts: the request's `engine.limit` extension bounds the whole exchange (connect to last
    byte); without it, the client's read timeout does. The connect timeout bounds the connect.
    """

    def __init__(self, connections: int, tls: ssl.SSLContext | None = None, max_body: int = REPLY_BYTES) -> None:
        self.connections = connections
        self.tls = tls or ssl.create_default_context()
        self.max_body = max_body  # a reply past it raises ReplyTooLarge: memory is bounded, not only time
        self._idle: dict[tuple[str, str, int], list[Connection]] = {}
        self._heads: dict[tuple[bytes, bytes, bytes, int | None, bytes], tuple[tuple[str, str, int], bytes]] = {}
        self._closing = False

    def _target(self, request: httpx.Request) -> tuple[tuple[str, str, int], bytes]:
        """(origin, request line + Host header), cached: the engine posts to one URL."""
        url = request.url
        key = (request.method.encode(), url.raw_scheme, url.raw_host, url.port, url.raw_path)
        known = self._heads.get(key)
        if known is not None:
            return known
        if url.scheme not in ("http", "https") or not url.host:
            raise httpx.UnsupportedProtocol(f"cannot send to {str(url)!r}: only http:// and https:// URLs")
        port = url.port or (443 if url.scheme == "https" else 80)
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (key[0], url.raw_path or b"/", url.netloc)
        known = ((url.scheme, url.host, port), head)
        if len(self._heads) < 64:
            self._heads[key] = known
        return known

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send `request` and read its whole reply (up to `max_body` bytes) into an `httpx.Response`.

        A `BodyStream` body is made when it is written, so nothing holds it while the reply is
        awaited. HEAD is refused (its reply's framing differs, and the engine never sends one).
        """
        if request.method == "HEAD":
            raise httpx.LocalProtocolError("this transport does not send HEAD requests", request=request)
        timeouts = request.extensions.get("timeout") or {}
        limit = request.extensions.get(LIMIT)
        if limit is None:
            limit = timeouts.get("read")
        deadline = None if limit is None else asyncio.get_running_loop().time() + max(limit, 0.0)
        origin, head = self._target(request)
        lines = [head]
        for name, value in request.headers.raw:
            if name.lower() in FRAMING:
                continue
            if b"\r" in name or b"\n" in name or b"\r" in value or b"\n" in value:
                raise httpx.LocalProtocolError(f"header {name!r} holds a line break", request=request)
            lines += (name, b": ", value, b"\r\n")
        prefix = b"".join(lines)
        del lines  # its pieces are in `prefix`: nothing of them is held while the reply is awaited
        stream = request.stream
        if isinstance(stream, BodyStream):
            source = stream.source

            def data() -> bytes:
                body = source()
                return b"".join((prefix, b"Content-Length: %d\r\n\r\n" % len(body), body))
        else:
            body = b"".join([part async for part in stream])  # type: ignore[union-attr]
            if body or request.method not in ("GET", "DELETE", "OPTIONS"):
                whole = b"".join((prefix, b"Content-Length: %d\r\n\r\n" % len(body), body))
            else:
                whole = prefix + b"\r\n"

            def data() -> bytes:
                return whole
        reply = await self._send(origin, data, deadline, limit, timeouts.get("connect"))
        headers, body = reply.headers, bytes(reply.body)
        if reply.coding is not None:  # handed up as identity: httpx would inflate it again, without a cap
            body = inflate(body, reply.coding, self.max_body, reply.status)
            headers = [(k, v) for k, v in headers if k.lower() not in (b"content-encoding", b"content-length")]
            if not reply.chunked:  # the length of what is handed up
                headers.append((b"Content-Length", b"%d" % len(body)))
        return httpx.Response(reply.status, headers=headers, stream=ReplyStream(body), request=request,
                              extensions={"http_version": b"HTTP/1.1", "reason_phrase": reply.reason})

    async def _connect(self, origin: tuple[str, str, int], deadline: float | None, limit: float | None,
                       connect: float | None) -> Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = self.tls if scheme == "https" else None
        seconds = connect if connect is not None else math.inf
        if deadline is not None and deadline - loop.time() < seconds:  # the request's budget runs out first
            seconds, error = max(deadline - loop.time(), 0.0), RequestTimeout.after(limit or 0.0)
        else:
            error = httpx.ConnectTimeout(f"no connection to {host}:{port} within {connect}s")
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: Connection(origin), host, port, ssl=tls,
                                       server_hostname=host if tls else None),
                None if math.isinf(seconds) else seconds,
            )
        except (asyncio.TimeoutError, TimeoutError):
            raise error from None
        except ssl.SSLError as exc:
            if isinstance(exc, ssl.SSLCertVerificationError) or exc.reason in TLS_MISMATCH:
                raise TLSRefused(f"no TLS with {host}:{port} ({exc.reason or exc}): "
                                 + ("its certificate is not trusted" if isinstance(exc, ssl.SSLCertVerificationError)
                                    else "is it a plain http:// server?")) from None
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from None
        return conn

    def _checkout(self, origin: tuple[str, str, int]) -> Connection | None:
        """The warmest idle connection still alive; the ones found closed are dropped (nothing was sent on them).

        A server that closes after each reply sends its FIN right behind the reply, and the next
        request may be taken before the loop has read it: the socket is asked, as httpcore asks it.
        """
        idle = self._idle.get(origin)
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since < IDLE_SECONDS and conn.alive():
                return conn
            conn.close()
        return None

    def _checkin(self, conn: Connection) -> None:
        if self._closing or not conn.usable:
            conn.close()
            return
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) >= self.connections:
            conn.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        idle.append(conn)

    async def _send(self, origin: tuple[str, str, int], data: BodySource, deadline: float | None,
                    limit: float | None, connect: float | None) -> _Reply:
        """One exchange on one connection; whatever fails once the request is written is raised."""
        pending = [data()]  # made before a connection is taken: a body that cannot be made costs none
        conn = self._checkout(origin)
        if conn is None:
            conn = await self._connect(origin, deadline, limit, connect)
        done = False
        try:
            reply = await conn.exchange(pending, self.max_body, deadline, limit)
            done = True
        finally:
            if not done:
                conn.close()
        if reply.keep_alive:
            self._checkin(conn)
        else:
            conn.close()
        return reply

    async def aclose(self) -> None:
        """Close every idle connection; ones in use close when their request ends."""
        self._closing = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

