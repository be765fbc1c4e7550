"""The engine's transport (`AsyncioTransport` under httpx's client, as `HttpPool` runs it) on a real loopback socket.

Each test plays a server that writes raw bytes, so framing, keep-alive and malformed replies
are what a real peer would send. The fault tests through the whole engine
(`test_transport_faults`) run the same path; here are the cases only a hand-written transport
can get wrong.
"""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import Awaitable, Callable

import httpx
import pytest

from engine.local.bench.memory import in_flight_request_bytes
from engine.sglang.client import HttpPool
from engine.sglang.http1 import MAX_HEAD, ReplyRefused, ReplyTooLarge, RequestTimeout

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]  # False: close after


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


class RawServer:
    """Answers each request with `answer(reader, writer, n)`; counts connections and requests."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/generate"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    self.requests.append(await read_request(reader))
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                if not await self.answer(reader, writer, len(self.requests)):
                    return
        finally:
            writer.close()


def reply(raw: bytes, keep: bool = True) -> Answer:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(raw)
        await writer.drain()
        return keep

    return answer


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def second_request_gets(raw: bytes) -> Answer:
    """OK to every request but the second (on the reused connection): `raw`, then the close."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(raw if n == 2 else OK)
        await writer.drain()
        return n != 2

    return answer


def client(max_body: int = 1 << 30, timeout: httpx.Timeout = httpx.Timeout(5.0, connect=2.0)) -> HttpPool:
    return HttpPool(8, timeout, max_body=max_body)


def idle(c: HttpPool) -> dict:
    """The transport's idle connections by origin."""
    return c.transport._idle  # type: ignore[attr-defined]


def run(coro: Awaitable[object]) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_requests_reuse_one_keep_alive_connection_and_send_what_was_given() -> None:
    async def go() -> None:
        async with RawServer(reply(OK)) as server:
            c = client()
            for i in range(3):
                r = await c.request("POST", server.url, content=b'{"i": %d}' % i, headers={"X-Key": "s-1"})
                assert (r.status_code, r.content, r.headers.get("Content-Type")) == (200, b"{}", "application/json")
            await c.aclose()
        assert server.connections == 1
        head, body = server.requests[2]
        assert head.startswith(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:") and b"\r\nX-Key: s-1\r\n" in head
        assert b"\r\nContent-Length: 8\r\n" in head and body == b'{"i": 2}'

    run(go())


def test_a_keep_alive_connection_the_server_dropped_is_replaced_without_an_error() -> None:
    async def go() -> None:
        async with RawServer(reply(OK, keep=False)) as server:  # closes after every reply, announcing nothing
            c = client()
            for _ in range(3):
                await asyncio.sleep(0.05)  # the close reaches us first: the idle connection is seen dead
                assert (await c.request("POST", server.url, content=b"{}")).status_code == 200
            await c.aclose()
        assert server.connections == 3 and len(server.requests) == 3

    run(go())


def test_a_request_written_on_a_kept_alive_connection_that_then_closes_is_an_error_never_a_silent_resend() -> None:
    async def go() -> None:
        async with RawServer(second_request_gets(b"")) as server:  # read the request, not a byte back, then the close
            c = client()
            assert (await c.request("POST", server.url, content=b"{}")).status_code == 200
            with pytest.raises(httpx.ReadError, match="after the request was sent"):
                await c.request("POST", server.url, content=b"{}")
            assert len(server.requests) == 2  # the server got it once: the retry policy decides about another
            assert (await c.request("POST", server.url, content=b"{}")).status_code == 200  # a new connection
            await c.aclose()
        assert server.connections == 2 and len(server.requests) == 3

    run(go())


def test_a_body_source_is_made_for_each_write_and_a_source_that_fails_costs_no_connection() -> None:
    made: list[int] = []

    def source() -> bytes:
        made.append(len(made))
        return b'{"n": %d}' % len(made)

    def broken() -> bytes:
        raise TypeError("not JSON")

    async def go() -> None:
        async with RawServer(reply(OK)) as server:
            c = client()
            assert (await c.request("POST", server.url, content=source)).status_code == 200
            with pytest.raises(TypeError):
                await c.request("POST", server.url, content=broken)
            assert (await c.request("POST", server.url, content=source)).status_code == 200
            assert (await c.request("POST", server.url, content=lambda: b"")).status_code == 200
            await c.aclose()
        assert made == [0, 1]  # once per request written
        assert [body for _, body in server.requests] == [b'{"n": 1}', b'{"n": 2}', b""]
        assert server.connections == 1  # the failed source did not cost the kept-alive connection
        assert b"\r\nContent-Length: 0\r\n" in server.requests[-1][0]

    run(go())


def test_a_fresh_connection_closed_before_a_reply_is_a_read_error_not_retried_here() -> None:
    async def go() -> None:
        async with RawServer(reply(b"", keep=False)) as server:
            c = client()
            with pytest.raises(httpx.ReadError):
                await c.request("POST", server.url, content=b"{}")
            await c.aclose()
        assert len(server.requests) == 1

    run(go())


@pytest.mark.parametrize("raw, reused", [
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}", False),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}", False),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}junk", False),  # bytes past the reply
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", True),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;ext=1\r\n{\r\n1\r\n}\r\n0\r\nX-Trailer: 1\r\n\r\n", True),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}", True),  # repeated, the same value
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 9\r\n\r\n2\r\n{}\r\n0\r\n\r\n", False),
])
def test_framing_and_whether_the_connection_is_kept(raw: bytes, reused: bool) -> None:
    async def go() -> None:
        async with RawServer(reply(raw)) as server:
            c = client()
            assert (await c.request("POST", server.url, content=b"{}")).content == b"{}"
            assert bool(idle(c).get(("http", "127.0.0.1", server.server.sockets[0].getsockname()[1]))) == reused
            await c.aclose()

    run(go())


