"""Full (gen-2) collections wait while samples are in flight; at the drain, one runs if it is due."""

from __future__ import annotations

import gc

from engine.loop.runtime import FullCollections


def _full_collections() -> int:
    return gc.get_stats()[2]["collections"]


def _churn(rounds: int = 200_000) -> None:
    """Allocate enough container objects to trigger many young collections (and, normally, full ones)."""
    keep = []
    for i in range(rounds):
        keep.append([i, {"i": i}])
        if len(keep) > 5000:
            keep.clear()


def test_no_full_collection_while_in_flight_and_the_collectors_own_schedule_after_the_drain() -> None:
    deferral = FullCollections()
    before_threshold = gc.get_threshold()
    gc.set_threshold(50, 2, 2)  # full collections every few young ones: easy to see
    try:
        baseline = _full_collections()
        _churn()
        assert _full_collections() > baseline, "the churn must trigger full collections when nothing defers them"
        deferral.enter()
        deferral.enter()  # two samples in flight
        during = _full_collections()
        _churn()
        assert _full_collections() == during
        deferral.exit()
        assert _full_collections() == during  # one sample still in flight
        deferral.exit()
        assert _full_collections() == during + 1  # the churn made one due: the drain runs it
        assert gc.get_threshold() == (50, 2, 2)  # and puts the thresholds back
        _churn()
        assert _full_collections() > during + 1  # the collector runs full collections again
    finally:
        gc.set_threshold(*before_threshold)


def test_the_drain_collects_only_when_a_full_collection_is_due_and_says_when() -> None:
    deferral = FullCollections()
    before_threshold = gc.get_threshold()
    gc.set_threshold(50, 2, 2)
    try:
        gc.collect()  # the count of young collections since the last full one starts at 0
        deferral.enter()
        before = _full_collections()
        deferral.exit()  # hardly anything allocated: nothing due
        assert _full_collections() == before and len(deferral.drains) == 1 and deferral.drains[-1][1] >= 0
        deferral.enter()
        _churn()  # many young collections while deferred: a full one is due
        during = _full_collections()
        deferral.exit()
        assert _full_collections() == during + 1 and len(deferral.drains) == 2
    finally:
        gc.set_threshold(*before_threshold)


def test_samples_handed_over_together_start_a_few_per_event_loop_turn_with_full_collections_deferred() -> None:
    import asyncio

    from engine.aio import Gate
    from engine.settings import EngineConfig
    from engine.loop import runtime

    class Stub:  # the two fields `in_flight` reads
        cfg = EngineConfig()
        start_gate = Gate(runtime.START_GATE)

    async def go() -> tuple[list[int], bool]:
        Stub.start_gate = Gate(runtime.START_GATE)
        started: list[int] = []
        deferred_before_start = []

        async def sample(i: int) -> None:
            async with runtime.Runtime.in_flight(Stub()):  # type: ignore[arg-type]
                deferred_before_start.append(gc.get_threshold()[2] == 1 << 30)
                started.append(i)

        tasks = [asyncio.ensure_future(sample(i)) for i in range(200)]
        counts = []
        while len(started) < 200:
            await asyncio.sleep(0)
            counts.append(len(started))
        await asyncio.gather(*tasks)
        return counts, all(deferred_before_start)

    counts, deferred = asyncio.run(go())
    steps = [b - a for a, b in zip([0, *counts], counts)]
    assert max(steps) <= runtime.START_GATE and len(counts) >= 200 // runtime.START_GATE
    assert deferred
