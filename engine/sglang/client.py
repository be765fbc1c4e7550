"""The SGLang HTTP client: one shared connection pool, bounded retries, no exceptions out.

`SGLangClient.generate` returns a `Reply` or a `Failure`; it raises only on cancellation.
Transient failures (connect/read errors, timeouts, 408, 429, 5xx, a body that is not
JSON) are retried with exponential backoff and full jitter, or after the server's
`Retry-After`. Time is bounded twice: one attempt, connect to last byte, by the request
timeout; all attempts and the waits between them, the one in flight included, by the
retry deadline. A server that drips bytes therefore cannot hold a sample past either.
Other 4xx are final (a context-length 400 becomes `context_exceeded`); a 3xx is reported
as a redirect and not followed. Every failure after a response records its status.

Every request is an `httpx.Request` sent by one `httpx.AsyncClient`; its transport is the
engine's own (`engine.sglang.http1.AsyncioTransport`), which writes a request at most once.
A request that failed after it was written is sent again only by the retry policy above:
counted, after a backoff, inside the deadline. httpx event hooks and respx's httpx mocker
work above the transport, on the path production runs (docs/http.md).
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import httpx

from engine.aio import Gate, within
from engine.settings import EngineConfig, RetryPolicy
from engine.settings.declare import default_of
from engine.sglang.http1 import LIMIT, AsyncioTransport, BodySource, BodyStream, ReplyTooLarge
from engine.sglang.wire import (
    Failure,
    Reply,
    RequestBody,
    dumps,
    error_message,
    is_context_error,
    loads,
    parse_reply,
    prepare_encoder,
    retry_after_seconds,
)

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
ROUTING_HEADER = "X-SMG-Routing-Key"
RETRY_AFTER_SPREAD = 0.1  # up to +10 %: samples told the same Retry-After do not all return at once
PROBE_TIMEOUT = 5.0  # seconds for all model-info requests at start-up
INFO_PATHS = ("/model_info", "/get_model_info", "/server_info", "/get_server_info")
VOCAB_PADDING = 1024  # embeddings are padded past the tokenizer (Qwen3: 267 ids); more means another model


class _NoCookies(httpx.Cookies):
    """A jar that keeps nothing: SGLang and its router set no cookies, and one jar would be state
    shared by every sample of the process (httpx reads every reply's headers into it)."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None


class EngineClient(httpx.AsyncClient):
    """`httpx.AsyncClient` without a cookie jar, whose `send` is one exchange.

    The engine never authenticates, never follows a redirect (it reports one) and keeps no
    cookie, so `send` skips the auth flow, the redirect loop and the cookie extraction that
    httpx runs for every request (the larger part of its client's price per request). What
    a user or a test plugs into httpx keeps working: event hooks run as in httpx, and the
    transport is the one httpx picks for the URL (`_transport_for_url`: mounts, and the seam
    respx's httpx mocker patches). A request with auth or redirects to follow goes through
    httpx's own `send`.
    """

    _jar = _NoCookies()  # empty for good: one for every client

    @property  # type: ignore[override]
    def cookies(self) -> httpx.Cookies:
        return self._jar

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        if cookies:
            raise ValueError("the engine's HTTP client keeps no cookies")

    async def send(self, request: httpx.Request, *, stream: bool = False, auth: Any = httpx.USE_CLIENT_DEFAULT,
                   follow_redirects: Any = httpx.USE_CLIENT_DEFAULT) -> httpx.Response:
        """Send `request` once: request hooks, the URL's transport, response hooks, the body read."""
        follow = self.follow_redirects if follow_redirects is httpx.USE_CLIENT_DEFAULT else follow_redirects
        if self.auth is not None or auth is not httpx.USE_CLIENT_DEFAULT or follow:
            return await super().send(request, stream=stream, auth=auth, follow_redirects=follow_redirects)
        if self.is_closed:
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        if "timeout" not in request.extensions:
            request.extensions["timeout"] = self.timeout.as_dict()
        hooks = self.event_hooks
        for hook in hooks["request"]:
            await hook(request)
        response = await self._transport_for_url(request.url).handle_async_request(request)
        response.request = request
        try:
            for hook in hooks["response"]:
                await hook(response)
            if not stream:
                await response.aread()
        except BaseException:
            await response.aclose()
            raise
        return response


class HttpPool:
    """Every HTTP request of one event loop's samples: one `httpx.AsyncClient` over one transport.

    At most `max_connections` requests run at once; the others wait on one gate, which wakes
    one waiter per free connection. `request` returns an `httpx.Response` with its body read.
    `transport` replaces the engine's own (a test's stub); the size cap and the whole-request
    limit are the engine's transport's, so another one must bound those itself.
    """

    def __init__(self, max_connections: int, timeout: httpx.Timeout, max_body: int = default_of(EngineConfig, "max_reply_bytes"),
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.max_body = max_body  # a reply past it raises ReplyTooLarge: memory is bounded, not only time
        connections = max(1, max_connections)
        # One TLS context, made once: loading the CA bundle is slow and large.
        self.transport = transport or AsyncioTransport(connections, ssl.create_default_context(), max_body)
        # trust_env=False: never route loopback or cluster traffic through a proxy from the env;
        # follow_redirects=False: a redirect is reported, the engine's URL is then wrong.
        self.client = EngineClient(transport=self.transport, timeout=timeout, trust_env=False, follow_redirects=False)
        self._gate = Gate(connections)
        self._urls: dict[str, httpx.URL] = {}
        self._timeouts = timeout.as_dict()  # the client would make this dict anew for every request

    def _url(self, url: str) -> httpx.URL:
        known = self._urls.get(url)
        if known is None:
            known = httpx.URL(url)
            if len(self._urls) < 64:
                self._urls[url] = known
        return known

    async def request(self, method: str, url: str, *, limit: float | None = None, content: bytes | BodySource | None = None,
                      json: Any = None, headers: dict[str, str] | None = None) -> httpx.Response:
        """A request through the client once a connection is free; returns with the body read.

        `content` may be a `BodySource`: the body is then made when it is written and held by
        nothing while the reply is awaited (unless an event hook is registered: hooks see the
        bytes). `limit` bounds the whole request in seconds once it holds a connection, from
        connect to the body's last byte (httpx's own timeouts are per read: a server dripping a
        byte at a time never trips them): `RequestTimeout` when it passes, and `ReplyTooLarge`
        when the body declares or runs past `max_body` bytes (nothing more of it is read).
        """
        if json is not None:
            content, headers = dumps(json), {"Content-Type": "application/json", **(headers or {})}
        hooks = self.client.event_hooks
        if callable(content) and (hooks["request"] or hooks["response"]):
            content = content()
        extensions = {"timeout": self._timeouts} if limit is None else {"timeout": self._timeouts, LIMIT: limit}
        if callable(content):
            request = httpx.Request(method, self._url(url), headers=headers, stream=BodyStream(content),
                                    extensions=extensions)
        else:
            request = httpx.Request(method, self._url(url), headers=headers, content=content, extensions=extensions)
        await self._gate.acquire()
        try:
            return await self.client.send(request)
        finally:
            self._gate.release()

    async def post(self, url: str, *, limit: float | None = None, **kwargs: Any) -> httpx.Response:
        """POST through `request`."""
        return await self.request("POST", url, limit=limit, **kwargs)

    def add_event_hook(self, kind: str, hook: Callable[..., Any]) -> None:
        """An httpx event hook ("request" or "response") on the client."""
        self.client.event_hooks[kind].append(hook)

    async def aclose(self) -> None:
        """Close the client and its connections."""
        await self.client.aclose()


def make_http_client(cfg: EngineConfig) -> HttpPool:
    """The connection pool of one event loop's samples, sized and timed as the settings say."""
    timeout = httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout)
    return HttpPool(cfg.max_connections, timeout, max_body=cfg.max_reply_bytes)


class TokenSource(Protocol):
    """What `generate` reads ids from: a sample's prompt and response arrays (a `Trajectory`)."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]


@attrs.frozen
class _Transient:
    """A failure worth retrying: what happened, the status if a response came, its Retry-After."""

    message: str
    status: int | None = None
    retry_after: float | None = None


class SGLangClient:
    """Posts token-in/token-out `/generate` requests to an SGLang server or router."""

    def __init__(
        self,
        base_url: str,
        http: HttpPool,
        retry: RetryPolicy,
        *,
        request_timeout: float = default_of(EngineConfig, "request_timeout"),
        vocab_size: int | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/generate"
        self.http = http
        self.retry = retry
        self.request_timeout = request_timeout
        self.tokenizer_vocab = vocab_size  # the tokenizer's size; the server's may narrow it
        self._rng = rng or random.Random()
        self.retries_spent = 0  # over the client's life, for soak reports
        self._vocab: int | None = vocab_size
        self._vocab_checked = False
        self._vocab_probe: asyncio.Future[int | None] | None = None
        prepare_encoder()
        # One encoded prompt per sample, kept with its trajectory and gone with it.
        self._bodies: weakref.WeakKeyDictionary[Any, RequestBody] = weakref.WeakKeyDictionary()

    async def generate(
        self,
        input_ids: Sequence[int] | TokenSource,
        sampling_params: dict[str, Any],
        max_new_tokens: int | None,
        *,
        routing_key: str | None = None,
        routed_experts_start: int | None = None,
    ) -> Reply | Failure:
        """One generation turn, retried while the failure is transient.

        `input_ids` is the ids to send, or a sample's trajectory: then its prompt's ids are
        encoded once, and only the response's are encoded each turn.
        `routed_experts_start` asks for routed experts (routing replay) from that row on.
        """
        def make_body() -> bytes:  # made again for each attempt: no body is held while a reply is awaited
            return self.body(input_ids, sampling_params, max_new_tokens, routed_experts_start)

        headers = {"Content-Type": "application/json"}
        if routing_key:
            headers[ROUTING_HEADER] = str(routing_key)
        vocab = self._vocab if self._vocab_checked else await self.vocabulary()
        loop = asyncio.get_running_loop()
        # a policy without a deadline of its own (a bare RetryPolicy()) retries within the request timeout
        retry_seconds = self.request_timeout if self.retry.deadline is None else self.retry.deadline
        deadline = loop.time() + retry_seconds
        attempt = 0
        while True:
            attempt += 1
            budget = min(self.request_timeout, deadline - loop.time())
            outcome = await self._post_once(make_body, headers, budget, vocab)
            if isinstance(outcome, Reply):
                return outcome
            if isinstance(outcome, Failure):
                return outcome
            delay = self._delay(attempt, outcome)
            left = deadline - loop.time()
            if attempt >= self.retry.max_attempts or delay >= left:
                why = f"gave up after {attempt} attempt(s)"
                if attempt < self.retry.max_attempts:
                    asked = f"the server asked for {outcome.retry_after:.3g}s, " if outcome.retry_after is not None else ""
                    why += f" ({asked}{max(left, 0.0):.3g}s left of the {retry_seconds:g}s retry deadline)"
                return Failure("unavailable", f"{why}: {outcome.message}", outcome.status)
            self.retries_spent += 1
            log.debug("retrying /generate in %.2fs after: %s", delay, outcome.message)
            await asyncio.sleep(delay)

    def body(
        self, input_ids: Sequence[int] | TokenSource, sampling_params: dict[str, Any], max_new_tokens: int | None,
        routed_experts_start: int | None = None,
    ) -> bytes:
        """The request body's bytes, with the sample's prompt encoded once for all its turns."""
        prompt = getattr(input_ids, "prompt_ids", None)
        response = getattr(input_ids, "response_ids", None)
        if prompt is None or response is None:
            return RequestBody().render(input_ids, (), sampling_params, max_new_tokens, routed_experts_start)  # type: ignore[arg-type]
        try:
            cached = self._bodies.get(input_ids)
            if cached is None:
                cached = self._bodies[input_ids] = RequestBody()
        except TypeError:  # not weak-referenceable: no prompt kept encoded
            cached = RequestBody()
        return cached.render(prompt, response, sampling_params, max_new_tokens, routed_experts_start)

    def _delay(self, attempt: int, outcome: _Transient) -> float:
        """Backoff with full jitter, or the server's Retry-After spread by up to 10 %."""
        rand = self._rng.random()
        if outcome.retry_after is not None:
            return outcome.retry_after * (1.0 + RETRY_AFTER_SPREAD * rand)
        return self.retry.delay(attempt, rand)

    async def _post_once(
        self, body: BodySource, headers: dict[str, str], budget: float, vocab: int | None
    ) -> Reply | Failure | _Transient:
        """One POST. Returns a final outcome, or a `_Transient` describing a retryable failure."""
        if budget <= 0:
            return _Transient("no time left for another attempt")
        try:
            response = await self.http.request("POST", self.url, content=body, headers=headers, limit=budget)
        except httpx.RequestError as exc:  # connect, read, write, protocol, timeouts
            return _Transient(f"{type(exc).__name__}: {exc}")
        except ReplyTooLarge as exc:  # the same request would get the same reply: not retried
            return Failure("rejected", str(exc), exc.status)
        status = response.status_code
        if status in RETRY_STATUSES:
            wait = retry_after_seconds(response.headers.get("retry-after"), time.time())
            return _Transient(f"HTTP {status}: {error_message(response.content)}", status, wait)
        if 300 <= status < 400:
            where = response.headers.get("location", "")[:300]
            return Failure("rejected", f"HTTP {status} redirect to {where!r}, not followed: point the engine's "
                           "server URL at the server itself", status)
        if status != 200:
            message = error_message(response.content)
            kind = "context_exceeded" if is_context_error(status, message) else "rejected"
            return Failure(kind, f"HTTP {status}: {message}", status)
        try:
            data = loads(response.content)
        except ValueError:
            return _Transient(f"HTTP 200 but the body is not JSON: {response.content[:80]!r}", status)
        return parse_reply(data, vocab)

    async def vocabulary(self) -> int | None:
        """The bound on ids: the tokenizer's size, cross-checked once with the server's model info."""
        if self._vocab_checked:
            return self._vocab
        if self._vocab_probe is None:
            self._vocab_probe = asyncio.ensure_future(self._probe_vocabulary())
        # Shielded: a sample cancelled while waiting must not cancel the probe the others share.
        return await asyncio.shield(self._vocab_probe)

    async def _probe_vocabulary(self) -> int | None:
        try:  # one bound for the whole probe: a server that drips must not hold the first samples long
            served = await within(min(PROBE_TIMEOUT, self.request_timeout), self._served_vocabulary())
        except Exception as exc:  # no model info is no reason to fail: the tokenizer's bound stands
            log.debug("no vocabulary size from the server: %s", exc)
            served = None
        self._vocab = settle_vocabulary(self.tokenizer_vocab, served)
        self._vocab_checked = True
        return self._vocab

    async def _served_vocabulary(self) -> int | None:
        """`vocab_size` from the first model-info endpoint that reports one, else None."""
        for path in INFO_PATHS:
            try:
                response = await self.http.request("GET", self.base_url + path)
            except Exception:  # connection refused, timeout, a mock that knows no such route
                return None
            if response.status_code != 200:
                continue
            try:
                size = find_vocab_size(loads(response.content))
            except ValueError:
                continue
            if size is not None:
                return size
        return None


def find_vocab_size(info: Any) -> int | None:
    """A positive int `vocab_size` at the top of a model/server info body or one level down."""
    if not isinstance(info, dict):
        return None
    candidates = [info.get("vocab_size")] + [v.get("vocab_size") for v in info.values() if isinstance(v, dict)]
    for value in candidates:
        if type(value) is int and value > 0:
            return value
    return None


def settle_vocabulary(tokenizer_size: int | None, served_size: int | None) -> int | None:
    """The id bound from both sizes: the smaller one; a warning when they disagree beyond padding."""
    if served_size is None or tokenizer_size is None:
        return tokenizer_size if served_size is None else served_size
    if served_size < tokenizer_size:
        log.warning("the server's model has %d ids but the tokenizer %d: is the engine's tokenizer the served "
                    "model's? ids from %d on are refused", served_size, tokenizer_size, served_size)
    elif served_size > tokenizer_size + VOCAB_PADDING:
        log.warning("the server's model has %d ids, the tokenizer %d: another model may be behind the router; "
                    "ids from %d on are refused", served_size, tokenizer_size, tokenizer_size)
    return min(tokenizer_size, served_size)
