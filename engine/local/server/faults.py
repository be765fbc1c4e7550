"""Fault injection for the embedded server: `serve --faults SPEC`.

A `FaultSpec` gives each fault kind a rate (the chance that one `/generate` request gets it)
and a seed. `fault_middleware` draws one decision per `/generate` request from a seeded RNG
and applies it, so a run with the same request order injects the same faults. Each kind
reproduces what a real SGLang server, router or network does to a client:

    http500     503 `{"object": "error", ..., "code": 503}` (queue full) or a plain 500
    reset       the connection is closed without a response
    stall       the answer comes after `stall_seconds` (longer than a client's timeout)
    malformed   200 with a JSON body cut in half
    no_meta     200 without `meta_info`
    abort       200 with finish_reason abort and only the first k of the tokens (k may be 0)
    context400  400 with SGLang's exact context-length message
    mismatch    200 whose `output_token_logprobs` has one entry less (or more) than `output_ids`

A SPEC is `kind=rate,...` plus optional `seed=N` and `stall_seconds=S`; the name of a preset
(`default`, `none`) stands for its settings, later keys override earlier ones:
`"default"`, `"default,seed=3"`, `"http500=0.05,reset=0.02,seed=7"`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
from aiohttp import web

from engine.local.server.protocol import input_too_long_message, request_too_long_message

KINDS = ("http500", "reset", "stall", "malformed", "no_meta", "abort", "context400", "mismatch")
_rate = attrs.validators.and_(attrs.validators.ge(0.0), attrs.validators.le(1.0))
QUEUE_FULL = {"object": "error", "message": "The request queue is full.", "type": "503", "param": None, "code": 503}
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _rate_field() -> Any:
    return attrs.field(default=0.0, converter=float, validator=_rate)


@attrs.frozen
class FaultSpec:
    """Per-request rates of each fault kind (their sum at most 1), a seed and the stall length."""

    http500: float = _rate_field()
    reset: float = _rate_field()
    stall: float = _rate_field()
    malformed: float = _rate_field()
    no_meta: float = _rate_field()
    abort: float = _rate_field()
    context400: float = _rate_field()
    mismatch: float = _rate_field()
    seed: int = attrs.field(default=0, converter=int)
    stall_seconds: float = attrs.field(default=3.0, converter=float, validator=attrs.validators.gt(0.0))

    def __attrs_post_init__(self) -> None:
        if self.total > 1.0 + 1e-9:
            raise ValueError(f"fault rates add up to {self.total:g}; at most 1 fault per request is drawn")

    @property
    def total(self) -> float:
        """The chance that a request gets some fault."""
        return sum(getattr(self, k) for k in KINDS)

    def rates(self) -> dict[str, float]:
        """The non-zero rates, by kind."""
        return {k: getattr(self, k) for k in KINDS if getattr(self, k)}

    def format(self) -> str:
        """The SPEC string that parses back to this spec."""
        parts = [f"{k}={v:g}" for k, v in self.rates().items()]
        return ",".join([*parts, f"seed={self.seed}", f"stall_seconds={self.stall_seconds:g}"])

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """Read a SPEC string (see the module docstring); raises ValueError naming the problem."""
        values: dict[str, str] = {}
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            if "=" not in part:
                if part not in PRESETS:
                    raise ValueError(f"unknown fault preset {part!r}; presets: {', '.join(PRESETS)}")
                values.update({k: str(v) for k, v in attrs.asdict(PRESETS[part]).items()})
                continue
            key, value = (s.strip() for s in part.split("=", 1))
            if key not in attrs.fields_dict(cls):
                raise ValueError(f"unknown fault key {key!r}; known: {', '.join(attrs.fields_dict(cls))}")
            values[key] = value
        try:
            return cls(**values)  # type: ignore[arg-type]  # the converters take strings
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad fault spec {text!r}: {exc}") from None


PRESETS: dict[str, FaultSpec] = {
    "none": FaultSpec(),
    "default": FaultSpec(http500=0.05, reset=0.02, stall=0.01, malformed=0.02, no_meta=0.01, abort=0.03,
                         context400=0.01, mismatch=0.02, seed=7),
}


@attrs.define(eq=False)
class FaultInjector:
    """Draws and applies faults; `counts` says how many of each kind were actually injected.

    Lives on the server's event loop: draws happen in request arrival order, no lock needed.
    `decode` rebuilds the `text` of a cut (aborted) reply from its remaining ids.
    """

    spec: FaultSpec
    decode: Callable[[list[int]], str]
    counts: collections.Counter[str] = attrs.Factory(collections.Counter)
    _rng: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._rng = random.Random(self.spec.seed)

    def draw(self) -> str | None:
        """The fault for the next request, or None. One uniform draw over the cumulative rates."""
        u, edge = self._rng.random(), 0.0
        for kind in KINDS:
            edge += getattr(self.spec, kind)
            if u < edge:
                return kind
        return None

    async def inject(self, kind: str, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Answer `request` with fault `kind` (calling the real handler where the fault needs a reply)."""
        body = await request.read()  # the whole request is in before we misbehave
        if kind == "http500":
            self.counts[kind] += 1
            if self._rng.random() < 0.5:
                return web.json_response(QUEUE_FULL, status=503)
            return web.Response(status=500, text="Internal Server Error")
        if kind == "reset":
            self.counts[kind] += 1
            if request.transport is not None:
                request.transport.close()
            return web.Response(status=500)  # never written: aiohttp drops it on a closed transport
        if kind == "stall":
            self.counts[kind] += 1
            await asyncio.sleep(self.spec.stall_seconds)  # a client that gave up cancels us here
            return await handler(request)
        if kind == "context400":
            self.counts[kind] += 1
            return web.json_response({"error": {"message": _context_message(body)}}, status=400)
        response = await handler(request)
        changed = self._rewrite(kind, response)
        if changed is None:
            return response  # an error reply already: nothing of ours to add
        self.counts[kind] += 1
        return changed

    def _rewrite(self, kind: str, response: web.StreamResponse) -> web.Response | None:
        """The 200 reply with fault `kind` applied to its body, or None if it was not a 200 JSON reply."""
        if not isinstance(response, web.Response) or response.status != 200 or not isinstance(response.body, bytes):
            return None
        raw = response.body
        if kind == "malformed":
            return web.Response(status=200, body=raw[: len(raw) // 2], content_type="application/json")
        data = json.loads(raw)
        for item in data if isinstance(data, list) else [data]:
            {"no_meta": _drop_meta, "abort": self._abort, "mismatch": _mismatch}[kind](item)
        return web.json_response(data)

    def _abort(self, item: dict[str, Any]) -> None:
        """Keep a random prefix of the tokens and say the request was aborted, as SGLang does."""
        meta = item["meta_info"]
        ids = item.get("output_ids") or []
        keep = self._rng.randint(0, len(ids))
        item["output_ids"] = ids[:keep]
        item["text"] = self.decode(ids[:keep])
        meta["finish_reason"] = dict(ABORTED)
        meta["completion_tokens"] = keep
        if "output_token_logprobs" in meta:
            meta["output_token_logprobs"] = meta["output_token_logprobs"][:keep]
            meta["output_token_logprobs_length"] = keep
        for span in meta.get("weight_versions") or []:
            span["end"] = min(span.get("end", keep), keep)


def _drop_meta(item: dict[str, Any]) -> None:
    item.pop("meta_info", None)


def _mismatch(item: dict[str, Any]) -> None:
    """One logprob entry less than there are ids; with no ids, one more (SGLang's max_new_tokens=0 quirk)."""
    meta = item["meta_info"]
    entries = meta.get("output_token_logprobs") or []
    entries = entries[:-1] if entries else [[-0.5, 0, None]]
    meta["output_token_logprobs"] = entries
    meta["output_token_logprobs_length"] = len(entries)


def _context_message(body: bytes) -> str:
    """SGLang's context-length message for this request, as if the context were one token too small."""
    try:
        payload = json.loads(body)
        n_input = len(payload.get("input_ids") or [])
        requested = (payload.get("sampling_params") or {}).get("max_new_tokens")
    except (ValueError, AttributeError, TypeError):
        n_input, requested = 0, None
    if isinstance(requested, int) and requested > 0:
        return request_too_long_message(n_input, requested, n_input + requested - 1)
    return input_too_long_message(n_input, max(1, n_input - 1))


FAULTS = web.AppKey("embedded_sglang_faults", FaultInjector)


def fault_middleware(injector: FaultInjector) -> Any:
    """An aiohttp middleware that applies `injector`'s decision to every `/generate` request."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path != "/generate" or request.method not in ("POST", "PUT"):
            return await handler(request)
        kind = injector.draw()
        if kind is None:
            return await handler(request)
        return await injector.inject(kind, request, handler)

    return middleware
