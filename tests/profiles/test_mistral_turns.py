"""Mistral's tool-call turns against Mistral's own renderer (PyPI `mistral-common`, its tokenizers
shipped in the package: v3 and v7 SentencePiece, v3 Tekken; nothing is downloaded).

What the engine relies on for this family, checked against the real token ids: the turn with
calls is `[TOOL_CALLS]` and the JSON array, ended by the EOS `</s>` (the token the chat profile
keeps as the turn's end); the `mistral` parser reads those calls (several, non-ASCII arguments,
with or without the space Tekken leaves out); the results follow the EOS in no role
(`[TOOL_RESULTS]`, no `[INST]`), each naming the model's call id, and the model goes on.

A whole rollout runs on a Mistral-v0.3-style tokenizer and template built from mistral-common's
files (tests/support/mistral.py): the ids the engine sends are mistral-common's, token for token.
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


def test_a_whole_mistral_rollout_is_mistral_common_s_render_token_for_token(fake_interpreter) -> None:
    # A Mistral-v0.3-style tokenizer and template (tests/support/mistral.py): the prompt with the tool,
    # the model's [TOOL_CALLS] turn ended by </s>, the result glued with the model's call id; the
    # second request must be exactly mistral-common's render of the same conversation.
    from engine import tools
    from engine.settings import EngineConfig, RetryPolicy
    from engine.local.invariants import sample_violations
    from engine.local.sample import Sample
    from tests.profiles.test_family_rollouts import _reply
    from tests.support.helpers import URL, ScriptedServer
    from tests.support.mistral import mistral_v3_tokenizer

    tok = mistral_v3_tokenizer()
    schema = tools.get("code_interpreter").schema()["function"]  # type: ignore[union-attr]
    call_text = '[TOOL_CALLS] [{"name": "code_interpreter", "arguments": ' + json.dumps({"code": CODE}, ensure_ascii=False) + ', "id": "a1b2c3d4e"}]'
    call_ids = tok(call_text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    answer_ids = tok(" It printed 42. Answer: \\boxed{42}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    server = ScriptedServer([_reply(call_ids, call_text), _reply(answer_ids, "")])
    cfg = EngineConfig(server_url=URL, profile="chat", max_context_len=4096, retry=RetryPolicy(max_attempts=1),
                       tools=("code_interpreter",))
    sample = Sample(prompt="What is 6 * 7? Use the tool.", label="42")

    profile = server.roll_out(cfg, tok, sample)
    assert profile.tool_parser == "mistral" and profile.closer == "</s>"  # from the template
    fsm = sample.metadata["fsm"]
    assert sample.status == Sample.Status.COMPLETED and fake_interpreter.codes == [CODE], fsm
    # mistral-common's own ids for the prompt, and for the conversation up to the next model turn
    mt = MistralTokenizer.v3()
    mistral_tool = Tool(function=Function(name="code_interpreter", description=schema["description"], parameters=schema["parameters"]))
    user = UserMessage(content=sample.prompt)
    prompt_ids = mt.encode_chat_completion(ChatCompletionRequest(messages=[user], tools=[mistral_tool])).tokens
    call = ToolCall(id="a1b2c3d4e", function=FunctionCall(name="code_interpreter", arguments=json.dumps({"code": CODE})))
    after = mt.encode_chat_completion(ChatCompletionRequest(tools=[mistral_tool], messages=[
        user, AssistantMessage(tool_calls=[call]), ToolMessage(content=f"Output:\n{CODE}", tool_call_id="a1b2c3d4e")])).tokens
    assert server.requests[0]["input_ids"] == prompt_ids
    assert server.requests[1]["input_ids"] == after  # the model's turn as sent, </s> once, the result with its id
    observation = after[len(prompt_ids) + len(call_ids):]
    assert sample.tokens == after + answer_ids
    assert sample.loss_mask == [1] * len(call_ids) + [0] * len(observation) + [1] * len(answer_ids)
    assert "a1b2c3d4e" in profile.decode(observation) and observation[0] == mt.instruct_tokenizer.BEGIN_TOOL_RESULTS
    assert sample_violations(sample, prompt_ids=prompt_ids, budget=4096, decode=profile.decode) == []


def test_the_mistral_template_shows_no_drift_and_its_results_name_the_call() -> None:
    from engine.profiles.base import ToolCall as EngineCall
    from engine.profiles.chat import ChatProfile
    from tests.support.mistral import mistral_v3_tokenizer

    profile = ChatProfile(mistral_v3_tokenizer())
    assert profile.drift is None and profile.shows_calls  # the glue is rendered per turn, with the calls' ids
    delta = profile.tool_delta(["1", "2"], [EngineCall("code_interpreter", id="a1b2c3d4e"), EngineCall("lookup", id="f5g6h7i8j")])
    assert delta == ('</s>[TOOL_RESULTS] {"content": "1", "call_id": "a1b2c3d4e"}[/TOOL_RESULTS]'
                     '[TOOL_RESULTS] {"content": "2", "call_id": "f5g6h7i8j"}[/TOOL_RESULTS]')


def test_a_call_id_the_template_refuses_falls_back_to_a_stand_in() -> None:
    from engine.profiles.base import ToolCall as EngineCall
    from engine.profiles.chat import ChatProfile
    from tests.support.mistral import mistral_v3_tokenizer

    delta = ChatProfile(mistral_v3_tokenizer()).tool_delta(["1"], [EngineCall("code_interpreter", id="short")])
    assert delta == '</s>[TOOL_RESULTS] {"content": "1", "call_id": "call00000"}[/TOOL_RESULTS]'  # not an exception
