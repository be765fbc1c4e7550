"""Mistral's tool-call turns as Mistral's own renderer writes them (PyPI `mistral-common`, its
tokenizers shipped in the package: v3 and v7 SentencePiece, v3 Tekken; nothing is downloaded).

What the engine relies on for this family, checked against the real token ids: the turn with
calls is `[TOOL_CALLS]` and the JSON array, ended by the EOS `</s>` (the token the chat profile
keeps as the turn's end); the `mistral` parser reads those calls (several, non-ASCII arguments,
with or without the space Tekken leaves out); the results follow the EOS in no role
(`[TOOL_RESULTS]`, no `[INST]`) and the model goes on.

Not a whole rollout: mistral-common is not a Hugging Face tokenizer with a chat template (its
transformers wrapper renders SentencePiece pieces, not text), so the chat profile cannot load it;
and a result names the model's call id, which the chat profile does not pass to the template.
"""

from __future__ import annotations

import json

import pytest

from engine.profiles.parsers import get_tool_parser

pytest.importorskip("mistral_common", reason="needs mistral-common (the dev extra)")

from mistral_common.protocol.instruct.messages import AssistantMessage, ToolMessage, UserMessage  # noqa: E402
from mistral_common.protocol.instruct.request import ChatCompletionRequest  # noqa: E402
from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall  # noqa: E402
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy  # noqa: E402
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer  # noqa: E402

CODE = "print('héllo 世界 🦜', 6 * 7)"
CALLS = [("a1b2c3d4e", {"code": CODE}), ("f5g6h7i8j", {"code": "print(1)"})]
SCHEMA = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
VARIANTS = {
    "v3": lambda: MistralTokenizer.v3(),
    "v3-tekken": lambda: MistralTokenizer.v3(is_tekken=True),
    "v7": lambda: MistralTokenizer.v7(),
}


def _text(tk, ids: list[int]) -> str:
    """The ids as a Hugging Face tokenizer decodes them: control tokens kept as their strings."""
    out, run = [], []
    for i in ids:
        if tk.is_special(i):
            out.append(tk.decode(run) if run else "")
            out.append(tk.decode([i], special_token_policy=SpecialTokenPolicy.KEEP))
            run = []
        else:
            run.append(i)
    return "".join(out) + (tk.decode(run) if run else "")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_mistral_s_own_rendering_of_a_turn_with_calls_and_its_results(variant: str) -> None:
    mt = VARIANTS[variant]()
    tk, instruct = mt.instruct_tokenizer.tokenizer, mt.instruct_tokenizer
    calls = [ToolCall(id=i, function=FunctionCall(name="code_interpreter", arguments=json.dumps(a))) for i, a in CALLS]
    request = ChatCompletionRequest(
        tools=[Tool(function=Function(name="code_interpreter", description="Run Python code.", parameters=SCHEMA))],
        messages=[UserMessage(content="What is 6 * 7? Use the tool."), AssistantMessage(tool_calls=calls),
                  ToolMessage(content="Output:\nhéllo 世界 🦜 42", tool_call_id="a1b2c3d4e"),
                  ToolMessage(content="1", tool_call_id="f5g6h7i8j")])
    ids = mt.encode_chat_completion(request).tokens
    start = ids.index(instruct.END_INST) + 1  # the generation prompt ends [/INST]; the model's turn follows
    end = ids.index(tk.eos_id, start)
    turn = ids[start:end + 1]
    assert turn[0] == instruct.TOOL_CALLS and turn[-1] == tk.eos_id  # the turn with calls ends on the EOS </s>
    text = _text(tk, turn)
    assert text.startswith("[TOOL_CALLS]") and text.endswith("</s>")
    read = get_tool_parser("mistral").parse(text, {"code_interpreter": SCHEMA})
    assert [(c.name, c.arguments, c.error) for c in read.calls] == [("code_interpreter", a, None) for _, a in CALLS]
    assert read.content == ""  # the EOS is not left as text
    # the results follow the EOS in no role (no [INST]) and each names the model's call id
    rest = ids[end + 1:]
    assert rest[0] == instruct.BEGIN_TOOL_RESULTS and instruct.BEGIN_INST not in rest
    results = _text(tk, rest)
    assert results.count("[TOOL_RESULTS]") == 2 and all(i in results for i, _ in CALLS)
    assert "héllo 世界 🦜 42" in results


def test_tekken_writes_no_space_after_the_marker_and_the_parser_reads_it_anyway() -> None:
    # SGLang's mistral detector needs "[TOOL_CALLS] [" and loses these calls (tool-call-formats.md)
    mt = MistralTokenizer.v3(is_tekken=True)
    call = ToolCall(id="a1b2c3d4e", function=FunctionCall(name="code_interpreter", arguments=json.dumps({"code": CODE})))
    request = ChatCompletionRequest(messages=[UserMessage(content="Q"), AssistantMessage(tool_calls=[call]),
                                              ToolMessage(content="42", tool_call_id="a1b2c3d4e")])
    text = _text(mt.instruct_tokenizer.tokenizer, mt.encode_chat_completion(request).tokens)
    assert "[TOOL_CALLS][{" in text
    turn = text[text.index("[TOOL_CALLS]"):text.index("</s>", text.index("[TOOL_CALLS]")) + len("</s>")]
    assert [(c.name, c.arguments) for c in get_tool_parser("mistral").parse(turn, {}).calls] == [("code_interpreter", {"code": CODE})]
