"""Figures 1 and 6: samples through the engine against the canned server, next to every floor.

The floors send exactly the requests the engine sends: they are captured from one warm-up
sample (the bytes put on the wire, decoded back to the payload dicts), so prompt, growing
`input_ids`, sampling params and the routing header are identical. Each floor does what any
client must and nothing else (no machine, no reply parsing, no tokenizer):

- the bare httpx loop: `post(json=...)` on httpx's own client and transport (httpcore), as
  many small clients of 4 connections each (httpcore's pool does work per request that grows
  with its size: this is the fastest way to use it);
- the bare loop on the engine's pool: the same loop on the engine's own `HttpPool` (httpx's
  client over the engine's transport), so it and the engine differ by the engine's work alone;
- the bare loop on the engine's transport: the same requests handed to the transport directly,
  without httpx's client, so it and the loop on the pool differ by what httpx's public
  `AsyncClient.send` costs (the engine pays it: it touches nothing private of httpx);
- the bare aiohttp loop: aiohttp's own client, bodies encoded once: the fastest general client.

Both engine and floors hold their concurrency slot for a whole sample, as slime's semaphore
does; every side runs once per repeat, in an order rotated repeat by repeat so drift on a
shared machine does not always favour the same side.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import httpx

from engine.aio import Gate
from engine.settings import EngineConfig
from engine.local.bench.common import Figure, Sizes, instant_interpreter, median
from engine.local.bench.server import ROUTING_HEADER, CannedServer
from engine.local.sample import Sample
from engine.loop.runtime import Runtime, full_collections
from engine.sglang.client import IDENTITY, make_http_client
from engine.sglang.http1 import AsyncioTransport
from engine.sglang.wire import dumps
from engine.slime import run_sample
from engine.slime.sample_io import engine_metadata

PROMPT = "What is 0.5 + 0.5? Check it with Python before you answer."
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 1024, "no_stop_trim": True, "skip_special_tokens": False}
ENGINE, BARE_HTTPX, BARE_CHOSEN, BARE_AIOHTTP = "engine", "bare_httpx", "bare_chosen", "bare_aiohttp"
BARE_TRANSPORT = "bare_transport"
TRANSPORT = "httpx's public client over the engine's transport"  # what the engine's requests go through
HTTPX_SHARD = 4  # connections per client of the bare httpx loop


def bench_config(url: str, *, turns: int, connections: int, tool_concurrency: int | None = None) -> EngineConfig:
    """Settings that let every sample take exactly `turns` turns (T-1 tool calls, then the answer);
    `tool_concurrency` None: the engine's default."""
    return EngineConfig(
        server_url=url, profile="retool", max_turns=turns, max_tool_calls=max(turns, 1),
        max_connections=connections, tool_concurrency=tool_concurrency,
    )


@attrs.define
class Run:
    """One timed pass: wall and CPU seconds of this process, the server's CPU, what came out."""

    wall: float
    cpu: float
    server_cpu: float
    samples: int
    statuses: dict[str, int] = attrs.field(factory=dict)
    turns: dict[int, int] = attrs.field(factory=dict)  # turns taken -> samples (engine only)
    errors: int = 0  # floors only: non-200 replies
    tool_errors: int = 0  # engine only: tool calls that came back with an error kind
    max_stall: float = 0.0  # seconds, when a ticker ran, while samples were in flight
    drain_collect: float = 0.0  # seconds of the engine's full collection once the last sample left


async def _ticker(stop: asyncio.Event, period: float = 0.001) -> list[tuple[float, float]]:
    """Sleep `period` over and over; return every interval between two wake-ups."""
    gaps = []
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(period)
        now = time.perf_counter()
        gaps.append((last, now))
        last = now
    return gaps


def in_flight_stall(gaps: list[tuple[float, float]], drains: list[float]) -> float:
    """The longest gap but those during which the last sample left (its drain's collection)."""
    return max((end - start for start, end in gaps if not any(start <= t <= end for t in drains)), default=0.0)


async def _timed(server: CannedServer, work: Callable[[], Awaitable[None]], *, tick: bool) -> tuple[float, float, float, float, float]:
    """(wall, cpu, server cpu, max stall while samples were in flight, drain collection) of `work()`.

    With `tick`, a ticker runs beside the work. The engine defers full collections until its
    last sample leaves, then runs one if due: that gap is reported apart, as the drain's.
    """
    stop = asyncio.Event()
    ticker = asyncio.create_task(_ticker(stop)) if tick else None
    await asyncio.sleep(0)  # let the ticker take its first timestamp before the burst starts
    server0, cpu0, wall0 = server.cpu_seconds(), time.process_time(), time.perf_counter()
    await work()
    wall, cpu, server_cpu = time.perf_counter() - wall0, time.process_time() - cpu0, server.cpu_seconds() - server0
    stop.set()
    gaps = await ticker if ticker is not None else []
    drains = [(at, took) for at, took in full_collections.drains if at >= wall0]
    return wall, cpu, server_cpu, in_flight_stall(gaps, [at for at, _ in drains]), max((t for _, t in drains), default=0.0)


