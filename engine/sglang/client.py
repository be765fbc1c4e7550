"""The SGLang HTTP client: one shared connection pool, bounded retries, no exceptions out.

`SGLangClient.generate` returns a `Reply` or a `Failure`; it raises only on cancellation.
Transient failures (connect/read errors, timeouts, 408, 429, 5xx, a body that is not
JSON) are retried with exponential backoff and full jitter, bounded in attempts and in
total time. Other 4xx are final: a context-length 400 becomes `context_exceeded`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import ssl
from collections.abc import Callable
from typing import Any

import attrs
import httpx

from engine.config import EngineConfig, RetryPolicy
from engine.sglang.wire import Failure, Reply, error_message, generate_payload, is_context_error, parse_reply

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
ROUTING_HEADER = "X-SMG-Routing-Key"
SHARD_CONNECTIONS = 4


class HttpPool:
    """Many small httpx clients instead of one big one, for every sample of an event loop.

    httpcore's pool does work proportional to its size whenever a request starts or ends
    (a `poll()` per idle connection, a scan of every connection). With one client of 256
    connections that is ~2 ms of CPU per request; with 64 clients of 4 it is ~0.7 ms
    (measured side by side against a loopback server). Requests beyond the pool's size
    wait on one semaphore, which wakes one waiter per free connection, not in httpcore's
    queue, which is rescanned on every event.
    """

    def __init__(self, max_connections: int, timeout: httpx.Timeout, per_shard: int = SHARD_CONNECTIONS) -> None:
        count = max(1, math.ceil(max_connections / per_shard))
        limits = httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
        # One TLS context for all shards: httpx builds one per client otherwise, loading the CA
        # bundle each time (~15 ms and ~0.7 MiB per shard: 2 s and 90 MiB at 512 connections).
        tls = ssl.create_default_context()
        # trust_env=False: never route loopback or cluster traffic through a proxy from the env
        self.shards = [httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False, verify=tls)
                       for _ in range(count)]
        self._free = [i for i in range(count) for _ in range(per_shard)]  # one entry per connection
        self._gate = asyncio.Semaphore(len(self._free))

    async def post(self, url: str, **kwargs: Any) -> httpx.Response:
        """POST on a shard with a free connection; returns with the body read."""
        async with self._gate:
            shard = self._free.pop()  # the gate guarantees one; LIFO reuses warm connections
            try:
                return await self.shards[shard].post(url, **kwargs)
            finally:
                self._free.append(shard)

    def add_event_hook(self, kind: str, hook: Callable[..., Any]) -> None:
        """An httpx event hook ("request" or "response") on every shard."""
        for client in self.shards:
            client.event_hooks[kind].append(hook)

    async def aclose(self) -> None:
        for client in self.shards:
            await client.aclose()


def make_http_client(cfg: EngineConfig) -> HttpPool:
    """The connection pool of one event loop's samples, sized and timed by the settings."""
    return HttpPool(cfg.max_connections, httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout))


class SGLangClient:
    """Posts token-in/token-out `/generate` requests to an SGLang server or router."""

    def __init__(self, base_url: str, http: HttpPool, retry: RetryPolicy, *, rng: random.Random | None = None) -> None:
        self.url = base_url.rstrip("/") + "/generate"
        self.http = http
        self.retry = retry
        self._rng = rng or random.Random()
        self.retries_spent = 0  # over the client's life, for soak reports

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        max_new_tokens: int | None,
        *,
        routing_key: str | None = None,
        rid: str | None = None,
        routed_experts_start: int | None = None,
    ) -> Reply | Failure:
        """One generation turn, retried while the failure is transient.

        `routed_experts_start` asks for routed experts (routing replay) from that row on.
        """
        payload = generate_payload(input_ids, sampling_params, max_new_tokens, rid, routed_experts_start)
        headers = {ROUTING_HEADER: str(routing_key)} if routing_key else None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry.deadline
        attempt = 0
        while True:
            attempt += 1
            outcome = await self._post_once(payload, headers)
            if isinstance(outcome, (Reply, Failure)):
                return attrs.evolve(outcome, attempts=attempt) if isinstance(outcome, Failure) else outcome
            last_error = outcome  # a message: transient
            delay = self.retry.delay(attempt, self._rng.random())
            if attempt >= self.retry.max_attempts or loop.time() + delay > deadline:
                return Failure("unavailable", f"gave up after {attempt} attempt(s): {last_error}", attempts=attempt)
            self.retries_spent += 1
            log.debug("retrying /generate in %.2fs after: %s", delay, last_error)
            await asyncio.sleep(delay)

    async def _post_once(self, payload: dict[str, Any], headers: dict[str, str] | None) -> Reply | Failure | str:
        """One POST. Returns a final outcome, or a string describing a transient failure."""
        try:
            response = await self.http.post(self.url, json=payload, headers=headers)
        except httpx.TransportError as exc:  # connect, read, write, pool, protocol, timeouts
            return f"{type(exc).__name__}: {exc}"
        status = response.status_code
        if status in RETRY_STATUSES:
            return f"HTTP {status}: {error_message(response.content)}"
        if status != 200:
            message = error_message(response.content)
            kind = "context_exceeded" if is_context_error(status, message) else "rejected"
            return Failure(kind, message, status)
        try:
            data = json.loads(response.content)
        except ValueError:
            return f"body is not JSON: {response.content[:80]!r}"
        return parse_reply(data)

