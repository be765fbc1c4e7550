"""engine.aio: `within` (one deadline, as `asyncio.timeout` does it), `Deadlines` (many on one timer) and `Gate`
(a cheap semaphore)."""

from __future__ import annotations

import asyncio

import pytest

from engine.aio import Deadlines, Gate, within


async def stubborn() -> str:
    """Answers the cancel with a result."""
    try:
        await asyncio.sleep(5)
    except asyncio.CancelledError:
        return "kept"
    return "slept"


def test_within_returns_the_result_or_raises_timeout_and_leaves_no_cancel_behind() -> None:
    async def main() -> None:
        assert await within(1.0, asyncio.sleep(0.01, result=5)) == 5
        with pytest.raises(TimeoutError):
            await within(0.02, asyncio.sleep(5))
        assert asyncio.current_task().cancelling() == 0  # the deadline's cancel was taken back
        with pytest.raises(TimeoutError):  # nested: the inner deadline is the one that fires
            await within(1.0, within(0.02, asyncio.sleep(5)))
        with pytest.raises(TimeoutError):  # nested: the outer one fires through the inner
            await within(0.02, within(1.0, asyncio.sleep(5)))
        assert asyncio.current_task().cancelling() == 0

        assert await within(0.02, stubborn()) == "kept"
        assert asyncio.current_task().cancelling() == 0  # taken back even though no cancel came out
        await asyncio.sleep(0.01)  # and the task still runs: no cancel was left pending

    asyncio.run(main())


@pytest.mark.parametrize("bound", ["within", "Deadlines"])
def test_a_cancel_from_elsewhere_stays_a_cancel_even_when_the_deadline_fires_too(bound: str) -> None:
    deadline_of = within if bound == "within" else Deadlines().within

    async def cancelled_at(cancel_after: float, deadline: float) -> None:
        asyncio.get_running_loop().call_later(cancel_after, asyncio.current_task().cancel)
        await deadline_of(deadline, asyncio.sleep(5))

    async def main() -> None:
        for cancel_after, deadline in ((0.02, 1.0), (0.03, 0.03)):
            task = asyncio.ensure_future(cancelled_at(cancel_after, deadline))
            with pytest.raises(asyncio.CancelledError):
                await task
            assert task.cancelled()

    asyncio.run(main())


def test_deadlines_time_out_each_await_at_its_own_deadline_on_one_timer() -> None:
    """What `within` does, for many awaits at once: each times out at its own deadline, the
    cancel taken back; the ones that finish in time are untouched."""
    deadlines = Deadlines()

    async def one(seconds: float, sleep: float) -> str:
        try:
            return await deadlines.within(seconds, asyncio.sleep(sleep, result="slept"))
        except TimeoutError:
            assert asyncio.current_task().cancelling() == 0
            return "timed out"

    async def kept() -> str:
        result = await deadlines.within(0.05, stubborn())
        assert asyncio.current_task().cancelling() == 0  # taken back though no cancel came out
        await asyncio.sleep(0.01)  # and the task still runs
        return result

    async def main() -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        tasks = [asyncio.ensure_future(one(d, s)) for d, s in ((0.3, 5), (0.1, 5), (5, 0.01), (0.2, 0.05), (0.5, 5))]
        ends = {}
        for task in asyncio.as_completed(tasks):
            result = await task
            ends.setdefault(result, []).append(round(loop.time() - started, 1))
        assert ends["slept"] == [0.0, 0.1] and ends["timed out"] == [0.1, 0.3, 0.5]
        assert await asyncio.ensure_future(kept()) == "kept"

    asyncio.run(main())
    asyncio.run(main())  # another loop: the same object starts afresh


# -- the pool's gate: at most n requests at once, waiters in order, no slot lost to a cancel ------
def test_the_gate_bounds_holders_serves_waiters_in_order_and_loses_no_slot_to_a_cancel() -> None:
    async def main() -> None:
        gate, order, holding = Gate(2), [], 0
        most = 0

        async def hold(name: str, seconds: float) -> None:
            nonlocal holding, most
            await gate.acquire()
            try:
                holding += 1
                most = max(most, holding)
                order.append(name)
                await asyncio.sleep(seconds)
            finally:
                holding -= 1
                gate.release()

        await asyncio.gather(*(hold(str(i), 0.01) for i in range(6)))
        assert most == 2 and order == [str(i) for i in range(6)]  # FIFO beyond the first two

        # A waiter cancelled while it waits gives its place up.
        one = Gate(1)
        await one.acquire()
        waiting = asyncio.ensure_future(one.acquire())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        one.release()
        await asyncio.wait_for(one.acquire(), 1)  # the slot came back, not to the cancelled waiter

        # A waiter cancelled just after it was handed the slot passes it on.
        handed = asyncio.ensure_future(one.acquire())
        await asyncio.sleep(0)
        one.release()  # the slot goes to `handed`, which has not run yet
        handed.cancel()
        await asyncio.gather(handed, return_exceptions=True)
        assert handed.cancelled()
        await asyncio.wait_for(one.acquire(), 1)  # not lost with the cancelled task

    asyncio.run(main())
