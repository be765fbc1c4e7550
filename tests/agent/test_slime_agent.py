"""`engine_agent` through slime's generate: an unmodified OpenAI client drives the sample through the
front door over a real socket, and the segments come back as samples."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest
import respx

from engine import slime
from engine.agent import serving
from engine.local.invariants import sample_violations
from engine.local.sample import Sample
from engine.profiles.chat import ChatProfile
from engine.profiles.tokenizer import load_tokenizer
from engine.slime.sample_io import weighted_reward
from tests.support.agents import ScriptedModel
from tests.support.helpers import URL, make_args

SAMPLING = {"max_new_tokens": 256, "temperature": 1.0, "no_stop_trim": True, "skip_special_tokens": False}
HARNESSES = "tests.support.agent_harnesses"


def generate(agent: str, sample: Sample, **settings: Any) -> tuple[Any, ScriptedModel]:
    """slime's generate for one sample whose agent is `agent`, against a scripted model."""
    profile = ChatProfile(load_tokenizer(None))
    model = ScriptedModel(profile)
    args = make_args(engine_profile="chat", engine_agent=agent, engine_agent_timeout=settings.pop("timeout", 60.0),
                     **settings)

    async def go() -> Any:
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=model)
            mock.route(host="127.0.0.1").pass_through()  # the harness's own requests reach the door
            try:
                return await slime.generate(args, sample, dict(SAMPLING))
            finally:
                await serving.close_served(slime.runtime_for(slime.EngineConfig.from_args(args)))

    return asyncio.run(go()), model


def test_an_agent_s_verbatim_task_is_one_sample_its_tokens_the_server_s():
    sample = Sample(index=7, prompt="Add the numbers 0 to 5 with the tool.", label="15")
    out, model = generate(f"{HARNESSES}:add_task", sample)
    assert out == [sample] and sample.status == Sample.Status.COMPLETED  # a list of one: the one shape
    fsm = sample.metadata["fsm"]
    assert fsm["termination_reason"] == "harness_finished" and fsm["breaks"] == []
    assert fsm["agent"] == {"reason": "harness_finished", "refused": [], "retries": 0, "result": 1.0}
    assert sample.reward == 1.0  # what the coroutine returned
    [(key, replies)] = model.replies.items()
    trained = [t for t, m in zip(sample.tokens[-sample.response_length:], sample.loss_mask) if m]
    assert trained == [i for ids, _ in replies for i in ids]
    assert [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if m] == [lp for _, lps in replies for lp in lps]
    assert len(fsm["turns"]) == 4 and all("logprob" in t and "span" in t for t in fsm["turns"])
    prompt = model.requests[key][0]
    assert sample_violations(sample, prompt_ids=prompt, budget=4096, decode=ChatProfile(load_tokenizer(None)).decode) == []


def test_a_compacted_history_fans_out_to_samples_sharing_the_rollout_id():
    sample = Sample(index=3, prompt="Add the numbers 0 to 5 with the tool.", metadata={"mine": 1})
    out, model = generate(f"{HARNESSES}:compacting", sample)
    assert isinstance(out, list) and len(out) == 2 and out[0] is sample
    assert [s.rollout_id for s in out] == [3, 3]
    assert [s.metadata["fsm"]["termination_reason"] for s in out] == ["history_compacted", "harness_finished"]
    assert [s.metadata["fsm"]["segment"] for s in out] == [{"index": 0, "count": 2, "ended_by": "history_compacted"},
                                                           {"index": 1, "count": 2, "ended_by": None}]
    assert all(s.metadata["mine"] == 1 for s in out) and out[1].metadata is not sample.metadata
    assert [s.status for s in out] == [Sample.Status.COMPLETED] * 2
    [(key, requests)] = model.requests.items()
    decode = ChatProfile(load_tokenizer(None)).decode
    second_prompt = next(q for q in requests if q == out[1].tokens[:len(q)] and len(q) == len(out[1].tokens) - out[1].response_length)
    for s, prompt in zip(out, (requests[0], second_prompt)):
        assert sample_violations(s, prompt_ids=prompt, budget=4096, decode=decode) == []
    # the two samples' paths together are the machine's one path, the break's edge closing the first
    assert out[0].metadata["fsm"]["trace"][-1] == ["HARNESS", "harness_call", "BUDGET_CHECK"] or tuple(
        out[0].metadata["fsm"]["trace"][-1]) == ("HARNESS", "harness_call", "BUDGET_CHECK")
    assert tuple(out[1].metadata["fsm"]["trace"][0]) == ("BUDGET_CHECK", "check", "GENERATE")
    assert [s.reward for s in out] == [1.0, 1.0]  # the harness's reward, shared (engine_segment_reward's default)


