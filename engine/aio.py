"""Asyncio helpers the wire and the loop share: one deadline for an await (`within`), many
deadlines rarely reached on one timer (`Deadlines`), and a counting gate cheaper than
`asyncio.Semaphore` (`Gate`)."""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")
# How early the loop may run a timer (it runs those due within its clock's resolution).
EARLY = max(time.get_clock_info("monotonic").resolution, 1e-3)


async def within(seconds: float, awaitable: Awaitable[T]) -> T:
    """Await with one deadline for all of it; raises `TimeoutError` when it passes."""
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, seconds)
    async with timeout(seconds):
        return await awaitable


class Deadlines:
    """`within` for awaits whose deadline is a backstop, rarely reached: a dict entry each instead
    of a loop timer each. `asyncio.timeout` makes, schedules and cancels a timer per await (~10 us
    on the loop's heap, where cancelled timers wait to be swept); here one timer is armed at the
    earliest deadline and, when it fires, cancels the awaits past theirs and is armed again at
    the next. Each await runs in a task of its own (the deadline cancels the task). What a
    deadline that passes does is what `asyncio.timeout`'s does: `TimeoutError`, the cancel taken
    back; a cancel from elsewhere stays a cancel. One loop at a time (a new loop starts afresh).
    """

    __slots__ = ("_due", "_expired", "_loop", "_timer", "_armed")

    def __init__(self) -> None:
        self._due: dict[asyncio.Task[object], float] = {}
        self._expired: set[asyncio.Task[object]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._armed = math.inf  # when the timer fires

    async def within(self, seconds: float, awaitable: Awaitable[T]) -> T:
        """Await with a deadline `seconds` from now; raises `TimeoutError` when it passes."""
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        if task is None or task in self._due:  # not in a task, or nested: the plain way
            return await within(seconds, awaitable)
        if loop is not self._loop:
            self._due.clear()
            self._expired.clear()
            self._loop, self._timer, self._armed = loop, None, math.inf
        when = loop.time() + seconds
        self._due[task] = when
        if when < self._armed:
            self._arm(when)
        cancelling = task.cancelling()
        try:
            result = await awaitable
        except asyncio.CancelledError as exc:
            if task in self._expired:
                self._expired.discard(task)
                if task.uncancel() <= cancelling:  # the deadline's cancel, and no other: a timeout
                    raise TimeoutError from exc
            raise
        finally:
            self._due.pop(task, None)
            if task in self._expired:  # past its deadline, yet it ended another way: take the cancel back
                self._expired.discard(task)
                task.uncancel()
        return result

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        self._timer, self._armed = self._loop.call_at(when, self._fire), when

    def _fire(self) -> None:
        self._timer, self._armed = None, math.inf
        now = self._loop.time() if self._loop is not None else 0.0
        later = math.inf
        for task, when in self._due.items():
            if task in self._expired:
                continue
            if when <= now + EARLY:
                self._expired.add(task)
                task.cancel()
            else:
                later = min(later, when)
        if later < math.inf:
            self._arm(later)


class Gate:
    """At most `n` holders at once; the rest wait in order. A free slot is taken with no future
    and no generator (what `asyncio.Semaphore.acquire` builds each time on Python 3.11), and a
    released slot passes straight to the first waiter."""

    __slots__ = ("_free", "_waiters")

    def __init__(self, n: int) -> None:
        self._free = n
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        """Take a slot, waiting for one if none is free."""
        if self._free > 0:
            self._free -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed a slot as it was cancelled: pass it on
            else:
                try:
                    self._waiters.remove(waiter)
                except ValueError:  # release() already dropped it
                    pass
            raise

    def release(self) -> None:
        """Give a slot back: to the first waiter still waiting, else to the free count."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1
