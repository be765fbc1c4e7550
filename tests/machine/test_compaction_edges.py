"""The edges of long rollouts, edge by edge: COMPACT (summarize, drop_oldest, and what ends them),
and the template's own render of the next prompt where it drops earlier reasoning."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest

from engine.machine.rollout import Rollout
from engine.profiles.chat import ChatProfile
from engine.profiles.history import SUMMARY_HEADER
from tests.machine import test_machine
from tests.machine.test_machine import ANSWER, PROMPT, path, walk
from tests.support.helpers import IM_END, encode, tok, turn

ASK = "Summarize, please."


def call(code: str) -> str:
    """A hermes tool call, as Qwen3's template writes one."""
    return f'<tool_call>\n{json.dumps({"name": "code_interpreter", "arguments": {"code": code}})}\n</tool_call>'


def chat_prompt_len() -> int:
    from engine import tools

    profile = ChatProfile(tok())
    return len(profile.render_prompt(PROMPT, [tools.get(n).schema() for n in tools.names()]))  # type: ignore[union-attr]


def compacting(mode: str, threshold: int, **kw: Any) -> dict[str, Any]:
    return {"profile": "chat", "compaction": mode, "compaction_threshold": threshold, "compaction_prompt": ASK, **kw}


def edge_guard(r: Rollout, edge: tuple[str, str, str]) -> list[str | None]:
    return [g for e, g in zip(path(r), r.record.guards) if e == edge]


def test_drop_oldest_starts_a_segment_without_the_oldest_exchange(fake_interpreter):
    # after two exchanges the segment reaches the threshold; the next keeps the latest one
    script = [turn(call("print(1)")), turn(call("print(2)")), turn(ANSWER)]
    first = walk(list(script), profile="chat")[0]  # the same rollout uncompacted, to size the threshold
    after_two = first.record.turn_log[0]["observation_tokens"] + first.record.turn_log[1]["observation_tokens"]
    threshold = first.traj.prompt_length + sum(len(encode(call(c))) + 1 for c in ("print(1)", "print(2)")) + after_two
    r, server = walk(list(script), **compacting("drop_oldest", threshold, compaction_keep_turns=1))
    assert edge_guard(r, ("BUDGET_CHECK", "check", "COMPACT")) == ["compaction_due"]
    assert edge_guard(r, ("COMPACT", "compacted", "BUDGET_CHECK")) == ["oldest_dropped"]
    assert (r.state, r.record.reason) == ("COMPLETED", "answered")
    assert len(r.closed) == 1 and r.closed[0].reason == "oldest_dropped"
    # the second segment's prompt: the first prompt, then the latest exchange, as the template renders it
    third = server.requests[2]["input_ids"]
    assert third == r.traj.prompt_ids.tolist() and len(third) < threshold
    text = tok().decode(third)
    assert "print(2)" in text and "print(1)" not in text and text.startswith(tok().decode(server.requests[0]["input_ids"])[:200])
    closed = r.closed[0].traj
    closed.check(full=True, max_total_length=4096)
    assert closed.prompt_ids.tolist() == server.requests[0]["input_ids"]
    assert r.record.turn_log[2] == {"turn": 2, "compaction": "drop_oldest", "tokens": 0, "dropped": 1}


def test_summarize_asks_in_the_segment_s_own_context_and_trains_the_summary(fake_interpreter):
    summary = "I printed 1 and 2."
    script = [turn(call("print(1)")), turn(call("print(2)")), turn(summary), turn(ANSWER)]
    probe = walk([turn(call("print(1)")), turn(call("print(2)")), turn(ANSWER)], profile="chat")[0]
    threshold = probe.closed and 0 or (probe.traj.total_length - len(encode(ANSWER)) - 1)  # after the second observation
    r, server = walk(script, **compacting("summarize", threshold))
    assert edge_guard(r, ("COMPACT", "compacted", "BUDGET_CHECK")) == ["summarized"]
    assert (r.state, r.record.reason, len(r.closed)) == ("COMPLETED", "answered", 1)
    asked = server.requests[2]["input_ids"]
    # the question replaces the generation prompt the segment ended with; nothing else changes
    before = server.requests[1]["input_ids"] + encode(call("print(2)")) + [IM_END]
    assert asked[: len(before)] == before
    assert tok().decode(asked[len(before):]).endswith(f"<|im_start|>user\n{ASK}<|im_end|>\n<|im_start|>assistant\n")
    closed = r.closed[0]
    assert closed.reason == "summarized"
    closed.traj.check(full=True, max_total_length=4096)
    assert closed.traj.input_ids() == asked + encode(summary) + [IM_END]
    mask = closed.traj.loss_mask.tolist()
    assert mask[-(len(encode(summary)) + 1):] == [1] * (len(encode(summary)) + 1)  # the summary is trained
    # the next segment: the prompt, the summary as a user message, the latest exchanges that fit
    nxt = tok().decode(server.requests[3]["input_ids"])
    assert SUMMARY_HEADER + summary in nxt and ASK not in nxt
    assert len(server.requests[3]["input_ids"]) < threshold
    assert r.record.turn_log[2]["compaction"] == "summarize" and r.record.turn_log[2]["tokens"] == len(encode(summary)) + 1


