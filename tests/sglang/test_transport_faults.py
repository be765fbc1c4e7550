"""Faults that live in the transport, on a real loopback socket, through `engine.slime.generate`.

A server that drips headers or a body, a 429/503 with `Retry-After`, a redirect: each is
played by `LoopbackServer`, and the engine's one HTTP path (httpx's client over the engine's
transport, as production runs it) must end the sample within its time bounds, with its status
code in `engine_error`.
Elapsed-time bounds here are correctness (the sample must not hang), with generous slack.
"""

from __future__ import annotations

import asyncio
import email.utils
import gzip
import json
import shutil
import ssl
import subprocess
import time

import httpx
import pytest

from engine import slime
from engine.local.sample import Sample
from engine.loop.runtime import Runtime
from engine.settings import EngineConfig, RetryPolicy
from engine.sglang.client import HttpPool, ServiceClient, ServiceFailed, SGLangClient
from engine.sglang.wire import Failure, Reply
from tests.sglang.loopback import Handler, LoopbackServer, drip, response_bytes, send
from tests.support.helpers import IM_END, SAMPLING, encode, make_args, reply_body

ANSWER = reply_body(encode("Answer: \\boxed{1}") + [IM_END])
SLACK = 1.5  # seconds on top of a bound: scheduling on a loaded 2-core machine, the vocabulary probe


def roll(server: LoopbackServer, **args) -> tuple[Sample, float]:
    """One sample against the loopback server; (sample, seconds it took)."""
    sample = Sample(prompt="What is 1?", label="1")

    async def go() -> float:
        async with server:
            # One attempt is judged: the caller re-queues (else a failed attempt is run again).
            ns = make_args(sglang_router_ip="127.0.0.1", sglang_router_port=server.port,
                           **{"engine_abort_status": "aborted", **args})
            slime.runtime_for(EngineConfig.from_args(ns))  # made (tokenizer loaded) before the clock starts
            started = time.monotonic()
            await slime.generate(ns, sample, dict(SAMPLING))
            took = time.monotonic() - started
            await slime.runtime_for(EngineConfig.from_args(ns)).aclose()
            return took

    return sample, asyncio.run(go())


def meta(sample: Sample) -> dict:
    return sample.metadata["fsm"]


def test_dripping_headers_end_the_sample_within_the_request_timeouts() -> None:
    server = LoopbackServer([drip(b"HTTP/1.1 200 OK\r\nX-Slow: ")], repeat_last=True)
    s, took = roll(server, engine_request_timeout=0.6, engine_retry_attempts=2, engine_retry_deadline=30.0)
    assert s.status == Sample.Status.ABORTED and meta(s)["termination_reason"] == "request_failed"
    assert "RequestTimeout" in meta(s)["engine_error"]
    assert len(server.generates) == 2
    assert 2 * 0.6 <= took < 2 * 0.6 + SLACK  # each attempt cut at 0.6 s although a byte came every 0.05 s


