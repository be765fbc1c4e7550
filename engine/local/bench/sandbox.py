"""Figures 3 and 4: the real code-interpreter sandbox, through the engine and call by call.

Figure 3 drives K samples through the engine against the canned server; each of their
M tool turns runs `time.sleep(s)` in the real sandbox under the engine's shared tool
slots, so the wall time includes everything a tool turn costs (sandbox start, uid
lease, cleanup, the engine's bookkeeping). The ideal is `M * s * ceil(K / slots)`.

Figure 4 times single `print(1)` runs through the registered `code_interpreter` tool,
next to the cost of starting a bare interpreter (`python -I -S -c pass`) spawned the same
way (asyncio subprocess): latency, CPU per call (the engine, the zygote and every child
together) and calls per second at 32 concurrent. The kinds are interleaved call by call,
so a noisy moment on the shared machine hits both, not one. `sandbox_figures` adds the
overlap of sleeping calls (16 x 1 s, 64 x 2 x 0.5 s, straight through `run_python`) and
how long cancelling a running call takes; `python -m engine.local.bench.sandbox` prints
only these.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs

from engine import tools
from engine.local.bench.common import Figure, Sizes, median, percentile
from engine.local.bench.rollout import bench_config, run_engine
from engine.local.bench.server import CannedServer
from engine.loop.runtime import Runtime
from engine.sandbox import SandboxLimits, capabilities, client, run_python


def sleep_code(seconds: float) -> str:
    return f"import time\ntime.sleep({seconds})"


async def tool_concurrency_figure(server: CannedServer, tokenizer: Any, sizes: Sizes) -> Figure:
    """Figure 3: wall time of K samples x M sandboxed sleeps against the ideal schedule."""
    k, m, s, slots = sizes.tool_samples, sizes.tool_calls, sizes.tool_sleep, sizes.tool_concurrency
    cfg = bench_config(server.url("sleep"), turns=m + 1, connections=max(k, 1), tool_concurrency=slots)
    ideal = m * s * math.ceil(k / slots)
    tool = tools.get("code_interpreter")
    if tool is None or type(tool).__name__ != "CodeInterpreter":
        raise RuntimeError(f"figure 3 needs the real code_interpreter, found {tool!r}")
    walls: list[float] = []
    child_cpu: list[float] = []  # CPU of the reaped sandbox processes, per call
    statuses: dict[str, int] = {}
    tool_errors = 0
    rt = Runtime.create(cfg, tokenizer=tokenizer)
    try:
        await run_engine(rt, server, 1, 1, "sleep-warm")  # sandbox capability probe, pool, machine
        for i in range(sizes.repeats):
            before = _children_cpu()
            run = await run_engine(rt, server, k, k, f"sleep-{i}")
            child_cpu.append((_children_cpu() - before) / max(k * m, 1))
            walls.append(run.wall)
            statuses, tool_errors = run.statuses, tool_errors + run.tool_errors
    finally:
        await rt.aclose()
    return Figure(
        "tool_concurrency", f"tool concurrency: {k} samples x {m} sandbox calls x {s:g} s, {slots} slots",
        median(walls), "s", ideal, "ideal M*s*ceil(K/slots)", "ratio", "<=", 1.5, sizes.repeats,
        {"statuses": statuses, "tool_errors": tool_errors, "walls_s": [round(w, 3) for w in walls],
         "overhead_per_round_s": (median(walls) - ideal) / max(m * math.ceil(k / slots), 1),
         "sandbox_cpu_ms_per_call": median(child_cpu) * 1e3,
         # No schedule beats the CPU the sandboxes need, spread over every core.
         "cpu_bound_s": max(ideal, median(child_cpu) * k * m / (os.cpu_count() or 1))},
    )


def _children_cpu() -> float:
    """CPU seconds of every process the sandbox ran: the engine's reaped children (a bare
    interpreter spawned here) and the zygote with its reaped children (the sandboxed runs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime + _zygote_cpu()


def _zygote_cpu() -> float:
    """CPU seconds of the zygote and of its children (the forker, which reaps every run, so the
    runs' time is in its own children's): each with what it reaped."""
    z = client.current()
    if z is None:
        return 0.0
    pids = [z.proc.pid]
    try:
        for tid in os.listdir(f"/proc/{z.proc.pid}/task"):
            with open(f"/proc/{z.proc.pid}/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
    return total


def _cpu_now() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime + _children_cpu()


async def _spawn(*args: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        *args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    if await proc.wait() != 0:
        raise RuntimeError(f"{args} exited {proc.returncode}")


def _sandboxed_call() -> Callable[[], Awaitable[None]]:
    tool = tools.get("code_interpreter")
    if tool is None:
        raise RuntimeError("no code_interpreter registered")

    async def sandboxed() -> None:
        result = await tool.execute(None, code="print(1)")
        text = getattr(result, "text", result)
        if text != "Output:\n1":
            raise RuntimeError(f"sandboxed print(1) gave {text!r}")

    return sandboxed


BARE = "python -I -S -c pass"


def _kinds() -> dict[str, Callable[[], Awaitable[None]]]:
    """The sandboxed call and the bare interpreter start it is compared with."""
    return {"sandbox": _sandboxed_call(), BARE: lambda: _spawn(sys.executable, "-I", "-S", "-c", "pass")}


async def _latency_and_cpu(runs: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per kind: wall seconds of each of `runs` calls, and CPU seconds per call (engine,
    zygote and children together), the kinds interleaved call by call."""
    kinds = _kinds()
    times: dict[str, list[float]] = {name: [] for name in kinds}
    cpu = {name: 0.0 for name in kinds}
    for run in kinds.values():
        await run()  # warm: the probe, the zygote, the page cache
    for _ in range(runs):
        for name, run in kinds.items():
            c0, t0 = _cpu_now(), time.perf_counter()
            await run()
            times[name].append(time.perf_counter() - t0)
            cpu[name] += _cpu_now() - c0
    return times, {name: total / runs for name, total in cpu.items()}


async def _throughput(call: Callable[[], Awaitable[None]], concurrency: int, total: int) -> float:
    """Calls per second with `concurrency` callers making `total` calls together."""
    left = total

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await call()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.perf_counter() - t0)


async def _cancel_seconds(repeats: int) -> list[float]:
    """How long cancelling a running call takes until it returned, everything of it killed."""
    took = []
    for _ in range(repeats):
        task = asyncio.create_task(run_python("import time\ntime.sleep(60)", SandboxLimits(timeout_s=120)))
        await asyncio.sleep(0.3)  # running by now
        t0 = time.perf_counter()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        took.append(time.perf_counter() - t0)
    return took


async def _schedule(samples: int, calls: int, seconds: float) -> float:
    """Wall time of `samples` concurrent callers each making `calls` sandboxed sleeps in turn."""
    code = sleep_code(seconds)

    async def sample() -> None:
        for _ in range(calls):
            result = await run_python(code, SandboxLimits(timeout_s=seconds + 30))
            if result.returncode != 0:
                raise RuntimeError(f"a sandboxed sleep failed: {result.stderr[-300:]}")

    t0 = time.perf_counter()
    await asyncio.gather(*(sample() for _ in range(samples)))
    return time.perf_counter() - t0


async def sandbox_figures(sizes: Sizes) -> list[Figure]:
    """The sandbox's cost, each beside a bare interpreter start measured in the same run:
    `print(1)` latency and CPU per call, calls per second at 32 concurrent, sleeping calls
    overlapping at 16 x 1 s and 64 x 2 x 0.5 s, and how long a cancel takes."""
    runs = sizes.sandbox_runs
    times, cpu = await _latency_and_cpu(runs)
    p50 = {name: percentile(t, 50) * 1e3 for name, t in times.items()}
    p99 = {name: percentile(t, 99) * 1e3 for name, t in times.items()}
    iso = probe_isolation()
    figures = [
        Figure("sandbox_latency", f"sandbox print(1) p50 (p99 {p99['sandbox']:.1f} ms), N={runs}", p50["sandbox"],
               "ms", p50[BARE], f"{BARE} p50", "value", "<=", 15.0, runs,
               {"p50/p99 ms": {k: [round(p50[k], 2), round(p99[k], 2)] for k in p50}, "isolation": iso}),
        Figure("sandbox_cpu", "sandbox print(1) CPU per call (engine + zygote + child)", cpu["sandbox"] * 1e3, "ms",
               cpu[BARE] * 1e3, f"{BARE} CPU", "value", "<=", 15.0, runs),
    ]
    kinds = _kinds()
    total = max(64, 4 * runs)
    rates = {}
    for name in (BARE, "sandbox", BARE):  # the floor on both sides: the box is shared
        rates.setdefault(name, []).append(await _throughput(kinds[name], 32, total))
    figures.append(Figure("sandbox_throughput", f"sandbox print(1) calls/s, 32 concurrent, {total} calls",
                          rates["sandbox"][0], "calls/s", median(rates[BARE]), f"{BARE} calls/s", "value", ">=", 250.0,
                          1, {"bare runs": [round(r, 1) for r in rates[BARE]]}))
    for samples, calls, seconds, target in ((16, 1, 1.0, 1.2), (64, 2, 0.5, 1.5)):
        wall = await _schedule(samples, calls, seconds)
        figures.append(Figure(f"sandbox_overlap_{samples}x{calls}", f"{samples} x {calls} sandboxed sleeps of "
                              f"{seconds:g} s, all concurrent", wall, "s", calls * seconds, "ideal calls*s", "ratio",
                              "<=", target, 1))
    cancels = await _cancel_seconds(5)
    figures.append(Figure("sandbox_cancel", "cancel a running call until it returned, all of it killed",
                          median(cancels) * 1e3, "ms", None, "", None, None, None, len(cancels),
                          {"max ms": round(max(cancels) * 1e3, 1)}))
    return figures


def probe_isolation() -> dict[str, Any]:
    """What isolation the measured sandbox had (the README says which the host got)."""
    iso = capabilities()
    return {k: iso[k] for k in ("mode", "root", "uid_per_run", "netns", "mntns", "ipcns", "cgroup", "landlock",
                                "seccomp", "zygote")}


async def latency_ratio(runs: int) -> dict[str, Any]:
    """Figure 4 in one mode: p50 of `print(1)` in the sandbox and of a bare interpreter start,
    their ratio, calls per second of each at 32 concurrent (the bare floor measured before and
    after), and the sandbox's mode and layers."""
    times, _ = await _latency_and_cpu(runs)
    p50 = {name: percentile(t, 50) * 1e3 for name, t in times.items()}
    kinds, total = _kinds(), max(64, 2 * runs)
    rates: dict[str, list[float]] = {}
    for name in (BARE, "sandbox", BARE):  # the floor on both sides: the box is shared
        rates.setdefault(name, []).append(await _throughput(kinds[name], 32, total))
    iso = capabilities()
    return {"mode": iso["mode"], "landlock": iso["landlock"], "seccomp": iso["seccomp"], "runs": runs,
            "sandbox_p50_ms": round(p50["sandbox"], 2), "bare_p50_ms": round(p50[BARE], 2),
            "ratio": round(p50["sandbox"] / p50[BARE], 3), "sandbox_calls_s": round(rates["sandbox"][0], 1),
            "bare_calls_s": round(median(rates[BARE]), 1)}


def latency_in_modes(runs: int) -> list[dict[str, Any]]:
    """`latency_ratio` in each of the three modes (root only), a process per mode."""
    import json
    import tempfile
    from pathlib import Path

    from engine.sandbox.attacks import modes

    rows = []
    for mode in modes.MODES:
        with tempfile.TemporaryDirectory(prefix="fsm-bench-") as tmp:
            argv, env, cwd = modes.mode_command(mode, Path(tmp))
            done = subprocess.run([*argv, "-m", "engine.local.bench.sandbox", "--latency-only", "--runs", str(runs)],
                                  cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"mode {mode}: {done.stderr.strip()[-400:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def main() -> int:
    """`python -m engine.local.bench.sandbox [--small] [--runs N] [--latency-only | --modes]`:
    only the sandbox's figures; `--latency-only` just print(1)'s p50 against a bare start (JSON);
    `--modes` that in each of the three modes (as root: docs/sandbox-modes.md)."""
    import argparse
    import json

    from engine.local.bench.report import format_table

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--latency-only", action="store_true")
    parser.add_argument("--modes", action="store_true")
    ns = parser.parse_args()
    sizes = Sizes.small() if ns.small else Sizes.default()
    if ns.runs:
        sizes = attrs.evolve(sizes, sandbox_runs=ns.runs)
    if ns.latency_only:
        print(json.dumps(asyncio.run(latency_ratio(sizes.sandbox_runs))))
        return 0
    if ns.modes:
        print(f"| mode | sandbox print(1) p50 ms | {BARE} p50 ms | ratio | sandbox calls/s, 32 concurrent | "
              f"{BARE} calls/s | Landlock ABI | seccomp |")
        print("|---|---|---|---|---|---|---|---|")
        for row in latency_in_modes(sizes.sandbox_runs):
            print(f"| {row['mode']} | {row['sandbox_p50_ms']} | {row['bare_p50_ms']} | {row['ratio']} | "
                  f"{row['sandbox_calls_s']} | {row['bare_calls_s']} | {row['landlock']} | {row['seccomp']} |")
        return 0
    figures = asyncio.run(sandbox_figures(sizes))
    for number, figure in enumerate(figures):
        figure.number = 4 if number < 3 else 3
    print(format_table(figures, {"python": sys.version.split()[0], "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
