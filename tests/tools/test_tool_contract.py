"""A tool's `create`, `execute` and `release` are awaited by the engine: a plain `def` is refused at
registration, naming the tool and the method, instead of failing every sample that calls it."""

from __future__ import annotations

from typing import Any

import pytest

from engine import tools


def _tool(plain: str) -> tools.Tool:
    class Counter(tools.Tool):
        name = "counter_contract"
        description = "counts"

        async def create(self) -> dict[str, int]:
            return {"n": 0}

        async def release(self, session: dict[str, int]) -> None:
            session.clear()

        async def execute(self, session: dict[str, int], **arguments: Any) -> str:
            session["n"] += 1
            return str(session["n"])

    def plain_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return {"n": 0}

    plain_method.__name__ = plain
    setattr(Counter, plain, plain_method)
    return Counter()


@pytest.mark.parametrize("method", ["create", "release", "execute"])
def test_a_plain_def_is_refused_at_registration_naming_tool_and_method(method: str) -> None:
    with pytest.raises(TypeError, match=rf"tool 'counter_contract': {method}\(\) must be `async def` \(the engine "
                                        rf"awaits it\); it is a plain def in "):
        tools.register(_tool(method))
    assert "counter_contract" not in tools.names()


async def _async_create(self: Any) -> dict[str, int]:
    return {"n": 0}


def test_the_same_tool_with_every_method_async_registers() -> None:
    tool = _tool("create")
    type(tool).create = _async_create  # type: ignore[method-assign]
    try:
        assert tools.register(tool) is tool and "counter_contract" in tools.names()
    finally:
        tools.registry.unregister("counter_contract")
