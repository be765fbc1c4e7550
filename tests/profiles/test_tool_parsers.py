"""The tool-call parsers on their own (no SGLang needed): calls, errors, reasoning, the registry."""

from __future__ import annotations

import pytest

import engine.logs
from engine.profiles import parsers
from engine.profiles.chat import ChatProfile
from engine.profiles.parsers import detect_tool_parser, foreign_format, get_tool_parser, register_tool_parser
from engine.profiles.parsers.base import ParsedTurn
from engine.profiles.tokenizer import load_tokenizer
from tests.profiles.formats_corpus import NESTED, ONE, RENDER, TOOLS, TWO, UNICODE, cases

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NATIVE = sorted(RENDER)


@pytest.mark.parametrize("name", NATIVE)
def test_each_format_reads_its_calls_typed_by_the_schema(name: str) -> None:
    parser = get_tool_parser(name)
    for calls in ([ONE, UNICODE, NESTED] if name == "gpt-oss" else [ONE, TWO, UNICODE, NESTED]):
        read = parser.parse(RENDER[name](calls), SCHEMAS)
        assert [(c.name, c.arguments, c.error) for c in read.calls] == [(n, a, None) for n, a in calls]
    # the integer and the object of NESTED come back typed even where the format wrote text
    assert parser.parse(RENDER[name](NESTED), SCHEMAS).calls[0].arguments["days"] == 2


@pytest.mark.parametrize("case", [c for c in cases() if c["expect"].startswith("engine_error")], ids=lambda c: c["id"])
def test_a_malformed_or_cut_call_is_an_error_never_an_answer(case: dict) -> None:
    read = get_tool_parser(case["parser"]).parse(case["text"], SCHEMAS)
    assert read.calls and any(c.error in ("malformed_call", "bad_arguments") for c in read.calls)
    assert all(c.detail for c in read.calls if c.error)


@pytest.mark.parametrize("name", ["qwen3_coder", "glm45", "glm47", "minimax-m2"])
def test_a_value_that_does_not_fit_names_the_argument(name: str) -> None:
    read = get_tool_parser(name).parse(RENDER[name]([("lookup", {"city": "Oslo", "days": "soon"})]), SCHEMAS)
    (call,) = read.calls
    assert call.error == "bad_arguments" and "'days'" in call.detail and "integer" in call.detail


def test_text_without_a_call_is_content() -> None:
    for name in NATIVE:
        assert get_tool_parser(name).parse("The answer is 42.", SCHEMAS) == ParsedTurn("The answer is 42.")


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError) as err:
        get_tool_parser("no-such-format")
    assert "unknown tool parser 'no-such-format': known are" in str(err.value)
    assert all(n in str(err.value) for n in ("hermes", "glm47", "gpt-oss", "qwen3_coder"))


def test_register_tool_parser_by_object_and_by_module_path() -> None:
    class Shout:
        name = "shout"

        def parse(self, text: str, schemas: dict) -> ParsedTurn:
            from engine.profiles.base import ToolCall

            return ParsedTurn("", (ToolCall("code_interpreter", {"code": text[6:]}),)) if text.startswith("CALL: ") else ParsedTurn(text)

    register_tool_parser("shout-test", Shout())
    assert get_tool_parser("shout-test").parse("CALL: 1+1", {}).calls[0].arguments == {"code": "1+1"}
    with pytest.raises(ValueError, match="already registered"):
        register_tool_parser("shout-test", Shout())
    with pytest.raises(ValueError, match="already registered"):
        register_tool_parser("hermes", Shout())
    register_tool_parser("pythonic-by-path", "engine.profiles.parsers.pythonic:PythonicParser")
    assert get_tool_parser("pythonic-by-path").parse("[code_interpreter(code='1')]", {}).calls[0].name == "code_interpreter"
    assert "shout-test" in parsers.tool_parser_names()


def test_another_family_s_call_is_named() -> None:
    assert foreign_format(RENDER["glm47"](ONE), "hermes", SCHEMAS) == "glm47"
    assert foreign_format(RENDER["kimi_k2"](ONE), "qwen3_coder", SCHEMAS) == "kimi_k2"
    assert foreign_format("just an answer", "hermes", SCHEMAS) is None
    assert foreign_format(RENDER["hermes"](ONE), "qwen25", SCHEMAS) is None  # the same family


def test_the_chat_template_names_the_parser() -> None:
    assert detect_tool_parser(load_tokenizer().chat_template) == "qwen"  # Qwen3: SGLang's name for it too
    assert detect_tool_parser("<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key>") == "glm47"
    assert detect_tool_parser("<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>") == "glm45"
    assert detect_tool_parser("<function={{ name }}>\n<parameter=") == "qwen3_coder"
    assert detect_tool_parser("{{ messages }}") is None


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer()


