"""The four desyncs slime's retool PR patched, each as a named transition of the machine."""

from __future__ import annotations

import respx

from engine import slime
from tests.conftest import run
from tests.support.helpers import SAMPLING, URL, ScriptedServer, encode, make_args, tok, turn
from engine.local.sample import Sample

CODE_TURN = "Let me compute.\n<code>\nprint(6*7)\n</code>"
ANSWER_TURN = "So the answer is 42.\nAnswer: \\boxed{42}"


def rollout(script: list, sample: Sample | None = None, **args_kw) -> tuple[Sample, ScriptedServer]:
    server = ScriptedServer(script)
    sample = sample or Sample(prompt="What is 6*7?", label="42", session_id="s-1")
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        out = run(slime.generate(make_args(**args_kw), sample, dict(SAMPLING)))
    assert out is sample
    return sample, server


def assert_aligned(s: Sample) -> None:
    """I1 and I3: arrays agree in length, tokens = prompt ids + response ids, text = decode(ids)."""
    n = s.response_length
    assert len(s.loss_mask) == len(s.rollout_log_probs) == n
    assert s.tokens[: len(s.tokens) - n] == slime_prompt_ids()
    assert s.response == tok().decode(s.tokens[len(s.tokens) - n :])


def test_fresh_two_turn_rollout_completes(fake_interpreter):
    s, server = rollout([turn(CODE_TURN), turn(ANSWER_TURN)])
    assert s.status == Sample.Status.COMPLETED
    assert s.metadata["fsm"]["termination_reason"] == "answered"
    assert fake_interpreter.codes == ["print(6*7)"]
    assert_aligned(s)
    obs = "\n\n<interpreter>\nOutput:\nprint(6*7)\n</interpreter>\n\n"
    assert s.response == tok().decode(encode(CODE_TURN) + [151645]) + obs + ANSWER_TURN + "<|im_end|>"
    # mask: model tokens 1, observation tokens 0 with logprob 0.0
    n1 = len(encode(CODE_TURN)) + 1
    n_obs = len(encode(obs))
    assert s.loss_mask == [1] * n1 + [0] * n_obs + [1] * (s.response_length - n1 - n_obs)
    assert all(lp == 0.0 for lp in s.rollout_log_probs[n1 : n1 + n_obs])
    # the second request continues token-in from the first turn plus the observation
    assert server.requests[1]["input_ids"] == s.tokens[: len(server.requests[1]["input_ids"])]
    assert server.requests[0]["return_logprob"] is True
    assert server.headers[0]["X-SMG-Routing-Key"] == "s-1"
    assert [e[0] for e in s.metadata["fsm"]["trace"]][:4] == ["RESET", "BUDGET_CHECK", "GENERATE", "TOOL_CALL"]


def test_retried_sample_with_stale_state_ends_identical_to_fresh(fake_interpreter):
    """Seed case 1: a sample retried after ABORTED carries stale state in every field."""
    script = lambda: [turn(CODE_TURN), turn(ANSWER_TURN, weight_version="v2")]
    fresh, _ = rollout(script())
    stale = Sample(prompt="What is 6*7?", label="42", session_id="s-1")
    stale.tokens = [1, 2, 3]
    stale.response = "stale text"
    stale.response_length = 3
    stale.loss_mask = [1, 0]
    stale.rollout_log_probs = [-0.5]
    stale.rollout_top_p_token_ids = [9]
    stale.rollout_top_p_token_offsets = [0, 1]
    stale.rollout_routed_experts = [[1]]
    stale.weight_versions = ["v0", "v1"]
    stale.status = Sample.Status.ABORTED
    stale.reward = 1.0
    stale.non_generation_time = 99.0
    stale.spec_info.spec_accept_token_num = 5
    stale.prefix_cache_info.cached_tokens = 7
    stale.metadata = {"fsm": {"trace": [["X", "y", "Z"]], "termination_reason": "server_aborted", "tool_stats": {"calls": 9},
                              "engine_error": "old"},
                      "turns": "the user's own", "profile": "mine", "attempt": 7}
    retried, _ = rollout(script(), sample=stale)
    for name in ("tokens", "response", "response_length", "loss_mask", "rollout_log_probs", "status",
                 "rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_routed_experts",
                 "weight_versions", "reward", "spec_info", "prefix_cache_info"):
        assert getattr(retried, name) == getattr(fresh, name), name
    assert retried.weight_versions == ["default", "v2"]
    for key in ("trace", "termination_reason", "turns"):
        assert retried.metadata["fsm"][key] == fresh.metadata["fsm"][key], key
    # RESET forgets only what the engine wrote: a user's keys of the same names stay.
    assert {k: retried.metadata[k] for k in ("turns", "profile", "attempt")} == {"turns": "the user's own", "profile": "mine", "attempt": 7}
    untimed = lambda stats: {k: v for k, v in stats.items() if k != "seconds"}  # noqa: E731
    assert untimed(retried.metadata["fsm"]["tool_stats"]) == untimed(fresh.metadata["fsm"]["tool_stats"])
    assert "engine_error" not in retried.metadata["fsm"]
    assert retried.non_generation_time < 5.0


