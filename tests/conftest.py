"""Fixtures, and the recorder of every machine edge the suite takes (see test_edge_coverage)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import respx.mocks

from engine import tools
from engine.machine import RolloutMachine

TAKEN_EDGES: set[tuple[str, str, str]] = set()
_original_fire = RolloutMachine.fire


def _recording_fire(self: RolloutMachine, r: Any, trigger: str) -> bool:
    ok = _original_fire(self, r, trigger)
    if ok:
        TAKEN_EDGES.add(tuple(r.record.trace[-1]))
    return ok


RolloutMachine.fire = _recording_fire  # type: ignore[method-assign]

# respx mocks above the transport, where httpx's client picks it (`respx.mock(using="httpx")` for
# every mock): the engine's requests then run the production path down to the transport.
respx.mocks.DEFAULT_MOCKER = "httpx"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The edge-coverage check judges what every other test fired, so it runs last."""
    last = [item for item in items if item.module is not None and item.module.__name__ == "tests.test_edge_coverage"]
    for item in last:
        items.remove(item)
    items.extend(last)


@pytest.fixture
def fake_interpreter() -> Iterator[Any]:
    """Replace the code interpreter by an in-process fake for the test's duration."""
    from tests.support.helpers import FakeInterpreter

    with tools.registry.registered(FakeInterpreter()) as fake:
        yield fake


def run(coro: Any) -> Any:
    """Run a coroutine on a fresh event loop (the suite needs no asyncio plugin)."""
    return asyncio.run(coro)
