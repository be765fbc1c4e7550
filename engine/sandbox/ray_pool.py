"""Sandboxed calls on a Ray cluster: a pool of sandbox workers (Ray actors) and the dispatch to them.

Each worker is a Ray actor that runs this package's own local sandbox, through a host
process of its own (`engine.sandbox.host`, which cleans up after a worker that dies). Ray
places the workers on the cluster's nodes (spread, sized by CPUs, optionally only on nodes
offering a custom resource); this module only chooses among them:

* A call goes to the least-loaded worker that has a free slot (`ceil(cpus)` calls each), ties
  going to the one that has run fewest calls, so a batch spreads over every node. A session's
  calls (`session_key`) stay on one worker while it lives.
* When every worker is busy the call waits, in a bounded queue (`queue` calls; one more is
  refused as `sandbox_busy`) and for at most its own time limit. The wait is counted in the
  call's statistics (`sandbox_wait_s`).
* Limits are enforced on both sides: the worker's sandbox enforces them as locally, and here
  a reply must come within the time limit plus `HANG_MARGIN_S` (else the worker counts as
  hung: it is killed and replaced, and the call answers `worker_hung`) and its output is
  capped again.
* A worker that dies mid-call (node lost, actor killed) costs that call one retry on another
  worker with what is left of its time limit, then `worker_lost`; the dead worker is replaced.
  `sandbox_workers_lost` and `sandbox_retries` count what happened, per call.

Dispatch awaits Ray's object refs on the event loop: nothing here blocks it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import os
import socket
import subprocess
import sys
import time
from typing import Any

import attrs
import ray
from ray import exceptions as ray_errors

from engine.sandbox import host as host_protocol
from engine.sandbox.dispatch import Busy, CallFailed, Counter, Dispatcher, RaySettings, Slot, no_count
from engine.sandbox.runner import SandboxError, SandboxLimits, SandboxResult

log = logging.getLogger(__name__)

HANG_MARGIN_S = 3.0  # a reply later than the time limit plus this: the worker hung (under the engine's 5 s backstop)
HOST_START_S = 60.0  # the host's interpreter start, on a loaded node
MIN_RETRY_S = 0.5  # a retry needs at least this much of the call's time limit left
START_TIMEOUT_S = 120.0  # a worker not up by then is replaced
MAX_START_FAILURES = 3  # a slot whose workers failed to start this often in a row stays empty

# Ray errors that mean the worker (or its node) is gone, not that the code failed.
LOST: tuple[type[BaseException], ...] = tuple(
    getattr(ray_errors, name) for name in ("RayActorError", "WorkerCrashedError", "ObjectLostError",
                                           "NodeDiedError", "LocalRayletDiedError") if hasattr(ray_errors, name)
)


class SandboxWorker:
    """The Ray actor: runs sandboxed code through its host process, several calls at once."""

    def __init__(self) -> None:
        self._host_pid = 0
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 0
        self._starting: asyncio.Lock | None = None

    async def ready(self) -> dict[str, Any]:
        """Start the host; say where this worker runs."""
        await self._ensure_host()
        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), "host_pid": self._host_pid}

    async def run(self, code: str, limits: dict[str, Any], stdin: bytes | None) -> dict[str, Any]:
        """Run one call in the host's sandbox; the host's reply (result or error)."""
        await self._ensure_host()
        assert self._writer is not None
        self._next_id += 1
        call_id = self._next_id
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = answer
        try:
            self._writer.write(host_protocol.request(call_id, code, limits, stdin))
            await self._writer.drain()
            return await answer
        except asyncio.CancelledError:  # ray.cancel: the host kills the run and cleans up
            self._send({"cancel": call_id})
            raise
        finally:
            self._pending.pop(call_id, None)

    def _send(self, message: dict[str, Any]) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(host_protocol.encode(message))

    async def _ensure_host(self) -> None:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._host_pid:
                return
            mine, theirs = socket.socketpair()
            # The host detaches (forks, and the first process exits) into a session of its own: Ray
            # kills a worker's child processes and process group with it, and the host must outlive
            # this worker, for it is what kills the sandboxes when this worker dies.
            starter = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "engine.sandbox.host", str(theirs.fileno()), pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            )
            theirs.close()
            reader, self._writer = await asyncio.open_connection(sock=mine, limit=host_protocol.LINE_LIMIT)
            hello = await asyncio.wait_for(reader.readline(), HOST_START_S)
            await starter.wait()
            if not hello:
                raise RuntimeError(f"the sandbox host did not start (exit code {starter.returncode})")
            self._host_pid = int(json.loads(hello)["pid"])
            asyncio.get_running_loop().create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                reply = json.loads(line)
                answer = self._pending.get(reply.get("id"))
                if answer is not None and not answer.done():
                    answer.set_result(reply)
        except Exception:  # whatever broke the channel, the worker cannot go on
            log.exception("sandbox host channel broke")
        # The host is gone, and with it every run: this worker dies too, so the pool retries
        # its calls elsewhere and replaces it.
        os._exit(1)


_Actor = ray.remote(SandboxWorker)


class _Lost(Exception):
    pass


class _Hung(Exception):
    pass


def attach() -> None:
    """Join the Ray cluster: the one this process already joined (slime's), else the running one."""
    if ray.is_initialized():
        return
    try:
        ray.init(address="auto", log_to_driver=False)
    except ConnectionError as exc:
        raise RuntimeError(
            "engine_sandbox_backend=ray: no running Ray cluster to attach to (the engine never starts one). "
            f"Start it first (`ray start --head`) or set RAY_ADDRESS; ray said: {exc}"
        ) from exc


def check_capacity(settings: RaySettings) -> None:
    """Refuse settings no node of the cluster can host (RuntimeError), warn about a partial fit."""
    total = ray.cluster_resources()
    if settings.resource is not None and total.get(settings.resource, 0) < 1:
        raise RuntimeError(
            f"engine_sandbox_resource={settings.resource!r}: no node of the Ray cluster offers this resource; "
            f"start the CPU nodes with `ray start --resources='{{\"{settings.resource}\": N}}'`"
        )
    if total.get("CPU", 0) < settings.cpus:
        raise RuntimeError(
            f"engine_sandbox_worker_cpus={settings.cpus:g}: the Ray cluster has {total.get('CPU', 0):g} CPUs in all"
        )
    fits = total.get("CPU", 0) // settings.cpus
    if settings.resource is not None:
        fits = min(fits, total[settings.resource])
    if fits < settings.workers:
        log.warning("the Ray cluster fits %d of %d sandbox workers now; the rest wait for room", fits, settings.workers)


class RayPool:
    """The sandbox workers of this process and the calls to them."""

    def __init__(self, settings: RaySettings) -> None:
        self.settings = settings
        self.slots = [Slot(i) for i in range(settings.workers)]
        self.dispatcher = Dispatcher(self.slots, max(1, math.ceil(settings.cpus)), settings.queue)
        self.closed = False
        self.replaced = 0
        self.calls_by_node: collections.Counter[str] = collections.Counter()

    @classmethod
    def start(cls, settings: RaySettings) -> RayPool:
        """Attach to the cluster, check it can host the workers, and start them (they come up meanwhile)."""
        attach()
        check_capacity(settings)
        pool = cls(settings)
        for slot in pool.slots:
            pool._spawn(slot)
        where = f" on nodes with resource {settings.resource!r}" if settings.resource else ""
        log.info("sandbox on Ray: %d workers of %g CPUs (%d calls each)%s", settings.workers, settings.cpus,
                 pool.dispatcher.per_worker, where)
        return pool

    def _options(self) -> dict[str, Any]:
        s = self.settings
        options: dict[str, Any] = {
            "num_cpus": s.cpus, "max_restarts": 0, "max_task_retries": 0, "scheduling_strategy": "SPREAD",
            "max_concurrency": self.dispatcher.per_worker + 4,  # the calls, plus ready() and cancels
        }
        if s.resource is not None:
            options["resources"] = {s.resource: 1}
        return options

    def _spawn(self, slot: Slot) -> None:
        slot.handle = _Actor.options(**self._options()).remote()
        slot.ready = slot.handle.ready.remote()
        slot.generation += 1
        slot.state, slot.node, slot.pid, slot.host_pid, slot.watcher = "starting", "", 0, 0, None

    def _watch(self) -> None:
        """Bring up, on this event loop, every worker still starting (once per worker)."""
        for slot in self.slots:
            if slot.state == "starting" and (slot.watcher is None or slot.watcher.done()):
                slot.watcher = asyncio.get_running_loop().create_task(self._bring_up(slot, slot.generation))

    async def _bring_up(self, slot: Slot, generation: int) -> None:
        try:
            info = await asyncio.wait_for(_awaitable(slot.ready), START_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - died while starting, or never placed
            if slot.generation == generation and not self.closed:
                slot.start_failures += 1
                log.warning("sandbox worker %d failed to start (%s: %s)", slot.index, type(exc).__name__, exc)
                self._replace(slot)
            return
        if slot.generation == generation and slot.state == "starting":
            slot.state, slot.node, slot.pid, slot.host_pid = "up", info["node"], info["pid"], info["host_pid"]
            slot.start_failures = 0
            self.dispatcher.changed()

    def _replace(self, slot: Slot) -> None:
        """Kill the slot's worker (its host cleans up after it) and start another in its place."""
        _kill(slot.handle)
        if self.closed:
            return
        if slot.start_failures >= MAX_START_FAILURES:
            slot.state, slot.handle = "empty", None
            log.error("sandbox worker %d failed to start %d times; its slot stays empty", slot.index,
                      slot.start_failures)
            return
        self.replaced += 1
        self._spawn(slot)
        self._watch()

    async def wait_ready(self, timeout: float = START_TIMEOUT_S) -> list[dict[str, Any]]:
        """Wait until every worker is up (or the timeout passes); `workers()` then."""
        self._watch()
        deadline = time.monotonic() + timeout
        while any(s.state == "starting" for s in self.slots) and time.monotonic() < deadline:
            self._watch()
            await asyncio.sleep(0.05)
        return self.workers()

    async def run(self, code: str, limits: SandboxLimits, *, stdin: bytes | None = None,
                  session_key: str | None = None, count: Counter = no_count) -> SandboxResult:
        """Run `code` on a worker: one retry on another when the worker dies, then `worker_lost`."""
        if self.closed:
            raise SandboxError("the Ray sandbox pool was shut down")
        self._watch()
        started: float | None = None  # when the first attempt began to run: the call's time limit counts from it
        for attempt in range(2):
            left = limits.timeout_s if started is None else limits.timeout_s - (time.monotonic() - started)
            if started is not None and left < MIN_RETRY_S:
                break
            waited = time.monotonic()
            try:
                slot = await self.dispatcher.acquire(session_key, left)
            except Busy as exc:
                if self.closed:
                    raise SandboxError("the Ray sandbox pool was shut down") from None
                raise CallFailed("sandbox_busy", f"the sandbox is busy: {exc}") from None
            finally:
                count("sandbox_wait_s", time.monotonic() - waited)
            try:
                if started is None:
                    started, run_limits = time.monotonic(), limits
                else:  # a retry has what is left of the call's time limit
                    left = limits.timeout_s - (time.monotonic() - started)
                    if left < MIN_RETRY_S:
                        break
                    run_limits = attrs.evolve(limits, timeout_s=left)
                handle, node = slot.handle, slot.node
                reply = await self._call(handle, code, run_limits, stdin)
                self.calls_by_node[node] += 1
                return _result(reply, run_limits)
            except _Lost as exc:
                count("sandbox_workers_lost")
                log.warning("sandbox worker %d lost mid-call (%s); replacing it", slot.index, exc)
                if slot.handle is handle:
                    self._replace(slot)
                if self.closed:
                    raise SandboxError("the Ray sandbox pool was shut down during the call") from None
                if attempt == 0:
                    count("sandbox_retries")
            except _Hung:
                count("sandbox_workers_hung")
                log.warning("sandbox worker %d did not answer within %.1f s; replacing it", slot.index,
                            run_limits.timeout_s + HANG_MARGIN_S)
                if slot.handle is handle:
                    self._replace(slot)
                raise CallFailed(
                    "worker_hung", f"the sandbox worker did not answer within {limits.timeout_s:g} seconds"
                ) from None
            finally:
                self.dispatcher.release(slot)
        raise CallFailed("worker_lost", "the sandbox worker running this code was lost (node lost or worker "
                                             "killed), and so was the retry; the code's result is unknown")

    async def _call(self, handle: Any, code: str, limits: SandboxLimits, stdin: bytes | None) -> dict[str, Any]:
        ref = handle.run.remote(code, attrs.asdict(limits), stdin)
        try:
            return await asyncio.wait_for(_awaitable(ref), limits.timeout_s + HANG_MARGIN_S)
        except asyncio.TimeoutError:
            raise _Hung() from None
        except asyncio.CancelledError:  # the engine gave up on the call: the worker kills the run
            _cancel(ref)
            raise
        except LOST as exc:
            raise _Lost(f"{type(exc).__name__}") from exc
        except ray_errors.RayTaskError as exc:  # a bug in the worker's own code, not the sandboxed code's
            raise SandboxError(f"the sandbox worker failed: {exc}") from exc

    def forget(self, key: str) -> None:
        """A session ended."""
        self.dispatcher.forget(key)

    def workers(self) -> list[dict[str, Any]]:
        """Each slot's worker: where it runs and how busy it is."""
        return [{"index": s.index, "state": s.state, "node": s.node, "pid": s.pid, "host_pid": s.host_pid,
                 "busy": s.busy, "calls": s.calls, "generation": s.generation} for s in self.slots]

    def describe(self) -> dict[str, Any]:
        """A summary for logs: workers up, per node, calls per node, replacements."""
        up = [s for s in self.slots if s.state == "up"]
        return {"workers": len(self.slots), "up": len(up), "per_worker": self.dispatcher.per_worker,
                "nodes": dict(collections.Counter(s.node for s in up)), "calls_by_node": dict(self.calls_by_node),
                "replaced": self.replaced, "waiting": self.dispatcher.waiting}

    def close(self) -> None:
        """Kill every worker (each host then cleans up its sandboxes and exits)."""
        self.closed = True
        for slot in self.slots:
            _kill(slot.handle)
            slot.state, slot.handle = "empty", None
        self.dispatcher.close()


async def _awaitable(ref: Any) -> Any:
    return await ref


def _kill(handle: Any) -> None:
    if handle is None or not ray.is_initialized():
        return
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already dead, or Ray is shutting down
        pass


def _cancel(ref: Any) -> None:
    try:
        ray.cancel(ref)
    except Exception:  # noqa: BLE001 - already finished or its worker gone
        pass


def _capped(text: Any, limit: int) -> tuple[str, int]:
    """`text` cut to `limit` characters, and how many were cut: the worker's cap, checked again here.

    The sandbox keeps at most `limit` bytes per stream and decodes them, so an honest reply never
    has more characters than that (counting bytes instead would cut replacement characters)."""
    if not isinstance(text, str):
        raise SandboxError("the sandbox worker sent a malformed reply")
    if len(text) <= limit:
        return text, 0
    return text[:limit], len(text) - limit


def _result(reply: dict[str, Any], limits: SandboxLimits) -> SandboxResult:
    """The host's reply as a `SandboxResult`, or the `SandboxError` it reports."""
    if reply.get("error") is not None:
        raise SandboxError(str(reply.get("message") or reply["error"]))
    fields = reply.get("result")
    if not isinstance(fields, dict):
        raise SandboxError("the sandbox worker sent a malformed reply")
    names = {f.name for f in attrs.fields(SandboxResult)}
    fields = {k: v for k, v in fields.items() if k in names}
    stdout, cut_out = _capped(fields.get("stdout"), limits.output_bytes)
    stderr, cut_err = _capped(fields.get("stderr"), limits.output_bytes)
    if cut_out or cut_err:
        fields.update(truncated=True, dropped=int(fields.get("dropped", 0)) + cut_out + cut_err)
    try:
        return SandboxResult(**{**fields, "stdout": stdout, "stderr": stderr})
    except TypeError as exc:
        raise SandboxError(f"the sandbox worker sent a malformed reply: {exc}") from exc
