"""Figures 1 and 6: samples through the engine against the canned server, next to a bare httpx loop.

The floor sends exactly the requests the engine sends: they are captured from one warm-up
sample (the bytes httpx put on the wire, decoded back to the payload dicts), so prompt,
growing `input_ids`, sampling params and the routing header are identical. The floor
then does what any client must (one pooled `httpx.AsyncClient` made by the engine's own
`make_http_client`, a wait for a free connection as the engine's client waits, then
`post(json=...)` with the body read) and nothing else: no machine, no reply parsing, no
tokenizer. Both sides hold their concurrency slot for a whole sample, as slime's
semaphore does; engine and floor alternate repeat by repeat.

Figure 1 also runs the floor's loop over aiohttp's client once per repeat. It is not a
floor the target uses (the engine speaks httpx); it shows how much of the floor is the
HTTP client itself.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import httpx

from engine.local.bench.common import Figure, Sizes, instant_interpreter, median
from engine.local.bench.server import ROUTING_HEADER, CannedServer
from engine.sglang.client import make_http_client
from engine.config import EngineConfig
from engine.loop.runtime import Runtime
from engine.local.sample import Sample
from engine.slime.sample_io import engine_metadata
from engine.slime import run_sample

PROMPT = "What is 0.5 + 0.5? Check it with Python before you answer."
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 1024, "no_stop_trim": True, "skip_special_tokens": False}


def bench_config(url: str, *, turns: int, connections: int, tool_concurrency: int = 32) -> EngineConfig:
    """Settings that let every sample take exactly `turns` turns (T-1 tool calls, then the answer)."""
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
    errors: int = 0  # floor only: non-200 replies
    tool_errors: int = 0  # engine only: tool calls that came back with an error kind
    max_stall: float = 0.0  # seconds, when a ticker ran


async def _ticker(stop: asyncio.Event, period: float = 0.001) -> float:
    """Sleep `period` over and over; return the longest interval between two wake-ups."""
    worst = 0.0
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(period)
        now = time.perf_counter()
        worst = max(worst, now - last)
        last = now
    return worst


async def _timed(server: CannedServer, work: Callable[[], Awaitable[None]], *, tick: bool) -> tuple[float, float, float, float]:
    """(wall, cpu, server cpu, max stall) of `work()`, optionally with a stall ticker beside it."""
    stop = asyncio.Event()
    ticker = asyncio.create_task(_ticker(stop)) if tick else None
    await asyncio.sleep(0)  # let the ticker take its first timestamp before the burst starts
    server0, cpu0, wall0 = server.cpu_seconds(), time.process_time(), time.perf_counter()
    await work()
    wall, cpu, server_cpu = time.perf_counter() - wall0, time.process_time() - cpu0, server.cpu_seconds() - server0
    stop.set()
    stall = await ticker if ticker is not None else 0.0
    return wall, cpu, server_cpu, stall


async def run_engine(rt: Runtime, server: CannedServer, n: int, concurrency: int, tag: str, *, tick: bool = False) -> Run:
    """Roll `n` samples out through `run_sample` (the slime adapter), `concurrency` at a time."""
    slots = asyncio.Semaphore(concurrency)
    samples = [Sample(index=i, prompt=PROMPT, session_id=f"{tag}-{i}") for i in range(n)]

    async def one(sample: Sample) -> None:
        async with slots:
            await run_sample(rt, sample, SAMPLING)

    async def work() -> None:
        await asyncio.gather(*(one(s) for s in samples))

    wall, cpu, server_cpu, stall = await _timed(server, work, tick=tick)
    statuses = collections.Counter(s.status.name for s in samples)
    turns = collections.Counter(len(engine_metadata(s).get("turns", [])) for s in samples)
    tool_errors = sum(sum((engine_metadata(s).get("tool_stats") or {}).get("errors", {}).values()) for s in samples)
    return Run(wall, cpu, server_cpu, n, dict(statuses), dict(turns), tool_errors=tool_errors, max_stall=stall)


async def run_floor(http: httpx.AsyncClient, url: str, payloads: list[dict[str, Any]], server: CannedServer,
                    n: int, concurrency: int, tag: str, *, connections: int, tick: bool = False) -> Run:
    """The same request sequence per sample with nothing but httpx: post, read, next turn.

    It posts through the same `HttpPool` as the engine's client (see engine/sglang/client.py), so
    the two differ by the engine's work alone.
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

    wall, cpu, server_cpu, stall = await _timed(server, work, tick=tick)
    return Run(wall, cpu, server_cpu, n, {"OK": n} if not errors else {"HTTP_ERRORS": errors}, errors=errors, max_stall=stall)


async def run_aiohttp(url: str, payloads: list[dict[str, Any]], server: CannedServer, n: int, concurrency: int,
                      tag: str, *, connections: int) -> Run:
    """The floor's loop over aiohttp's client instead of httpx: how much of the floor is the transport."""
    import aiohttp

    slots = asyncio.Semaphore(concurrency)
    errors = 0
    bodies = [json.dumps(p).encode() for p in payloads]  # encoded once: this row is about the transport

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections)) as session:

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

        await asyncio.gather(*(one(i) for i in range(min(n, connections))))  # open the connections
        wall, cpu, server_cpu, _ = await _timed(server, work, tick=False)
    return Run(wall, cpu, server_cpu, n, {"OK": n} if not errors else {"HTTP_ERRORS": errors}, errors=errors)


async def capture_requests(cfg: EngineConfig, tokenizer: Any, tag: str) -> list[dict[str, Any]]:
    """Roll one sample out and keep every `/generate` payload it sent, in order."""
    captured: list[bytes] = []

    async def keep(request: httpx.Request) -> None:
        captured.append(request.content)  # json= bodies are encoded before hooks run

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
    return [json.loads(body) for body in captured]