def test_chat_profile_reads_the_configured_format(qwen3) -> None:
    from engine import tools

    assert tools.get("code_interpreter") is not None
    profile = ChatProfile(qwen3, tool_parser="glm47")
    turn = profile.parse_turn("I will run it.</think>" + RENDER["glm47"](ONE))
    assert turn.action == "tool" and [(c.name, c.arguments) for c in turn.calls] == ONE


def test_a_call_inside_the_reasoning_is_not_run(qwen3) -> None:
    profile = ChatProfile(qwen3, tool_parser="hermes")
    turn = profile.parse_turn("<think>maybe " + RENDER["hermes"](ONE) + "</think>\n\nNo tool needed: 42.")
    assert turn.action == "answer" and not turn.calls
    assert profile.parse_turn("<think>plan</think>" + RENDER["hermes"](ONE)).action == "tool"


def test_another_format_s_call_is_an_answer_marked_foreign(qwen3) -> None:
    profile = ChatProfile(qwen3, tool_parser="hermes")
    turn = profile.parse_turn(RENDER["deepseekv31"](ONE))
    assert turn.action == "answer" and turn.foreign == "deepseekv31"
    assert profile.parse_turn("Answer: \\boxed{42}").foreign is None


def test_chat_profile_refuses_an_unknown_parser(qwen3) -> None:
    with pytest.raises(ValueError, match="unknown tool parser 'nope': known are"):
        ChatProfile(qwen3, tool_parser="nope")


def test_the_default_parser_is_chosen_from_the_template_and_logged_once(qwen3, caplog) -> None:
    engine.logs.forget()
    with caplog.at_level("INFO", logger="engine.profiles.parsers"):
        assert ChatProfile(qwen3).tool_parser == "qwen"
        ChatProfile(qwen3)
    lines = [r.getMessage() for r in caplog.records if "tool parser" in r.getMessage()]
    assert lines == ["tool parser qwen (from the chat template); set engine_tool_parser to choose"]


@pytest.mark.parametrize("family", ["glm45", "glm47", "qwen3_coder"])
def test_another_family_s_body_in_hermes_s_own_tags_is_an_answer_marked_foreign(qwen3, family: str) -> None:
    # GLM and Qwen3-Coder write <tool_call> too: hermes cannot read the body, their parsers read it whole
    profile = ChatProfile(qwen3, tool_parser="hermes")
    text = "Let me check.\n" + RENDER[family](ONE)
    assert get_tool_parser("hermes").parse(text, SCHEMAS).calls[0].error == "malformed_call"  # the parser alone
    turn = profile.parse_turn(text)
    assert turn.action == "answer" and not turn.calls and turn.foreign in {"glm47", "qwen3_coder"}
    assert turn.foreign == ("qwen3_coder" if family == "qwen3_coder" else "glm47")


def test_hermes_json_under_glm47_is_foreign_and_the_other_way_round(qwen3) -> None:
    assert ChatProfile(qwen3, tool_parser="glm47").parse_turn(RENDER["hermes"](ONE)).foreign == "hermes"
    assert ChatProfile(qwen3, tool_parser="qwen3_coder").parse_turn(RENDER["glm47"](ONE)).foreign == "glm47"


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"\n</tool_call>',  # JSON cut short
    '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "x = [f(1)]"\n</tool_call>',  # ...holding a pythonic-looking list
    "<tool_call>\nprint(1)\n</tool_call>",  # no JSON at all
    '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}}\n',  # never closed
])
def test_a_genuinely_malformed_hermes_call_is_still_an_error(qwen3, text: str) -> None:
    turn = ChatProfile(qwen3, tool_parser="hermes").parse_turn(text)
    assert turn.action == "tool" and turn.foreign is None
    assert [c.error for c in turn.calls] == ["malformed_call"]


def test_formats_that_write_call_ids_keep_them() -> None:
    # a template may show the id with the result (Mistral's call_id); ids do not count in equality
    mistral = get_tool_parser("mistral").parse('[TOOL_CALLS] [{"name": "code_interpreter", "arguments": {"code": "1"}, "id": "a1b2c3d4e"}]', {})
    assert [c.id for c in mistral.calls] == ["a1b2c3d4e"]
    compact = get_tool_parser("mistral").parse('[TOOL_CALLS]code_interpreter[CALL_ID]f5g6h7i8j[ARGS]{"code": "1"}', {})
    assert [(c.name, c.id) for c in compact.calls] == [("code_interpreter", "f5g6h7i8j")]
    kimi = get_tool_parser("kimi_k2").parse(RENDER["kimi_k2"](TWO), SCHEMAS)
    assert [c.id for c in kimi.calls] == [f"functions.{n}:{i}" for i, (n, _) in enumerate(TWO)]
    assert get_tool_parser("hermes").parse(RENDER["hermes"](ONE), SCHEMAS).calls[0].id is None