def test_a_summary_kept_out_of_training_stays_in_its_segment_with_mask_0(fake_interpreter):
    script = [turn(call("print(1)")), turn("Short summary."), turn(ANSWER)]
    probe = walk([turn(call("print(1)")), turn(ANSWER)], profile="chat")[0]
    threshold = probe.traj.total_length - len(encode(ANSWER)) - 1
    r, _ = walk(script, **compacting("summarize", threshold, compaction_train_summary=False))
    closed = r.closed[0].traj
    n = len(encode("Short summary.")) + 1
    assert closed.loss_mask.tolist()[-n:] == [0] * n and closed.logprobs.tolist()[-n:] == [0.0] * n
    assert r.record.turn_log[1]["tokens"] == 0 and r.record.turn_log[1]["summary_tokens"] == n


@pytest.mark.parametrize("reply, reason", [
    (turn(""), "summary_refused"),
    (turn("<think>\nI would rather not.\n</think>\n\n"), "summary_refused"),
    (turn("a summary that goes on and on", finish="length"), "summary_overflows"),
])
def test_a_summary_refused_or_unfinished_ends_the_sample_truncated_keeping_what_came_before(fake_interpreter, reply, reason):
    probe = walk([turn(call("print(1)")), turn(ANSWER)], profile="chat")[0]
    threshold = probe.traj.total_length - len(encode(ANSWER)) - 1
    r, server = walk([turn(call("print(1)")), reply], **compacting("summarize", threshold))
    assert path(r)[-1] == ("COMPACT", "compacted", "TRUNCATED")
    assert (r.state, r.record.reason) == ("TRUNCATED", reason)
    assert r.closed == [] and r.traj.loss_mask.tolist()[: len(encode(call("print(1)"))) + 1] == [1] * (len(encode(call("print(1)"))) + 1)
    assert r.traj.input_ids()[: len(server.requests[1]["input_ids"])] == server.requests[1]["input_ids"]


def test_no_room_to_ask_for_a_summary_overflows_without_a_request(fake_interpreter):
    probe = walk([turn(call("print(1)")), turn(ANSWER)], profile="chat")[0]
    total = probe.traj.total_length - len(encode(ANSWER)) - 1
    r, server = walk([turn(call("print(1)"))], **compacting("summarize", total - 1, max_context_len=total))
    assert (r.state, r.record.reason) == ("TRUNCATED", "summary_overflows")
    assert len(server.requests) == 1 and r.record.turn_log[-1]["compaction"] == "summarize"


def test_a_summary_too_long_for_the_next_prompt_overflows(fake_interpreter):
    probe = walk([turn(call("print(1)")), turn(ANSWER)], profile="chat")[0]
    threshold = probe.traj.total_length - len(encode(ANSWER)) - 1
    r, _ = walk([turn(call("print(1)")), turn("word " * threshold)], **compacting("summarize", threshold, max_context_len=8 * threshold))
    assert (r.state, r.record.reason) == ("TRUNCATED", "summary_overflows")


def test_drop_oldest_whose_prompt_alone_reaches_the_threshold_overflows(fake_interpreter):
    r, _ = walk([turn(call("print(1)"))], **compacting("drop_oldest", 3))
    assert path(r)[-1] == ("COMPACT", "compacted", "TRUNCATED")
    assert (r.state, r.record.reason) == ("TRUNCATED", "compaction_overflows")


@pytest.mark.parametrize("reply, state, reason", [
    (turn("x", with_logprobs=False), "ABORTED", "logprobs_missing"),
    (turn("half a summ", finish="abort"), "ABORTED", "server_aborted"),
    (httpx.Response(400, json={"error": "context length exceeded: too many tokens"}), "TRUNCATED", "context_rejected"),
    (httpx.Response(400, json={"error": "bad sampling param"}), "FAILED", "request_rejected"),
    (httpx.Response(503), "ABORTED", "request_failed"),
])
def test_a_summary_request_that_fails_ends_as_a_turn_would(fake_interpreter, reply, state, reason):
    probe = walk([turn(call("print(1)")), turn(ANSWER)], profile="chat")[0]
    threshold = probe.traj.total_length - len(encode(ANSWER)) - 1
    r, _ = walk([turn(call("print(1)")), reply, reply], **compacting("summarize", threshold, abort_status="aborted"))
    assert path(r)[-1][0] == "COMPACT" and (r.state, r.record.reason) == (state, reason)


