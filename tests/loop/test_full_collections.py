"""Full (gen-2) collections wait while samples are in flight, and resume when they drain."""

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
        assert _full_collections() == during  # the drain forces none
        assert gc.get_threshold() == (50, 2, 2)  # it puts the thresholds back
        _churn()
        assert _full_collections() > during  # and the collector runs full collections again
    finally:
        gc.set_threshold(*before_threshold)