async def run_engine(rt: Runtime, server: CannedServer, n: int, concurrency: int, tag: str, *, tick: bool = False) -> Run:
    """Roll `n` samples out through `run_sample` (the slime adapter), `concurrency` at a time."""
    slots = asyncio.Semaphore(concurrency)
    samples = [Sample(index=i, prompt=PROMPT, session_id=f"{tag}-{i}") for i in range(n)]

    async def one(sample: Sample) -> None:
        async with slots:
            await run_sample(rt, sample, SAMPLING)

    async def work() -> None:
        await asyncio.gather(*(one(s) for s in samples))

    wall, cpu, server_cpu, stall, drain = await _timed(server, work, tick=tick)
    statuses = collections.Counter(s.status.name for s in samples)
    turns = collections.Counter(len(engine_metadata(s).get("turns", [])) for s in samples)
    tool_errors = sum(sum((engine_metadata(s).get("tool_stats") or {}).get("errors", {}).values()) for s in samples)
    return Run(wall, cpu, server_cpu, n, dict(statuses), dict(turns), tool_errors=tool_errors, max_stall=stall,
               drain_collect=drain)


async def run_floor(http: Any, url: str, payloads: list[dict[str, Any]], server: CannedServer,
                    n: int, concurrency: int, tag: str, *, connections: int, tick: bool = False) -> Run:
    """The same request sequence per sample with nothing but the HTTP client: post, read, next turn.

    `http` is the engine's own `HttpPool`, an `HttpxFloor` or a `TransportFloor`: anything with an httpx-style
    `post`. The body is `json=`, as a user writes it first.
    """
    slots = asyncio.Semaphore(concurrency)
    errors = 0

    async def one(i: int) -> None:
        nonlocal errors
        headers = {ROUTING_HEADER: f"{tag}-{i}"}
        async with slots:
            for payload in payloads:
                response = await http.post(url, json=payload, headers=headers)
                errors += response.status_code != 200

    async def work() -> None:
        await asyncio.gather(*(one(i) for i in range(n)))

    wall, cpu, server_cpu, stall, _ = await _timed(server, work, tick=tick)
    return Run(wall, cpu, server_cpu, n, {"OK": n} if not errors else {"HTTP_ERRORS": errors}, errors=errors, max_stall=stall)


class HttpxFloor:
    """httpx's own client and transport, as many small clients: `post` on one with a free connection."""

    def __init__(self, connections: int, timeout: httpx.Timeout) -> None:
        count = max(1, math.ceil(connections / HTTPX_SHARD))
        limits = httpx.Limits(max_connections=HTTPX_SHARD, max_keepalive_connections=HTTPX_SHARD)
        self.clients = [httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) for _ in range(count)]
        self._free = [i for i in range(count) for _ in range(HTTPX_SHARD)]  # one entry per connection
        self._gate = Gate(len(self._free))

    async def post(self, url: str, **kwargs: Any) -> httpx.Response:
        """`post` on a client with a free connection (the last freed first: its connection is warm)."""
        await self._gate.acquire()
        shard = self._free.pop()
        try:
            return await self.clients[shard].post(url, **kwargs)
        finally:
            self._free.append(shard)
            self._gate.release()

    async def aclose(self) -> None:
        """Close every client."""
        for client in self.clients:
            await client.aclose()


class TransportFloor:
    """The engine's transport called directly (`handle_async_request`), no client above it."""

    def __init__(self, connections: int, timeout: httpx.Timeout) -> None:
        self.transport = AsyncioTransport(connections)
        self.gate = Gate(connections)
        self.timeouts = timeout.as_dict()

    async def post(self, url: str, *, json: Any, headers: dict[str, str]) -> httpx.Response:
        """The request the pool would build, sent by the transport, its body read."""
        request = httpx.Request("POST", url, headers={**IDENTITY, "Content-Type": "application/json", **headers},
                                content=dumps(json), extensions={"timeout": self.timeouts})
        await self.gate.acquire()
        try:
            response = await self.transport.handle_async_request(request)
            await response.aread()
            return response
        finally:
            self.gate.release()

    async def aclose(self) -> None:
        await self.transport.aclose()