def test_per_turn_max_new_tokens_is_clamped_to_the_context_left(fake_interpreter):
    """Seed case 2: one turn may not ask for more than the context has left."""
    prompt_len = len(slime_prompt_ids())
    budget = prompt_len + 60
    s, server = rollout([turn(CODE_TURN), turn(ANSWER_TURN)], rollout_max_context_len=budget)
    first, second = server.requests
    assert first["sampling_params"]["max_new_tokens"] == 60  # min(256, 60)
    left = budget - len(second["input_ids"])
    assert second["sampling_params"]["max_new_tokens"] == left
    assert 0 < left < 60
    assert_aligned(s)
    assert len(s.tokens) <= budget


def test_missing_logprobs_aborts_without_retokenizing(fake_interpreter):
    """Seed case 3: text without output_token_logprobs must not be re-tokenized."""
    # ABORTED handed back as to a caller that re-queues (tests/slime covers the re-run otherwise)
    s, _ = rollout([turn(CODE_TURN), turn(ANSWER_TURN, with_logprobs=False)], engine_abort_status="aborted")
    assert s.status == Sample.Status.ABORTED
    assert s.metadata["fsm"]["termination_reason"] == "logprobs_missing"
    assert_aligned(s)
    assert "Answer" not in s.response  # nothing of the unusable turn was appended


def test_tool_output_past_budget_is_trimmed_and_stays_truncated(fake_interpreter):
    """Seed case 4: a big print overflows the context; TRIM cuts every array together."""
    fake_interpreter.output = lambda code: "Output:\n" + "9" * 5000
    budget = len(slime_prompt_ids()) + 300
    s, server = rollout([turn(CODE_TURN)], rollout_max_context_len=budget)
    assert len(server.requests) == 1
    assert s.status == Sample.Status.TRUNCATED
    assert s.metadata["fsm"]["termination_reason"] == "observation_over_budget"
    assert len(s.tokens) == budget
    assert_aligned(s)
    trace = [tuple(e) for e in s.metadata["fsm"]["trace"]]
    assert trace[-2:] == [("TOOL_CALL", "observe", "TRIM"), ("TRIM", "trim", "TRUNCATED")]
    # TRUNCATED is not overwritten by the stop finish of the last model turn
    assert s.metadata["fsm"]["turns"][-1]["finish"] == "stop"


def test_prompt_that_fills_the_budget_ends_truncated_without_a_request():
    budget = len(slime_prompt_ids())
    s, server = rollout([], rollout_max_context_len=budget)
    assert server.requests == []
    assert s.status == Sample.Status.TRUNCATED
    assert s.metadata["fsm"]["termination_reason"] == "context_full"
    assert s.response_length == 0 and s.loss_mask == [] and s.response == ""
    assert len(s.tokens) == budget


def slime_prompt_ids() -> list[int]:
    from engine.profiles.retool import RetoolProfile, render_retool_prompt
    from engine import tools as t

    schemas = [t.get(n).schema() for n in t.names() if n not in RetoolProfile.withheld_tools]
    return encode(render_retool_prompt("What is 6*7?", schemas))


def test_prompt_longer_than_the_budget_ends_truncated_and_is_removed_from_training():
    """The PR version crashed here: no output at all. Now: TRUNCATED, empty response, removed."""
    budget = len(slime_prompt_ids()) - 1
    s, server = rollout([], rollout_max_context_len=budget)
    assert server.requests == []
    assert s.status == Sample.Status.TRUNCATED
    assert s.metadata["fsm"]["termination_reason"] == "prompt_over_budget"
    assert s.remove_sample is True
    assert (s.response, s.response_length, s.loss_mask, s.rollout_log_probs) == ("", 0, [], [])
