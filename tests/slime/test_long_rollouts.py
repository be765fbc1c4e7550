"""Long rollouts through slime's generate: a compacted rollout comes back as slime's fan-out (one
sample per segment, `rollout_id` shared, each whole), one sample per model turn when asked, the
reward shared or discounted per sample, and one shape for every sample of such a job."""

from __future__ import annotations

import json
from typing import Any

import pytest
import respx

from engine import slime
from engine.local.invariants import sample_violations
from engine.local.sample import Sample
from engine.profiles.chat import ChatProfile
from tests.conftest import run
from tests.support.helpers import IM_END, SAMPLING, URL, ScriptedServer, encode, make_args, tok, turn

ANSWER = "It is 3.\nAnswer: \\boxed{3}"


def call(code: str) -> str:
    return f'<tool_call>\n{json.dumps({"name": "code_interpreter", "arguments": {"code": code}})}\n</tool_call>'


def generate(script: list[Any], sample: Sample, **settings: Any) -> tuple[Any, ScriptedServer]:
    server = ScriptedServer(script)
    args = make_args(engine_profile="chat", engine_tools=["code_interpreter"], **settings)

    async def go() -> Any:
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=server)
            return await slime.generate(args, sample, dict(SAMPLING))

    return run(go()), server


def whole(samples: list[Any], server: ScriptedServer) -> None:
    """Every sample is whole (I1-I4, I6 from the outside), its prompt a request the server got, its
    trained tokens and logprobs the server's replies."""
    decode = ChatProfile(tok()).decode
    prompts = [r["input_ids"] for r in server.requests]
    for s in samples:
        prompt = s.tokens[: len(s.tokens) - s.response_length]
        assert prompt in prompts, "a sample's prompt is what some request sent"
        assert sample_violations(s, prompt_ids=prompt, budget=4096, decode=decode) == [], s.metadata["fsm"]
    # I4 against the server's record: across the segments, in order, every token the server sent is
    # trained once with its logprob, and nothing else is
    trained = [(t, lp) for s in samples for t, lp, m in zip(s.tokens[len(s.tokens) - s.response_length:],
                                                            s.rollout_log_probs, s.loss_mask) if m]
    assert trained == [(i, lp) for ids, lps in server.replies for i, lp in zip(ids, lps)]


def test_a_compacted_rollout_is_one_sample_per_segment_sharing_the_rollout_id(fake_interpreter):
    script = [turn(call("print(1)")), turn(call("print(2)")), turn("I printed 1, then 2."), turn(ANSWER)]
    sample = Sample(index=5, prompt="What is 1 + 2?", label="3")
    [probe], _ = generate([turn(call("print(1)")), turn(call("print(2)")), turn(ANSWER)], Sample(index=0, prompt=sample.prompt))
    threshold = len(probe.tokens) - len(encode(ANSWER)) - 1
    out, server = generate(script, sample, engine_compaction="summarize", engine_compaction_threshold=threshold)
    assert isinstance(out, list) and len(out) == 2 and out[0] is sample
    assert [s.rollout_id for s in out] == [5, 5]
    fsm = [s.metadata["fsm"] for s in out]
    assert [f["segment"] for f in fsm] == [{"index": 0, "count": 2, "ended_by": "summarized"},
                                           {"index": 1, "count": 2, "ended_by": None}]
    assert [s.status for s in out] == [Sample.Status.COMPLETED, Sample.Status.COMPLETED]
    assert fsm[1]["termination_reason"] == "answered" and fsm[1]["breaks"] == ["summarized"]
    assert fsm[0]["trace"][-2:] == [("BUDGET_CHECK", "check", "COMPACT"), ("COMPACT", "compacted", "BUDGET_CHECK")]
    assert fsm[1]["trace"][0] == ("BUDGET_CHECK", "check", "GENERATE")
    whole(out, server)
    # the first segment ends with the question and the summary, trained
    assert out[0].tokens[-len(encode("I printed 1, then 2.")) - 1:] == encode("I printed 1, then 2.") + [IM_END]
    # the rollout is scored once, from its last words, and each sample gets it
    rewards = [run(slime.reward_func(None, s)) for s in out]
    assert [r["score"] for r in rewards] == [1.0, 1.0] and fsm[0]["rollout_final_text"].endswith("\\boxed{3}<|im_end|>")


