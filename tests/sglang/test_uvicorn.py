"""The engine's one HTTP path against uvicorn, the server SGLang itself runs on (real sockets, loopback).

A small ASGI `/generate` app answers in chunks (no Content-Length: uvicorn frames it chunked)
after an optional delay. uvicorn runs on a thread of its own with its own event loop; the
engine runs on the test's loop, through `SGLangClient` and the pool `make_http_client` builds,
as in production.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from engine.settings import EngineConfig, RetryPolicy
from engine.sglang.client import SGLangClient, make_http_client
from engine.sglang.wire import Reply
from tests.support.helpers import IM_END, encode, reply_body

uvicorn = pytest.importorskip("uvicorn", reason="uvicorn is in the dev extra: pip install -e '.[dev]'")

ANSWER = json.dumps(reply_body(encode("Answer: \\boxed{1}") + [IM_END])).encode()
PIECE = 256  # bytes per body message: the reply goes out as many chunks


class GenerateApp:
    """An ASGI app: POST /generate gets ANSWER in chunks after `delay` seconds; anything else a 404."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.posts = 0
        self.in_flight = 0
        self.most_in_flight = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        if scope["path"] != "/generate":
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        self.posts += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            for i in range(0, len(ANSWER), PIECE):
                await send({"type": "http.response.body", "body": ANSWER[i : i + PIECE], "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.in_flight -= 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Uvicorn:
    """uvicorn serving `app` on 127.0.0.1:`port` from a thread; `stop()` is its graceful shutdown."""

    def __init__(self, app: GenerateApp, port: int, keep_alive: float = 5.0) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=port, timeout_keep_alive=keep_alive, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=10)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


def engine_client(port: int, connections: int = 8, attempts: int = 3) -> SGLangClient:
    cfg = EngineConfig(server_url=f"http://127.0.0.1:{port}", max_connections=connections)
    retry = RetryPolicy(max_attempts=attempts, base_delay=0.1, max_delay=0.5, deadline=30.0)
    return SGLangClient(cfg.server_url, make_http_client(cfg), retry, request_timeout=30.0, vocab_size=200_000,
                        rng=random.Random(0))


def test_chunked_replies_and_keep_alive_past_uvicorns_idle_timeout() -> None:
    app, port = GenerateApp(), free_port()
    server = Uvicorn(app, port, keep_alive=0.5)
    framing: list[str | None] = []

    async def on_response(response: httpx.Response) -> None:
        framing.append(response.headers.get("transfer-encoding"))

    async def go() -> SGLangClient:
        client = engine_client(port)
        client.http.add_event_hook("response", on_response)
        for _ in range(3):
            reply = await client.generate([1, 2, 3], {}, 8)
            assert isinstance(reply, Reply) and reply.ids == json.loads(ANSWER)["output_ids"]
            await asyncio.sleep(1.0)  # past uvicorn's keep-alive: it closes the idle connection
        await client.http.aclose()
        return client

    try:
        client = asyncio.run(go())
    finally:
        server.stop()
    assert framing[-3:] == ["chunked"] * 3
    assert app.posts == 3 and client.retries_spent == 0  # each closed connection seen before the write: no resend


def test_256_concurrent_requests() -> None:
    app, port = GenerateApp(delay=0.2), free_port()
    server = Uvicorn(app, port)

    async def go() -> tuple[list[object], SGLangClient]:
        client = engine_client(port, connections=256)
        replies = await asyncio.gather(*(client.generate([1, 2, i], {}, 8) for i in range(256)))
        await client.http.aclose()
        return replies, client

    try:
        replies, client = asyncio.run(go())
    finally:
        server.stop()
    assert all(isinstance(r, Reply) for r in replies)
    assert app.posts == 256 and client.retries_spent == 0
    assert app.most_in_flight > 64  # they were in flight together, not one after another


def test_a_restart_mid_run_costs_counted_retries_and_loses_no_request() -> None:
    port = free_port()
    first, second = GenerateApp(delay=0.2), GenerateApp(delay=0.05)
    server = Uvicorn(first, port)

    async def go() -> tuple[list[object], SGLangClient]:
        nonlocal server
        client = engine_client(port, connections=64, attempts=20)
        run = asyncio.gather(*(client.generate([1, 2, i], {}, 8) for i in range(256)))
        while first.posts < 64:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(server.stop)  # graceful: the requests it is working on are answered
        server = await asyncio.to_thread(Uvicorn, second, port)
        replies = await run
        await client.http.aclose()
        return replies, client

    try:
        replies, client = asyncio.run(go())
    finally:
        server.stop()
    assert all(isinstance(r, Reply) for r in replies), [r for r in replies if not isinstance(r, Reply)][:3]
    assert first.posts >= 64 and second.posts > 0  # the run straddled the restart
    attempts = 256 + client.retries_spent
    assert 256 <= first.posts + second.posts <= attempts  # never a POST the retry policy did not count
    assert client.retries_spent > 0  # the refused connects while it was down were retried, and counted
