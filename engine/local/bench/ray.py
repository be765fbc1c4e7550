"""Figure 7: sandboxed calls on Ray, on a two-node Ray test cluster started on this machine (loopback only).

Row `ray_spread`: K calls that each sleep s seconds in the sandbox, all issued at once to a
pool of W one-call workers that Ray placed on two nodes. The ideal is `s * ceil(K / W)`:
perfect use of every worker, nothing else costing time. What is left over is dispatch,
the actor call, the host hop and the sandbox's own start and cleanup, per round.

Row `ray_overhead`: p50 of `print(1)` through the Ray pool next to p50 of the same call in
the local sandbox of this process (the floor), interleaved call by call so a noisy moment on
the shared machine hits both. Their difference is what the Ray path adds per call.

Without `ray` installed, one information row says the figure was skipped.

    python -m engine.local.bench.ray [--small]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import time
from typing import Any

import attrs

from engine.local.bench.common import Figure, Sizes, median, percentile
from engine.local.bench.report import format_table
from engine.sandbox import backend
from engine.sandbox.runner import SandboxLimits, run_python

RESOURCE = "sandbox"
LIMITS = SandboxLimits(timeout_s=30)


@attrs.frozen
class RaySizes:
    """K calls of s seconds over W workers; N interleaved print(1) calls for the overhead row."""

    calls: int
    sleep: float
    workers: int
    runs: int
    repeats: int

    @classmethod
    def of(cls, sizes: Sizes) -> RaySizes:
        """Small for the CI size, else the full one."""
        if sizes == Sizes.small():
            return cls(calls=8, sleep=0.3, workers=2, runs=sizes.sandbox_runs, repeats=sizes.repeats)
        return cls(calls=32, sleep=0.5, workers=4, runs=sizes.sandbox_runs, repeats=sizes.repeats)


def ray_figures(sizes: Sizes) -> list[Figure]:
    """Start a two-node cluster, measure both rows, stop everything; an info row without ray."""
    if importlib.util.find_spec("ray") is None:
        return [Figure("ray_spread", "sandbox on Ray: skipped, `ray` is not installed", math.nan, "s", None, "-",
                       None, None, None, 0, {"skipped": "pip install -e '.[ray]' in the checkout"})]
    from engine.local.cluster import loopback_cluster

    rs = RaySizes.of(sizes)
    per_node = math.ceil(rs.workers / 2)
    node = {"num_cpus": per_node, "resources": {RESOURCE: per_node}, "object_store_memory": 80 << 20}
    with loopback_cluster(2, **node):
        try:
            backend.configure("ray", backend.RaySettings(workers=rs.workers, cpus=1, resource=RESOURCE, queue=rs.calls))
            return asyncio.run(_measure(rs))
        finally:
            backend.shutdown()


async def _measure(rs: RaySizes) -> list[Figure]:
    pool = backend.pool()
    assert pool is not None
    workers = await pool.wait_ready()
    if any(w["state"] != "up" for w in workers):
        raise RuntimeError(f"not every sandbox worker came up: {workers}")
    await asyncio.gather(*(pool.run("print(1)", LIMITS) for _ in range(rs.workers)))  # each host probes once
    await run_python("print(1)", LIMITS)  # and so does this process, for the local floor
    return [await _spread(pool, rs), await _overhead(pool, rs)]


async def _spread(pool: Any, rs: RaySizes) -> Figure:
    code = f"import time\ntime.sleep({rs.sleep})"
    ideal = rs.sleep * math.ceil(rs.calls / rs.workers)
    walls: list[float] = []
    before = dict(pool.calls_by_node)
    for _ in range(rs.repeats):
        started = time.perf_counter()
        results = await asyncio.gather(*(pool.run(code, LIMITS) for _ in range(rs.calls)))
        walls.append(time.perf_counter() - started)
        if any(r.returncode != 0 for r in results):
            raise RuntimeError(f"a sleeping call failed: {[r for r in results if r.returncode != 0][:1]}")
    rounds = math.ceil(rs.calls / rs.workers)
    by_node = {node[:8]: n - before.get(node, 0) for node, n in pool.calls_by_node.items()}
    return Figure(
        "ray_spread", f"sandbox on Ray: {rs.calls} calls x {rs.sleep:g} s over {rs.workers} workers, 2 nodes",
        median(walls), "s", ideal, "ideal s*ceil(K/W)", "ratio", "<=", 1.5, rs.repeats,
        {"walls_s": [round(w, 3) for w in walls], "overhead_per_round_s": (median(walls) - ideal) / rounds,
         "calls_by_node": by_node},
    )


async def _overhead(pool: Any, rs: RaySizes) -> Figure:
    times: dict[str, list[float]] = {"ray": [], "local": []}
    for _ in range(rs.runs):
        for name in times:
            started = time.perf_counter()
            result = await (pool.run("print(1)", LIMITS) if name == "ray" else run_python("print(1)", LIMITS))
            times[name].append(time.perf_counter() - started)
            if result.stdout != "1\n":
                raise RuntimeError(f"{name} print(1) gave {result!r}")
    ms = {name: (percentile(t, 50) * 1e3, percentile(t, 99) * 1e3) for name, t in times.items()}
    return Figure(
        "ray_overhead", f"sandbox on Ray: print(1) p50 (p99 {ms['ray'][1]:.1f} ms), N={rs.runs}",
        ms["ray"][0], "ms", ms["local"][0], "local sandbox p50", "ratio", "<=", 1.5, rs.runs,
        {"ray p50/p99 ms": [round(v, 2) for v in ms["ray"]], "local p50/p99 ms": [round(v, 2) for v in ms["local"]],
         "ray_minus_local_p50_ms": round(ms["ray"][0] - ms["local"][0], 2)},
    )


def main(argv: list[str] | None = None) -> int:
    """Measure figure 7 alone and print its rows."""
    parser = argparse.ArgumentParser(prog="python -m engine.local.bench.ray", description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the CI size")
    ns = parser.parse_args(argv)
    started = time.perf_counter()
    figures = ray_figures(Sizes.small() if ns.small else Sizes.default())
    for f in figures:
        f.number = 7
    print(format_table(figures, {"figure": 7, "total_s": round(time.perf_counter() - started, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