@attrs.define
class Pair:
    """Engine and floor runs of one measurement, repeat by repeat."""

    engine: list[Run] = attrs.field(factory=list)
    floor: list[Run] = attrs.field(factory=list)
    aiohttp: list[Run] = attrs.field(factory=list)  # a reference, not a floor the target uses
    requests_per_sample: int = 0


async def measure_pair(server: CannedServer, tokenizer: Any, *, scenario: str, samples: int, turns: int,
                       concurrency: int, connections: int, repeats: int, tick: bool, transport: bool = False) -> Pair:
    """Warm both clients, then run engine and floor alternately (order flipped each repeat, so
    drift on a shared machine does not always favour the same side)."""
    cfg = bench_config(server.url(scenario), turns=turns, connections=connections)
    payloads = await capture_requests(cfg, tokenizer, f"{scenario}-w")
    if len(payloads) != turns:
        raise RuntimeError(f"the warm-up sample sent {len(payloads)} requests, expected {turns}")
    rt = Runtime.create(cfg, tokenizer=tokenizer)
    floor_http = make_http_client(cfg)
    pair = Pair(requests_per_sample=len(payloads))
    try:
        warm = min(samples, concurrency)  # open the connections both sides will reuse
        await run_engine(rt, server, warm, concurrency, f"{scenario}-we")
        await run_floor(floor_http, rt.client.url, payloads, server, warm, concurrency, f"{scenario}-wf", connections=connections)
        for i in range(repeats):
            sides = ["engine", "floor"] if i % 2 == 0 else ["floor", "engine"]
            for side in sides:
                tag = f"{scenario}-{side}-{i}"
                if side == "engine":
                    pair.engine.append(await run_engine(rt, server, samples, concurrency, tag, tick=tick))
                else:
                    pair.floor.append(await run_floor(floor_http, rt.client.url, payloads, server, samples, concurrency,
                                                      tag, connections=connections, tick=tick))
            if transport:
                pair.aiohttp.append(await run_aiohttp(rt.client.url, payloads, server, samples, concurrency,
                                                      f"{scenario}-aiohttp-{i}", connections=connections))
    finally:
        await rt.aclose()
        await floor_http.aclose()
    return pair


def _summary(runs: list[Run], turns: int) -> dict[str, Any]:
    n = runs[0].samples if runs else 0
    return {
        "samples_per_s": median([r.samples / r.wall for r in runs]),
        "wall_s": median([r.wall for r in runs]),
        "cpu_us_per_turn": median([r.cpu / (r.samples * turns) * 1e6 for r in runs]),
        "server_cpu_share": median([r.server_cpu / r.wall for r in runs]),  # ~1.0: the server was saturated
        "max_stall_ms": median([r.max_stall * 1e3 for r in runs]),
        "statuses": runs[-1].statuses if runs else {},
        "turns_taken": runs[-1].turns if runs else {},
        "samples": n,
    }


async def rollout_figures(server: CannedServer, tokenizer: Any, sizes: Sizes) -> list[Figure]:
    """Figure 1: samples/s of the engine against the bare httpx floor, and CPU per turn."""
    with instant_interpreter():
        pair = await measure_pair(
            server, tokenizer, scenario="tool", samples=sizes.samples, turns=sizes.turns,
            concurrency=sizes.concurrency, connections=sizes.concurrency, repeats=sizes.repeats, tick=False,
            transport=True,
        )
    engine, floor = _summary(pair.engine, sizes.turns), _summary(pair.floor, sizes.turns)
    reference = _summary(pair.aiohttp, sizes.turns)
    shape = f"{sizes.samples} samples x {sizes.turns} turns, concurrency {sizes.concurrency}"
    notes = {"engine": engine, "floor": floor, "shape": shape}
    return [
        Figure("rollout_throughput", f"rollout throughput ({shape})", engine["samples_per_s"], "samples/s",
               floor["samples_per_s"], "bare httpx loop", "ratio", ">=", 0.8, sizes.repeats, notes),
        Figure("rollout_cpu_per_turn", "client CPU per turn (process time / turns)", engine["cpu_us_per_turn"], "us",
               floor["cpu_us_per_turn"], "bare httpx loop", None, None, None, sizes.repeats,
               {"engine_only_us_per_turn": engine["cpu_us_per_turn"] - floor["cpu_us_per_turn"]}),
        Figure("transport_reference", "reference: the floor's loop over aiohttp's client", reference["cpu_us_per_turn"],
               "us", floor["cpu_us_per_turn"], "bare httpx loop", None, None, None, sizes.repeats,
               {"samples_per_s": reference["samples_per_s"], "server_cpu_share": reference["server_cpu_share"]}),
    ]


async def scale_figure(server: CannedServer, tokenizer: Any, sizes: Sizes, repeats: int) -> Figure:
    """Figure 6: the longest event-loop stall with `scale_samples` samples in flight at once.

    All samples start together and share figure 1's pool (256 connections; 32 with --small),
    so most of them wait for a connection in the engine's `HttpPool`.
    """
    n, turns = sizes.scale_samples, sizes.scale_turns
    with instant_interpreter():
        pair = await measure_pair(
            server, tokenizer, scenario="scale", samples=n, turns=turns, concurrency=n,
            connections=sizes.concurrency, repeats=repeats, tick=True,
        )
    engine, floor = _summary(pair.engine, turns), _summary(pair.floor, turns)
    return Figure("scale_stall", f"longest loop stall, {n} samples in flight ({turns} turns)", engine["max_stall_ms"], "ms",
                  floor["max_stall_ms"], "bare httpx loop", "value", "<=", 50.0, repeats,
                  {"engine": engine, "floor": floor})