def test_an_attempt_failed_after_a_compaction_is_rerun_from_reset_and_ends_as_a_fresh_rollout(fake_interpreter):
    """I5 across segments: the second segment's turn is aborted by the server; the rerun starts
    from RESET (the first segment's sample included) and ends exactly as a fresh rollout."""
    played = [turn(call("print(1)")), turn(call("print(2)")), turn("I printed 1, then 2."), turn(ANSWER)]
    [probe], _ = generate([played[0], played[1], played[3]], Sample(index=0, prompt="What is 1 + 2?"))
    settings = dict(engine_compaction="summarize", engine_compaction_threshold=len(probe.tokens) - len(encode(ANSWER)) - 1)
    fresh, _ = generate(played, Sample(index=5, prompt="What is 1 + 2?", label="3"), **settings)
    failing = [*played[:3], turn("It is", finish="abort")]
    retried, server = generate([*failing, *played], Sample(index=5, prompt="What is 1 + 2?", label="3"), **settings)
    assert len(fresh) == len(retried) == 2
    assert [a["reason"] for a in retried[0].metadata["fsm"]["attempts"]] == ["server_aborted"]
    for again, first in zip(retried, fresh):
        assert (again.tokens, again.loss_mask, again.rollout_log_probs, again.status) == (
            first.tokens, first.loss_mask, first.rollout_log_probs, first.status)
        assert again.metadata["fsm"]["segment"] == first.metadata["fsm"]["segment"]
    server.replies = server.replies[len(failing):]  # what the rerun was served: all of it trained, once
    whole(retried, server)


def test_a_discounted_reward_gives_each_earlier_segment_gamma_times_the_next_s(fake_interpreter):
    script = [turn(call("print(1)")), turn("Printed 1."), turn(ANSWER)]
    [probe], _ = generate([turn(call("print(1)")), turn(ANSWER)], Sample(index=0, prompt="What is 1 + 2?"))
    threshold = len(probe.tokens) - len(encode(ANSWER)) - 1
    out, _ = generate(script, Sample(index=1, prompt="What is 1 + 2?", label="3"), engine_compaction="summarize",
                      engine_compaction_threshold=threshold, engine_segment_reward="discounted", engine_segment_discount=0.5)
    assert [s.metadata["fsm"]["reward_weight"] for s in out] == [0.5, 1.0]
    assert [run(slime.reward_func(None, s))["score"] for s in out] == [0.5, 1.0]


def test_per_turn_samples_are_each_turn_s_exact_prompt_and_output(fake_interpreter):
    script = [turn(call("print(1)")), turn(call("print(2)")), turn(ANSWER)]
    out, server = generate(script, Sample(index=9, prompt="What is 1 + 2?", label="3"), engine_samples="per_turn")
    assert len(out) == 3 and {s.rollout_id for s in out} == {9}
    for s, request, text in zip(out, server.requests, [call("print(1)"), call("print(2)"), ANSWER]):
        assert s.tokens[: len(s.tokens) - s.response_length] == request["input_ids"]  # its exact prompt
        assert s.tokens[-s.response_length:] == encode(text) + [IM_END] and s.loss_mask == [1] * s.response_length
    assert [s.metadata["fsm"]["segment"]["ended_by"] for s in out] == ["per_turn", "per_turn", None]
    assert [s.status for s in out] == [Sample.Status.COMPLETED] * 3
    whole(out, server)
    # each turn's path is its own stretch of the rollout's; together they are all of it
    paths = [s.metadata["fsm"]["trace"] for s in out]
    assert [p[-1] for p in paths[:2]] == [("GENERATE", "reply", "TOOL_CALL")] * 2
    assert paths[2][-1] == ("GENERATE", "reply", "COMPLETED") and sum(len(p) for p in paths) == len(
        [e for p in paths for e in p])


