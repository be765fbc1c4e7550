"""The SGLang HTTP client: one shared connection pool, bounded retries, no exceptions out.

`SGLangClient.generate` returns a `Reply` or a `Failure`; it raises only on cancellation.
Transient failures (connect/read errors, timeouts, 408, 429, 5xx, a body that is not
JSON) are retried with exponential backoff and full jitter, or after the server's
`Retry-After`. Time is bounded twice: one attempt, connect to last byte, by the request
timeout; all attempts and the waits between them, the one in flight included, by the
retry deadline. A server that drips bytes therefore cannot hold a sample past either.
Other 4xx are final (a context-length 400 becomes `context_exceeded`); a 3xx is reported
as a redirect and not followed. Every failure after a response records its status.

The transport is chosen by `engine_http_transport`:
- `asyncio`: the engine's own HTTP/1.1 client on asyncio's transports (`engine.sglang.http1`);
- `httpx`: httpx's own (httpcore), on many small clients (see `HttpPool`);
- `aiohttp`: aiohttp's transport under httpx's client (PyPI `httpx-aiohttp`);
- `aiohttp_direct`: aiohttp's client alone, behind the three calls the pool makes;
- `auto` (the default): `asyncio`, except while respx mocks httpx (respx patches httpcore,
  which only the `httpx` transport calls), then `httpx`.
Why that default: a turn needs one POST of bytes already encoded and one body read whole;
every general client spends more CPU on that than the rest of the engine's turn (bench,
512 x 8 turns: the bare loop on the pool costs ~36 us/turn on `asyncio`, ~117 on
`aiohttp_direct`, over 1 ms on `httpx`), and it needs no package. The engine reads only
status, headers and body, so nothing of httpx's API is lost to it; httpx event hooks still
see every request and reply, and respx-mocked tests keep httpx by themselves.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import math
import random
import ssl
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import httpx

from engine.aio import Gate, within
from engine.config import HTTP_TRANSPORTS as TRANSPORTS
from engine.config import EngineConfig, RetryPolicy
from engine.sglang.http1 import (
    AsyncioClient,
    BodySource,
    Hooks,
    RawResponse,
    ReplyTooLarge,
    RequestTimeout,
    declared_length,
    json_body,
    request_hooks,
    response_hooks,
)
from engine.sglang.wire import (
    Failure,
    Reply,
    RequestBody,
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
SHARD_CONNECTIONS = 4
RETRY_AFTER_SPREAD = 0.1  # up to +10 %: samples told the same Retry-After do not all return at once
PROBE_TIMEOUT = 5.0  # seconds for all model-info requests at start-up
INFO_PATHS = ("/model_info", "/get_model_info", "/server_info", "/get_server_info")
VOCAB_PADDING = 1024  # embeddings are padded past the tokenizer (Qwen3: 267 ids); more means another model



async def _read_capped(chunks: Any, status: int, limit: int) -> bytes:
    """Join an async iterator of byte chunks, raising `ReplyTooLarge` once it passes `limit`."""
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise ReplyTooLarge(status, limit)
        parts.append(chunk)
    return b"".join(parts)


def respx_active() -> bool:
    """True while a respx mock patches httpx (checked without importing respx)."""
    if "respx" not in sys.modules:
        return False
    try:
        from respx.mocks import Mocker

        return any(mocker.routers for mocker in Mocker.registry.values())
    except Exception:  # another respx version: assume it may be mocking
        return True


def resolve_transport(name: str) -> str:
    """The transport a setting value gives (`auto` resolved); ValueError with the fix when it cannot be had."""
    if name not in TRANSPORTS:
        raise ValueError(f"engine_http_transport must be one of {', '.join(TRANSPORTS)}, not {name!r}")
    if name == "aiohttp" and importlib.util.find_spec("httpx_aiohttp") is None:
        raise ValueError("engine_http_transport=aiohttp needs the package httpx-aiohttp (pip install httpx-aiohttp)")
    if name == "aiohttp_direct" and importlib.util.find_spec("aiohttp") is None:
        raise ValueError("engine_http_transport=aiohttp_direct needs the package aiohttp (pip install aiohttp)")
    if name == "auto":
        return "httpx" if respx_active() else "asyncio"
    return name


def _transient_errors() -> tuple[type[BaseException], ...]:
    """Exceptions of a request that mean "try again": httpx's, and aiohttp's it does not map."""
    errors: tuple[type[BaseException], ...] = (httpx.RequestError,)
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        errors += (aiohttp.ClientError,)
    return errors


class HttpPool:
    """Every HTTP request of one event loop's samples, on one of two transports.

    httpx's own transport: many small clients instead of one big one. httpcore's pool does
    work proportional to its size whenever a request starts or ends (a `poll()` per idle
    connection, a scan of every connection). With one client of 256 connections that is
    ~2 ms of CPU per request; with 64 clients of 4 it is ~0.7 ms. aiohttp's transport: one
    client, as aiohttp's connector does constant work per request. Requests beyond the
    pool's size wait on one semaphore, which wakes one waiter per free connection.
    """

    def __init__(
        self, max_connections: int, timeout: httpx.Timeout, per_shard: int = SHARD_CONNECTIONS, transport: str = "httpx",
        max_body: int = 1 << 30,
    ) -> None:
        self.transport = resolve_transport(transport)
        self.max_body = max_body  # a reply past it raises ReplyTooLarge: memory is bounded, not only time
        # One TLS context for all clients: httpx builds one per client otherwise, loading the CA
        # bundle each time (~15 ms and ~0.7 MiB per shard: 2 s and 90 MiB at 512 connections).
        tls = ssl.create_default_context()
        if self.transport == "asyncio":
            per_shard = max(1, max_connections)
            self.shards = [AsyncioClient(per_shard, timeout, tls)]  # type: ignore[list-item]
        elif self.transport == "aiohttp_direct":
            per_shard = max(1, max_connections)
            self.shards = [DirectClient(per_shard, timeout, tls)]  # type: ignore[list-item]
        elif self.transport == "aiohttp":
            per_shard = max(1, max_connections)
            self.shards = [_aiohttp_client(per_shard, timeout, tls)]
        else:
            count = max(1, math.ceil(max_connections / per_shard))
            limits = httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
            # trust_env=False: never route loopback or cluster traffic through a proxy from the env
            self.shards = [httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False, verify=tls)
                           for _ in range(count)]
        self._free = [i for i in range(len(self.shards)) for _ in range(per_shard)]  # one entry per connection
        self._gate = Gate(len(self._free))
        if self.transport in ("aiohttp", "aiohttp_direct"):
            import aiohttp  # noqa: F401  # loaded now, so its errors are among the transient ones
        self._errors = _transient_errors()

    async def request(self, method: str, url: str, *, limit: float | None = None, **kwargs: Any) -> RawResponse:
        """A request on a client with a free connection; returns with the body read.

        `limit` bounds the whole request in seconds once it holds a connection, from connect
        to the body's last byte (httpx's own timeouts are per read: a server dripping a byte
        at a time never trips them). Raises `RequestTimeout` when it passes, and `ReplyTooLarge`
        when the body declares or runs past `max_body` bytes (nothing more of it is read).
        """
        await self._gate.acquire()
        shard = self._free.pop()  # the gate guarantees one; LIFO reuses warm connections
        try:
            client = self.shards[shard]
            if isinstance(client, AsyncioClient):  # bounds the request itself: no timeout scope around it
                return await client.request(method, url, max_body=self.max_body, limit=limit, **kwargs)
            if callable(kwargs.get("content")):  # these clients hold the bytes while the request runs
                kwargs["content"] = kwargs["content"]()
            if isinstance(client, DirectClient):
                send = client.request(method, url, max_body=self.max_body, **kwargs)
            else:
                send = _httpx_request(client, method, url, self.max_body, **kwargs)
            if limit is None:
                return await send
            try:
                return await within(max(limit, 0.0), send)
            except (TimeoutError, asyncio.TimeoutError):  # two classes on Python 3.10
                raise RequestTimeout.after(limit) from None
        finally:
            self._free.append(shard)
            self._gate.release()

    async def post(self, url: str, *, limit: float | None = None, **kwargs: Any) -> RawResponse:
        """POST through `request`."""
        return await self.request("POST", url, limit=limit, **kwargs)

    def add_event_hook(self, kind: str, hook: Callable[..., Any]) -> None:
        """An httpx event hook ("request" or "response") on every client."""
        for client in self.shards:
            client.event_hooks[kind].append(hook)

    @property
    def transient_errors(self) -> tuple[type[BaseException], ...]:
        """What a failed request may raise that is worth a retry."""
        return self._errors

    async def aclose(self) -> None:
        """Close every client and its connections."""
        for client in self.shards:
            await client.aclose()


async def _httpx_request(client: httpx.AsyncClient, method: str, url: str, max_body: int, **kwargs: Any) -> RawResponse:
    """`client.request`, reading the body as a stream that stops at `max_body` bytes (decoded)."""
    response = await client.send(client.build_request(method, url, **kwargs), stream=True)
    try:
        declared = declared_length(response.headers.get("content-length"))
        if declared is not None and declared > max_body:
            raise ReplyTooLarge(response.status_code, max_body, declared)
        body = await _read_capped(response.aiter_bytes(), response.status_code, max_body)
    finally:
        await response.aclose()
    return RawResponse(response.status_code, response.headers, body)


def _aiohttp_client(connections: int, timeout: httpx.Timeout, tls: ssl.SSLContext) -> httpx.AsyncClient:
    """One httpx client whose requests go through an aiohttp session of `connections` connections."""
    import aiohttp
    from httpx_aiohttp import AiohttpTransport

    def session() -> aiohttp.ClientSession:  # made on first use, inside the event loop
        connector = aiohttp.TCPConnector(limit=connections, ssl=tls, keepalive_timeout=5.0)
        return aiohttp.ClientSession(connector=connector, trust_env=False)

    transport = AiohttpTransport(verify=tls, trust_env=False, client=session)
    return httpx.AsyncClient(transport=transport, timeout=timeout, trust_env=False)


class DirectClient:
    """aiohttp's client behind the few calls `HttpPool` makes of an `httpx.AsyncClient`.

    httpx's client machinery (request and URL objects, cookies, auth and redirect flows, byte
    streams) costs more CPU per request than aiohttp's whole client; this skips it. Redirects
    are never followed; the body is read whole; errors are aiohttp's (`HttpPool` retries them).
    httpx event hooks still work: while one is registered, each request and response is also
    built as an httpx object for it (a cost paid only then).
    """

    def __init__(self, connections: int, timeout: httpx.Timeout, tls: ssl.SSLContext) -> None:
        self.connections = connections
        self.tls = tls
        self.timeout = timeout
        self.event_hooks: Hooks = {"request": [], "response": []}
        self._session: Any = None

    def _open(self) -> Any:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=self.connections, ssl=self.tls, keepalive_timeout=5.0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout.connect, sock_read=self.timeout.read)
        # auto_decompress off: SGLang sends plain JSON; a compressed reply is no reason to inflate bombs
        return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False, auto_decompress=False)

    async def request(self, method: str, url: str, *, content: bytes | None = None, json: Any = None,
                      headers: dict[str, str] | None = None, max_body: int = 1 << 30) -> RawResponse:
        """Send and read the whole body, up to `max_body` bytes (`ReplyTooLarge` past it)."""
        if self._session is None:  # made on first use, inside the event loop
            self._session = self._open()
        if json is not None:
            (content, headers), json = json_body(json, headers), None
        request = await request_hooks(self.event_hooks, method, url, content, headers)
        async with self._session.request(method, url, data=content, json=json, headers=headers,
                                         allow_redirects=False) as response:
            declared = response.content_length
            if declared is not None and declared > max_body:
                raise ReplyTooLarge(response.status, max_body, declared)
            if declared is not None:  # the common case: read exactly what was declared, at once
                body = await response.read()
            else:  # chunked or until close: read in pieces, counting
                body = await _read_capped(response.content.iter_any(), response.status, max_body)
            raw = RawResponse(response.status, response.headers, body)
        await response_hooks(self.event_hooks, raw, request)
        return raw

    async def post(self, url: str, **kwargs: Any) -> RawResponse:
        """POST through `request`."""
        return await self.request("POST", url, **kwargs)

    async def aclose(self) -> None:
        """Close the session and its connections."""
        if self._session is not None:
            await self._session.close()


def make_http_client(cfg: EngineConfig) -> HttpPool:
    """The connection pool of one event loop's samples, sized, timed and carried as the settings say."""
    timeout = httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout)
    return HttpPool(cfg.max_connections, timeout, transport=cfg.http_transport, max_body=cfg.max_reply_bytes)


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
        request_timeout: float = 1800.0,
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
        deadline = loop.time() + self.retry.deadline
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
                    why += f" ({asked}{max(left, 0.0):.3g}s left of the {self.retry.deadline:g}s retry deadline)"
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
        except self.http.transient_errors as exc:  # connect, read, write, pool, protocol, timeouts
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
