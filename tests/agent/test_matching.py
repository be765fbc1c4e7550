"""Matching a call's history onto what was sampled: what extends it, and every break by its name."""

from __future__ import annotations

import pytest

from engine.agent.calls import CallMade, Message, Part
from engine.agent.matching import contradiction, match_history, same_message, turn_matches

SYSTEM, USER = Message("system", "You add numbers."), Message("user", "What is 1+2+4?")
CALL = CallMade("c1", "add", '{"a": 1, "b": 2}')
TURN = Message("assistant", "Let me add.", reasoning="1 and 2 first", calls=(CALL,))
RESULT = Message("tool", "3", call_id="c1")
TRANSCRIPT = [SYSTEM, USER, TURN]
MODEL = frozenset({2})


def test_a_history_that_repeats_the_transcript_and_adds_extends_it():
    m = match_history([SYSTEM, USER, TURN, RESULT], TRANSCRIPT, MODEL, "json_calls")
    assert m.extends and m.added == (RESULT,)


@pytest.mark.parametrize("matcher", ["exact", "json_calls", "role_content"])
def test_the_turn_echoed_as_the_model_wrote_it_matches_under_every_matcher(matcher: str):
    assert turn_matches(TURN, TURN, matcher) == "same"


def test_json_calls_takes_other_json_formatting_and_a_left_out_reasoning_but_exact_does_not():
    spaced = Message("assistant", "Let me add.", calls=(CallMade("c1", "add", '{ "b":2, "a":1 }'),))
    assert turn_matches(TURN, spaced, "json_calls") == "same"
    assert turn_matches(TURN, spaced, "exact") == "turn_rewritten"
    dropped = Message("assistant", "Let me add.", calls=(CALL,))
    assert turn_matches(TURN, dropped, "exact") == "reasoning_dropped"
    assert turn_matches(TURN, dropped, "json_calls") == "same"


def test_white_space_around_the_text_counts_only_under_exact():
    padded = Message("assistant", "\nLet me add.  ", reasoning="1 and 2 first", calls=(CALL,))
    assert turn_matches(TURN, padded, "json_calls") == "same"
    assert turn_matches(TURN, padded, "exact") == "turn_rewritten"


def test_role_content_ignores_calls_and_reasoning():
    other = Message("assistant", "Let me add.", calls=(CallMade("zz", "sub", "{}"),))
    assert turn_matches(TURN, other, "role_content") == "same"
    assert turn_matches(TURN, Message("assistant", "Let me subtract."), "role_content") == "turn_rewritten"


def test_a_rewritten_call_is_a_named_break_at_the_turn():
    rewritten = Message("assistant", "Let me add.", reasoning="1 and 2 first", calls=(CallMade("c1", "add", '{"a": 1, "b": 5}'),))
    m = match_history([SYSTEM, USER, rewritten, RESULT], TRANSCRIPT, MODEL, "json_calls")
    assert (m.extends, m.reason, m.at) == (False, "turn_rewritten", 2)


def test_a_call_id_the_harness_changed_is_a_rewrite():
    other_id = Message("assistant", "Let me add.", calls=(CallMade("zz", "add", '{"a": 1, "b": 2}'),))
    assert turn_matches(TURN, other_id, "json_calls") == "turn_rewritten"


def test_the_reasoning_left_out_under_exact_is_reasoning_dropped():
    dropped = Message("assistant", "Let me add.", calls=(CALL,))
    m = match_history([SYSTEM, USER, dropped, RESULT], TRANSCRIPT, MODEL, "exact")
    assert (m.extends, m.reason) == (False, "reasoning_dropped")


def test_a_shorter_history_that_parts_after_its_start_is_compacted():
    long = [SYSTEM, USER, TURN, RESULT, Message("assistant", "Now 4.", calls=(CallMade("c2", "add", '{"a": 3, "b": 4}'),)),
            Message("tool", "7", call_id="c2"), Message("assistant", "7.")]
    summary = [SYSTEM, Message("user", "Summary: the sum so far is 7. Go on."), Message("user", "Continue")]
    m = match_history(summary, long, frozenset({2, 4, 6}), "json_calls")
    assert (m.extends, m.reason, m.at) == (False, "history_compacted", 1)


def test_a_history_that_parts_at_its_first_message_is_a_fork():
    m = match_history([Message("system", "You are a sub-agent."), USER], TRANSCRIPT, MODEL, "json_calls")
    assert (m.reason, m.at) == ("history_forked", 0)


def test_the_same_history_again_with_nothing_added_is_a_fork():
    assert match_history(TRANSCRIPT, TRANSCRIPT, MODEL, "json_calls").reason == "history_forked"
    assert match_history([SYSTEM, USER], TRANSCRIPT, MODEL, "json_calls").reason == "history_forked"


def test_a_result_for_a_call_never_made_is_a_contradiction():
    stray = Message("tool", "9", call_id="never")
    m = match_history([SYSTEM, USER, TURN, stray], TRANSCRIPT, MODEL, "json_calls")
    assert (m.extends, m.reason, m.at) == (False, "history_contradicts", 3)
    assert contradiction([SYSTEM, USER, Message("tool", "3")]) == 2  # no call made at all
    assert contradiction([SYSTEM, USER, TURN, RESULT]) is None


def test_a_text_sent_as_a_string_or_as_a_part_is_the_same_message_and_an_image_is_not_text():
    assert same_message(Message("user", "hi"), Message("user", (Part("text", "hi"),)))
    assert not same_message(Message("user", "hi"), Message("user", (Part("text", "hi"), Part("image", image="data:x"))))