def test_a_harness_s_reward_is_discounted_per_segment_back_from_the_last():
    sample = Sample(index=3, prompt="Add the numbers 0 to 5 with the tool.")
    out, _ = generate(f"{HARNESSES}:compacting", sample, engine_segment_reward="discounted", engine_segment_discount=0.5)
    assert [s.metadata["fsm"]["segment"]["ended_by"] for s in out] == ["history_compacted", None]
    assert [s.reward for s in out] == [0.5, 1.0]
    assert [s.metadata["fsm"]["reward_weight"] for s in out] == [0.5, 1.0]  # what reward_func scales by, had it scored them


def test_a_reward_given_whole_is_shared_as_its_kind_allows():
    assert weighted_reward(2.0, 0.5) == 1.0 and weighted_reward(3, 1.0) == 3
    assert weighted_reward({"score": 2.0, "acc": True}, 0.25) == {"score": 0.5, "acc": True}
    assert weighted_reward({"acc": 1.0}, 0.25) == {"acc": 1.0}  # no score to share: as given
    assert weighted_reward(True, 0.5) is True


def test_a_harness_that_crashes_ends_the_sample_failed_with_its_turn_kept():
    sample = Sample(index=1, prompt="Add.")
    [out], model = generate(f"{HARNESSES}:crashing", sample)
    fsm = out.metadata["fsm"]
    assert out.status == Sample.Status.FAILED and fsm["termination_reason"] == "harness_crashed"
    assert "RuntimeError: the harness broke" in fsm["agent"]["detail"] and not out.remove_sample
    assert out.loss_mask.count(1) == out.response_length > 0


def test_a_harness_past_its_time_is_stopped_and_the_sample_truncated():
    sample = Sample(index=1, prompt="Add.")
    [out], _ = generate(f"{HARNESSES}:hanging", sample, timeout=1.0)
    assert out.status == Sample.Status.TRUNCATED
    assert out.metadata["fsm"]["termination_reason"] == "harness_timed_out" and out.response_length > 0


def test_a_harness_that_never_calls_the_model_leaves_nothing_to_train():
    sample = Sample(index=1, prompt="Add.")
    [out], _ = generate(f"{HARNESSES}:silent", sample)
    assert out.status == Sample.Status.FAILED and out.remove_sample
    assert out.metadata["fsm"]["termination_reason"] == "harness_made_no_call"
    assert out.metadata["fsm"]["agent"]["result"] == "nothing to do"


@pytest.mark.parametrize("agent, profile, error", [
    ("'unclosed", "chat", "engine_agent: the command line cannot be split"),
    (f"{HARNESSES}:add_task", "retool", "engine_agent needs engine_profile: chat"),
])
def test_an_agent_that_cannot_run_is_a_setup_failure_not_a_crash(agent: str, profile: str, error: str):
    sample = Sample(index=1, prompt="Add.")
    out = asyncio.run(slime.generate(make_args(engine_profile=profile, engine_agent=agent), sample, dict(SAMPLING)))
    assert out.status == Sample.Status.FAILED and out.remove_sample
    assert out.metadata["fsm"]["termination_reason"] == "engine_setup_failed"
    assert error in out.metadata["fsm"]["engine_error"]


@pytest.mark.slow
def test_a_command_line_harness_gets_its_session_in_the_environment():
    sample = Sample(index=2, prompt="Add the numbers 0 to 5 with the tool.")
    [out], model = generate(f"{sys.executable} -m tests.support.agent_cli --task {{prompt}}", sample)
    fsm = out.metadata["fsm"]
    assert out.status == Sample.Status.COMPLETED, fsm
    assert "harness starts: Add the numbers 0 to 5 with the tool. --task Add the numbers" in fsm["agent"]["output"]
    assert "harness done" in fsm["agent"]["output"] and len(fsm["turns"]) == 4


def test_a_segment_a_break_leaves_without_a_token_is_not_trained():
    """The budget spent by the time a break opens the next segment (here max turns: the harness
    compacts after its second turn, the job allows two): that segment holds no token, and slime
    trains nothing of it, its reason kept."""
    sample = Sample(index=5, prompt="Add the numbers 0 to 5 with the tool.")
    out, _ = generate(f"{HARNESSES}:compacting", sample, engine_max_turns=2)
    assert isinstance(out, list) and len(out) == 2
    first, empty = out
    assert first.metadata["fsm"]["termination_reason"] == "history_compacted" and not first.remove_sample
    assert first.response_length > 0 and sum(first.loss_mask) > 0
    assert empty.response_length == 0 and empty.metadata["fsm"]["termination_reason"] == "max_turns_reached"
    assert empty.status == Sample.Status.TRUNCATED and empty.remove_sample
