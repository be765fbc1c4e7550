"""The edges of an agent's session, edge by edge: the harness answers the turns (a stub here; the
real sessions are tests/agent), its calls extend the trajectory or break it into segments."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.machine.rollout import HarnessEvent
from tests.machine.test_machine import ANSWER, CODE, path, prompt_len, walk
from tests.support.helpers import IM_END, SAMPLING, StubHarness, encode, fake_logprobs, turn

OBSERVATION = encode("<tool_response>3</tool_response>")
NEW_PROMPT = tuple(encode("<|im_start|>user\nagain, in other words<|im_end|>\n<|im_start|>assistant\n"))


def extends(**kw: Any) -> HarnessEvent:
    return HarnessEvent("extends", observation_ids=tuple(OBSERVATION), **kw)


def test_a_turn_goes_to_the_harness_and_its_end_completes_the_sample():
    harness = StubHarness([])
    r, server = walk([turn(CODE)], harness=harness)
    assert path(r)[-2:] == [("GENERATE", "reply", "HARNESS"), ("HARNESS", "harness_end", "COMPLETED")]
    assert (r.state, r.record.reason) == ("COMPLETED", "harness_finished")
    assert harness.answered == [CODE + "<|im_end|>"]  # the harness got the turn; no tool of the engine ran
    assert r.tool_call_count == 0 and len(server.requests) == 1


@pytest.mark.parametrize("reason, state", [("harness_timed_out", "TRUNCATED"), ("harness_crashed", "FAILED")])
def test_a_harness_that_hangs_or_fails_ends_the_sample_keeping_what_was_sampled(reason: str, state: str):
    r, _ = walk([turn(CODE), turn(ANSWER)], harness=StubHarness([extends(), HarnessEvent("end", reason=reason)]))
    assert path(r)[-1] == ("HARNESS", "harness_end", state)
    assert (r.state, r.record.reason) == (state, reason)
    first, second = encode(CODE) + [IM_END], encode(ANSWER) + [IM_END]
    assert r.traj.response_ids.tolist() == first + OBSERVATION + second
    assert r.traj.loss_mask.tolist() == [1] * len(first) + [0] * len(OBSERVATION) + [1] * len(second)


def test_what_the_harness_added_is_appended_with_mask_0_and_the_next_request_extends_the_first():
    r, server = walk([turn(CODE), turn(ANSWER)], harness=StubHarness([extends()]))
    assert ("HARNESS", "harness_call", "BUDGET_CHECK") in path(r) and r.record.guards[path(r).index(
        ("HARNESS", "harness_call", "BUDGET_CHECK"))] == "history_extends"
    first = server.requests[0]["input_ids"]
    assert server.requests[1]["input_ids"] == first + encode(CODE) + [IM_END] + OBSERVATION
    assert r.record.turn_log[0]["observation_tokens"] == len(OBSERVATION)
    assert r.closed == []


@pytest.mark.parametrize("reason", ["reasoning_dropped", "turn_rewritten", "history_compacted", "history_contradicts",
                                    "history_forked"])
def test_a_history_that_does_not_extend_closes_the_segment_on_its_named_edge(reason: str):
    harness = StubHarness([HarnessEvent("break", reason=reason, prompt_ids=NEW_PROMPT)])
    r, server = walk([turn(CODE), turn(ANSWER)], harness=harness)
    edge = ("HARNESS", "harness_call", "BUDGET_CHECK")
    assert edge in path(r) and r.record.guards[path(r).index(edge)] == reason
    assert len(r.closed) == 1
    closed = r.closed[0]
    assert closed.reason == reason
    assert closed.traj.response_ids.tolist() == encode(CODE) + [IM_END]  # the first segment: its turn alone
    assert closed.traj.loss_mask.tolist() == [1] * (len(encode(CODE)) + 1)
    closed.traj.check(full=True, max_total_length=4096)
    # the second segment's prompt is the history as given; its request sends that, nothing of the first
    assert server.requests[1]["input_ids"] == list(NEW_PROMPT)
    assert r.traj.prompt_ids.tolist() == list(NEW_PROMPT) and r.traj.response_ids.tolist() == encode(ANSWER) + [IM_END]
    # each segment's path ends where the next begins: the break's edge is the closed one's last
    trace = path(r)
    assert trace[closed.end.trace - 1] == edge and trace[closed.end.trace] == ("BUDGET_CHECK", "check", "GENERATE")
    assert closed.start.turns == 0 and closed.end.turns == 1 and len(r.record.turn_log) == 2


def test_an_observation_over_the_budget_is_trimmed_and_the_sample_truncated():
    budget = prompt_len() + len(encode(CODE)) + 1 + len(OBSERVATION) - 1
    r, _ = walk([turn(CODE)], harness=StubHarness([extends()]), max_context_len=budget)
    assert path(r)[-2:] == [("HARNESS", "harness_call", "TRIM"), ("TRIM", "trim", "TRUNCATED")]
    assert (r.state, r.record.reason) == ("TRUNCATED", "observation_over_budget")
    assert r.traj.total_length == budget


def test_a_server_abort_goes_on_inside_the_turn_and_the_harness_gets_it_whole():
    harness = StubHarness([])
    r, server = walk([turn("Let me", finish="abort", seed=1), turn(" think. " + CODE, seed=2)], harness=harness)
    assert path(r)[1:6] == [("BUDGET_CHECK", "check", "GENERATE"), ("GENERATE", "reply", "BUDGET_CHECK"),
                            ("BUDGET_CHECK", "check", "GENERATE"), ("GENERATE", "reply", "HARNESS"),
                            ("HARNESS", "harness_end", "COMPLETED")]
    assert r.record.guards[2] == "abort_resumed_inside"
    part, rest = encode("Let me"), encode(" think. " + CODE) + [IM_END]
    assert server.requests[1]["input_ids"] == server.requests[0]["input_ids"] + part
    assert server.requests[1]["sampling_params"]["max_new_tokens"] == SAMPLING["max_new_tokens"] - len(part)
    assert harness.answered == ["Let me think. " + CODE + "<|im_end|>"]  # one reply: the whole turn
    assert r.traj.logprobs.tolist() == fake_logprobs(part, 1) + fake_logprobs(rest, 2)
    assert r.turn_count == 1 and r.record.turn_log[0]["aborted"] is True


def test_a_server_that_keeps_aborting_a_turn_ends_the_sample_aborted():
    from engine.machine.guards import RESUMES_PER_TURN

    aborts = [turn("x", finish="abort") for _ in range(RESUMES_PER_TURN + 1)]
    r, server = walk(aborts, harness=StubHarness([]))
    assert len(server.requests) == RESUMES_PER_TURN + 1
    assert path(r)[-1] == ("GENERATE", "reply", "ABORTED") and (r.state, r.reason) == ("ABORTED", "server_aborted")


def test_a_call_s_own_cap_and_stop_strings_shape_the_turn_that_answers_it():
    r, server = walk([turn(CODE), turn(ANSWER)], harness=StubHarness([extends(max_new_tokens=7, stop=("STOP",))]),
                     params={**SAMPLING, "stop": ["</code>"]})
    assert server.requests[0]["sampling_params"]["max_new_tokens"] == SAMPLING["max_new_tokens"]
    assert server.requests[1]["sampling_params"]["max_new_tokens"] == 7
    assert server.requests[1]["sampling_params"]["stop"] == ["</code>", "STOP"]
    assert "STOP" not in server.requests[0]["sampling_params"]["stop"]


def test_the_caller_s_abort_cuts_a_harness_that_never_calls_again():
    class Silent:
        """Answers nothing more; the caller starts aborting the step while it waits."""

        async def exchange(self, r: Any) -> HarnessEvent:
            runtime = r.inputs.abort_check.__self__  # the runtime whose abort check the rollout polls
            asyncio.get_running_loop().call_later(0.3, runtime.abort.set)
            await asyncio.sleep(3600)
            raise AssertionError("never")

    r, _ = walk([turn(CODE)], harness=Silent())
    assert path(r)[-1] == ("HARNESS", "cancelled", "ABORTED")
    assert (r.state, r.record.reason) == ("ABORTED", "abort_requested")


def test_a_segment_whose_arrays_broke_discards_every_segment():
    class Corrupting(StubHarness):
        async def exchange(self, r: Any) -> HarnessEvent:
            event = await super().exchange(r)
            if event.kind == "break":
                r.traj.logprobs[0] = -99.0  # what the server sent is no longer what is held (I4)
            return event

    r, _ = walk([turn(CODE), turn(ANSWER)], harness=Corrupting([HarnessEvent("break", reason="history_forked",
                                                                             prompt_ids=NEW_PROMPT)]))
    assert (r.state, r.record.reason) == ("ABORTED", "invariant_violated")
    assert r.record.violation.startswith("segment 0: I4")
    assert r.closed[0].traj.response_length == 0 and r.traj.response_length == 0
