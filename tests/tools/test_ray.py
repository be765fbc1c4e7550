"""Sandboxed calls on Ray: the setting, the dispatch, and a real two-node cluster on this machine.

The cluster tests start Ray's own test cluster (`ray.cluster_utils.Cluster`: a head and one
more node, 2 logical CPUs each, a custom `sandbox` resource on both) once for the module,
and a pool of 4 one-CPU workers, so Ray must place two on each node. Calls are short
sleeps (little CPU: the machine is shared). They run a batch through the engine that
spreads over both nodes, keep a session on one worker, cancel a running call, hang a
worker (SIGSTOP), kill one mid-call (SIGKILL) and shut the pool down with a call running,
and check from /proc that no worker, host or sandbox process is left. The whole file takes
about 40 s here. The cluster tests skip only when `ray` is not installed; the setting, the
dispatch and the host are tested without Ray.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

from engine import tools
from engine.settings import EngineConfig
from engine.local.bench.rollout import PROMPT, SAMPLING
from engine.local.bench.server import CannedServer, scenario
from engine.local.invariants import sample_violations
from engine.local.sample import Sample
from engine.loop.runtime import Runtime
from engine.slime import generate, run_sample
from engine.slime.sample_io import engine_metadata
from tests.support.helpers import make_args
from engine.tools.python_session import PythonSession
from engine.sandbox import backend
from engine.sandbox import host as host_protocol
from engine.sandbox.dispatch import Busy, Dispatcher, Slot
from engine.sandbox.runner import SandboxError, SandboxLimits

WORKERS = 4
RESOURCE = "sandbox"
SLOW_CALL_S = 6  # the killed call: its sandbox must be gone long before it could have ended by itself


# --- the setting -------------------------------------------------------------------------------

@pytest.fixture
def without_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `ray` unimportable, as on a machine without the extra."""
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)


def test_ray_backend_is_refused_with_a_clear_message_without_ray(without_ray: None) -> None:
    with pytest.raises(ValueError, match=r"needs the `ray` package.*pip install"):
        EngineConfig(sandbox_backend="ray")
    with pytest.raises(ValueError, match=r"needs the `ray` package"):
        EngineConfig.from_args(make_args(engine_sandbox_backend="ray"))
    with pytest.raises(ValueError, match=r"needs the `ray` package"):
        backend.configure("ray")
    assert backend.current() == "local"
    # Through slime's generate function: the sample says why, nothing raises into slime's gather.
    sample = asyncio.run(generate(make_args(engine_sandbox_backend="ray"), Sample(prompt="hi"), dict(SAMPLING)))
    assert sample.status.name == "FAILED"
    assert "needs the `ray` package" in engine_metadata(sample)["engine_error"]


def test_unknown_backend_is_refused_and_local_is_the_default() -> None:
    with pytest.raises(ValueError, match=r"one of local, ray, got 'kubernetes'"):
        EngineConfig(sandbox_backend="kubernetes")
    cfg = EngineConfig.from_args(make_args(engine_sandbox_workers=8, engine_sandbox_worker_cpus=2,
                                           engine_sandbox_resource="cpu_node", engine_sandbox_queue=16))
    assert cfg.sandbox_backend == "local"
    ray_settings = (cfg.sandbox_workers, cfg.sandbox_worker_cpus, cfg.sandbox_resource, cfg.sandbox_queue)
    assert ray_settings == (8, 2.0, "cpu_node", 16)
    with pytest.raises(ValueError):
        EngineConfig(sandbox_workers=0)


# --- the dispatch (no Ray) -------------------------------------------------------------------

def _up(n: int) -> list[Slot]:
    return [Slot(i, state="up", generation=1) for i in range(n)]