def test_a_body_delimited_by_the_close_is_read_to_the_end() -> None:
    async def go() -> None:
        async with RawServer(reply(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 100_000, keep=False)) as server:
            c = client()
            r = await c.request("POST", server.url, content=b"{}")
            assert r.content == b"x" * 100_000
            await c.aclose()

    run(go())


@pytest.mark.parametrize("raw, words", [
    (b"HTTP/2 200 OK\r\n\r\n", "status line"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "status line"),
    (b"HTTP/1.1 200 OK\r\nNo colon here\r\n\r\n", "malformed header"),
    (b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n", "malformed header"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", "conflicting Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1e3\r\n\r\n", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}XX0\r\n\r\n", "CRLF"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"a" * (MAX_HEAD + 10), "head longer"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 2000, "chunk-size line too long"),
    (b"HTTP/1.1 000 Zero\r\n\r\n", "status line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n", "bad Content-Length"),  # a digit to str.isdigit
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}", "Transfer-Encoding"),
    (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "interim"),
    (b"HTTP/1.1 100 Continue\r\n\r\n" * 20_000, "interim"),  # a flood of them: an error, not a recursion
    (b"HTTP/1.1 200 OK\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\n{}", "Content-Encoding 'br'"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", "only transfer coding"),
    (b"HTTP/1.1 200 OK\nContent-Length: 2\n\n{}", "bare LF"),  # never a CRLF CRLF: refused at once, not timed out
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\nX: 1\r\n\r\n{}", "bare LF"),
    (b"HTTP/1.1 200 OK\rContent-Length: 2\r\n\r\n{}", "bare LF"),
])
def test_malformed_replies_are_protocol_errors_and_the_connection_is_dropped(raw: bytes, words: str) -> None:
    async def go() -> None:
        async with RawServer(reply(raw)) as server:
            c = client()
            with pytest.raises(httpx.RemoteProtocolError, match=words):
                await c.request("POST", server.url, content=b"{}")
            assert not any(idle(c).values())
            await c.aclose()

    run(go())


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 100001\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n186a1\r\n",  # one chunk of 100001
    b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 100_001,  # until close
])
def test_a_reply_past_the_cap_raises_reply_too_large_without_reading_on(raw: bytes) -> None:
    async def go() -> None:
        async with RawServer(reply(raw)) as server:
            c = client(max_body=100_000)
            with pytest.raises(ReplyTooLarge):
                await c.request("POST", server.url, content=b"{}")
            await c.aclose()

    run(go())


