"""Partial rollout: an aborted multi-turn sample resumes where it stopped, or restarts cleanly."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import respx

from engine import slime
from tests.conftest import run
from tests.support.helpers import IM_END, fake_logprobs, SAMPLING, URL, ScriptedServer, encode, make_args, reply_body, tok, turn
from engine.local.sample import Sample

CODE = "<code>\nprint(1)\n</code>"
ANSWER = "Answer: \\boxed{1}"
PROMPT = "What is 1?"


def attempt(sample: Sample, script: list, **args_kw: Any) -> ScriptedServer:
    """One call of slime's generate on `sample` with partial rollout on."""
    server = ScriptedServer(script)
    # slime hands an ABORTED sample back to generate only when it re-queues it (aborting the
    # step, or the fully-async worker): the setting says so here.
    kw = {"partial_rollout": True, "engine_abort_status": "aborted", **args_kw}
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        run(slime.generate(make_args(**kw), sample, dict(SAMPLING)))
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    assert sample.response == tok().decode(sample.tokens[len(sample.tokens) - sample.response_length :])
    return server


def server_tokens(server: ScriptedServer) -> list[list[int]]:
    return [r["input_ids"] for r in server.requests]


def abort_reply(text: str, version: str = "v1") -> httpx.Response:
    ids = encode(text)
    return httpx.Response(200, json=reply_body(ids, finish="abort", weight_version=version))


def test_abort_in_turn_1_before_any_token_resumes_from_the_prompt(fake_interpreter):
    s = Sample(prompt=PROMPT)
    attempt(s, [abort_reply("")])
    assert s.status == Sample.Status.ABORTED and s.response_length == 0
    assert s.metadata["fsm"]["checkpoint"]["resume_at"] == "generate"
    second = attempt(s, [turn(ANSWER, weight_version="v2")])
    assert s.status == Sample.Status.COMPLETED
    assert s.metadata["fsm"]["attempt"] == 2 and "checkpoint_rejected" not in s.metadata["fsm"]
    assert ("RESET", "resume", "RESUME") in map(tuple, s.metadata["fsm"]["trace"])
    assert second.requests[0]["input_ids"] == s.tokens[: len(second.requests[0]["input_ids"])]


def test_abort_in_turn_3_after_two_tool_calls_keeps_both_turns_and_observations(fake_interpreter):
    s = Sample(prompt=PROMPT)
    first = attempt(s, [turn(CODE, weight_version="v1"), turn(CODE, weight_version="v1"), abort_reply("So the", "v1")])
    assert s.status == Sample.Status.ABORTED
    kept = list(s.tokens)
    cp = s.metadata["fsm"]["checkpoint"]
    assert cp["resume_at"] == "generate" and cp["partial_turn_tokens"] == len(encode("So the"))
    second = attempt(s, [turn(" answer: " + ANSWER, weight_version="v2")])
    assert s.status == Sample.Status.COMPLETED
    # the resumed request continues exactly from the kept tokens
    assert second.requests[0]["input_ids"] == kept
    # tokens = what the server produced across both attempts, with the observations between
    resumed_ids = encode(" answer: " + ANSWER) + [IM_END]
    assert s.tokens == kept + resumed_ids
    assert s.rollout_log_probs[-len(resumed_ids):] == fake_logprobs(resumed_ids)
    assert [seg[3] for seg in s.metadata["fsm"]["segments"] if seg[0] == "model"] == ["v1", "v1", "v1", "v2"]
    assert s.weight_versions == ["v1", "v1", "v1", "v2"]
    assert s.metadata["fsm"]["policy_versions"] == 2
    assert len(fake_interpreter.codes) == 2  # the finished tool calls were not run again
    # the turn cut mid-way was parsed whole: "So the answer: ..." answered
    assert s.metadata["fsm"]["termination_reason"] == "answered"