def test_calls_go_to_the_least_loaded_worker_then_to_the_least_used() -> None:
    async def go() -> None:
        slots = _up(3)
        d = Dispatcher(slots, per_worker=2, queue=8)
        first = [await d.acquire(None, 1) for _ in range(3)]
        assert sorted(s.index for s in first) == [0, 1, 2]  # one each before any gets a second
        d.release(first[1])
        assert await d.acquire(None, 1) is first[1]  # the only one with nothing running
        for s in slots:
            d.release(s)
        slots[0].calls = 5
        assert (await d.acquire(None, 1)).index != 0  # equal load: the one that ran fewest calls

    asyncio.run(go())


def test_a_session_stays_on_its_worker_and_moves_when_the_worker_is_replaced() -> None:
    async def go() -> None:
        slots = _up(3)
        d = Dispatcher(slots, per_worker=1, queue=8)
        mine = await d.acquire("s", 1)
        d.release(mine)
        mine.calls += 10  # now the most used: a new call without a key would go elsewhere
        assert await d.acquire("s", 1) is mine
        # Busy: the session waits for its own worker rather than moving.
        with pytest.raises(Busy, match="free for 0.05 s"):
            await d.acquire("s", 0.05)
        d.release(mine)
        mine.generation += 1  # its worker was replaced: the session goes to the least used one
        moved = await d.acquire("s", 1)
        assert moved is not mine
        d.forget("s")
        d.release(moved)

    asyncio.run(go())


def test_a_call_waits_for_a_free_worker_in_a_bounded_queue() -> None:
    async def go() -> None:
        (slot,) = _up(1)
        d = Dispatcher([slot], per_worker=1, queue=1)
        await d.acquire(None, 1)
        waiter = asyncio.ensure_future(d.acquire(None, 5))
        await asyncio.sleep(0.05)
        assert d.waiting == 1 and not waiter.done()
        with pytest.raises(Busy, match="already wait"):  # the queue holds one: the next is refused at once
            await d.acquire(None, 5)
        started = time.monotonic()
        asyncio.get_running_loop().call_later(0.1, d.release, slot)
        assert await waiter is slot
        assert time.monotonic() - started >= 0.09
        assert d.waiting == 0 and slot.busy == 1
        with pytest.raises(Busy, match=r"free for 0.1 s \(1 of 1 workers up\)"):  # and no longer than its time
            await d.acquire(None, 0.1)

    asyncio.run(go())


def test_a_worker_coming_up_wakes_the_waiting_calls() -> None:
    async def go() -> None:
        slot = Slot(0, state="starting", generation=1)
        d = Dispatcher([slot], per_worker=1, queue=4)
        waiter = asyncio.ensure_future(d.acquire(None, 5))
        await asyncio.sleep(0.02)
        slot.state = "up"
        d.changed()
        assert await asyncio.wait_for(waiter, 1) is slot

    asyncio.run(go())


def test_closing_the_pool_ends_every_wait_at_once() -> None:
    async def go() -> None:
        (slot,) = _up(1)
        d = Dispatcher([slot], per_worker=1, queue=4)
        await d.acquire(None, 1)
        waiter = asyncio.ensure_future(d.acquire(None, 30))
        await asyncio.sleep(0.02)
        slot.state = "empty"
        d.close()
        with pytest.raises(Busy, match="shut down"):
            await asyncio.wait_for(waiter, 1)
        with pytest.raises(Busy, match="shut down"):
            await d.acquire(None, 30)

    asyncio.run(go())


