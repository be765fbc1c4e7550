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
import random
from typing import Any

import attrs
import httpx

from engine.config import EngineConfig, RetryPolicy
from engine.wire import Failure, Reply, error_message, generate_payload, is_context_error, parse_reply

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
ROUTING_HEADER = "X-SMG-Routing-Key"


def make_http_client(cfg: EngineConfig) -> httpx.AsyncClient:
    """One pooled client for all samples of an event loop; never reads proxies from the env."""
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=cfg.max_connections, max_keepalive_connections=cfg.max_connections),
        timeout=httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout),
        trust_env=False,
    )


class SGLangClient:
    """Posts token-in/token-out `/generate` requests to an SGLang server or router."""

    def __init__(
        self,
        base_url: str,
        http: httpx.AsyncClient,
        retry: RetryPolicy,
        *,
        rng: random.Random | None = None,
        max_in_flight: int | None = None,
    ) -> None:
        self.url = base_url.rstrip("/") + "/generate"
        self.http = http
        self.retry = retry
        self._rng = rng or random.Random()
        self.retries_spent = 0  # over the client's life, for soak reports
        # Requests beyond the pool's size wait here rather than in httpcore's pool: httpcore
        # rescans every queued request against every connection whenever a request starts or
        # ends (O(queued x connections) each time), which with thousands of samples in flight
        # costs milliseconds per request and stalls the event loop for seconds. An asyncio
        # semaphore as wide as the pool wakes one waiter per release. None: no gate.
        self._in_flight = asyncio.Semaphore(max_in_flight) if max_in_flight else None

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        max_new_tokens: int | None,
        *,
        routing_key: str | None = None,
        rid: str | None = None,
    ) -> Reply | Failure:
        """One generation turn, retried while the failure is transient."""
        payload = generate_payload(input_ids, sampling_params, max_new_tokens, rid)
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
            if self._in_flight is None:
                response = await self.http.post(self.url, json=payload, headers=headers)
            else:
                async with self._in_flight:  # post() returns with the body read: the connection is free
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

