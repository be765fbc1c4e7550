"""The engine's HTTP client: one shared connection pool, bounded retries, no exceptions out.

`SGLangClient.generate` returns a `Reply` or a `Failure`; it raises only on cancellation.
Transient failures (connect/read errors, timeouts, malformed replies, 408, 429, 5xx, a body
that is not JSON) are retried with exponential backoff and full jitter, or after the server's
`Retry-After`. Time is bounded twice: one attempt, connect to last byte, by the request
timeout; all attempts and the waits between them, the one in flight included, by the
retry deadline. A server that drips bytes therefore cannot hold a sample past either.
Other 4xx are final (a context-length 400 becomes `context_exceeded`), and so is a reply that
would come again as it is (`ReplyRefused`: past the size cap, a coding the engine does not read),
and an https:// server whose TLS cannot work (`TLSRefused`: an untrusted certificate, a plain server);
a 3xx is reported as a redirect and not followed. Every failure after a response records its
status. A server URL that is not an http(s) URL is refused when the client is made.

Every request is an `httpx.Request` sent by httpx's own `AsyncClient.send` over the engine's
transport (`engine.sglang.http1.AsyncioTransport`), which writes a request at most once.
A request that failed after it was written is sent again only by the retry policy above:
counted, after a backoff, inside the deadline. httpx event hooks and respx's httpx mocker
work above the transport, on the path production runs (docs/http.md). Services beside the
model server (an environment's simulated user, a judge) are asked through the same pool and
policy (`ServiceClient`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import random
import ssl
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import attrs
import httpx

from engine.aio import Gate, within
from engine.settings import EngineConfig, RetryPolicy
from engine.settings.declare import default_of
from engine.sglang.http1 import LIMIT, AsyncioTransport, BodySource, BodyStream, ReplyRefused, TLSRefused
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
# Asked of every server: a compressing proxy in front of SGLang then sends the body as it is.
IDENTITY = {"Accept-Encoding": "identity"}


class NoCookies(httpx.Cookies):
    """Cookies that keep nothing: SGLang and its router set none, and a jar would be state shared by
    every sample of the loop, read from every reply's headers."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None


class EngineClient(httpx.AsyncClient):
    """httpx's `AsyncClient` (its own `send`: hooks, auth, redirects), whose `cookies` keep nothing.

    httpx reads each reply's `Set-Cookie` into `client.cookies` through a stand-in for urllib's
    request, a fair part of its price per request (bench figure 1); `NoCookies` skips it.
    """

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("cookies"):
            raise ValueError("the engine's HTTP client keeps no cookies")
        super().__init__(**kwargs)
        self.no_cookies = NoCookies()

    @property  # type: ignore[override]
    def cookies(self) -> httpx.Cookies:
        """Always empty."""
        return self.no_cookies

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        if cookies:
            raise ValueError("the engine's HTTP client keeps no cookies")


class AsIs(httpx.Auth):
    """No authentication: each request goes out as it is. httpx's own flow for that is an async
    generator per request (a frame, and a registration with asyncio); this is one small object."""

    def async_auth_flow(self, request: httpx.Request) -> AsyncGenerator[httpx.Request, httpx.Response]:
        return _Once(request)


class _Once(AsyncGenerator[httpx.Request, httpx.Response]):
    """An auth flow that yields its request once and ends at the response."""

    __slots__ = ("request",)

    def __init__(self, request: httpx.Request) -> None:
        self.request: httpx.Request | None = request

    async def asend(self, value: httpx.Response | None) -> httpx.Request:
        request, self.request = self.request, None
        if request is None:
            raise StopAsyncIteration
        return request

    async def athrow(self, typ: Any, val: Any = None, tb: Any = None) -> httpx.Request:
        raise typ if val is None else val


AS_IS = AsIs()
_IN_POOL: contextvars.ContextVar[bool] = contextvars.ContextVar("engine_http_request", default=False)