def test_the_engine_attaches_to_a_running_cluster_and_never_starts_one(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = pytest.importorskip("ray", reason="the `ray` extra is not installed")
    from engine.sandbox import ray_pool

    calls: list[dict[str, Any]] = []

    def no_cluster(**kwargs: Any) -> None:
        calls.append(kwargs)
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    with pytest.raises(RuntimeError, match=r"no running Ray cluster to attach to.*ray start --head"):
        backend.configure("ray")
    assert [c["address"] for c in calls] == ["auto"]  # "auto" joins a running cluster, never starts one
    assert backend.current() == "local" and backend.pool() is None
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # slime's process: already joined
    ray_pool.attach()
    assert len(calls) == 1


# --- the host: what cleans up after a worker that died (no Ray) ------------------------------------

def test_the_host_kills_its_runs_when_the_worker_end_closes() -> None:
    """The worker's end of the socket closing (its process died) makes the host kill every run and exit."""
    mine, theirs = socket.socketpair()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    starter = subprocess.Popen([sys.executable, "-m", "engine.sandbox.host", str(theirs.fileno())],
                               pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    theirs.close()
    replies = mine.makefile("rb")
    host = json.loads(replies.readline())["pid"]
    try:
        assert starter.wait(timeout=20) == 0 and host != starter.pid  # detached: no child of its starter
        limits = attrs.asdict(SandboxLimits(timeout_s=60))
        mine.sendall(host_protocol.request(1, "import time\ntime.sleep(60)", limits, None))
        mine.sendall(host_protocol.request(2, "print(6 * 7)", limits, None))
        reply = json.loads(replies.readline())
        assert reply["id"] == 2 and reply["result"]["stdout"] == "42\n"  # runs side by side: the quick one answers
        deadline = time.monotonic() + 30
        while not (sandbox := {p: t for p, t in _descendants(host).items() if _runs_the_code(p)}):
            assert time.monotonic() < deadline, "the long run never started"
            time.sleep(0.05)
        replies.close()
        mine.close()  # as when the worker's process dies
        deadline = time.monotonic() + 10  # killed and cleaned up, not left to sleep its 60 s
        while _running(host) or any(_running(p, t) for p, t in sandbox.items()):
            assert time.monotonic() < deadline, "the host or its run outlived the worker's end"
            time.sleep(0.05)
    finally:
        if _running(host):
            os.kill(host, signal.SIGKILL)


# --- a real two-node cluster -------------------------------------------------------------------

def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) of a process, None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[19])


def _running(pid: int, start: int | None = None) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and (start is None or stat[1] == start)


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live process under `root`, from a /proc scan."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found: dict[int, int] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found and (stat := _stat(pid)) is not None and stat[0] != "Z":
                found[pid] = stat[1]
                frontier.append(pid)
    return found


def _runs_the_code(pid: int) -> bool:
    """Whether the process is a sandboxed program: a child of the sandbox's zygote, run as a leased uid."""
    from engine.sandbox import UID_BASE, UID_COUNT

    try:
        with open(f"/proc/{pid}/status") as f:
            uid = int(next(line.split()[1] for line in f if line.startswith("Uid:")))
    except (OSError, StopIteration, ValueError):
        return False
    return UID_BASE <= uid < UID_BASE + UID_COUNT


async def _until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head and a second node on this machine, joined by this process; torn down whatever happened."""
    pytest.importorskip("ray", reason="the `ray` extra is not installed")
    from engine.local.cluster import loopback_cluster

    node = {"num_cpus": 2, "resources": {RESOURCE: 2}, "object_store_memory": 80 << 20}
    with loopback_cluster(2, **node) as c:
        try:
            yield c
        finally:
            backend.shutdown()


@pytest.fixture(scope="module")
def tok() -> Any:
    from engine.profiles.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def server(tok: Any) -> Iterator[CannedServer]:
    scenarios = {
        "quick": scenario(tok, 2, "import time\ntime.sleep(0.3)\nprint(6 * 7)"),
        "slow": scenario(tok, 2, f"import time\ntime.sleep({SLOW_CALL_S})\nprint(6 * 7)"),
    }
    with CannedServer(scenarios) as s:
        yield s


def _config(url: str, *, slots: int) -> EngineConfig:
    return EngineConfig(
        server_url=url, profile="retool", max_turns=2, max_tool_calls=2, tool_concurrency=slots, tool_timeout=20,
        sandbox_backend="ray", sandbox_workers=WORKERS, sandbox_worker_cpus=1, sandbox_resource=RESOURCE,
    )


async def _ready_pool(timeout: float = 60) -> Any:
    pool = backend.pool()
    assert pool is not None and backend.current() == "ray"
    workers = await pool.wait_ready(timeout)
    assert [w["state"] for w in workers] == ["up"] * WORKERS, workers
    return pool


def _check(samples: list[Sample], prompt: list[int], tok: Any) -> list[dict[str, Any]]:
    """Every sample completed, with the invariants intact and the tool's answer in its response."""
    stats = []
    for s in samples:
        assert s.status.name == "COMPLETED", engine_metadata(s)
        assert not sample_violations(s, prompt_ids=prompt, budget=None, decode=tok.decode)
        assert "Output:\n42" in s.response
        stats.append(engine_metadata(s)["tool_stats"])
    return stats


