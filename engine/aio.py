"""Two asyncio helpers the wire and the loop share: one deadline for an await (`within`) and a
counting gate cheaper than `asyncio.Semaphore` (`Gate`)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(seconds: float, awaitable: Awaitable[T]) -> T:
    """Await with one deadline for all of it; raises `TimeoutError` when it passes."""
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, seconds)
    async with timeout(seconds):
        return await awaitable


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
