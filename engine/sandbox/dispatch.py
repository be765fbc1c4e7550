"""Choosing a sandbox worker for a call: least loaded, sticky sessions, a bounded wait. No Ray in here.

Kept apart from `engine.sandbox.ray_pool` so the choice can be tested without a cluster, and
without Ray installed. A `Slot` is one place in the pool; the worker filling it is replaced
when lost, and `generation` tells the workers of one slot apart (a session held by a lost
worker moves to another). Everything here runs on one event loop, so it needs no locks.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

import attrs
from attrs import validators as v

Counter = Callable[[str, float], None]  # adds to a statistic of the running call (a tool passes `tools.count`)


def no_count(key: str, amount: float = 1) -> None:
    """The counter of a call nobody counts."""


MAX_SESSIONS = 65536  # sticky sessions remembered; the oldest is forgotten first (release forgets too)


@attrs.frozen
class RaySettings:
    """How the Ray pool is sized and placed.

    `workers` actors, each reserving `cpus` CPUs (and running `ceil(cpus)` calls at once);
    `resource`, when set, is a custom resource every worker also takes one unit of, so the
    workers land only on nodes started with it (CPU nodes, not the GPU nodes that train).
    `queue` bounds the calls waiting for a free worker; one more is refused (`sandbox_busy`).
    """

    workers: int = attrs.field(default=4, validator=v.gt(0))
    cpus: float = attrs.field(default=1.0, validator=v.gt(0))
    resource: str | None = attrs.field(default=None, validator=v.optional(v.min_len(1)))
    queue: int = attrs.field(default=256, validator=v.ge(0))


class CallFailed(Exception):
    """The backend could give this call no answer of the code's (`kind`: sandbox_busy, worker_hung,
    worker_lost); the calling tool answers the model with an error observation of that kind."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class Busy(Exception):
    """No worker could take the call: the queue is full, or no slot freed in time."""


@attrs.define(eq=False)
class Slot:
    """One place in the pool and the worker filling it now (a lost worker is replaced in its slot)."""

    index: int
    handle: Any = None
    ready: Any = None  # the worker's `ready()` ref while it starts
    generation: int = 0
    state: str = "starting"  # starting | up | empty
    node: str = ""
    pid: int = 0
    host_pid: int = 0
    busy: int = 0
    calls: int = 0
    start_failures: int = 0
    watcher: asyncio.Task[None] | None = None


class Dispatcher:
    """Least-loaded choice of a worker, sticky sessions, the bounded wait for a free slot. No Ray here."""

    def __init__(self, slots: list[Slot], per_worker: int, queue: int) -> None:
        self.slots = slots
        self.per_worker = per_worker
        self.queue = queue
        self.waiting = 0
        self.closed = False
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._sessions: collections.OrderedDict[str, tuple[Slot, int]] = collections.OrderedDict()

    def pick(self, key: str | None) -> Slot | None:
        """The worker this call should go to now, or None if it must wait."""
        if key is not None and (held := self._sessions.get(key)) is not None:
            slot, generation = held
            if slot.state == "up" and slot.generation == generation:
                self._sessions.move_to_end(key)
                return slot if slot.busy < self.per_worker else None
            del self._sessions[key]  # its worker is gone: the session moves to another
        free = [s for s in self.slots if s.state == "up" and s.busy < self.per_worker]
        if not free:
            return None
        best = min(free, key=lambda s: (s.busy, s.calls))
        if key is not None:
            self._sessions[key] = (best, best.generation)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return best

    async def acquire(self, key: str | None, timeout: float) -> Slot:
        """Take a slot, waiting at most `timeout` seconds in the bounded queue; raises `Busy`."""
        slot = self.pick(key)
        if slot is None:
            if self.closed:
                raise Busy("the sandbox pool was shut down")
            if self.waiting >= self.queue:
                raise Busy(f"{self.waiting} calls already wait for a sandbox worker (the queue's bound)")
            self.waiting += 1
            try:
                slot = await self._wait(key, timeout)
            finally:
                self.waiting -= 1
        slot.busy += 1
        slot.calls += 1
        return slot

    async def _wait(self, key: str | None, timeout: float) -> Slot:
        deadline = time.monotonic() + timeout
        while (slot := self.pick(key)) is None:
            if self.closed:
                raise Busy("the sandbox pool was shut down")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                up = sum(s.state == "up" for s in self.slots)
                raise Busy(f"no sandbox worker was free for {timeout:g} s ({up} of {len(self.slots)} workers up)")
            woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(woken)
            try:
                await asyncio.wait_for(woken, remaining)
            except asyncio.TimeoutError:
                pass
            finally:
                if woken in self._waiters:
                    self._waiters.remove(woken)
        return slot

    def release(self, slot: Slot) -> None:
        """A call on `slot` ended."""
        slot.busy = max(0, slot.busy - 1)
        self.changed()

    def changed(self) -> None:
        """A slot freed or a worker came up: every waiter looks again, oldest first."""
        while self._waiters:
            woken = self._waiters.popleft()
            if not woken.done():
                try:
                    woken.set_result(None)
                except RuntimeError:  # its event loop is closed: nobody waits there any more
                    pass

    def close(self) -> None:
        """No worker will come any more: every waiting call gives up now."""
        self.closed = True
        self.changed()

    def forget(self, key: str) -> None:
        """A session ended."""
        self._sessions.pop(key, None)
