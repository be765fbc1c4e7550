"""Statuses that fit the caller: each transient failure, as slime's own loops treat the result.

For every failure class that ends an attempt at ABORTED, with the stand-in Sample and slime's
rules (tests/slime/slime_rules.py): by default the sample is re-run from RESET and comes back
trainable; when no attempt finishes it ends FAILED with `remove_sample` (reward computed, no
token trained); ABORTED is handed back only to a caller that re-queues it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
import respx

from engine import slime
from engine.local.sample import Sample
from engine.machine.trajectory import InvariantViolation, Trajectory
from engine.profiles.reward import retool_score
from tests.conftest import run
from tests.slime.slime_rules import StepDied, generate_and_rm, slime_aborting, train_view
from tests.support.helpers import SAMPLING, URL, ScriptedServer, encode, make_args, reply_body, turn

ANSWER = "Answer: \\boxed{42}"
TOP_P = {**SAMPLING, "custom_params": {"return_top_p_token_ids": True}}


def with_top_p(body: dict[str, Any]) -> dict[str, Any]:
    ids = body["output_ids"]
    body["meta_info"]["top_p_token_ids"] = [t for t in ids for _ in range(2)]
    body["meta_info"]["top_p_token_offsets"] = list(range(0, 2 * len(ids) + 1, 2))
    return body


def answer(top_p: bool = False) -> httpx.Response:
    body = reply_body(encode(ANSWER) + [151645])
    return httpx.Response(200, json=with_top_p(body) if top_p else body)


# failure class -> (replies that make one attempt fail, the reason recorded, sampling params)
FAILURES: dict[str, tuple[Callable[[], list[Any]], str, dict[str, Any]]] = {
    "server_abort": (lambda: [turn("Let me", finish="abort")], "server_aborted", SAMPLING),
    "logprobs_missing": (lambda: [turn(ANSWER, with_logprobs=False)], "logprobs_missing", SAMPLING),
    "logprobs_mismatch": (
        lambda: [httpx.Response(200, json=reply_body(encode(ANSWER), logprobs=[-0.5]))], "logprobs_mismatch", SAMPLING),
    "malformed_reply": (lambda: [httpx.Response(200, json={"text": "no meta"})], "reply_malformed", SAMPLING),
    "retries_spent": (lambda: [httpx.Response(503, json={"error": "busy"})] * 3, "request_failed", SAMPLING),
    "top_p_missing": (lambda: [turn(ANSWER)], "top_p_replay_missing", TOP_P),
}


def generate(sample: Sample, script: list[Any], params: dict[str, Any] = SAMPLING, **args_kw: Any) -> ScriptedServer:
    server = ScriptedServer(script)
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        out = run(slime.generate(make_args(**args_kw), sample, dict(params)))
    assert out is sample
    return server


@pytest.mark.parametrize("kind", FAILURES)
def test_a_failed_attempt_is_rerun_from_reset_and_trains_like_a_fresh_sample(kind: str) -> None:
    fail, reason, params = FAILURES[kind]
    top_p = params is TOP_P
    fresh = Sample(prompt="What is 6*7?", label="42")
    generate(fresh, [answer(top_p)], params)
    sample = Sample(prompt="What is 6*7?", label="42")
    server = generate(sample, [*fail(), answer(top_p)], params)
    assert sample.status == Sample.Status.COMPLETED
    attempts = sample.metadata["fsm"]["attempts"]
    assert [a["reason"] for a in attempts] == [reason] and attempts[0]["attempt"] == 1
    # I5: the re-run ends exactly as a fresh sample does
    assert (sample.tokens, sample.loss_mask, sample.rollout_log_probs) == (fresh.tokens, fresh.loss_mask,
                                                                          fresh.rollout_log_probs)
    assert server.requests[-1]["input_ids"] == server.requests[0]["input_ids"]  # from RESET, nothing stitched
    generate_and_rm(None, sample)
    view = train_view(sample, top_p_asked=top_p)
    assert view["reward"] == 1.0 and sum(view["loss_mask"]) == sample.response_length


@pytest.mark.parametrize("kind", FAILURES)
def test_a_sample_no_attempt_finishes_ends_failed_and_is_not_trained(kind: str) -> None:
    fail, reason, params = FAILURES[kind]
    sample = Sample(prompt="What is 6*7?", label="42")
    server = generate(sample, [*fail(), *fail()], params, engine_sample_attempts=2)
    fsm = sample.metadata["fsm"]
    assert sample.status == Sample.Status.FAILED and sample.remove_sample is True
    assert (fsm["termination_reason"], fsm["last_reason"]) == ("attempts_exhausted", reason)
    assert [a["reason"] for a in fsm["attempts"]] == [reason, reason]
    assert "checkpoint" not in fsm
    assert len(server.requests) == 2 * len(fail())
    generate_and_rm(None, sample)
    view = train_view(sample)  # slime's default loop survives it
    assert view["reward"] == retool_score("", "42", 0)["score"]  # the no-answer reward
    assert not any(view["loss_mask"])


@pytest.mark.parametrize("kind", FAILURES)
def test_aborted_is_handed_back_only_to_a_caller_that_requeues_it(kind: str) -> None:
    fail, reason, params = FAILURES[kind]
    sample = Sample(prompt="What is 6*7?", label="42")
    server = generate(sample, fail(), params, engine_abort_status="aborted")
    assert sample.status == Sample.Status.ABORTED
    assert sample.metadata["fsm"]["termination_reason"] == reason and "attempts" not in sample.metadata["fsm"]
    assert len(server.requests) == len(fail())  # no re-run: the caller re-queues it
    generate_and_rm(None, sample)
    assert sample.reward is None
    with pytest.raises(StepDied):  # why ABORTED must not reach slime's default loop
        train_view(sample)


def test_the_fully_async_worker_gets_aborted_back() -> None:
    sample = Sample(prompt="What is 6*7?", label="42")
    server = generate(sample, [turn("Let me", finish="abort")],
                      rollout_function_path="slime.rollout.fully_async_rollout.generate_rollout_fully_async")
    assert sample.status == Sample.Status.ABORTED and len(server.requests) == 1


def test_while_slime_aborts_the_step_the_sample_stops_aborted_without_a_request() -> None:
    sample = Sample(prompt="What is 6*7?", label="42")
    with slime_aborting():
        server = generate(sample, [answer()], partial_rollout=True)
    assert sample.status == Sample.Status.ABORTED
    assert sample.metadata["fsm"]["termination_reason"] == "abort_requested"
    assert sample.metadata["fsm"]["checkpoint"]["resume_at"] == "generate"
    assert server.requests == []


def test_an_invariant_violation_is_rerun_like_any_transient_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    real_check = Trajectory.check
    broken = {"left": 1}

    def check_once_broken(self: Trajectory, **kw: Any) -> None:
        if self.response_length and broken["left"]:
            broken["left"] -= 1
            raise InvariantViolation("I1", "injected")
        real_check(self, **kw)

    monkeypatch.setattr(Trajectory, "check", check_once_broken)
    sample = Sample(prompt="What is 6*7?", label="42")
    generate(sample, [answer(), answer()])
    assert sample.status == Sample.Status.COMPLETED
    assert [a["reason"] for a in sample.metadata["fsm"]["attempts"]] == ["invariant_violated"]


def test_attempts_stop_at_the_sample_deadline() -> None:
    sample = Sample(prompt="What is 6*7?", label="42")
    server = generate(sample, [turn("x", finish="abort")] * 5, engine_sample_attempts=5,
                      engine_sample_deadline=0.000001)
    assert sample.metadata["fsm"]["termination_reason"] == "attempts_exhausted"
    assert len(server.requests) == 1