class _QuietPerRequest(logging.Filter):
    """Drops httpx's `HTTP Request: ...` INFO line for the engine's own requests (one per turn under
    slime's INFO logging); other users of httpx in the process keep theirs, and warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or not _IN_POOL.get()


_QUIET = _QuietPerRequest()
logging.getLogger("httpx").addFilter(_QUIET)  # the same object each time: added once


def check_url(url: str, what: str = "server URL") -> str:
    """`url` if it is an absolute http:// or https:// URL with a host; else ValueError (a setup error,
    never a failure to retry: `localhost:30000` reads as scheme `localhost`)."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ValueError(f"the {what} {url!r} is not a URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        hint = f" (http://{url}?)" if "://" not in url else ""
        raise ValueError(f"the {what} {url!r} is not an http:// or https:// URL with a host{hint}")
    return url


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
        headers = IDENTITY if not headers else {**IDENTITY, **headers}
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
        quiet = _IN_POOL.set(True)
        try:  # credentials in the URL (http://user:pass@host) get httpx's own flow: Basic auth
            response = await self.client.send(request, auth=httpx.USE_CLIENT_DEFAULT if request.url.userinfo else AS_IS)
        finally:
            _IN_POOL.reset(quiet)
            self._gate.release()
        # httpx wraps the stream in one that points back at the response (to set `elapsed` when it
        # closes): a cycle, so every reply, its body and its request would wait for a collection,
        # and the engine defers full ones while samples are in flight. The body is read: let go.
        response.stream = httpx.ByteStream(b"")
        return response

    async def post(self, url: str, *, limit: float | None = None, **kwargs: Any) -> httpx.Response:
        """POST through `request`."""
        return await self.request("POST", url, limit=limit, **kwargs)

    def add_event_hook(self, kind: str, hook: Callable[..., Any]) -> None:
        """An httpx event hook ("request" or "response") on the client."""
        self.client.event_hooks[kind].append(hook)

    async def aclose(self) -> None:
        """Close the client and its connections."""
        await self.client.aclose()


def request_once(method: str, url: str, *, timeout: float, max_body: int = 1 << 20) -> httpx.Response:
    """One request outside any event loop (a command's check before its run starts), through a pool
    of its own: the engine's transport, its bounds (`timeout` connect to last byte, `max_body`).
    Raises what `HttpPool.request` raises: `httpx.HTTPError`s (`ReplyRefused` among them)."""
    async def once() -> httpx.Response:
        pool = HttpPool(1, httpx.Timeout(timeout), max_body=max_body)
        try:
            return await pool.request(method, url, limit=timeout)
        finally:
            await pool.aclose()

    return asyncio.run(once())


def make_http_client(cfg: EngineConfig) -> HttpPool:
    """The connection pool of one event loop's samples, sized and timed as the settings say."""
    timeout = httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout)
    return HttpPool(cfg.max_connections, timeout, max_body=cfg.max_reply_bytes)


@attrs.frozen
class _Transient:
    """A failure worth retrying: what happened, the status if a response came, its Retry-After."""

    message: str
    status: int | None = None
    retry_after: float | None = None


