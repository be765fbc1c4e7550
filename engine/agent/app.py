"""The front door: an aiohttp.web app serving OpenAI's and Anthropic's protocols over `Sessions`.

`serve(sessions)` binds it on loopback and returns a `FrontDoor`. Each session has its own base
URL, `{url}/s/{key}`, under which `/v1/...` lives; a request to `{url}/v1/...` names its session
by its key as the API key instead (`Authorization: Bearer KEY` or `x-api-key: KEY`). A request
becomes one `ModelCall` (`engine.agent.chat`, `.responses`, `.messages` read and answer each
protocol), the session answers it, and the answer goes back as the protocol's reply, or, when
the request asked, as its event stream: the engine generates a whole turn before the first byte,
so the stream is the finished answer in chunks. A client that leaves mid-stream costs nothing:
the turn was taken and recorded before. A request refused (by the door or by the session) gets
the protocol's error shape and status, one logged line, and `x-should-retry: false` so the SDKs
do not send it again; a session that raises gets a 500, which they do retry. An SDK's retry
(`x-stainless-retry-count` > 0) is marked on the call with the body's digest, so the session
answers it with the earlier answer instead of taking a second turn.

A harness sends its whole history with every call: the door keeps what it read of a session's
last history with the session (`Sessions.notes`), and reads of the next call only the items that
are not the same text at the same place (`engine.agent.shapes.History`), so a call costs what it
adds, not what its history holds.

Each protocol module provides `read(body, last) -> Asked` (or BadRequest), `reply(answer, asked)`,
`events(answer, asked)` (the stream's bytes), `error(problem)`, `model_list(names)` and
`model_card(name)`; the two that count tokens add `token_count(n)`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from types import ModuleType
from typing import Any, TypeVar
from urllib.parse import quote

import attrs
from aiohttp import web

from engine.agent import chat, messages, responses, shapes
from engine.agent.calls import CallRefused, ModelAnswer, Sessions
from engine.agent.shapes import Asked, BadRequest, History, Problem

log = logging.getLogger("engine.agent")

MAX_BODY = 64 * 2**20  # a long agent history with images runs to megabytes; aiohttp's default is 1 MiB
CLOSE_GRACE = 5.0  # seconds `aclose` lets calls in flight finish before cancelling them
RETRY_HEADER = "x-stainless-retry-count"
ANTHROPIC_HEADER = "anthropic-version"


@attrs.define(eq=False)
class FrontDoor:
    """A running front door: its base URL, each session's own, and how to close it."""

    url: str
    _runner: web.AppRunner

    def session_url(self, key: str) -> str:
        """The base URL of session `key`: an SDK given `{session_url}/v1` (OpenAI) or `session_url`
        (Anthropic) as its base URL talks to that session whatever API key it sends."""
        return f"{self.url}/s/{quote(key, safe='')}"

    async def aclose(self) -> None:
        """Stop listening and close every connection (calls in flight get CLOSE_GRACE seconds to finish)."""
        await self._runner.cleanup()


async def serve(sessions: Sessions, host: str = "127.0.0.1", port: int = 0, *,
                max_body: int = MAX_BODY) -> FrontDoor:
    """Serve `sessions` on `host:port` (port 0: a free one) until `aclose`."""
    # handler_cancellation off: a harness that hangs up does not cancel the turn its session is taking
    runner = web.AppRunner(make_app(sessions, max_body=max_body), access_log=None, handler_cancellation=False,
                           shutdown_timeout=CLOSE_GRACE)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return FrontDoor(url=f"http://{shown}:{bound_port}", runner=runner)


def make_app(sessions: Sessions, *, max_body: int = MAX_BODY) -> web.Application:
    """The aiohttp application: every route under `/v1` and under `/s/{key}/v1`."""
    door = _Door(sessions)
    app = web.Application(client_max_size=max_body)
    for prefix in ("", "/s/{key}"):
        app.router.add_post(f"{prefix}/v1/chat/completions", door.handler(chat))
        app.router.add_post(f"{prefix}/v1/responses", door.handler(responses))
        app.router.add_post(f"{prefix}/v1/responses/input_tokens", door.counter(responses, responses.read))
        app.router.add_post(f"{prefix}/v1/messages", door.handler(messages))
        app.router.add_post(f"{prefix}/v1/messages/count_tokens",
                            door.counter(messages, lambda body, last: messages.read(body, last, counting=True)))
        app.router.add_get(f"{prefix}/v1/models", door.models)
        app.router.add_get(f"{prefix}/v1/models/{{model}}", door.model)
    app.router.add_route("*", "/{tail:.*}", door.unknown)
    return app


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Reader = Callable[[Any, History | None], Asked]  # a protocol's `read(body, last)`
Answered = TypeVar("Answered", ModelAnswer, int)


