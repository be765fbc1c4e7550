"""Smoke test of `python -m engine bench`: tiny sizes, result structure, never a timing assertion."""

from __future__ import annotations

import asyncio

import attrs

from engine import tools
from engine.local.bench.common import Sizes, instant_interpreter
from engine.local.bench.fsm import _rollout, edge_index, fsm_cycle, fsm_figures, plain_cycle
from engine.local.bench.memory import PROMPT_TOKENS, body_figure, memory_figure
from engine.local.bench.rollout import BARE_AIOHTTP, BARE_HTTPX, ENGINE, SIDES, measure_sides
from engine.local.bench.server import CannedServer, scenario
from engine.machine.table import RolloutMachine, get_machine
from engine.profiles.tokenizer import load_tokenizer

TINY = attrs.evolve(Sizes.small(), samples=6, turns=3, concurrency=4, repeats=1, fsm_cycles=20, fsm_setups=50,
                    add_models=20, memory_samples=2, memory_tokens=2048)


def test_bench_smoke() -> None:
    original = tools.get("code_interpreter")

    # Figure 2: the machine and its plain-Python comparison walk the same edges.
    machine = get_machine()
    fsm_r, plain_r = _rollout(), _rollout()
    fsm_cycle(machine, fsm_r, 2)
    plain_cycle(edge_index(machine), plain_r, 2)
    assert fsm_r.record.trace == plain_r.record.trace and len(fsm_r.record.trace) == 6
    assert fsm_r.traj.response_ids == plain_r.traj.response_ids
    stock_r = _rollout()
    fsm_cycle(RolloutMachine(machine.spec, stock=True), stock_r, 2)
    assert stock_r.record.trace == fsm_r.record.trace and stock_r.record.guards == fsm_r.record.guards
    figures = fsm_figures(TINY)
    assert [f.key for f in figures] == ["fsm_setup", "fsm_transition", "fsm_transition_stock"]
    assert figures[2].value > 0 and figures[2].floor == figures[1].value and figures[2].passed is None

    # Figure 5: one row, bytes per sample measured (its request waiting on a real socket among them),
    # the list-size floor computed.
    memory = memory_figure(TINY)
    assert memory.value > memory.notes["in_flight_request_bytes"] > 0 and memory.floor and memory.passed in (True, False)
    assert memory.notes["request_body_bytes"] > 4 * TINY.memory_tokens  # the JSON body of the ids was sent
    assert memory.notes["encoded_prompt_bytes"] < 8 * PROMPT_TOKENS + 512  # the prompt's digits, not the response's
    body = body_figure(TINY.memory_tokens, rounds=2)
    assert body.value > 0 and body.floor and body.passed is None  # information: the CPU the kept bytes would save

    # Figure 1's machinery: every engine sample COMPLETED in exactly T turns; every floor sent all requests.
    tok = load_tokenizer()
    with CannedServer({"tool": scenario(tok, TINY.turns, "print(1)")}) as server, instant_interpreter():
        sides = asyncio.run(measure_sides(server, tok, scenario="tool", samples=TINY.samples, turns=TINY.turns,
                                          concurrency=TINY.concurrency, connections=TINY.concurrency, repeats=1,
                                          tick=True))
    assert sides.requests_per_sample == TINY.turns
    assert list(sides.runs) == SIDES and {ENGINE, BARE_HTTPX, BARE_AIOHTTP} <= set(sides.runs)
    for name, (run,) in sides.runs.items():
        assert run.samples == TINY.samples and run.wall > 0 and run.cpu > 0 and run.max_stall > 0, name
        if name.startswith("engine"):
            assert run.statuses == {"COMPLETED": TINY.samples} and run.turns == {TINY.turns: TINY.samples}, name
            assert run.tool_errors == 0
        else:
            assert run.errors == 0 and run.statuses == {"OK": TINY.samples}, name
    assert tools.get("code_interpreter") is original  # the instant tool was put back


def test_the_stall_in_flight_leaves_out_the_gap_of_the_drain_and_only_it() -> None:
    from engine.local.bench.rollout import in_flight_stall

    gaps = [(0.0, 0.001), (0.001, 0.030), (0.030, 0.031), (0.031, 0.200)]
    assert in_flight_stall(gaps, []) == 0.200 - 0.031
    assert in_flight_stall(gaps, [0.100]) == 0.030 - 0.001  # the drain fell in the last gap
    assert in_flight_stall(gaps, [5.0]) == 0.200 - 0.031  # a drain outside the run leaves all in
    assert in_flight_stall([], []) == 0.0


def test_long_rollouts_figure_compacts_and_reports_each_length_against_the_shortest() -> None:
    """Figure 9's machinery: every rollout takes exactly T turns, compacted more often the longer it runs."""
    from engine.local.bench.long import SCENARIO, long_figures, long_scenario, one_pass
    from engine.local.bench.agent import InstantAdd

    tok = load_tokenizer()
    sizes = attrs.evolve(TINY, long_samples=2, long_turns=(3, 40, 70))
    with CannedServer({SCENARIO: long_scenario(tok)}) as server:
        with tools.registry.registered(InstantAdd()):
            assert asyncio.run(one_pass(server, tok, 2, 3, traced=False))[1] == 0
        figures = asyncio.run(long_figures(server, tok, sizes))
    assert [f.key for f in figures] == ["long_turn_cpu_40", "long_turn_cpu_70", "long_turn_memory_40", "long_turn_memory_70"]
    assert all(f.value > 0 and f.floor and f.floor_label == "the same at 3 turns" for f in figures)
    assert 1 <= figures[0].notes["compactions"] < figures[1].notes["compactions"] and figures[0].notes["floor_compactions"] == 0
    assert [f.passed is None for f in figures] == [False, False, True, False]  # the longest memory row is judged
    assert tools.get("add") is None
