"""One HTTP path: httpx's client over the engine's transport, the same in production and under respx."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import respx

from engine import slime
from engine.settings import EngineConfig
from engine.local.sample import Sample
from engine.sglang.client import EngineClient, HttpPool, make_http_client
from engine.sglang.http1 import AsyncioTransport, BodyStream
from tests.conftest import run
from tests.sglang.loopback import LoopbackServer, send
from tests.support.helpers import SAMPLING, URL, ScriptedServer, make_args, turn

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def test_the_pool_is_httpx_s_client_over_the_engine_s_transport() -> None:
    async def build() -> HttpPool:
        pool = make_http_client(EngineConfig())
        await pool.aclose()
        return pool

    pool = asyncio.run(build())
    assert isinstance(pool.client, httpx.AsyncClient) and isinstance(pool.transport, AsyncioTransport)
    assert pool.client.follow_redirects is False and pool.client.trust_env is False


def test_respx_mocks_above_the_transport_on_the_production_path(fake_interpreter, monkeypatch) -> None:
    """respx replaces only what the client's transport would do: the request is built, sent
    and read by the same code as in production, its body made from the same body source."""
    server = ScriptedServer([turn("<code>\nprint(1)\n</code>"), turn("Answer: \\boxed{1}")])
    sample = Sample(prompt="What is 1?", label="1")
    streams: list[object] = []
    send_real = EngineClient.send

    async def spy(self: EngineClient, request: httpx.Request, **kw: object) -> httpx.Response:
        streams.append(type(request.stream))
        return await send_real(self, request, **kw)

    written: list[object] = []
    monkeypatch.setattr(EngineClient, "send", spy)
    monkeypatch.setattr(AsyncioTransport, "handle_async_request", lambda *a: written.append(a))
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        run(slime.generate(make_args(), sample, dict(SAMPLING)))
    assert sample.status == Sample.Status.COMPLETED and len(server.requests) == 2
    first, second = server.requests
    assert second["input_ids"][: len(first["input_ids"])] == first["input_ids"]  # the second turn continues the first
    assert BodyStream in streams  # the /generate bodies were the production body sources
    assert written == []  # nothing reached the transport: respx answered above it


def test_no_production_code_asks_about_a_test_library() -> None:
    asks = re.compile(r"import respx|from respx|[\'\"]respx[\'\"]")  # an import, or a look in sys.modules
    offenders = [str(p.relative_to(ENGINE)) for p in ENGINE.rglob("*.py") if asks.search(p.read_text())]
    assert offenders == []


def test_httpx_event_hooks_see_every_request_and_reply() -> None:
    """The soak's wire recorder and the bench's request capture are httpx hooks."""
    seen: list[tuple[str, object]] = []

    async def on_request(request: httpx.Request) -> None:
        seen.append(("request", request.content))

    async def on_response(response: httpx.Response) -> None:
        seen.append(("response", (response.status_code, await response.aread(), response.request.headers["x-k"])))

    async def go() -> None:
        async with LoopbackServer([send(200, b'{"a": 1}', {"X-Y": "z"})]) as server:
            pool = HttpPool(4, httpx.Timeout(5.0))
            pool.add_event_hook("request", on_request)
            pool.add_event_hook("response", on_response)
            response = await pool.post(server.url + "/generate", content=lambda: b"{}", headers={"X-K": "v"}, limit=5.0)
            await pool.aclose()
            assert (response.status_code, response.content, response.headers.get("x-y")) == (200, b'{"a": 1}', "z")

    asyncio.run(go())
    assert seen == [("request", b"{}"), ("response", (200, b'{"a": 1}', "v"))]


def test_cookies_a_server_sets_are_never_sent_back() -> None:
    async def go() -> list[dict[str, str]]:
        cookie = {"Set-Cookie": "session=abc; Path=/"}
        async with LoopbackServer([send(200, b"{}", cookie), send(200, b"{}", cookie)]) as server:
            pool = HttpPool(4, httpx.Timeout(5.0))
            for _ in range(2):
                assert (await pool.post(server.url + "/generate", content=b"{}")).status_code == 200
            await pool.aclose()
            return [s.headers for s in server.generates]

    first, second = asyncio.run(go())
    assert "cookie" not in first and "cookie" not in second



def test_a_redirect_is_handed_back_not_followed_and_a_closed_client_refuses() -> None:
    async def go() -> tuple[int, int]:
        async with LoopbackServer([send(302, b"", {"Location": "/elsewhere"}), send(200, b"{}")]) as server:
            pool = HttpPool(4, httpx.Timeout(5.0))
            response = await pool.post(server.url + "/generate", content=b"{}")
            await pool.aclose()
            try:
                await pool.client.send(httpx.Request("POST", server.url + "/generate", content=b"{}"))
            except RuntimeError as exc:
                assert "closed" in str(exc)
            else:
                raise AssertionError("a closed client sent a request")
            return response.status_code, len(server.generates)

    assert asyncio.run(go()) == (302, 1)  # one POST: the Location was never followed


def test_what_the_engine_never_asks_for_still_goes_through_httpx_s_own_send() -> None:
    """Auth and followed redirects are httpx's: a user's own use of the client keeps them."""
    async def go() -> tuple[int, list[dict[str, str]]]:
        script = [send(302, b"", {"Location": "/generate"}), send(200, b"{}")]
        async with LoopbackServer(script) as server:
            client = EngineClient(transport=AsyncioTransport(4), trust_env=False)
            response = await client.send(httpx.Request("POST", server.url + "/generate", content=b"{}"),
                                         auth=httpx.BasicAuth("u", "p"), follow_redirects=True)
            await client.aclose()
            return response.status_code, [s.headers for s in server.generates]

    status, seen = asyncio.run(go())
    assert status == 200 and len(seen) == 2 and seen[0]["authorization"].startswith("Basic ")


def test_a_client_made_to_follow_redirects_follows_them() -> None:
    async def go() -> tuple[int, int]:
        async with LoopbackServer([send(307, b"", {"Location": "/generate"}), send(200, b"{}")]) as server:
            client = EngineClient(transport=AsyncioTransport(4), trust_env=False, follow_redirects=True)
            response = await client.send(httpx.Request("POST", server.url + "/generate", content=b"{}"))
            await client.aclose()
            return response.status_code, len(server.generates)

    assert asyncio.run(go()) == (200, 2)