def test_a_cancelled_request_closes_its_connection() -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{")  # and never the rest
        await writer.drain()
        await reader.read()  # until the client goes away
        return False

    async def go() -> None:
        async with RawServer(slow) as server:
            c = client()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(c.request("POST", server.url, content=b"{}"), 0.3)
            await asyncio.sleep(0.05)
            assert not any(idle(c).values())
            assert server.connections == 1
            await c.aclose()

    run(go())


def test_a_header_with_a_line_break_is_refused_before_anything_is_sent() -> None:
    async def go() -> None:
        async with RawServer(reply(OK)) as server:
            c = client()
            with pytest.raises(httpx.LocalProtocolError):
                await c.request("POST", server.url, content=b"{}", headers={"X-Key": "a\r\nX-Evil: 1"})
            await c.aclose()
        assert server.requests == []

    run(go())


def test_refused_connections_and_unsupported_urls_are_clear_errors() -> None:
    async def go() -> None:
        c = client()
        async with RawServer(reply(OK)) as server:
            url = server.url
        with pytest.raises(httpx.ConnectError, match="cannot connect"):
            await c.request("POST", url, content=b"{}")
        with pytest.raises(httpx.UnsupportedProtocol):
            await c.request("POST", "ftp://127.0.0.1/generate", content=b"{}")
        await c.aclose()

    run(go())


def test_json_bodies_and_event_hooks() -> None:
    seen: list[str] = []

    async def on_request(request: httpx.Request) -> None:
        seen.append(f"{request.method} {request.url.path} {request.content.decode()}")

    async def on_response(response: httpx.Response) -> None:  # httpx hands hooks the reply unread
        seen.append(f"{response.status_code} {(await response.aread()).decode()}")

    async def go() -> None:
        async with RawServer(reply(OK)) as server:
            pool = HttpPool(4, httpx.Timeout(5.0))
            pool.add_event_hook("request", on_request)
            pool.add_event_hook("response", on_response)
            r = await pool.post(server.url, json={"a": 1}, limit=5.0)
            assert r.status_code == 200
            await pool.aclose()
        head, body = server.requests[0]
        assert b"Content-Type: application/json" in head and body.replace(b" ", b"") == b'{"a":1}'

    run(go())
    assert seen[0].startswith("POST /generate {") and seen[1] == "200 {}"


def test_event_hooks_see_the_bytes_of_a_body_source() -> None:
    seen: list[bytes] = []

    async def on_request(request: httpx.Request) -> None:
        seen.append(request.content)

    async def go() -> None:
        async with RawServer(reply(OK)) as server:
            c = client()
            c.add_event_hook("request", on_request)
            assert (await c.request("POST", server.url, content=lambda: b'{"x": 1}')).status_code == 200
            await c.aclose()
        assert seen == [b'{"x": 1}'] and server.requests[0][1] == b'{"x": 1}'

    run(go())


def test_a_million_tiny_chunks_are_read_into_one_buffer_and_capped_by_their_bytes() -> None:
    chunks = b"1\r\nx\r\n" * 50_000
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"

    async def go() -> None:
        async with RawServer(reply(raw)) as server:
            c = client()
            assert (await c.request("POST", server.url, content=b"{}")).content == b"x" * 50_000
            await c.aclose()
            c = client(max_body=49_999)
            with pytest.raises(ReplyTooLarge):
                await c.request("POST", server.url, content=b"{}")
            await c.aclose()

    run(go())


def test_no_content_replies_end_at_their_head_whatever_their_framing_headers_say() -> None:
    async def go() -> None:
        raw = b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\nContent-Length: 999999999999\r\n\r\n"
        async with RawServer(reply(raw)) as server:
            c = client(max_body=100)
            r = await asyncio.wait_for(c.request("POST", server.url, content=b"{}"), 2.0)
            assert (r.status_code, r.content) == (204, b"")
            await c.aclose()

    run(go())


def test_a_request_the_server_began_to_answer_is_never_sent_again() -> None:
    async def go() -> None:
        async with RawServer(second_request_gets(b"HTTP/1.1 100 Continue\r\n\r\n")) as server:  # then the close
            c = client()
            assert (await c.request("POST", server.url, content=b"{}")).status_code == 200
            with pytest.raises(httpx.ReadError, match="mid-reply"):
                await c.request("POST", server.url, content=b"{}")
            await c.aclose()
        assert len(server.requests) == 2

    run(go())


def test_without_a_limit_the_read_timeout_bounds_the_request() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        await reader.read()
        return False

    async def go() -> None:
        async with RawServer(silent) as server:
            c = client(timeout=httpx.Timeout(0.3, connect=2.0))
            with pytest.raises(RequestTimeout):
                await asyncio.wait_for(c.request("GET", server.url), 5.0)
            await c.aclose()

    run(go())


def test_reply_headers_answer_in_any_case() -> None:
    async def go() -> None:
        async with RawServer(reply(b"HTTP/1.1 200 OK\r\nRetry-After: 3\r\nContent-Length: 0\r\n\r\n")) as server:
            c = client()
            r = await c.request("POST", server.url, content=b"{}")
            assert r.headers.get("retry-after") == r.headers["RETRY-AFTER"] == "3" and "Retry-After" in r.headers
            await c.aclose()

    run(go())


def test_every_transport_reads_only_ascii_digits_as_a_declared_length() -> None:
    from engine.sglang.http1 import declared_length

    assert declared_length(" 12 ") == 12
    assert declared_length("\u00b2") is None  # a digit to str.isdigit, not to int()
    assert declared_length(None) is None
    assert declared_length("9" * 19) is None


# -- memory: a request waiting for its reply holds none of its body ------------------------------
def test_a_sample_waiting_for_its_reply_holds_none_of_its_request_body() -> None:
    held, sent = in_flight_request_bytes(repeats=1)
    assert sent > 32768 * 6  # the whole 32k-id body reached the server
    assert held < sent // 8, f"{held} bytes held while waiting, of a {sent}-byte body"


def test_with_a_request_hook_the_body_is_held_while_waiting() -> None:
    async def hook(request: httpx.Request) -> None:
        await request.aread()

    held, sent = in_flight_request_bytes(repeats=1, hook=hook)
    assert held > sent  # what the body source saves, measured the same way


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-15)
    return packer.compress(data) + packer.flush()