class AiohttpFloor:
    """The floor's loop over aiohttp's own client, bodies encoded once: the transport's limit."""

    def __init__(self, connections: int) -> None:
        self.connections = connections
        self.session: Any = None

    async def run(self, url: str, payloads: list[dict[str, Any]], server: CannedServer, n: int, concurrency: int,
                  tag: str, *, tick: bool = False) -> Run:
        import aiohttp

        if self.session is None:  # made inside the loop; kept across repeats, as the other floors keep theirs
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.connections))
        session = self.session
        slots = asyncio.Semaphore(concurrency)
        errors = 0
        bodies = [json.dumps(p).encode() for p in payloads]  # encoded once: this row is about the transport

        async def one(i: int) -> None:
            nonlocal errors
            headers = {ROUTING_HEADER: f"{tag}-{i}", "Content-Type": "application/json"}
            async with slots:
                for body in bodies:
                    async with session.post(url, data=body, headers=headers) as response:
                        await response.read()
                        errors += response.status != 200

        async def work() -> None:
            await asyncio.gather(*(one(i) for i in range(n)))

        wall, cpu, server_cpu, stall, _ = await _timed(server, work, tick=tick)
        return Run(wall, cpu, server_cpu, n, {"OK": n} if not errors else {"HTTP_ERRORS": errors}, errors=errors,
                   max_stall=stall)

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()


async def capture_requests(cfg: EngineConfig, tokenizer: Any, tag: str) -> list[dict[str, Any]]:
    """Roll one sample out and keep every `/generate` payload it sent, in order."""
    captured: list[bytes] = []

    async def keep(request: httpx.Request) -> None:
        captured.append(await request.aread())

    http = make_http_client(cfg)
    http.add_event_hook("request", keep)
    rt = Runtime.create(cfg, tokenizer=tokenizer, http=http)
    try:
        sample = Sample(index=0, prompt=PROMPT, session_id=f"{tag}-capture")
        await run_sample(rt, sample, SAMPLING)
    finally:
        await rt.aclose()
    if sample.status.name != "COMPLETED":
        raise RuntimeError(f"warm-up sample ended {sample.status.name}: {engine_metadata(sample).get('engine_error')}")
    return [json.loads(body) for body in captured if body]


@attrs.define
class Sides:
    """Every side's runs of one measurement, repeat by repeat, by side name."""

    runs: dict[str, list[Run]]
    requests_per_sample: int


SIDES = [ENGINE, BARE_HTTPX, BARE_CHOSEN, BARE_TRANSPORT, BARE_AIOHTTP]


async def measure_sides(server: CannedServer, tokenizer: Any, *, scenario: str, samples: int, turns: int,
                        concurrency: int, connections: int, repeats: int, tick: bool,
                        sides: list[str] | None = None) -> Sides:
    """Warm every side, then run each once per repeat in a rotated order."""
    names = sides or SIDES
    cfg = bench_config(server.url(scenario), turns=turns, connections=connections)
    payloads = await capture_requests(cfg, tokenizer, f"{scenario}-w")
    if len(payloads) != turns:
        raise RuntimeError(f"the warm-up sample sent {len(payloads)} requests, expected {turns}")
    url = cfg.server_url + "/generate"
    engines = {ENGINE: Runtime.create(cfg, tokenizer=tokenizer)}
    timeout = httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout)
    pools: dict[str, Any] = {BARE_HTTPX: HttpxFloor(connections, timeout), BARE_CHOSEN: make_http_client(cfg),
                             BARE_TRANSPORT: TransportFloor(connections, timeout)}
    aio = AiohttpFloor(connections)

    async def run_side(name: str, n: int, tag: str, ticking: bool) -> Run:
        if name in engines:
            return await run_engine(engines[name], server, n, concurrency, tag, tick=ticking)
        if name == BARE_AIOHTTP:
            return await aio.run(url, payloads, server, n, concurrency, tag, tick=ticking)
        return await run_floor(pools[name], url, payloads, server, n, concurrency, tag, connections=connections,
                               tick=ticking)

    result = Sides({name: [] for name in names}, len(payloads))
    try:
        for name in names:  # open the connections every side will reuse
            await run_side(name, min(samples, concurrency), f"{scenario}-w{name}", False)
        for i in range(repeats):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                result.runs[name].append(await run_side(name, samples, f"{scenario}-{name}-{i}", tick))
    finally:
        for rt in engines.values():
            await rt.aclose()
        for pool in pools.values():
            await pool.aclose()
        await aio.aclose()
    return result


def _summary(runs: list[Run], turns: int) -> dict[str, Any]:
    n = runs[0].samples if runs else 0
    return {
        "samples_per_s": median([r.samples / r.wall for r in runs]),
        "wall_s": median([r.wall for r in runs]),
        "cpu_us_per_turn": median([r.cpu / (r.samples * turns) * 1e6 for r in runs]),
        "server_cpu_share": median([r.server_cpu / r.wall for r in runs]),  # ~1.0: the server was saturated
        "max_stall_ms": median([r.max_stall * 1e3 for r in runs]),
        "drain_collect_ms": median([r.drain_collect * 1e3 for r in runs]),
        "statuses": runs[-1].statuses if runs else {},
        "turns_taken": runs[-1].turns if runs else {},
        "samples": n,
    }


