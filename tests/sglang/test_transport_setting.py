"""`engine_http_transport`: what each value builds, and a clear end for one that cannot be had."""

from __future__ import annotations

import asyncio
import importlib.util

import httpx
import pytest
import respx

from engine import slime
from engine.config import EngineConfig
from engine.local.sample import Sample
from engine.sglang import client as client_module
from engine.sglang.client import HttpPool, make_http_client, resolve_transport, respx_active
from tests.conftest import run
from tests.support.helpers import SAMPLING, URL, ScriptedServer, make_args, turn

HAVE_HTTPX_AIOHTTP = importlib.util.find_spec("httpx_aiohttp") is not None
HAVE_AIOHTTP = importlib.util.find_spec("aiohttp") is not None


def pool_transport(cfg: EngineConfig) -> str:
    async def build() -> str:
        pool = make_http_client(cfg)
        await pool.aclose()
        return pool.transport

    return asyncio.run(build())


def test_auto_takes_the_engines_own_client_and_httpx_while_respx_mocks() -> None:
    assert not respx_active()
    assert pool_transport(EngineConfig()) == "asyncio"
    with respx.mock():
        assert respx_active()
        assert pool_transport(EngineConfig()) == "httpx"
    names = ["httpx", "asyncio"] + (["aiohttp", "aiohttp_direct"] if HAVE_AIOHTTP and HAVE_HTTPX_AIOHTTP else [])
    for name in names:
        assert pool_transport(EngineConfig(http_transport=name)) == name


def test_without_the_packages_auto_needs_none_and_the_others_say_what_to_install(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(client_module.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("httpx_aiohttp", "aiohttp") else real(name, *a))
    assert resolve_transport("auto") == "asyncio"
    with pytest.raises(ValueError, match="pip install httpx-aiohttp"):
        resolve_transport("aiohttp")
    with pytest.raises(ValueError, match="pip install aiohttp"):
        resolve_transport("aiohttp_direct")
    sample = Sample(prompt="What is 1?", label="1")
    run(slime.generate(make_args(engine_http_transport="aiohttp"), sample, dict(SAMPLING)))
    fsm = sample.metadata["fsm"]
    assert sample.status == Sample.Status.FAILED and fsm["termination_reason"] == "engine_setup_failed"
    assert "httpx-aiohttp" in fsm["engine_error"]


def test_an_unknown_transport_ends_the_sample_with_a_message() -> None:
    sample = Sample(prompt="What is 1?", label="1")
    run(slime.generate(make_args(engine_http_transport="carrier-pigeon"), sample, dict(SAMPLING)))
    fsm = sample.metadata["fsm"]
    assert fsm["termination_reason"] == "engine_setup_failed" and "carrier-pigeon" in fsm["engine_error"]
    with pytest.raises(ValueError, match="must be one of"):
        resolve_transport("carrier-pigeon")


@pytest.mark.parametrize("transport", ["auto", "httpx"])
def test_respx_mocked_samples_work_with_httpx_and_with_auto(fake_interpreter, transport: str) -> None:
    server = ScriptedServer([turn("<code>\nprint(1)\n</code>"), turn("Answer: \\boxed{1}")])
    sample = Sample(prompt="What is 1?", label="1")
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        run(slime.generate(make_args(engine_http_transport=transport), sample, dict(SAMPLING)))
    assert sample.status == Sample.Status.COMPLETED and len(server.requests) == 2
    first, second = server.requests
    assert second["input_ids"][: len(first["input_ids"])] == first["input_ids"]  # the second turn continues the first


def test_one_client_for_the_direct_transports_but_many_small_httpx_ones() -> None:
    async def shards(transport: str) -> int:
        pool = HttpPool(64, httpx.Timeout(5.0), transport=transport)
        await pool.aclose()
        return len(pool.shards)

    assert asyncio.run(shards("httpx")) == 16
    assert asyncio.run(shards("asyncio")) == 1
    if HAVE_HTTPX_AIOHTTP:
        assert asyncio.run(shards("aiohttp")) == 1
    if HAVE_AIOHTTP:
        assert asyncio.run(shards("aiohttp_direct")) == 1


@pytest.mark.parametrize("transport", [
    "asyncio", pytest.param("aiohttp_direct", marks=pytest.mark.skipif(not HAVE_AIOHTTP, reason="aiohttp is not installed")),
])
def test_httpx_event_hooks_see_every_request_and_reply_on_the_direct_transports(transport: str) -> None:
    """The soak's wire recorder and the bench's request capture are httpx hooks."""
    from tests.sglang.loopback import LoopbackServer, send

    seen: list[tuple[str, object]] = []

    async def on_request(request: httpx.Request) -> None:
        seen.append(("request", request.content))

    async def on_response(response: httpx.Response) -> None:
        seen.append(("response", (response.status_code, await response.aread(), response.request.headers["x-k"])))

    async def go() -> None:
        async with LoopbackServer([send(200, b'{"a": 1}', {"X-Y": "z"})]) as server:
            pool = HttpPool(4, httpx.Timeout(5.0), transport=transport)
            pool.add_event_hook("request", on_request)
            pool.add_event_hook("response", on_response)
            response = await pool.post(server.url + "/generate", content=b"{}", headers={"X-K": "v"}, limit=5.0)
            await pool.aclose()
            assert (response.status_code, response.content, response.headers.get("x-y")) == (200, b'{"a": 1}', "z")

    asyncio.run(go())
    assert seen == [("request", b"{}"), ("response", (200, b'{"a": 1}', "v"))]

