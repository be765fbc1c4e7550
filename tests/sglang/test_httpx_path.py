"""One HTTP path: httpx's client over the engine's transport, the same in production and under respx."""

from __future__ import annotations

import ast
import asyncio
import gc
import logging
import re
from pathlib import Path

import httpx
import pytest
import respx

from engine import slime
from engine.local.sample import Sample
from engine.settings import EngineConfig
from engine.sglang.client import EngineClient, HttpPool, NoCookies, make_http_client
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
    send_real = httpx.AsyncClient.send

    async def spy(self: httpx.AsyncClient, request: httpx.Request, **kw: object) -> httpx.Response:
        streams.append(type(request.stream))
        return await send_real(self, request, **kw)

    written: list[object] = []
    monkeypatch.setattr(httpx.AsyncClient, "send", spy)
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


def test_cookies_a_server_sets_are_never_kept_nor_sent_back(monkeypatch) -> None:
    """httpx hands every reply to `client.cookies.extract_cookies`: the engine's client's `NoCookies`."""
    handed: list[int] = []
    monkeypatch.setattr(NoCookies, "extract_cookies", lambda self, response: handed.append(response.status_code))

    async def go() -> tuple[list[dict[str, str]], int, int]:
        cookie = {"Set-Cookie": "session=abc; Path=/"}
        async with LoopbackServer([send(200, b"{}", cookie), send(200, b"{}", cookie)]) as server:
            pool = HttpPool(4, httpx.Timeout(5.0))
            for _ in range(2):
                assert (await pool.post(server.url + "/generate", content=b"{}")).status_code == 200
            kept, jar = len(pool.client.cookies), len(pool.client.cookies.jar)
            await pool.aclose()
            return [s.headers for s in server.generates], kept, jar

    (first, second), kept, jar = asyncio.run(go())
    assert "cookie" not in first and "cookie" not in second and kept == jar == 0
    assert handed == [200, 200]  # httpx's own path, through the public `cookies`
    with pytest.raises(ValueError, match="keeps no cookies"):
        EngineClient(cookies={"a": "b"})


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


def test_httpx_s_auth_and_redirects_work_over_the_engine_s_transport() -> None:
    """The engine uses neither, but a user's own client over the transport keeps them."""
    async def go() -> tuple[int, list[dict[str, str]]]:
        script = [send(302, b"", {"Location": "/generate"}), send(200, b"{}")]
        async with LoopbackServer(script) as server:
            client = httpx.AsyncClient(transport=AsyncioTransport(4), trust_env=False)
            response = await client.send(httpx.Request("POST", server.url + "/generate", content=b"{}"),
                                         auth=httpx.BasicAuth("u", "p"), follow_redirects=True)
            await client.aclose()
            return response.status_code, [s.headers for s in server.generates]

    status, seen = asyncio.run(go())
    assert status == 200 and len(seen) == 2 and seen[0]["authorization"].startswith("Basic ")


def test_a_client_made_to_follow_redirects_follows_them() -> None:
    async def go() -> tuple[int, int]:
        async with LoopbackServer([send(307, b"", {"Location": "/generate"}), send(200, b"{}")]) as server:
            client = httpx.AsyncClient(transport=AsyncioTransport(4), trust_env=False, follow_redirects=True)
            response = await client.send(httpx.Request("POST", server.url + "/generate", content=b"{}"))
            await client.aclose()
            return response.status_code, len(server.generates)

    assert asyncio.run(go()) == (200, 2)


# -- httpx's own contracts hold on the engine's path ---------------------------------------------
def test_a_reply_has_its_elapsed_time_and_can_be_streamed() -> None:
    async def go() -> tuple[float, list[bytes], bytes]:
        async with LoopbackServer([send(200, b'{"a": 1}'), send(200, b'{"b": 2}')]) as server:
            pool = HttpPool(4, httpx.Timeout(5.0))
            response = await pool.post(server.url + "/generate", content=b"{}")
            async with pool.client.stream("POST", server.url + "/generate", content=b"{}") as streamed:
                chunks = [chunk async for chunk in streamed.aiter_bytes()]
            await pool.aclose()
            return response.elapsed.total_seconds(), chunks, response.content

    elapsed, chunks, content = asyncio.run(go())
    assert 0 < elapsed < 5 and content == b'{"a": 1}' and b"".join(chunks) == b'{"b": 2}'


def test_a_transport_error_carries_its_request() -> None:
    async def go() -> list[tuple[type, httpx.Request, httpx.Request]]:
        caught = []
        async with LoopbackServer([send(200, b"{}")]) as server:
            url = server.url + "/generate"
        pool = HttpPool(4, httpx.Timeout(5.0))
        for target in (url, "ftp://127.0.0.1/generate"):
            request = pool.client.build_request("POST", target, content=b"{}")
            try:
                await pool.client.send(request)
            except httpx.RequestError as exc:
                caught.append((type(exc), exc.request, request))
        await pool.aclose()
        return caught

    (refused, seen, sent), (unsupported, seen2, sent2) = asyncio.run(go())
    assert refused is httpx.ConnectError and unsupported is httpx.UnsupportedProtocol
    assert seen is sent and seen2 is sent2


