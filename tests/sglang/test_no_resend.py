"""A POST /generate is sent again only by the retry policy: counted, after a backoff, inside the deadline.

The server is a real loopback socket that reads a request, works on it, then drops the
connection without a byte of reply: the engine cannot know whether the work was done, so the
transport never resends on its own. Only a connection found closed before the write is
replaced silently (nothing was sent on it).
"""

from __future__ import annotations

import asyncio
import random

import httpx

from engine import slime
from engine.settings import EngineConfig, RetryPolicy
from engine.local.sample import Sample
from engine.sglang.client import HttpPool, SGLangClient
from engine.sglang.wire import Failure, Reply
from tests.sglang.loopback import Handler, LoopbackServer, send
from tests.support.helpers import IM_END, SAMPLING, encode, make_args, reply_body

WORK = 1.0  # seconds the server works on a request before it drops the connection
ANSWER = reply_body(encode("Answer: \\boxed{1}") + [IM_END])


def works_then_drops(seconds: float = WORK) -> Handler:
    async def handler(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(seconds)
        writer.transport.abort()  # no reply, no graceful close: the request's fate is unknown

    return handler


async def one_client(server: LoopbackServer, attempts: int) -> SGLangClient:
    pool = HttpPool(4, httpx.Timeout(30.0, connect=5.0))
    retry = RetryPolicy(max_attempts=attempts, base_delay=0.2, max_delay=0.2, deadline=30.0)
    return SGLangClient(server.url, pool, retry, request_timeout=30.0, vocab_size=200_000, rng=random.Random(1))


def test_a_kept_alive_connection_dropped_after_the_server_worked_is_one_counted_retry() -> None:
    async def go() -> None:
        async with LoopbackServer([send(200, ANSWER), works_then_drops(), send(200, ANSWER)]) as server:
            client = await one_client(server, attempts=3)
            assert isinstance(await client.generate([1, 2, 3], {}, 8), Reply)  # the connection is now kept alive
            started = asyncio.get_running_loop().time()
            assert isinstance(await client.generate([1, 2, 3], {}, 8), Reply)
            took = asyncio.get_running_loop().time() - started
            await client.http.aclose()
            # two calls, three attempts, three POSTs: the dropped one was resent once, and counted
            assert len(server.generates) == 3 and client.retries_spent == 1
            second, third = server.generates[1:]
            assert third.at - second.at >= WORK  # sent again only after the drop, past the backoff
            assert second.body == third.body
            assert took >= WORK

    asyncio.run(go())


def test_with_one_attempt_a_dropped_request_is_a_failure_and_was_posted_once() -> None:
    async def go() -> None:
        async with LoopbackServer([send(200, ANSWER), works_then_drops(0.3)]) as server:
            client = await one_client(server, attempts=1)
            assert isinstance(await client.generate([1, 2, 3], {}, 8), Reply)
            outcome = await client.generate([1, 2, 3], {}, 8)
            await client.http.aclose()
            assert isinstance(outcome, Failure) and outcome.kind == "unavailable"
            assert "ReadError" in outcome.message and "gave up after 1 attempt" in outcome.message
            assert len(server.generates) == 2 and client.retries_spent == 0

    asyncio.run(go())


def test_through_the_engine_every_post_is_an_attempt_the_retry_policy_counted() -> None:
    server = LoopbackServer([works_then_drops(0.3), works_then_drops(0.3), works_then_drops(0.3)])
    sample = Sample(prompt="What is 1?", label="1")

    async def go() -> int:
        async with server:
            ns = make_args(sglang_router_ip="127.0.0.1", sglang_router_port=server.port, engine_retry_attempts=3,
                           engine_retry_deadline=30.0, engine_abort_status="aborted")
            rt = slime.runtime_for(EngineConfig.from_args(ns))
            await slime.generate(ns, sample, dict(SAMPLING))
            await rt.aclose()
            return rt.client.retries_spent

    retries = asyncio.run(go())
    fsm = sample.metadata["fsm"]
    assert sample.status == Sample.Status.ABORTED and fsm["termination_reason"] == "request_failed"
    assert "gave up after 3 attempt(s)" in fsm["engine_error"] and "ReadError" in fsm["engine_error"]
    assert len(server.generates) == 3 and retries == 2  # one POST per attempt: the first, and two counted retries


def test_an_idle_connection_the_server_closed_is_replaced_without_a_retry_or_a_second_post() -> None:
    async def closes_after(writer: asyncio.StreamWriter) -> None:
        await send(200, ANSWER)(writer)
        writer.close()  # an idle keep-alive timeout, as uvicorn's: the engine sees the close before its next write

    async def go() -> None:
        async with LoopbackServer([closes_after, closes_after]) as server:
            client = await one_client(server, attempts=1)
            for _ in range(2):
                assert isinstance(await client.generate([1, 2, 3], {}, 8), Reply)
                await asyncio.sleep(0.1)
            await client.http.aclose()
            assert len(server.generates) == 2 and client.retries_spent == 0

    asyncio.run(go())
