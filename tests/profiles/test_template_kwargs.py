"""The chat template's variables (slime's `--apply-chat-template-kwargs`, `enable_thinking` say) go
into every render of the chat profile, the glue after a tool result included: with thinking
switched off, each turn's prompt is the real template's own render with that switch, token for
token, for Qwen3, Qwen3.5 and GLM-4.7, as slime renders its dataset's prompt and SGLang a chat
request. Without it the glue opens a thinking turn the first prompt did not."""

from __future__ import annotations

from typing import Any

import pytest
import respx

from engine import slime, tools
from engine.local.invariants import sample_violations
from engine.local.sample import Sample
from engine.profiles.chat import ChatProfile, turn_end
from engine.profiles.tokenizer import load_tokenizer, offline_tokenizer_dir
from engine.settings import SettingsError
from engine.settings.core import EngineConfig
from tests.conftest import run
from tests.support.helpers import SAMPLING, URL, ScriptedServer, make_args, profile_turn

FAMILIES = ("qwen-3", "qwen-3.5", "glm-4.7-flash")
OFF = {"enable_thinking": False}
PROMPT = "What is 1 + 2, then 3 - 1? Check with the tool."


def call(content: str, code: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if code is not None:
        message["tool_calls"] = [{"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": code}}}]
    return message


def render(tok: Any, messages: list[dict[str, Any]], schema: dict[str, Any], prompt: bool, **kwargs: Any) -> str:
    return tok.apply_chat_template(messages, tools=[schema], tokenize=False, add_generation_prompt=prompt, **kwargs)


def script(tok: Any, profile: ChatProfile, schema: dict[str, Any]) -> tuple[list[list[dict[str, Any]]], list[str]]:
    """The messages before each turn and each turn's text as the template writes it with thinking off."""
    turns = [call("Let me check.", "print(1 + 2)"), call("Now the other.", "print(3 - 1)"), call("Answer: \\boxed{3}")]
    messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
    before, texts = [], []
    for k, turn in enumerate(turns):
        before.append(list(messages))
        prompt, whole = render(tok, messages, schema, True, **OFF), render(tok, [*messages, turn], schema, False, **OFF)
        assert whole.startswith(prompt)
        texts.append(whole[len(prompt):turn_end(profile, whole)])
        code = turn.get("tool_calls", [{}])[0].get("function", {}).get("arguments", {}).get("code")
        messages += [turn, {"role": "tool", "content": f"Output:\n{code}"}]  # the fake interpreter echoes the code
    return before, texts


def empty_blocks_out(profile: ChatProfile, text: str) -> str:
    return text.replace("<think>\n\n</think>\n\n", "").replace("<think></think>", "").replace("</think>", "")


def roll_out(model: str, texts: list[str], profile: ChatProfile, **settings: Any) -> tuple[Any, ScriptedServer]:
    server = ScriptedServer([profile_turn(profile, t) for t in texts])
    sample = Sample(index=1, prompt=PROMPT, label="3")
    args = make_args(hf_checkpoint=offline_tokenizer_dir(model), engine_profile="chat", engine_tools=["code_interpreter"],
                     **settings)

    async def go() -> Any:
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=server)
            return await slime.generate(args, sample, dict(SAMPLING))

    return run(go()), server


@pytest.mark.parametrize("model", FAMILIES)
def test_every_prompt_is_the_template_s_render_with_slime_s_kwargs(model: str, fake_interpreter: Any) -> None:
    tok = load_tokenizer(offline_tokenizer_dir(model))
    profile = ChatProfile(tok, template_kwargs=OFF)
    assert not profile.thinking_forced  # the generation prompt closes the reasoning it would open
    schema = tools.get("code_interpreter").schema()  # type: ignore[union-attr]
    before, texts = script(tok, profile, schema)
    out, server = roll_out(model, texts, profile, apply_chat_template_kwargs=OFF)
    sample = out[0] if isinstance(out, list) else out
    assert (len(out) if isinstance(out, list) else 1) == 1 and sample.status == Sample.Status.COMPLETED
    assert len(server.requests) == 3
    for k, (request, messages) in enumerate(zip(server.requests, before)):
        expected = render(tok, messages, schema, True, **OFF)
        text = profile.decode(request["input_ids"])
        if k == 0:  # the prompt: the template's own, token for token
            assert request["input_ids"] == profile.encode(expected)
        # the glue after a tool result opens the turn as the template does with thinking off ...
        assert text.endswith(expected[-40:]), f"turn {k + 1}: {text[-200:]!r}"
        # ... and one sequence: a full render (Qwen3's) leaves out earlier turns' empty reasoning, nothing else
        assert empty_blocks_out(profile, text) == empty_blocks_out(profile, expected), f"turn {k + 1}"
    for earlier, later in zip(server.requests, server.requests[1:]):
        assert later["input_ids"][: len(earlier["input_ids"])] == earlier["input_ids"]
    assert sample_violations(sample, prompt_ids=server.requests[0]["input_ids"], budget=4096, decode=profile.decode) == []


@pytest.mark.parametrize("model", FAMILIES)
def test_without_the_kwargs_the_glue_reopens_thinking(model: str, fake_interpreter: Any) -> None:
    """The case the setting exists for: the same rollout rendered without it differs from the
    template's render with thinking off at the first tool result."""
    tok = load_tokenizer(offline_tokenizer_dir(model))
    with_off = ChatProfile(tok, template_kwargs=OFF)
    schema = tools.get("code_interpreter").schema()  # type: ignore[union-attr]
    before, texts = script(tok, with_off, schema)
    _, server = roll_out(model, texts, with_off)
    assert len(server.requests) >= 2
    assert server.requests[1]["input_ids"] != with_off.encode(render(tok, before[1], schema, True, **OFF))


@pytest.mark.parametrize("value", ['{"tokenize": true}', "[1]", "{not json", '{"add_generation_prompt": false}'])
def test_kwargs_the_engine_sets_itself_or_not_a_mapping_are_refused(value: str) -> None:
    with pytest.raises(SettingsError, match="apply_chat_template_kwargs"):
        EngineConfig(chat_template_kwargs=value)


def test_slime_s_json_text_and_a_mapping_read_alike() -> None:
    assert EngineConfig(chat_template_kwargs='{"enable_thinking": false}').chat_template_kwargs == OFF
    assert EngineConfig(chat_template_kwargs=OFF).chat_template_kwargs == OFF
    assert EngineConfig().chat_template_kwargs == {}


@pytest.mark.parametrize("model", FAMILIES)
def test_a_request_s_own_kwargs_render_alike_only_where_the_real_template_renders_the_same(model: str) -> None:
    tok = load_tokenizer(offline_tokenizer_dir(model))
    thinking, off = ChatProfile(tok), ChatProfile(tok, template_kwargs=OFF)
    # each of these templates thinks unless told not to: asking it to think changes nothing
    assert thinking.renders_alike({}) and thinking.renders_alike({"enable_thinking": True})
    assert not thinking.renders_alike(OFF)
    assert off.renders_alike(OFF) and off.renders_alike({})  # overlaid on the job's: nothing new
    assert not off.renders_alike({"enable_thinking": True})
    assert thinking.renders_alike({"a_variable_no_template_reads": 1})
    with pytest.raises(ValueError, match="may not set add_generation_prompt"):
        thinking.renders_alike({"add_generation_prompt": False})