def _listening(pids: set[int]) -> list[tuple[str, int]]:
    """(host address, pid) of every TCP socket the processes listen on, from /proc."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes[link[8:-1]] = pid
        except OSError:
            continue  # gone meanwhile
    found: list[tuple[str, int]] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    raw = bytes.fromhex(fields[1].split(":")[0])
                    # /proc writes each 32-bit word of the address in host (little-endian) order
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    host = socket.inet_ntop(socket.AF_INET if len(words) == 4 else socket.AF_INET6, words)
                    found.append((host, inodes[fields[9]]))
    return found


def _loopback(host: str) -> bool:
    ip = ipaddress.ip_address(host)
    return ip.is_loopback or (isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def test_the_test_cluster_listens_on_loopback_only(cluster: Any) -> None:
    import ray

    def worker_pid() -> int:
        return os.getpid()

    assert ray.get([ray.remote(worker_pid).remote() for _ in range(2)])  # a worker process is up on a node
    assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {"127.0.0.1"}
    listening = _listening(set(_descendants(os.getpid())))
    assert len({pid for _, pid in listening}) >= 3  # the GCS and both raylets at least
    assert [(host, pid) for host, pid in listening if not _loopback(host)] == []


@pytest.mark.slow
def test_a_batch_of_samples_spreads_its_calls_over_both_nodes(cluster: Any, server: CannedServer, tok: Any) -> None:
    import ray

    async def go() -> None:
        rt = Runtime.create(_config(server.url("quick"), slots=2 * WORKERS), tokenizer=tok)
        try:
            pool = await _ready_pool()
            nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            assert len(nodes) == 2 and {w["node"] for w in pool.workers()} == nodes  # Ray placed them on both
            before = dict(pool.calls_by_node)
            samples = [Sample(index=i, prompt=PROMPT, session_id=f"spread-{i}") for i in range(2 * WORKERS)]
            await asyncio.wait_for(asyncio.gather(*(run_sample(rt, s, dict(SAMPLING)) for s in samples)), 60)
            stats = _check(samples, await rt.prompt_ids(PROMPT, rt.allowed_tools()), tok)
            ran = {node: n - before.get(node, 0) for node, n in pool.calls_by_node.items()}
            assert set(ran) == nodes and sum(ran.values()) == len(samples) and min(ran.values()) >= 2
            # Twice as many calls as workers: half of them waited for one, and the samples say so.
            assert all(st["calls"] == 1 and not st["errors"] and "sandbox_wait_s" in st for st in stats)
            assert sum(st["sandbox_wait_s"] > 0.1 for st in stats) >= WORKERS // 2
        finally:
            await rt.aclose()

    asyncio.run(go())


@pytest.mark.slow
def test_a_session_keeps_to_one_worker(cluster: Any, server: CannedServer, tok: Any) -> None:
    async def go() -> None:
        rt = Runtime.create(_config(server.url("quick"), slots=WORKERS), tokenizer=tok)
        try:
            pool = await _ready_pool()
            tool = tools.get("python_session")
            assert tool is not None
            states = [await tool.create(), await tool.create()]
            used: list[set[int]] = [set(), set()]
            for step in range(3):
                for n, state in enumerate(states):
                    before = [w["calls"] for w in pool.workers()]
                    out = await tool.execute(state, code=f"x{n} = {step}\nprint(x{n} * 7)")
                    assert out.text == f"Output:\n{step * 7}"
                    used[n] |= {w["index"] for w, b in zip(pool.workers(), before) if w["calls"] > b}
            assert all(len(u) == 1 for u in used) and used[0] != used[1], used
            for state in states:
                await tool.release(state)
        finally:
            await rt.aclose()

    asyncio.run(go())


@pytest.mark.slow
def test_a_hung_worker_cannot_hang_the_call(cluster: Any, server: CannedServer, tok: Any) -> None:
    async def go() -> None:
        rt = Runtime.create(_config(server.url("quick"), slots=WORKERS), tokenizer=tok)
        try:
            pool = await _ready_pool()
            tool = PythonSession(SandboxLimits(timeout_s=1.0))  # a short limit: the hang shows within 1 + 3 s
            state = await tool.create()
            before = [w["calls"] for w in pool.workers()]
            assert (await tool.execute(state, code="x = 6 * 7")).text == ""
            (mine,) = [w for w, b in zip(pool.workers(), before) if w["calls"] > b]
            host = _stat(mine["host_pid"])
            os.kill(mine["pid"], signal.SIGSTOP)  # alive but deaf: a hang, not a death
            started = time.monotonic()
            with tools.registry.call_stats() as stats, pytest.raises(tools.ToolError) as err:
                await asyncio.wait_for(tool.execute(state, code="print(x)"), 30)
            assert err.value.kind == "worker_hung"
            assert time.monotonic() - started < 1.0 + 3.0 + 2.0
            assert stats["sandbox_workers_hung"] == 1
            # The stopped worker was killed, its host went with it, and a new worker took the slot.
            await _until(lambda: not _running(mine["pid"]), 20, "the hung worker is gone")
            assert host is not None
            await _until(lambda: not _running(mine["host_pid"], host[1]), 20, "the hung worker's host is gone")
            workers = await pool.wait_ready(60)
            assert workers[mine["index"]]["state"] == "up" and workers[mine["index"]]["pid"] != mine["pid"]
            # The session goes on on another worker (its cells replay there).
            assert (await tool.execute(state, code="print(x)")).text == "Output:\n42"
            await tool.release(state)
        finally:
            await rt.aclose()

    asyncio.run(go())


@pytest.mark.slow
def test_a_cancelled_call_is_killed_on_its_worker(cluster: Any, server: CannedServer, tok: Any) -> None:
    """The engine giving up on a call (its backstop, an abort) kills the run; the worker stays."""
    async def go() -> None:
        rt = Runtime.create(_config(server.url("quick"), slots=WORKERS), tokenizer=tok)
        try:
            pool = await _ready_pool()
            call = asyncio.ensure_future(backend.run("import time\ntime.sleep(60)", SandboxLimits(timeout_s=60)))
            found: dict[int, int] = {}

            def running() -> bool:
                for w in pool.workers():
                    if w["busy"]:
                        found.update({p: t for p, t in _descendants(w["host_pid"]).items() if _runs_the_code(p)})
                return bool(found)

            await _until(running, 30, "the call runs in a sandbox")
            workers = pool.workers()
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await _until(lambda: not any(_running(p, t) for p, t in found.items()), 5, "the cancelled run is gone")
            assert [w["pid"] for w in pool.workers()] == [w["pid"] for w in workers]  # nobody was replaced
            assert all(w["busy"] == 0 for w in pool.workers())
        finally:
            await rt.aclose()

    asyncio.run(go())


def test_a_reply_is_checked_again_on_this_side() -> None:
    pytest.importorskip("ray", reason="the `ray` extra is not installed")
    from engine.sandbox import ray_pool

    limits = SandboxLimits(output_bytes=4)
    fields = {"stdout": "abcdefgh", "stderr": "xy", "returncode": 0, "timed_out": False, "truncated": False,
              "started": 1.0, "ended": 2.0, "killed": False, "dropped": 0, "a_field_from_a_newer_worker": 1}
    result = ray_pool._result({"id": 1, "result": fields}, limits)
    assert (result.stdout, result.stderr, result.truncated, result.dropped) == ("abcd", "xy", True, 4)
    with pytest.raises(SandboxError, match="could not set up"):
        ray_pool._result({"id": 1, "error": "sandbox", "message": "could not set up"}, limits)
    for bad in ({"id": 1}, {"id": 1, "result": {**fields, "stdout": 5}}, {"id": 1, "result": {"stdout": ""}}):
        with pytest.raises(SandboxError, match="malformed"):
            ray_pool._result(bad, limits)


@pytest.mark.slow
def test_a_worker_killed_mid_call_costs_one_retry_and_leaves_nothing_running(
    cluster: Any, server: CannedServer, tok: Any
) -> None:
    async def go() -> None:
        rt = Runtime.create(_config(server.url("slow"), slots=WORKERS), tokenizer=tok)
        seen: dict[int, int] = {}  # every worker, host and sandbox process this test saw: pid -> start time
        try:
            pool = await _ready_pool()
            for w in pool.workers():
                for pid in (w["pid"], w["host_pid"]):
                    stat = _stat(pid)
                    assert stat is not None
                    seen[pid] = stat[1]
            samples = [Sample(index=i, prompt=PROMPT, session_id=f"kill-{i}") for i in range(WORKERS)]
            batch = asyncio.ensure_future(asyncio.gather(*(run_sample(rt, s, dict(SAMPLING)) for s in samples)))
            victim: dict[str, Any] = {}
            sandbox: dict[int, int] = {}

            def running_a_call() -> bool:
                for w in pool.workers():
                    found = _descendants(w["host_pid"]) if w["busy"] else {}
                    if any(_runs_the_code(pid) for pid in found):  # not just the sandbox's start-up probe
                        victim.update(w)
                        sandbox.update(found)
                        return True
                return False

            await _until(running_a_call, 30, "a worker runs a sandboxed call")
            seen.update(sandbox)
            os.kill(victim["pid"], signal.SIGKILL)  # the actor's process dies mid-call
            # Its host sees the worker's end close and kills the run: well before the code would end.
            await _until(lambda: not any(_running(p, t) for p, t in sandbox.items()), SLOW_CALL_S / 3,
                         "the lost call's sandbox is gone")
            await _until(lambda: not _running(victim["host_pid"], seen[victim["host_pid"]]), SLOW_CALL_S / 3,
                         "the lost worker's host is gone")
            await asyncio.wait_for(batch, 90)

            stats = _check(samples, await rt.prompt_ids(PROMPT, rt.allowed_tools()), tok)  # every call answered
            assert sum(st.get("sandbox_workers_lost", 0) for st in stats) >= 1
            assert sum(st.get("sandbox_retries", 0) for st in stats) >= 1
            assert all(not st["errors"] for st in stats)
            workers = await pool.wait_ready(60)
            assert pool.replaced >= 1 and workers[victim["index"]]["pid"] != victim["pid"]
            for w in workers:
                for pid in (w["pid"], w["host_pid"]):
                    stat = _stat(pid)
                    if stat is not None:
                        seen[pid] = stat[1]
            # Shut down with a call running: Ray kills the workers, their hosts kill the run.
            last = asyncio.ensure_future(backend.run("import time\ntime.sleep(60)", SandboxLimits(timeout_s=60)))
            sandbox.clear()
            await _until(running_a_call, 30, "a worker runs a sandboxed call")
            seen.update(sandbox)
        finally:
            await rt.aclose()
            backend.shutdown()
        with pytest.raises(SandboxError, match="shut down"):
            await asyncio.wait_for(last, 10)
        # No worker, host or sandbox process of this test is left running.
        await _until(lambda: not [p for p, t in seen.items() if _running(p, t)], 10,
                     "every process of the pool is gone")

    asyncio.run(go())