def test_per_turn_rewards_where_the_environment_scores_each_turn():
    from engine import envs

    class Scoring(envs.Environment):
        name = "scoring_test"

        async def respond(self, episode: Any, conversation: envs.Conversation) -> envs.Reply:
            return envs.Reply("Go on.", reward=0.25) if "again" not in conversation.text else envs.Reply(done=True, reward=1.0, reason="done")

    envs.register_environment(Scoring(), replace=True)
    try:
        out, _ = generate([turn("Hello."), turn("Hello again.")], Sample(index=2, prompt="Say hello twice."),
                          engine_environment="scoring_test", engine_samples="per_turn")
    finally:
        envs.unregister_environment("scoring_test")
    assert [run(slime.reward_func(None, s))["score"] for s in out] == [0.25, 1.0]
    assert out[0].metadata["fsm"]["turn_rewards"] == [{"turn": 1, "span": (0, out[0].response_length), "reward": 0.25}]


def test_where_samples_may_fan_out_every_sample_is_a_list(fake_interpreter):
    """slime flattens a batch by its first element's shape: a list of one keeps every sample alike."""
    out, _ = generate([turn(ANSWER)], Sample(index=4, prompt="What is 1 + 2?", label="3"),
                      engine_compaction="drop_oldest", engine_compaction_threshold=3000)
    assert isinstance(out, list) and len(out) == 1 and out[0].status == Sample.Status.COMPLETED
    bad, _ = generate([], Sample(index=4, prompt=12), engine_compaction="drop_oldest", engine_compaction_threshold=3000)
    assert isinstance(bad, list) and bad[0].metadata["fsm"]["termination_reason"] == "bad_sample_input"
    # Qwen3's template drops earlier reasoning once a user turn follows, which an environment a
    # sample names may write: such a job may fan out too
    dropping, _ = generate([turn(ANSWER)], Sample(index=4, prompt="What is 1 + 2?"))
    assert isinstance(dropping, list) and len(dropping) == 1
    plain, _ = generate([turn(ANSWER)], Sample(index=4, prompt="What is 1 + 2?"), engine_earlier_reasoning="keep")
    assert isinstance(plain, Sample)  # one sequence whatever happens: one sample, as before


@pytest.mark.parametrize("threshold", [4096, 5000])
def test_a_threshold_the_context_cannot_hold_is_engine_setup_failed(threshold: int):
    sample = Sample(index=0, prompt="What is 1 + 2?")
    out, server = generate([], sample, engine_compaction="summarize", engine_compaction_threshold=threshold)
    assert out is sample and server.requests == []
    fsm = sample.metadata["fsm"]
    assert fsm["termination_reason"] == "engine_setup_failed"
    assert fsm["engine_error"] == f"SettingsError: engine_compaction_threshold must be below the context (4096 tokens), got {threshold}"


def test_a_failed_summary_keeps_the_segments_before(fake_interpreter):
    script = [turn(call("print(1)")), turn("Printed 1."), turn(call("print(3)")), turn("")]
    [probe], _ = generate([turn(call("print(1)")), turn(ANSWER)], Sample(index=0, prompt="What is 1 + 2?"))
    threshold = len(probe.tokens) - len(encode(ANSWER)) - 1
    out, server = generate(script, Sample(index=3, prompt="What is 1 + 2?"), engine_compaction="summarize",
                           engine_compaction_threshold=threshold, engine_compaction_keep_turns=0)
    assert [s.metadata["fsm"]["segment"]["ended_by"] for s in out] == ["summarized", None]
    assert out[-1].status == Sample.Status.TRUNCATED and out[-1].metadata["fsm"]["termination_reason"] == "summary_refused"
    whole(out, server)