def test_logprobs_of_the_resumed_turn_are_the_servers(fake_interpreter):
    s = Sample(prompt=PROMPT)
    attempt(s, [abort_reply("partial words")])
    old = list(s.rollout_log_probs)
    ids = encode(" and the rest. " + ANSWER) + [IM_END]
    lps = [-0.125 * (i + 1) for i in range(len(ids))]
    attempt(s, [httpx.Response(200, json=reply_body(ids, logprobs=lps))])
    assert s.rollout_log_probs == old + lps
    assert s.loss_mask == [1] * s.response_length


def test_offpolicy_mask_set_by_slime_is_kept_and_applied_when_asked(fake_interpreter):
    s = Sample(prompt=PROMPT)
    attempt(s, [turn(CODE), abort_reply("half")])
    n_old = s.response_length
    s.loss_mask = [0] * n_old  # what slime's generate_and_rm does with mask_offpolicy_in_partial_rollout
    attempt(s, [turn(ANSWER)], mask_offpolicy_in_partial_rollout=True)
    assert s.status == Sample.Status.COMPLETED
    assert s.loss_mask[:n_old] == [0] * n_old
    assert set(s.loss_mask[n_old:]) == {1}
    # asked, but slime did not zero them: the engine applies the mask itself
    t = Sample(prompt=PROMPT)
    attempt(t, [turn(CODE), abort_reply("half")])
    attempt(t, [turn(ANSWER)], mask_offpolicy_in_partial_rollout=True)
    assert t.loss_mask[:n_old] == [0] * n_old


def test_abort_while_tools_run_reruns_the_cut_off_call(fake_interpreter):
    s = Sample(prompt=PROMPT)
    never = asyncio.Event()

    async def slow(code: str) -> str:
        await never.wait()
        return ""

    orig_execute = type(fake_interpreter).execute

    async def hanging(self, state, **arguments):
        self.codes.append(arguments["code"])
        await never.wait()

    type(fake_interpreter).execute = hanging
    server = ScriptedServer([turn(CODE)])

    async def go() -> None:
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=server)
            task = asyncio.create_task(slime.generate(make_args(partial_rollout=True, engine_abort_status="aborted"), s, dict(SAMPLING)))
            while not fake_interpreter.codes:
                await asyncio.sleep(0.01)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    try:
        run(go())
    finally:
        type(fake_interpreter).execute = orig_execute
    assert s.status == Sample.Status.ABORTED
    assert s.metadata["fsm"]["checkpoint"]["resume_at"] == "tools"
    second = attempt(s, [turn(ANSWER)])
    assert fake_interpreter.codes == ["print(1)", "print(1)"], s.metadata  # the cut-off call ran again
    assert s.status == Sample.Status.COMPLETED
    trace = list(map(tuple, s.metadata["fsm"]["trace"]))
    assert trace[:3] == [("RESET", "resume", "RESUME"), ("RESUME", "continue", "TOOL_CALL"),
                         ("TOOL_CALL", "dispatch", "TOOL_CODE_INTERPRETER")]
    assert "Output:\nprint(1)" in s.response and len(second.requests) == 1


def test_resume_with_no_budget_left_ends_truncated(fake_interpreter):
    s = Sample(prompt=PROMPT)
    attempt(s, [turn(CODE), abort_reply("x y z")])
    used = len(s.tokens)
    server = attempt(s, [], rollout_max_context_len=used)
    assert server.requests == []
    assert s.status == Sample.Status.TRUNCATED
    assert s.metadata["fsm"]["termination_reason"] == "context_full"
    assert len(s.tokens) == used


def tampered(change) -> Sample:
    s = Sample(prompt=PROMPT)
    attempt(s, [turn(CODE), abort_reply("so")])
    change(s)
    return s