def test_a_body_dripping_under_a_huge_content_length_is_cut_by_the_retry_deadline() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 500000000\r\n\r\n{"  # under the size cap
    server = LoopbackServer([drip(head, b" ")], repeat_last=True)
    # The request timeout alone would allow 60 s; the retry deadline bounds the attempt in flight.
    s, took = roll(server, engine_request_timeout=60.0, engine_retry_attempts=5, engine_retry_deadline=1.0)
    assert s.status == Sample.Status.ABORTED and meta(s)["termination_reason"] == "request_failed"
    assert "RequestTimeout" in meta(s)["engine_error"]
    assert len(server.generates) == 1
    assert 1.0 <= took < 1.0 + SLACK
    assert s.response_length == 0 and s.rollout_log_probs == []


def chunked(body: bytes, piece: int = 65536) -> Handler:
    """A handler that sends a 200 JSON-looking body in chunked encoding (no Content-Length)."""

    async def handler(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(body), piece):
            part = body[i : i + piece]
            writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    return handler


def test_a_reply_declaring_more_than_the_size_cap_is_refused_before_it_is_read() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n{"
    server = LoopbackServer([drip(head, b" ")], repeat_last=True)
    s, took = roll(server, engine_request_timeout=60.0, engine_retry_deadline=30.0)
    assert s.status == Sample.Status.FAILED and meta(s)["termination_reason"] == "request_rejected"
    assert "HTTP 200 reply declared 10000000000 bytes, over engine_max_reply_bytes=1073741824" in meta(s)["engine_error"]
    assert len(server.generates) == 1 and took < SLACK  # not retried, not waited on
    assert s.response_length == 0


def test_a_chunked_reply_running_past_the_size_cap_is_cut_there() -> None:
    big = json.dumps({"text": "x" * (3 << 20)}).encode()  # 3 MiB, cap 1 MiB
    server = LoopbackServer([chunked(big)], repeat_last=True)
    s, _ = roll(server, engine_max_reply_bytes=1 << 20)
    assert s.status == Sample.Status.FAILED and meta(s)["termination_reason"] == "request_rejected"
    assert "HTTP 200 reply ran past 1048576 bytes" in meta(s)["engine_error"]
    assert len(server.generates) == 1


def test_a_chunked_reply_under_the_size_cap_is_read_whole() -> None:
    server = LoopbackServer([chunked(json.dumps(ANSWER).encode(), piece=7)], repeat_last=True)
    s, _ = roll(server, engine_max_reply_bytes=1 << 16)
    assert s.status == Sample.Status.COMPLETED and s.response.endswith("\\boxed{1}<|im_end|>")


def test_retry_after_in_seconds_is_honoured() -> None:
    busy = send(503, {"object": "error", "message": "The request queue is full.", "code": 503}, {"Retry-After": "1"})
    server = LoopbackServer([busy, send(200, ANSWER)])
    s, _ = roll(server, engine_retry_base_delay=0.01)
    assert s.status == Sample.Status.COMPLETED
    first, second = server.generates
    assert 1.0 <= second.at - first.at < 1.0 * 1.1 + SLACK  # not the 0-10 ms backoff the settings give
    assert first.body == second.body  # the same bytes again


def test_retry_after_as_an_http_date_is_honoured() -> None:
    def until(seconds: float):
        async def handler(writer):
            when = email.utils.formatdate(time.time() + seconds, usegmt=True)
            await send(429, {"error": {"message": "slow down"}}, {"Retry-After": when})(writer)
        return handler

    server = LoopbackServer([until(2.0), send(200, ANSWER)])
    s, _ = roll(server, engine_retry_base_delay=0.01)
    assert s.status == Sample.Status.COMPLETED
    first, second = server.generates
    assert 1.0 <= second.at - first.at < 2.0 * 1.1 + SLACK  # HTTP dates have whole seconds


def test_retry_after_past_the_retry_deadline_gives_up_at_once_with_the_status() -> None:
    server = LoopbackServer([send(503, {"object": "error", "message": "busy", "code": 503}, {"Retry-After": "120"})])
    s, took = roll(server, engine_retry_deadline=3.0)
    assert s.status == Sample.Status.ABORTED and meta(s)["termination_reason"] == "request_failed"
    error = meta(s)["engine_error"]
    assert "HTTP 503" in error and "asked for 120s" in error
    assert len(server.generates) == 1 and took < SLACK


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_redirect_is_reported_as_one_and_not_followed(status: int) -> None:
    server = LoopbackServer([send(status, b"", {"Location": "http://elsewhere.invalid/generate"})])
    s, _ = roll(server)
    assert s.status == Sample.Status.FAILED and meta(s)["termination_reason"] == "request_rejected"
    error = meta(s)["engine_error"]
    assert f"HTTP {status} redirect to 'http://elsewhere.invalid/generate'" in error
    assert len(server.generates) == 1


@pytest.mark.parametrize("status, reason", [(404, "request_rejected"), (500, "request_failed"), (429, "request_failed")])
def test_every_http_failure_records_its_status(status: int, reason: str) -> None:
    server = LoopbackServer([send(status, b"nope")], repeat_last=True)
    s, _ = roll(server)
    assert meta(s)["termination_reason"] == reason
    assert f"HTTP {status}: nope" in meta(s)["engine_error"]


def test_the_servers_smaller_vocabulary_narrows_the_id_bound() -> None:
    ids = encode("Answer: \\boxed{1}") + [IM_END]
    bound = max(ids)  # the served model says ids stop below <|im_end|>: that id is now out of range
    server = LoopbackServer([send(200, reply_body(ids))], info={"model_path": "m", "vocab_size": bound})
    s, _ = roll(server)
    assert s.status == Sample.Status.ABORTED and meta(s)["termination_reason"] == "ids_out_of_vocab"
    assert [x.path for x in server.seen][:1] == ["/model_info"]
    assert s.response_length == 0 and s.rollout_log_probs == []


def test_a_well_behaved_server_completes() -> None:
    server = LoopbackServer([send(200, ANSWER)])
    s, _ = roll(server)
    assert s.status == Sample.Status.COMPLETED
    (request,) = server.generates
    assert request.headers["content-type"] == "application/json"
    payload = json.loads(request.body)
    assert payload["return_logprob"] is True and payload["input_ids"] == s.tokens[: len(payload["input_ids"])]


# -- replies the engine does not take, and the servers that close after each reply ---------------
def closes_after(reply: bytes) -> Handler:
    """A handler that writes `reply` and closes the connection at once, announcing nothing."""

    async def handler(writer: asyncio.StreamWriter) -> None:
        writer.write(reply)
        await writer.drain()
        writer.close()

    return handler


def raw(head: bytes, body: bytes) -> Handler:
    async def handler(writer: asyncio.StreamWriter) -> None:
        writer.write(head + body)
        await writer.drain()

    return handler


ANSWER_BYTES = json.dumps(ANSWER).encode()


def test_a_server_closing_after_each_reply_costs_no_retry_back_to_back() -> None:
    """Its FIN arrives right behind the reply: the next turn, taken at once, must not write on that connection."""
    async def go() -> tuple[int, int]:
        async with LoopbackServer([closes_after(response_bytes(200, ANSWER_BYTES))], repeat_last=True) as server:
            client = SGLangClient(server.url, HttpPool(4, httpx.Timeout(30.0)), RetryPolicy(max_attempts=3, base_delay=0.01),
                                  vocab_size=200_000)
            for _ in range(200):
                assert isinstance(await client.generate([1, 2, 3], {}, 8), Reply)
            await client.http.aclose()
            return len(server.generates), client.retries_spent

    assert asyncio.run(go()) == (200, 0)  # one POST a turn, no retry


def test_at_the_pool_a_server_closing_after_each_reply_fails_no_request() -> None:
    async def go() -> tuple[int, int]:
        async with LoopbackServer([closes_after(response_bytes(200, b"{}"))], repeat_last=True) as server:
            pool = HttpPool(8, httpx.Timeout(30.0))

            async def eight_times(worker: int) -> int:
                return sum([(await pool.post(server.url + "/generate", content=b"{}")).status_code == 200
                            for _ in range(25)])

            ok = sum(await asyncio.gather(*(eight_times(i) for i in range(8))))
            await pool.aclose()
            return ok, len(server.generates)

    assert asyncio.run(go()) == (200, 200)


def test_gzip_then_chunked_is_refused_at_once_and_posted_once() -> None:
    """The body would be gzip's bytes: only chunked is a transfer coding the engine reads, and the
    server would frame the next reply the same way, so it is not retried."""
    gz = gzip.compress(ANSWER_BYTES)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
    server = LoopbackServer([raw(head, b"%x\r\n%s\r\n0\r\n\r\n" % (len(gz), gz))], repeat_last=True)
    s, took = roll(server)
    assert s.status == Sample.Status.FAILED and meta(s)["termination_reason"] == "request_rejected"
    assert "Transfer-Encoding 'gzip, chunked'" in meta(s)["engine_error"]
    assert len(server.generates) == 1 and took < SLACK
    assert server.generates[0].headers["accept-encoding"] == "identity"


def test_a_gzip_reply_is_inflated_within_the_reply_cap() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
    gz = gzip.compress(ANSWER_BYTES)
    server = LoopbackServer([raw(head % len(gz), gz)])
    s, _ = roll(server)
    assert s.status == Sample.Status.COMPLETED and s.response.endswith("\\boxed{1}<|im_end|>")
    assert len(server.generates) == 1


def test_a_gzip_reply_inflating_past_the_reply_cap_is_refused_and_posted_once() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
    bomb = gzip.compress(b" " * (8 << 20))  # 8 MiB of spaces in about 8 KiB
    server = LoopbackServer([raw(head % len(bomb), bomb)], repeat_last=True)
    s, _ = roll(server, engine_max_reply_bytes=1 << 20)
    assert s.status == Sample.Status.FAILED and meta(s)["termination_reason"] == "request_rejected"
    assert "HTTP 200 reply inflates past 1048576 bytes, over engine_max_reply_bytes" in meta(s)["engine_error"]
    assert len(server.generates) == 1


def test_a_content_coding_the_engine_does_not_read_is_refused_and_posted_once() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: br\r\nContent-Length: 4\r\n\r\n"
    server = LoopbackServer([raw(head, b"\x0b\x01\x80{")], repeat_last=True)
    s, took = roll(server)
    assert s.status == Sample.Status.FAILED and meta(s)["termination_reason"] == "request_rejected"
    assert "Content-Encoding 'br'" in meta(s)["engine_error"] and len(server.generates) == 1 and took < SLACK


def test_a_head_with_bare_lf_line_ends_fails_at_once_not_after_the_request_timeout() -> None:
    server = LoopbackServer([raw(b"HTTP/1.1 200 OK\nContent-Type: application/json\nContent-Length: %d\n\n"
                                % len(ANSWER_BYTES), ANSWER_BYTES)], repeat_last=True)
    s, took = roll(server)  # the request timeout is 1,800 s
    assert s.status == Sample.Status.FAILED and meta(s)["termination_reason"] == "request_rejected"
    assert "bare LF" in meta(s)["engine_error"]
    assert len(server.generates) == 1 and took < SLACK


NESTED = b"[" * 100_000 + b"]" * 100_000  # valid JSON, deeper than any parser's stack


@pytest.mark.parametrize("status, kind, reason, posts", [
    (200, "unavailable", "request_failed", 2),  # a body that is not JSON: retried, then given up
    (500, "unavailable", "request_failed", 2),
    (400, "rejected", "request_rejected", 1),   # a refusal: final, its message quoted
])
def test_a_reply_nested_past_the_parsers_stack_is_a_failed_request_never_a_crash(
        status: int, kind: str, reason: str, posts: int) -> None:
    server = LoopbackServer([send(status, NESTED)], repeat_last=True)
    s, _ = roll(server, engine_retry_attempts=2, engine_retry_base_delay=0.0)
    fsm = meta(s)
    assert fsm["termination_reason"] == reason and fsm["engine_error"].startswith(f"{kind}: "), fsm["engine_error"]
    assert "RecursionError" not in fsm["engine_error"] and len(server.generates) == posts


def test_a_url_without_a_scheme_is_a_setup_error_and_nothing_is_posted() -> None:
    async def go() -> tuple[list[str], int]:
        async with LoopbackServer([send(200, ANSWER)], repeat_last=True) as server:
            bare = f"127.0.0.1:{server.port}"  # httpx reads it as a path; "localhost:30000" as scheme "localhost"
            refused = []
            for url in (bare, "localhost:30000", "http:///generate"):
                with pytest.raises(ValueError, match="not an http:// or https:// URL") as caught:
                    SGLangClient(url, HttpPool(4, httpx.Timeout(5.0)), RetryPolicy())
                refused.append(str(caught.value))
            with pytest.raises(ValueError, match="an http:// or https:// URL"):  # the settings refuse it first
                Runtime.create(EngineConfig(server_url=bare))
            service = ServiceClient(HttpPool(4, httpx.Timeout(5.0)), RetryPolicy(base_delay=0.01))
            with pytest.raises(ServiceFailed, match="UnsupportedProtocol"):  # final at once, never retried
                await service.post_json(bare + "/generate", {}, timeout=30.0)
            assert service.retrying.spent == 0
            return refused, len(server.generates)

    refused, posts = asyncio.run(go())
    assert posts == 0 and "(http://127.0.0.1:" in refused[0] and "(http:" not in refused[2]


async def _answer_400_to_anything(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A plain HTTP server's answer to a TLS handshake: a 400, then the close."""
    await reader.read(1)
    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    await writer.drain()
    writer.close()


def _self_signed(tmp_path) -> ssl.SSLContext:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate to make")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


@pytest.mark.parametrize("server", ["plain", "self_signed"])
def test_an_https_url_whose_tls_cannot_work_is_refused_at_once_not_retried(server: str, tmp_path) -> None:
    tls = _self_signed(tmp_path) if server == "self_signed" else None
    connections = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        if tls is None:
            await _answer_400_to_anything(reader, writer)
            return
        try:  # TLS after the accept, so that every connection is counted
            await writer.start_tls(tls)
        except (ssl.SSLError, ConnectionError):  # the client refused the certificate
            writer.close()

    async def go() -> Reply | Failure:
        listening = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"https://127.0.0.1:{listening.sockets[0].getsockname()[1]}"
        client = SGLangClient(url, HttpPool(4, httpx.Timeout(5.0)), RetryPolicy(max_attempts=6, base_delay=0.01),
                              request_timeout=5.0, vocab_size=1000)
        try:
            return await client.generate([1, 2, 3], dict(SAMPLING), 8)
        finally:
            await client.http.aclose()
            listening.close()

    outcome = asyncio.run(go())
    assert isinstance(outcome, Failure) and outcome.kind == "rejected", outcome  # before: 6 attempts, "unavailable"
    why = "is it a plain http:// server?" if server == "plain" else "its certificate is not trusted"
    assert outcome.message.startswith("TLSRefused: no TLS with 127.0.0.1:") and why in outcome.message
    assert len(connections) == 2  # the model-info probe's and the one POST's (before: 1 + 6)