def test_the_template_s_render_drops_earlier_reasoning_at_a_user_turn_a_new_segment(fake_interpreter):
    """Qwen3's template keeps a turn's reasoning until a user message follows it: the environment's
    reply makes the next prompt the template's render (reasoning gone), a new segment."""
    first = "<think>\nLet me greet.\n</think>\n\nHello."
    r, server = walk([turn(first), turn("Hello again.")], profile="chat", environment="echo_test")
    edge = ("ENVIRONMENT", "env_reply", "BUDGET_CHECK")
    assert edge_guard(r, edge) == ["reasoning_dropped"]
    assert len(r.closed) == 1 and r.closed[0].reason == "reasoning_dropped"
    second = tok().decode(server.requests[1]["input_ids"])
    # the turn as the template renders it before a user message: its reasoning gone (the echo holds its text)
    assert "<|im_start|>assistant\n<think>" not in second
    assert "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nYou said: <think>" in second
    assert second.endswith("<|im_end|>\n<|im_start|>assistant\n")
    # kept as one sequence when asked: the reasoning stays
    kept, server = walk([turn(first), turn("Hello again.")], profile="chat", environment="echo_test",
                        earlier_reasoning="keep")
    assert kept.closed == [] and "<|im_start|>assistant\n<think>" in tok().decode(server.requests[1]["input_ids"])


def test_a_template_that_drops_all_earlier_reasoning_breaks_after_a_tool_turn(fake_interpreter, monkeypatch):
    # Qwen3's template, but keeping reasoning for the last message only (as some templates do)
    dropping = copy.copy(tok())
    dropping.chat_template = tok().chat_template.replace("loop.index0 > ns.last_query_index", "loop.last")
    assert dropping.chat_template != tok().chat_template and ChatProfile(dropping).earlier_reasoning() == "dropped"
    monkeypatch.setattr(test_machine, "tok", lambda: dropping)
    r, server = walk([turn("<think>\nRun it.\n</think>\n\n" + call("print(1)")), turn(ANSWER)], profile="chat")
    assert edge_guard(r, ("TOOL_CALL", "observe", "BUDGET_CHECK")) == ["reasoning_dropped"]
    assert r.closed[0].traj.response_ids.tolist() == encode("<think>\nRun it.\n</think>\n\n" + call("print(1)")) + [IM_END]
    assert "Run it." not in tok().decode(server.requests[1]["input_ids"])
    assert r.record.turn_log[0]["tools"] == ("code_interpreter",)  # the results are recorded though not glued on


def test_a_tool_loop_under_qwen3_stays_one_sequence(fake_interpreter):
    """Reasoning is kept across tool results: nothing is rendered again, one segment."""
    r, server = walk([turn("<think>\nRun it.\n</think>\n\n" + call("print(1)")), turn(ANSWER)], profile="chat")
    assert r.closed == [] and "Run it." in tok().decode(server.requests[1]["input_ids"])
    assert r.history is not None and r.history.exchanges[0].message is None  # never read back into a message


def test_a_compaction_threshold_the_context_cannot_hold_is_one_sentence():
    from engine.settings import EngineConfig, SettingsError

    with pytest.raises(SettingsError, match=r"^engine_compaction_threshold must be below the context \(4096 tokens\), got 4096$"):
        EngineConfig(compaction="summarize", compaction_threshold=4096, max_context_len=4096)
    with pytest.raises(SettingsError, match="needs engine_compaction_threshold or a context"):
        EngineConfig(compaction="drop_oldest").threshold()  # asked by the runtime: run learns the server's context first
    assert EngineConfig(compaction="summarize", max_context_len=4000).threshold() == 3000
    assert EngineConfig(compaction_threshold=4096, max_context_len=4096).threshold() is None  # off: not read


def test_compaction_needs_a_profile_that_renders_messages():
    from engine.loop.runtime import Runtime
    from engine.settings import SettingsError
    from tests.machine.test_machine import cfg

    with pytest.raises(SettingsError, match="^engine_compaction: summarize renders .* the retool profile has none"):
        Runtime.create(cfg(compaction="summarize", compaction_threshold=100), tokenizer=tok())