async def rollout_figures(server: CannedServer, tokenizer: Any, sizes: Sizes) -> list[Figure]:
    """Figure 1: the engine's CPU per turn and throughput against every floor, same requests, same server."""
    with instant_interpreter():
        sides = await measure_sides(
            server, tokenizer, scenario="tool", samples=sizes.samples, turns=sizes.turns,
            concurrency=sizes.concurrency, connections=sizes.concurrency, repeats=sizes.repeats, tick=False,
        )
    s = {name: _summary(runs, sizes.turns) for name, runs in sides.runs.items()}
    engine, httpx_floor, aio = s[ENGINE], s[BARE_HTTPX], s[BARE_AIOHTTP]
    chosen = s[BARE_CHOSEN]
    shape = f"{sizes.samples} samples x {sizes.turns} turns, concurrency {sizes.concurrency}"
    cpu = "cpu_us_per_turn"
    figures = [
        Figure("rollout_cpu_per_turn", f"engine CPU per turn ({TRANSPORT}; {shape})", engine[cpu], "us",
               httpx_floor[cpu], "bare httpx loop", "ratio", "<=", 0.5, sizes.repeats,
               {"engine_only_us_per_turn": engine[cpu] - chosen[cpu], "transport": TRANSPORT}),
        Figure("rollout_cpu_vs_aiohttp", "engine CPU per turn against the fastest general client", engine[cpu], "us",
               aio[cpu], "bare aiohttp loop", "ratio", "<=", 2.5, sizes.repeats),
        Figure("rollout_throughput", "rollout throughput", engine["samples_per_s"], "samples/s",
               httpx_floor["samples_per_s"], "bare httpx loop", "ratio", ">=", 3.0, sizes.repeats,
               {name: {k: v for k, v in summary.items() if k != "samples"} for name, summary in s.items()}),
        Figure("floor_chosen", "floor: bare loop on the engine's pool (httpx's client, the engine's transport)",
               chosen[cpu], "us", httpx_floor[cpu],
               "bare httpx loop", None, None, None, sizes.repeats),
        Figure("floor_transport", "floor: bare loop on the engine's transport, without httpx's client",
               s[BARE_TRANSPORT][cpu], "us", chosen[cpu], "bare loop on the engine's pool", None, None, None,
               sizes.repeats, {"httpx_client_us_per_turn": chosen[cpu] - s[BARE_TRANSPORT][cpu]}),
        Figure("floor_aiohttp", "floor: bare aiohttp loop (bodies encoded once)", aio[cpu], "us", httpx_floor[cpu],
               "bare httpx loop", None, None, None, sizes.repeats),
    ]
    return figures


async def scale_figure(server: CannedServer, tokenizer: Any, sizes: Sizes, repeats: int) -> list[Figure]:
    """Figure 6: the longest event-loop stall with thousands of samples in flight at once.

    All samples start together and share figure 1's pool (256 connections; 32 with --small),
    so most of them wait for a connection in the pool. The engine's stall is judged against
    the bare loop on the same transport; the bare httpx loop's is shown beside it. The
    engine's full collection, deferred until its last sample has left, is a row of its own:
    nothing is in flight while it runs.
    """
    figures = []
    turns = sizes.scale_turns
    for n in sizes.scale_samples:
        names = [ENGINE, BARE_HTTPX, BARE_CHOSEN]
        with instant_interpreter():
            sides = await measure_sides(
                server, tokenizer, scenario="scale", samples=n, turns=turns, concurrency=n,
                connections=sizes.concurrency, repeats=repeats, tick=True, sides=names,
            )
        s = {name: _summary(runs, turns) for name, runs in sides.runs.items()}
        same = s[BARE_CHOSEN]
        figures.append(Figure(
            f"scale_stall_{n}", f"longest loop stall, {n} samples in flight ({turns} turns)",
            s[ENGINE]["max_stall_ms"], "ms", same["max_stall_ms"], "bare loop on the engine's pool", "ratio", "<=", 1.0,
            repeats, {"bare_httpx_stall_ms": s[BARE_HTTPX]["max_stall_ms"],
                      **{name: {k: v for k, v in summary.items() if k != "samples"} for name, summary in s.items()}},
        ))
        figures.append(Figure(
            f"scale_drain_{n}", f"the engine's deferred full collection, once the last of {n} samples left",
            s[ENGINE]["drain_collect_ms"], "ms", None, "", None, None, None, repeats,
        ))
    return figures
