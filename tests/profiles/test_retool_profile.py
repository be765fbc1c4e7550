"""The retool profile reproduces slime's retool example: prompt text, turn rules, reward."""

from __future__ import annotations

import pytest

from engine import tools
from engine.profiles.retool import INVALID_ACTION, RetoolProfile, parse_retool_turn, render_retool_prompt
from engine.profiles.reward import answers_match, last_boxed, retool_score
from tests.support.helpers import tok

# slime's examples/retool template rendered (Jinja2) for this question and its one tool.
EXPECTED_PROMPT = (
    "<|im_start|>systemYou are a helpful assistant that can use Python tools to solve mathematical problems. "
    "When you need to perform calculations, use the code_interpreter tool to execute code and get results.\n"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    '{"function": {"description": "A tool for executing Python code in a safe sandbox environment.", '
    '"name": "code_interpreter", "parameters": {"properties": {"code": {"description": "The Python code to execute", '
    '"type": "string"}}, "required": ["code"], "type": "object"}}, "type": "function"}'
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>\n<|im_end|>\n<|im_start|>userWhat is 1+1?<|im_end|>\n<|im_start|>assistant"
)


def test_prompt_is_the_examples_byte_for_byte():
    schema = tools.get("code_interpreter").schema()
    assert render_retool_prompt("What is 1+1?", [schema]) == EXPECTED_PROMPT
    ids = RetoolProfile(tok()).render_prompt("What is 1+1?", [schema])
    assert tok().decode(ids) == EXPECTED_PROMPT


def test_system_message_of_a_chat_prompt_replaces_the_default():
    text = render_retool_prompt([{"role": "system", "content": "SYS"}, {"role": "user", "content": "Q"}], [])
    assert text == "<|im_start|>systemSYS\n<|im_end|>\n<|im_start|>userQ<|im_end|>\n<|im_start|>assistant"


@pytest.mark.parametrize(
    "text, action, detail",
    [
        ("Answer: \\boxed{\\frac{1}{2}}", "answer", "\\frac{1}{2}"),
        ("<code>print(1)</code> and Answer: \\boxed{3}", "answer", "3"),  # the answer wins, as in the example
        ('<tool_call>{"name": "code_interpreter", "arguments": {"code": "x = 1\nprint(x)"}}</tool_call>', "tool", "x = 1\nprint(x)"),
        ("text <code>\nprint(2)\n</code>", "tool", "print(2)"),
        ("```python\nprint(3)\n```", "tool", "print(3)"),
        ('<tool_call>{"name": "code_interpreter", "arguments": {"code": " "}}</tool_call> <code>print(4)</code>', "tool", "print(4)"),
        ("just thinking", "invalid", None),
    ],
)
def test_turn_rules(text, action, detail):
    turn = parse_retool_turn(text)
    assert turn.action == action
    if action == "answer":
        assert turn.answer == detail
    elif action == "tool":
        assert turn.calls[0].name == "code_interpreter" and turn.calls[0].arguments["code"] == detail


def test_observations_are_the_examples():
    profile = RetoolProfile(tok())
    from engine.profiles.base import CallResult, ToolCall, Turn

    turn = Turn("tool", (ToolCall("code_interpreter", {"code": "print(1)"}),))
    assert profile.observation_text(turn, [CallResult(turn.calls[0], "Output:\n1")]) == "\n\n<interpreter>\nOutput:\n1\n</interpreter>\n\n"
    assert profile.observation_text(Turn("invalid"), []) == INVALID_ACTION


def test_reward():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
    assert last_boxed("no box") is None
    assert answers_match("\\dfrac{1}{2}", "0.5") and answers_match("1,000", "1000") and answers_match(" 42. ", "42")
    assert not answers_match("41", "42")
    assert retool_score("Answer: \\boxed{42}", "42", tool_calls=0) == {"score": 1.0, "acc": True, "pred": "42"}
    wrong = retool_score("Answer: \\boxed{41}", "42", tool_calls=6)
    assert wrong["score"] == -0.8 and wrong["acc"] is False  # -1 + (6-2)/2*0.1
    assert retool_score("Answer: \\boxed{41}", "42", tool_calls=20)["score"] == -0.6  # capped
    assert retool_score("nothing", "42", tool_calls=0)["pred"] == ""