class Retrying:
    """The retry policy at work: attempts until one is final, with backoff between them, counted."""

    def __init__(self, policy: RetryPolicy, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.spent = 0  # retries over its life, for soak reports
        self._rng = rng or random.Random()

    async def run(self, attempt: Callable[[float], Awaitable[Any]], timeout: float, deadline: float | None = None) -> Any:
        """`await attempt(budget)` until it returns anything but a `_Transient`, which is retried.

        `budget` is the seconds the attempt may take: `timeout`, or less when the retry deadline
        (the policy's, else `timeout`; or `deadline` seconds if sooner) is nearer. When the attempts run out, or
        the next wait would pass the deadline, the last transient failure comes back as
        `Failure("unavailable")`.
        """
        loop = asyncio.get_running_loop()
        # a policy without a deadline of its own (a bare RetryPolicy()) retries within `timeout`
        seconds = timeout if self.policy.deadline is None else self.policy.deadline
        if deadline is not None:
            seconds = min(seconds, deadline)
        deadline = loop.time() + seconds
        attempts = 0
        while True:
            attempts += 1
            budget = min(timeout, deadline - loop.time())
            outcome = await attempt(budget) if budget > 0 else _Transient("no time left for another attempt")
            if not isinstance(outcome, _Transient):
                return outcome
            delay = self._delay(attempts, outcome)
            left = deadline - loop.time()
            if attempts >= self.policy.max_attempts or delay >= left:
                why = f"gave up after {attempts} attempt(s)"
                if attempts < self.policy.max_attempts:
                    asked = f"the server asked for {outcome.retry_after:.3g}s, " if outcome.retry_after is not None else ""
                    why += f" ({asked}{max(left, 0.0):.3g}s left of the {seconds:g}s retry deadline)"
                return Failure("unavailable", f"{why}: {outcome.message}", outcome.status)
            self.spent += 1
            log.debug("retrying in %.2fs after: %s", delay, outcome.message)
            await asyncio.sleep(delay)

    def _delay(self, attempt: int, outcome: _Transient) -> float:
        """Backoff with full jitter, or the server's Retry-After spread by up to 10 %."""
        rand = self._rng.random()
        if outcome.retry_after is not None:
            return outcome.retry_after * (1.0 + RETRY_AFTER_SPREAD * rand)
        return self.policy.delay(attempt, rand)


async def exchange(http: HttpPool, url: str, body: bytes | BodySource, headers: dict[str, str],
                   limit: float) -> httpx.Response | Failure | _Transient:
    """One POST, sorted: a response to read (200 or a final 4xx/5xx), a final `Failure`, or a `_Transient`.

    Transient: connect and read errors, timeouts, malformed replies, 408, 429 and 5xx (with the
    server's Retry-After). Final: a reply refused as it would come again (`ReplyRefused`: too
    large, a coding the engine does not read), a URL httpx cannot send to, a redirect.
    """
    try:
        response = await http.request("POST", url, content=body, headers=headers, limit=limit)
    except ReplyRefused as exc:  # the same request would get the same reply: not retried
        return Failure("rejected", str(exc), exc.status)
    except (httpx.UnsupportedProtocol, httpx.InvalidURL, TLSRefused) as exc:  # a URL no attempt can reach
        return Failure("rejected", f"{type(exc).__name__}: {exc}")
    except httpx.RequestError as exc:  # connect, read, write, protocol, timeouts
        return _Transient(f"{type(exc).__name__}: {exc}")
    status = response.status_code
    if status in RETRY_STATUSES:
        wait = retry_after_seconds(response.headers.get("retry-after"), time.time())
        return _Transient(f"HTTP {status}: {error_message(response.content)}", status, wait)
    if 300 <= status < 400:
        where = response.headers.get("location", "")[:300]
        return Failure("rejected", f"HTTP {status} redirect to {where!r}, not followed: point the engine at the "
                       "server itself", status)
    return response


class TokenSource(Protocol):
    """What `generate` reads ids from: a sample's prompt and response arrays (a `Trajectory`)."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]


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
        self.base_url = check_url(base_url).rstrip("/")
        self.url = self.base_url + "/generate"
        self.http = http
        self.retry = retry
        self.retrying = Retrying(retry, rng)
        self.request_timeout = request_timeout
        self.tokenizer_vocab = vocab_size  # the tokenizer's size; the server's may narrow it
        self._vocab: int | None = vocab_size
        self._vocab_checked = False
        self._vocab_probe: asyncio.Future[int | None] | None = None
        prepare_encoder()
        # One encoded prompt per sample, kept with its trajectory and gone with it.
        self._bodies: weakref.WeakKeyDictionary[Any, RequestBody] = weakref.WeakKeyDictionary()

    @property
    def retries_spent(self) -> int:
        """Retries over the client's life, for soak reports."""
        return self.retrying.spent

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
        # Made again for each attempt: no body is held while a reply is awaited. Partials, not
        # closures: `attempt(budget)` is `_post_once`'s own coroutine, one frame less that the
        # reply's arrival resumes on its way up.
        make_body = functools.partial(self.body, input_ids, sampling_params, max_new_tokens, routed_experts_start)
        headers = {"Content-Type": "application/json"}
        if routing_key:
            headers[ROUTING_HEADER] = str(routing_key)
        vocab = self._vocab if self._vocab_checked else await self.vocabulary()
        attempt = functools.partial(self._post_once, make_body, headers, vocab=vocab)
        outcome: Reply | Failure = await self.retrying.run(attempt, self.request_timeout)
        return outcome

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

    async def _post_once(
        self, body: BodySource, headers: dict[str, str], budget: float, vocab: int | None
    ) -> Reply | Failure | _Transient:
        """One POST. Returns a final outcome, or a `_Transient` describing a retryable failure."""
        response = await exchange(self.http, self.url, body, headers, budget)
        if not isinstance(response, httpx.Response):
            return response
        status = response.status_code
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


class ServiceFailed(Exception):
    """A request to a service that brought no usable reply; the message says what happened."""


class ServiceClient:
    """JSON requests to services beside the model server (a simulated user's model, a judge).

    They go through the loop's one pool, as `/generate` does: its connections and reply cap, and
    the same retry policy (transient failures retried with backoff), bounded by each call's
    `timeout`. This is the HTTP client the engine gives an environment (`engine.envs`).
    """

    def __init__(self, http: HttpPool, retry: RetryPolicy, rng: random.Random | None = None) -> None:
        self.http = http
        self.retrying = Retrying(retry, rng)

    async def post_json(self, url: str, body: Any, *, timeout: float) -> Any:
        """POST `body` as JSON to `url` and return the reply's JSON, all attempts within `timeout` seconds.

        Raises `ServiceFailed`: a non-200 reply (after retries where it is transient), a body
        that is not JSON, a reply refused, or no reply within the attempts and the time.
        """
        data = dumps(body)
        headers = {"Content-Type": "application/json"}

        async def attempt(budget: float) -> Any:
            response = await exchange(self.http, url, data, headers, budget)
            if not isinstance(response, httpx.Response):
                return response
            if response.status_code != 200:
                return Failure("rejected", f"HTTP {response.status_code}: {error_message(response.content)}",
                               response.status_code)
            try:
                return loads(response.content)
            except ValueError:  # a service answering HTML answers HTML again: not retried
                return Failure("rejected", f"HTTP 200 but the body is not JSON: {response.content[:80]!r}", 200)

        outcome = await self.retrying.run(attempt, timeout, deadline=timeout)
        if isinstance(outcome, Failure):
            raise ServiceFailed(outcome.message)
        return outcome


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