def _coded(coding: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Encoding: %s\r\nContent-Length: %d\r\n\r\n%s" % (coding, len(body), body)


@pytest.mark.parametrize("raw, expected", [
    (_coded(b"gzip", gzip.compress(b'{"a": 1}')), b'{"a": 1}'),
    (_coded(b"x-gzip", gzip.compress(b'{"a": 1}')), b'{"a": 1}'),
    (_coded(b"deflate", zlib.compress(b'{"a": 1}')), b'{"a": 1}'),  # zlib's format, as HTTP names it
    (_coded(b"deflate", raw_deflate(b'{"a": 1}')), b'{"a": 1}'),  # the raw stream, as some servers send it
    (_coded(b"identity", b'{"a": 1}'), b'{"a": 1}'),
    (_coded(b"gzip", gzip.compress(b"x")[:-4]), "cut short"),  # the trailer lost
    (_coded(b"gzip", gzip.compress(b"x") + b"junk"), "past its end"),
    (_coded(b"gzip", b"not gzip at all"), "does not inflate"),
    (_coded(b"gzip", gzip.compress(b"x" * 100_001)), "inflates past 100000 bytes"),
    (_coded(b"gzip, gzip", gzip.compress(gzip.compress(b"x"))), "Content-Encoding 'gzip, gzip'"),
])
def test_a_compressed_reply_is_inflated_within_the_cap_or_refused(raw: bytes, expected: bytes | str) -> None:
    async def go() -> None:
        async with RawServer(reply(raw)) as server:
            c = client(max_body=100_000)
            if isinstance(expected, bytes):
                r = await c.request("POST", server.url, content=b"{}")
                assert r.content == expected and r.headers.get("content-encoding") in (None, "identity")
                assert r.headers["content-length"] == str(len(expected))  # the inflated body's
            else:
                with pytest.raises(ReplyRefused, match=expected):
                    await c.request("POST", server.url, content=b"{}")
            await c.aclose()
        assert server.requests[0][0].count(b"\r\nAccept-Encoding: identity\r\n") == 1

    run(go())


def test_an_idle_connection_the_server_closed_is_seen_at_checkout_before_the_loop_reads_its_fin() -> None:
    """The server writes its reply and closes in one go; the next request is taken at once."""
    async def go() -> None:
        async with RawServer(reply(OK, keep=False)) as server:
            c = client()
            for _ in range(20):  # back to back: no sleep for the FIN to be read first
                assert (await c.request("POST", server.url, content=b"{}")).status_code == 200
            await c.aclose()
        assert server.connections == 20 and len(server.requests) == 20

    run(go())


def slow(delays: dict[int, float]) -> Answer:
    """OK to every request, the n-th after `delays[n]` seconds."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        await asyncio.sleep(delays.get(n, 0.0))
        writer.write(OK)
        await writer.drain()
        return True

    return answer


def test_a_connections_one_timer_bounds_each_request_by_its_own_limit() -> None:
    """The time bound's timer is kept from request to request on a connection: a later request
    with a shorter limit is still cut at its own, one with a longer limit is not cut at an
    earlier one's, and requests with the same limit arm no timer of their own."""
    async def shorter_later() -> None:
        loop = asyncio.get_running_loop()
        async with RawServer(slow({3: 2.0})) as server:
            c = client()
            await c.request("POST", server.url, content=b"{}", limit=30.0)
            (conn,) = next(iter(idle(c).values()))
            timer = conn.timer
            assert timer is not None and 29.0 < timer.when() - loop.time() <= 30.0
            await c.request("POST", server.url, content=b"{}", limit=30.0)
            assert conn.timer is timer  # the same timer: nothing made for the second request
            started = loop.time()
            with pytest.raises(RequestTimeout):  # armed again, earlier, for this one's 0.3 s
                await c.request("POST", server.url, content=b"{}", limit=0.3)
            assert 0.25 <= loop.time() - started < 1.5 and conn.timer is None  # cut and closed
            await c.aclose()

    async def longer_later() -> None:
        async with RawServer(slow({2: 0.6})) as server:
            c = client()
            await c.request("POST", server.url, content=b"{}", limit=0.2)  # arms the timer 0.2 s out
            # it fires while this request runs, finds it due later, and is armed at its 1.5 s
            assert (await c.request("POST", server.url, content=b"{}", limit=1.5)).status_code == 200
            assert len(server.requests) == 2 and server.connections == 1
            await c.aclose()

    run(shorter_later())
    run(longer_later())
