"""Smoke test of the benchmark's figure 8 (an agent's calls as its history grows): tiny sizes, the
rows and what they are made of, never a timing assertion."""

from __future__ import annotations

import asyncio

import attrs
import pytest

from engine.local.bench.agent import (
    EARLY,
    LATE,
    SCENARIO,
    agent_figures,
    agent_scenario,
    around,
    door_side,
    session_side,
)
from engine.local.bench.common import Sizes
from engine.local.bench.server import CannedServer
from engine.profiles.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow
TINY = attrs.evolve(Sizes.small(), agent_sessions=2, agent_turns=LATE + 2, repeats=1)


def test_figure_8_reads_every_round_of_every_side() -> None:
    tok = load_tokenizer()
    with CannedServer({SCENARIO: agent_scenario(tok, TINY.agent_turns)}) as server:
        per_call = asyncio.run(session_side(server, tok, TINY))
        door_calls, door_turn = asyncio.run(door_side(server, tok, TINY))
        figures = asyncio.run(agent_figures(server, tok, TINY))
    assert len(per_call) == len(door_calls) == TINY.agent_turns and min(per_call) > 0 and door_turn > 0
    assert [f.key for f in figures] == ["agent_call_cpu_growth", "agent_door_call_growth", "agent_turn_cpu"]
    for growth in figures[:2]:  # in process, and through the door: both judged
        assert growth.value > 0 and growth.floor and growth.passed in (True, False) and growth.threshold == 1.5
        assert f"turn {LATE}" in growth.title and f"turn {EARLY}" in growth.floor_label
    assert figures[2].passed is None  # the door against the engine's loop: information
    # each turn's figure is the median of the rounds around it, the turn's own among them
    rounds = [float(k) for k in range(1, TINY.agent_turns + 1)]
    assert around(rounds, EARLY) == EARLY and around(rounds, LATE) == LATE