@attrs.define(eq=False)
class _Door:
    """The handlers, over one `Sessions`."""

    sessions: Sessions

    def handler(self, dialect: ModuleType) -> Handler:
        """A model call's route: read, ask the session, answer (or stream)."""

        async def handle(request: web.Request) -> web.StreamResponse:
            found = await self._prelude(request, dialect, dialect.read, keep=True)
            if isinstance(found, web.Response):
                return found
            key, asked = found
            answer = await self._consult(request, dialect, key, self.sessions.call(key, asked.call))
            if isinstance(answer, web.Response):
                return answer
            if not asked.stream:
                return _json(dialect.reply(answer, asked))
            return await _stream(request, dialect.events(answer, asked), key)

        return handle

    def counter(self, dialect: ModuleType, read: Reader) -> Handler:
        """A token count's route (`count_tokens`, `input_tokens`): the session renders and counts."""

        async def count(request: web.Request) -> web.StreamResponse:
            found = await self._prelude(request, dialect, read)
            if isinstance(found, web.Response):
                return found
            key, asked = found
            counted = await self._consult(request, dialect, key, self.sessions.count_tokens(key, asked.call))
            return counted if isinstance(counted, web.Response) else _json(dialect.token_count(counted))

        return count

    async def models(self, request: web.Request) -> web.Response:
        """`GET /v1/models`, in Anthropic's shape for the Anthropic SDK, else OpenAI's."""
        return _json(_listing(request).model_list(self.sessions.models()))

    async def model(self, request: web.Request) -> web.Response:
        """`GET /v1/models/{model}`."""
        dialect = _listing(request)
        name = request.match_info["model"]
        if name not in self.sessions.models():
            return _problem(request, dialect, _unknown_model(name, self.sessions.models()), None)
        return _json(dialect.model_card(name))

    async def unknown(self, request: web.Request) -> web.Response:
        """Any other path: 404 in the shape of the SDK that asked."""
        problem = Problem(404, "not_found", f"no such endpoint: {request.method} {request.path}", code="unknown_url")
        return _problem(request, _listing(request), problem, None)

    async def _prelude(self, request: web.Request, dialect: ModuleType, read: Reader, *,
                       keep: bool = False) -> tuple[str, Asked] | web.Response:
        """The session key and the request read as a call, or the error response. The session's
        last history as read is reused; `keep`: this one is kept for its next call (a token count
        is not: it may count a history the harness is only trying out)."""
        key = _key(request)
        if key is None:
            problem = Problem(401, "unauthorized", "no session key: use the session's base URL, or its key as the "
                                                   "API key (Authorization: Bearer KEY or x-api-key: KEY)")
            return _problem(request, dialect, problem, None)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            problem = Problem(413, "too_large", f"the request body is over the limit: {exc.text}")
            return _problem(request, dialect, problem, key)
        try:
            body, exact = shapes.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return _problem(request, dialect, Problem.invalid(f"the body is not JSON: {exc}"), key)
        keeper = getattr(self.sessions, "notes", None)  # optional: without it each request is read whole
        notes = keeper(key) if exact and keeper is not None else None
        try:
            asked = read(body, None if notes is None else notes.get(dialect.__name__))
        except BadRequest as exc:
            return _problem(request, dialect, exc.problem, key)
        if keep and notes is not None and asked.history is not None:
            notes[dialect.__name__] = asked.history
        digest = hashlib.sha256(raw).hexdigest()
        call = attrs.evolve(asked.call, digest=digest, retry_of=digest if _retry_count(request) > 0 else None)
        return key, attrs.evolve(asked, call=call)

    @staticmethod
    async def _consult(request: web.Request, dialect: ModuleType, key: str,
                       asking: Awaitable[Answered | CallRefused]) -> Answered | web.Response:
        """What the session answers, or the error response for its refusal (a key never opened: 404
        when the path named it, 401 when the API key did; an unknown model: 404) or its failure (500, logged)."""
        try:
            got = await asking
        except Exception:
            log.exception("session %s failed on %s", _shown(key), _route(request))
            return _problem(request, dialect, Problem(500, "internal", "the session failed on this request"), key)
        if not isinstance(got, CallRefused):
            return got
        if got.kind == "unauthorized" and "key" in request.match_info:
            return _problem(request, dialect, Problem(404, "not_found", got.message, code="session_not_found"), key)
        return _problem(request, dialect, Problem.refused(got), key)


def _key(request: web.Request) -> str | None:
    """The session key: from the path, else the API key."""
    if "key" in request.match_info:
        return request.match_info["key"]
    authorization = request.headers.get("Authorization", "")
    if authorization[:7].lower() == "bearer " and authorization[7:].strip():
        return authorization[7:].strip()
    return request.headers.get("x-api-key") or None


def _retry_count(request: web.Request) -> int:
    try:
        return int(request.headers.get(RETRY_HEADER, "0"))
    except ValueError:
        return 0


def _listing(request: web.Request) -> ModuleType:
    """The shape to answer a request that names no protocol: Anthropic's SDK sends its version header."""
    return messages if ANTHROPIC_HEADER in request.headers else chat


def _unknown_model(name: str, served: list[str]) -> Problem:
    return Problem(404, "not_found", f"the model {name!r} is not served here (served: {', '.join(served) or 'none'})",
                   code="model_not_found", param="model")


def _shown(key: str | None) -> str:
    """A session key as logs show it: enough to tell sessions apart, not enough to use one."""
    return "-" if key is None else key[:8] + ("..." if len(key) > 8 else "")


def _route(request: web.Request) -> str:
    """The request's route with `{key}` in place of the key (an unmatched path as it came)."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None and "key" in request.match_info else request.path


def _json(data: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=json.dumps(data, ensure_ascii=False), status=status, headers=headers,
                        content_type="application/json")


def _problem(request: web.Request, dialect: ModuleType, problem: Problem, key: str | None) -> web.Response:
    """The protocol's error reply, logged in one line; only a failure of ours invites a retry."""
    log.warning("%s %s (session %s): %d %s: %s", request.method, _route(request), _shown(key), problem.status,
                problem.kind, problem.message[:300])
    headers = {"x-should-retry": "false"} if problem.status < 500 else None
    return _json(dialect.error(problem), problem.status, headers)


async def _stream(request: web.Request, chunks: Iterator[bytes], key: str) -> web.StreamResponse:
    """Write server-sent events; a client that leaves mid-stream is noted, nothing else."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await response.prepare(request)
        for chunk in chunks:
            await response.write(chunk)
        await response.write_eof()
    except ConnectionError:
        log.info("the client of session %s left mid-stream", _shown(key))
    return response
