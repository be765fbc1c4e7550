"""slime's per-call metrics (prefix cache, speculative decoding) and the retool reward's input."""

from __future__ import annotations

from typing import Any

import httpx
import respx

from engine import slime
from engine.local.sample import Sample
from tests.conftest import run
from tests.slime.slime_rules import generate_and_rm
from tests.support.helpers import IM_END, SAMPLING, URL, FakeInterpreter, ScriptedServer, encode, make_args, reply_body

CODE = "<code>\nprint(1)\n</code>"
ANSWER = "Answer: \\boxed{42}"


def reply(text: str, **meta: Any) -> httpx.Response:
    body = reply_body(encode(text) + [IM_END])
    body["meta_info"].update(meta)
    return httpx.Response(200, json=body)


def generate(sample: Sample, script: list[Any], **args_kw: Any) -> Sample:
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=ScriptedServer(script))
        run(slime.generate(make_args(**args_kw), sample, dict(SAMPLING)))
    return sample


def test_cache_and_speculative_figures_accumulate_per_call_as_slime_does(fake_interpreter: FakeInterpreter) -> None:
    sample = Sample(prompt="Q", label="42")
    sample.prefix_cache_info.cached_tokens = 999  # stale, from an earlier attempt: cleared first
    generate(sample, [
        reply(CODE, prompt_tokens=100, cached_tokens=0, spec_accept_token_num=3, spec_draft_token_num=4,
              spec_verify_ct=2),
        reply(ANSWER, prompt_tokens=130, cached_tokens=96, spec_accept_token_num=5, spec_draft_token_num=8,
              spec_verify_ct=3),
    ])
    cache, spec = sample.prefix_cache_info, sample.spec_info
    assert (cache.cached_tokens, cache.total_prompt_tokens) == (96, 230)
    assert (spec.spec_accept_token_num, spec.spec_draft_token_num, spec.spec_verify_ct) == (8, 12, 5)
    assert spec.completion_token_num == len(encode(CODE)) + len(encode(ANSWER)) + 2
    assert [t["cached_tokens"] for t in sample.metadata["fsm"]["turns"]] == [0, 96]


def test_without_speculative_decoding_spec_info_is_left_alone(fake_interpreter: FakeInterpreter) -> None:
    sample = generate(Sample(prompt="Q"), [reply(ANSWER, prompt_tokens=50, cached_tokens=10)])
    assert sample.spec_info.completion_token_num == 0 and sample.prefix_cache_info.cached_tokens == 10


def test_an_answer_printed_by_a_tool_earns_the_no_answer_reward(fake_interpreter: FakeInterpreter) -> None:
    """A program that prints the boxed answer must not be rewarded: the model never answered."""
    fake_interpreter.output = lambda code: "Answer: \\boxed{42}"
    sample = generate(Sample(prompt="Q", label="42"), [reply(CODE)], engine_max_turns=1)
    assert "\\boxed{42}" in sample.response  # the tool's print is in the response (mask 0)...
    generate_and_rm(None, sample)
    assert sample.reward["score"] < 0 and sample.reward["pred"] == ""  # ...and is not the model's answer
    assert sample.metadata["fsm"]["final_text"] == ""


def test_the_models_own_final_answer_is_scored(fake_interpreter: FakeInterpreter) -> None:
    fake_interpreter.output = lambda code: "Answer: \\boxed{7}"
    sample = generate(Sample(prompt="Q", label="42"), [reply(CODE), reply("So " + ANSWER)])
    generate_and_rm(None, sample)
    assert sample.reward["score"] == 1.0 and sample.reward["pred"] == "42"
    assert sample.metadata["fsm"]["final_text"] == "So " + ANSWER + "<|im_end|>"