@pytest.mark.parametrize("settings, named", [
    (dict(engine_compaction="summarize", engine_compaction_threshold=3000), "engine_compaction: summarize"),
    (dict(engine_samples="per_turn"), "engine_samples: per_turn"),
])
def test_partial_rollout_with_samples_that_fan_out_is_engine_setup_failed(settings: dict[str, Any], named: str):
    """slime's abort() reads each element of a group as a Sample, and a re-queued group comes back to
    generate as it was: a rollout returned as a list cannot resume, so the combination is refused."""
    sample = Sample(index=0, prompt="What is 1 + 2?")
    out, server = generate([], sample, partial_rollout=True, **settings)
    assert out is sample and server.requests == []
    fsm = sample.metadata["fsm"]
    assert fsm["termination_reason"] == "engine_setup_failed"
    assert fsm["engine_error"] == (f"SettingsError: partial_rollout cannot resume a rollout that comes back as several "
                                   f"samples ({named}): turn one of them off")


def test_with_partial_rollout_a_template_that_drops_reasoning_keeps_one_sequence(caplog):
    """Qwen3's template drops earlier reasoning once a user turn follows; with partial rollout the
    samples cannot fan out, so each stays one sequence (as engine_earlier_reasoning: keep), said once."""
    from engine import envs, logs

    logs.forget()  # said once per process: an earlier test may have said it
    class Again(envs.Environment):
        name = "again_test"

        async def respond(self, episode: Any, conversation: envs.Conversation) -> envs.Reply:
            return envs.Reply("Once more.") if len(conversation.messages) < 4 else envs.Reply(done=True, reason="done")

    script = [turn("<think>\nSay it.\n</think>\n\nHello."), turn("<think>\nAgain.\n</think>\n\nHello again.")]
    with envs.registered_environment(Again()):
        out, server = generate(script, Sample(index=1, prompt="Say hello."), engine_environment="again_test",
                               partial_rollout=True)
        assert isinstance(out, Sample) and out.status == Sample.Status.COMPLETED
        assert "breaks" not in out.metadata["fsm"] and "Say it." in tok().decode(server.requests[1]["input_ids"])
        assert any("partial_rollout: each sample stays one sequence" in r.getMessage() for r in caplog.records)
        dropped, server = generate(script, Sample(index=1, prompt="Say hello."), engine_environment="again_test")
    # without partial rollout the second turn's prompt is the template's own render: a new segment
    assert [s.metadata["fsm"]["segment"]["ended_by"] for s in dropped] == ["reasoning_dropped", None]
    assert "Say it." not in tok().decode(server.requests[1]["input_ids"])


def test_the_fully_async_worker_gets_no_aborted_sample_inside_a_list(fake_interpreter):
    """slime's fully-async worker re-queues a group by the status of each element: an ABORTED sample
    inside a list it would not see, and would train. So the engine re-runs such a sample itself."""
    fully_async = dict(rollout_function_path="slime.rollout.fully_async_rollout.generate_rollout_fully_async")
    out, server = generate([turn("Let me", finish="abort"), turn(ANSWER)], Sample(index=2, prompt="What is 1 + 2?"),
                           **fully_async)
    assert isinstance(out, list) and [s.status for s in out] == [Sample.Status.COMPLETED]
    assert len(server.requests) == 2 and out[0].metadata["fsm"]["attempts"][0]["reason"] == "server_aborted"
    single, server = generate([turn("Let me", finish="abort")], Sample(index=2, prompt="What is 1 + 2?"),
                              engine_earlier_reasoning="keep", **fully_async)
    assert single.status == Sample.Status.ABORTED and len(server.requests) == 1  # a Sample it sees: handed back
