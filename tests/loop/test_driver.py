"""The driver's steps, one at a time, on a stub runtime."""

from __future__ import annotations

import types
from typing import Any

from engine.settings import EngineConfig
from engine.loop import driver
from engine.machine import actions as a
from engine.machine.rollout import Inputs, Rollout, TurnScratch
from engine.sglang.wire import Failure
from tests.conftest import run


def test_the_last_turn_s_scratch_is_let_go_before_the_request_waits() -> None:
    """A sample waiting on the server holds no earlier turn's reply, text or parse (memory, figure 5)."""
    r = Rollout(Inputs(EngineConfig(), prompt="p", sampling_params={"max_new_tokens": 8}))
    r.prompt_ids = (1, 2, 3)
    a.reset_rollout(r)
    r.turn = TurnScratch(text="the last turn, decoded", observation_ids=[4, 5])
    seen: list[tuple[str, list[int]]] = []

    async def generate(*args: Any, **kwargs: Any) -> Failure:
        seen.append((r.turn.text, r.turn.observation_ids))
        return Failure("unavailable", "the server is down")

    rt = types.SimpleNamespace(client=types.SimpleNamespace(generate=generate))
    trigger = run(driver.step_generate(rt, r))  # type: ignore[arg-type]
    assert seen == [("", [])]
    assert trigger == driver.FAILURE_TRIGGERS["unavailable"] and r.record.error == "unavailable: the server is down"