def private_httpx_names_in(source: str, httpx_private: set[str], own: set[str]) -> set[str]:
    """The `_names` of httpx that `source` reaches for: `obj._name` for a name httpx defines and the
    engine does not (`own`), and any `httpx._module`."""
    tree = ast.parse(source)
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr.startswith("_")
            and not node.attr.startswith("__")}
    modules = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    return (used & httpx_private - own) | {m for m in modules if m.startswith("httpx._")}


def defined_private_names(sources: list[str], *, but_in_httpx_subclasses: bool = False) -> set[str]:
    """`_names` that code defines (functions, classes, assigned attributes and variables, arguments);
    with `but_in_httpx_subclasses`, not those a subclass of an httpx class defines or assigns: there
    they may be httpx's own."""
    names: set[str] = set()
    for source in sources:
        tree = ast.parse(source)
        skipped: set[int] = set()
        if but_in_httpx_subclasses:
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and any("httpx" in ast.unparse(b) for b in node.bases):
                    skipped |= {id(inner) for inner in ast.walk(node)} - {id(node)}
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_the_engine_touches_no_private_name_of_httpx() -> None:
    httpx_private = defined_private_names([p.read_text() for p in Path(httpx.__file__).parent.rglob("*.py")])
    offenders = {}
    for path in ENGINE.rglob("*.py"):
        text = path.read_text()
        own = defined_private_names([text], but_in_httpx_subclasses=True)  # the file's own `_names`
        if found := private_httpx_names_in(text, httpx_private, own):
            offenders[str(path.relative_to(ENGINE))] = found
    assert offenders == {}
    # what the check finds, planted
    planted = ("import httpx\nfrom httpx._models import Response\n"
               "class Whole(httpx.Response):\n"
               "    def __init__(self, body):\n"
               "        self._content = body\n"
               "async def send(client, request):\n"
               "    return await client._transport_for_url(request.url).handle_async_request(request)\n")
    own = defined_private_names([planted], but_in_httpx_subclasses=True)
    assert private_httpx_names_in(planted, httpx_private, own) == {"_transport_for_url", "_content", "httpx._models"}


def test_httpx_s_info_line_is_dropped_for_the_engine_s_requests_only(caplog) -> None:
    """One line a turn under slime's INFO logging otherwise; another httpx client keeps its lines."""
    async def go() -> None:
        async with LoopbackServer([send(200, b"{}"), send(200, b"{}")]) as server:
            pool = HttpPool(4, httpx.Timeout(5.0))
            await pool.post(server.url + "/generate", content=b"{}")
            other = httpx.AsyncClient(transport=AsyncioTransport(4), trust_env=False)
            await other.post(server.url + "/generate", content=b"{}")
            await other.aclose()
            await pool.aclose()

    with caplog.at_level(logging.INFO, logger="httpx"):
        asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if r.name == "httpx"]
    assert len(lines) == 1 and lines[0].startswith("HTTP Request: POST")


def test_the_engine_s_requests_carry_no_credentials_unless_its_url_does() -> None:
    async def go() -> list[dict[str, str]]:
        async with LoopbackServer([send(200, b"{}"), send(200, b"{}")]) as server:
            pool = HttpPool(4, httpx.Timeout(5.0))
            await pool.post(server.url + "/generate", content=b"{}")
            with_user = server.url.replace("http://", "http://user:secret@")
            response = await pool.post(with_user + "/generate", content=b"{}")
            await pool.aclose()
            assert response.status_code == 200 and response.history == []
            return [s.headers for s in server.generates]

    bare, with_user = asyncio.run(go())
    assert "authorization" not in bare and with_user["authorization"] == "Basic dXNlcjpzZWNyZXQ="


def test_a_reply_read_through_the_pool_leaves_no_cycle_for_the_collector() -> None:
    """httpx's response and the stream it wraps point at each other; the engine defers full
    collections while samples are in flight, so each reply, body and request would wait for one."""
    async def go() -> int:
        async with LoopbackServer([send(200, b'{"a": 1}')], repeat_last=True) as server:
            pool = HttpPool(4, httpx.Timeout(5.0))
            await pool.post(server.url + "/generate", content=b"{}")
            gc.collect()
            gc.disable()
            try:
                for _ in range(20):
                    assert (await pool.post(server.url + "/generate", content=b"{}")).content == b'{"a": 1}'
                found = gc.collect()
            finally:
                gc.enable()
            await pool.aclose()
            return found

    assert asyncio.run(go()) == 0