def test_tampered_checkpoint_takes_reset_and_says_why(fake_interpreter):
    cases = {
        "response ids, logprobs or top-p replay were changed": lambda s: s.rollout_log_probs.__setitem__(0, -9.0),
        "the prompt differs": lambda s: setattr(s, "prompt", "What is 2?"),
        "token counts disagree": lambda s: setattr(s, "response_length", s.response_length - 1),
        "loss mask or logprobs length": lambda s: s.loss_mask.pop(),
        "malformed checkpoint": lambda s: s.metadata["fsm"]["checkpoint"].pop("segments"),
    }
    for why, change in cases.items():
        s = tampered(change)
        server = attempt(s, [turn(ANSWER)])
        assert why in s.metadata["fsm"]["checkpoint_rejected"], (why, s.metadata["fsm"].get("checkpoint_rejected"))
        trace = list(map(tuple, s.metadata["fsm"]["trace"]))
        assert trace[0] == ("RESET", "resume", "BUDGET_CHECK")
        assert server.requests[0]["input_ids"] == s.tokens[: len(server.requests[0]["input_ids"])]
        assert s.response == ANSWER + "<|im_end|>"  # nothing of the first attempt was stitched in
        assert s.metadata["fsm"]["attempt"] == 1


def test_without_partial_rollout_a_retry_restarts(fake_interpreter):
    s = Sample(prompt=PROMPT)
    attempt(s, [turn(CODE), abort_reply("so")])
    server = ScriptedServer([turn(ANSWER)])
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        run(slime.generate(make_args(partial_rollout=False), s, dict(SAMPLING)))
    assert s.response == ANSWER + "<|im_end|>" and "checkpoint" not in s.metadata["fsm"]


def test_abort_flag_stops_50_samples_in_tool_calls_before_their_next_generation(fake_interpreter):
    release = asyncio.Event()
    gate = {"in_tools": 0}

    async def held(self, state, **arguments):
        gate["in_tools"] += 1
        await release.wait()
        return "Output:\n1"

    orig = type(fake_interpreter).execute
    type(fake_interpreter).execute = held
    server = ScriptedServer([turn(CODE)], repeat_last=True)
    samples = [Sample(prompt=PROMPT, session_id=str(i)) for i in range(50)]

    async def go() -> int:
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=server)
            args = make_args(partial_rollout=True, engine_abort_status="aborted", engine_tool_concurrency=64)
            tasks = [asyncio.create_task(slime.generate(args, s, dict(SAMPLING))) for s in samples]
            while gate["in_tools"] < 50:
                await asyncio.sleep(0.01)
            sent_before = len(server.requests)
            rt = slime.runtime_for(__import__("engine.settings", fromlist=["EngineConfig"]).EngineConfig.from_args(args))
            rt.abort.set()
            release.set()
            await asyncio.gather(*tasks)
            rt.abort.clear()
            return sent_before

    try:
        sent_before = run(go())
    finally:
        type(fake_interpreter).execute = orig
    assert sent_before == 50
    assert len(server.requests) == 50  # no new /generate after the flag
    for s in samples:
        assert s.status == Sample.Status.ABORTED
        assert s.metadata["fsm"]["termination_reason"] == "abort_requested"
        assert s.metadata["fsm"]["checkpoint"]["resume_at"] == "generate"
        assert list(map(tuple, s.metadata["fsm"]["trace"]))[-1] == ("BUDGET_CHECK", "check", "ABORTED")
    # and they resume: the observation is kept, the next turn is generated
    attempt(samples[0], [turn(ANSWER)])
    assert samples[0].status == Sample.Status.COMPLETED and "Output:\n1" in samples[0].response


def test_a_cancel_while_a_request_waits_counts_only_the_turns_that_came_back(fake_interpreter):
    """The request in flight is no turn yet: the checkpoint counts the one answered turn, no fewer."""
    s = Sample(prompt=PROMPT)
    answered = ScriptedServer([turn(CODE, weight_version="v1")])

    async def go() -> None:
        waiting = asyncio.Event()

        async def server(request: httpx.Request) -> httpx.Response:
            if not answered.requests:
                return answered(request)
            waiting.set()
            await asyncio.sleep(3600)
            raise AssertionError("never answered")

        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=server)
            args = make_args(partial_rollout=True, engine_abort_status="aborted")
            task = asyncio.ensure_future(slime.generate(args, s, dict(SAMPLING)))
            await waiting.wait()
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    run(go())
    fsm = s.metadata["fsm"]
    assert s.status == Sample.Status.ABORTED and fsm["trace"][-1][0] == "GENERATE"
    assert fsm["checkpoint"]["turns"] == 1 and fsm["checkpoint"]["resume_at"] == "generate"
