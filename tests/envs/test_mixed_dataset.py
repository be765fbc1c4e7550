"""One rollout step over a dataset mixing two environments and a plain tool task, through slime's
`generate_and_rm_group`: each sample gets the environment its metadata names (with its arguments,
or the default, or none), every array slime trains on is whole (I1-I4, I6), rewards are composed
per sample, and `flow` shows the time spent in the environments.

slime is not installable, so its group function runs two ways: slime's own, from a checkout of
THUDM/slime on PYTHONPATH (skipped, saying so, where none is), and the restatement of its rules in
tests/slime/slime_rules.py (always).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import respx

from engine import envs, tools
from engine.local.sample import Sample
from engine.profiles.tokenizer import default_tokenizer_dir
from engine.trace.paths import flow_overlay, flow_table, spec_for_samples
from tests.conftest import run
from tests.slime import slime_rules
from tests.slime.slime_rules import train_view
from tests.support.helpers import IM_END, SAMPLING, encode, fake_logprobs, make_args, reply_body, tok

GUESS = "Guess my number between 1 and 10."
ORDER = "Where is my order 42? I am not happy."
MATH = "What is 6 * 7? Use the calculator."
CALL = '<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
# The model's turns for each prompt, in order (the k-th answers a request holding k of its turns).
SCRIPT = {
    GUESS: ["Is it 5?", "It must be 7."],
    ORDER: [CALL.format(name="lookup_order", arguments='{"order": 42}'),
            "Your order 42 ships tomorrow.", "I am sorry: I will refund it now."],
    MATH: [CALL.format(name="multiply", arguments='{"a": 6, "b": 7}'), "The product is 42. Answer: \\boxed{42}"],
}


class GuessMix(envs.Environment):
    """Higher or lower; the secret comes from the sample's arguments."""

    name = "guess_mix"

    async def start(self, task: envs.Task) -> dict[str, Any]:
        return {"secret": int(task.args["secret"])}

    async def respond(self, episode: dict[str, Any], conversation: envs.Conversation) -> envs.Reply:
        guess = int("".join(c for c in conversation.text if c.isdigit()) or 0)
        if guess == episode["secret"]:
            return envs.Reply(reward=1.0, done=True, reason="guessed", success=True)
        return envs.Reply("Higher." if guess < episode["secret"] else "Lower.", reward=-0.1)


class Customer(envs.Environment):
    """A rule-based customer who wants a refund; it reads the whole conversation, tool turns included."""

    name = "customer_mix"

    def __init__(self) -> None:
        self.seen: list[envs.Conversation] = []

    async def start(self, task: envs.Task) -> dict[str, Any]:
        return {"wants": task.args.get("wants", "refund")}

    async def respond(self, episode: dict[str, Any], conversation: envs.Conversation) -> envs.Reply:
        self.seen.append(conversation)
        if episode["wants"] in conversation.text:
            return envs.Reply(reward=1.0, done=True, reason="refunded", success=True)
        return envs.Reply("Shipping is not enough. I want a refund.", reward=0.0)


class LookupOrder(tools.Tool):
    name = "lookup_order"
    description = "Look an order up."
    parameters = {"type": "object", "properties": {"order": {"type": "integer"}}, "required": ["order"]}

    async def execute(self, state: Any, **arguments: Any) -> str:
        return f"order {arguments['order']}: shipped"


class Multiply(tools.Tool):
    name = "multiply"
    description = "Multiply two numbers."
    parameters = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                  "required": ["a", "b"]}

    async def execute(self, state: Any, **arguments: Any) -> str:
        return str(arguments["a"] * arguments["b"])


def answer_by_prompt(request: httpx.Request) -> httpx.Response:
    """The server: the prompt the request holds picks the script, the turns it holds the next turn."""
    text = tok().decode(json.loads(request.content)["input_ids"])
    prompt = next(p for p in SCRIPT if p in text)
    done = text.count("<|im_start|>assistant") - 1  # the generation prompt opens one more
    ids = encode(SCRIPT[prompt][done]) + [IM_END]
    return httpx.Response(200, json=reply_body(ids))


def dataset(make: Any) -> list[list[Any]]:
    """Three groups of two: the guess game (named, with arguments), the customer (the default,
    named by nothing), the tool task (`"none"`, whatever the default)."""
    rows = [
        dict(prompt=[{"role": "user", "content": GUESS}], metadata={"environment": {"name": "guess_mix", "args": {"secret": 7}}}),
        dict(prompt=[{"role": "user", "content": ORDER}], metadata={"environment": {"name": "customer_mix", "args": {"wants": "refund"}}}),
        dict(prompt=[{"role": "user", "content": ORDER}], metadata={}),
        dict(prompt=[{"role": "user", "content": MATH}], label="42", metadata={"environment": "none"}),
    ]
    groups = [[0, 0], [1, 2], [3, 3]]
    return [[make(index=10 * g + k, group_index=g, **rows[i]) for k, i in enumerate(group)] for g, group in enumerate(groups)]


SETTINGS = dict(engine_profile="chat", engine_environment="customer_mix", engine_tools="lookup_order,multiply",
                engine_tool_timeout=10, engine_reward_rule="sum")


@pytest.fixture
def registered() -> Iterator[Customer]:
    customer = Customer()
    with envs.registered_environment(GuessMix()), envs.registered_environment(customer), \
            tools.registry.registered(LookupOrder()), tools.registry.registered(Multiply()):
        yield customer


def restated(groups: list[list[Any]]) -> list[list[Any]]:
    args = make_args(custom_generate_function_path="engine.slime.generate", custom_rm_path="engine.slime.reward_func",
                     group_rm=False, **SETTINGS)

    async def go() -> list[list[Any]]:
        with respx.mock(assert_all_called=False) as mock:
            mock.post("http://sglang.test:30000/generate").mock(side_effect=answer_by_prompt)
            return list(await asyncio.gather(*(slime_rules.generate_and_rm_group(args, g, dict(SAMPLING)) for g in groups)))

    return run(go())


def slimes_own() -> tuple[Any, Any]:
    """slime's `generate_and_rm_group` and `Sample`, from a checkout on PYTHONPATH."""
    try:
        from slime.rollout import sglang_rollout
        from slime.utils.types import Sample as SlimeSample
    except ImportError as exc:
        pytest.skip(f"slime's checkout is not importable ({exc}): put THUDM/slime (and its requirements) on PYTHONPATH "
                    "to run its own generate_and_rm_group; the restated rules ran")
    return sglang_rollout, SlimeSample


def through_slime(sglang_rollout: Any, groups: list[list[Any]]) -> list[list[Any]]:
    args = argparse.Namespace(**vars(make_args(**SETTINGS)))
    for key, value in dict(hf_checkpoint=default_tokenizer_dir(), custom_generate_function_path="engine.slime.generate",
                           custom_rm_path="engine.slime.reward_func", group_rm=False, sglang_server_concurrency=8,
                           rollout_num_gpus=1, rollout_num_gpus_per_engine=1, rollout_temperature=1.0, rollout_top_p=1.0,
                           rollout_top_k=-1, rollout_max_response_len=256, rollout_stop=None, rollout_stop_token_ids=None,
                           rollout_skip_special_tokens=False, sglang_dp_size=None, partial_rollout=False,
                           mask_offpolicy_in_partial_rollout=False, ci_test=False, reward_key="score",
                           rollout_sample_hook_path=None).items():
        setattr(args, key, value)
    state_class = sglang_rollout.GenerateState
    type(state_class)._instances.pop(state_class, None)  # slime's singleton, made from these args

    async def go() -> list[list[Any]]:
        state = state_class(args)
        with respx.mock(assert_all_called=False) as mock:
            mock.post("http://sglang.test:30000/generate").mock(side_effect=answer_by_prompt)
            return list(await asyncio.gather(*(sglang_rollout.generate_and_rm_group(args, g, state.sampling_params.copy())
                                               for g in groups)))

    try:
        return run(go())
    finally:
        type(state_class)._instances.pop(state_class, None)


def check_step(groups: list[list[Any]], customer: Customer) -> None:
    # The chat template drops reasoning before a user turn, and environments write user turns: a
    # rollout may fan out, so every element is a list (one sample each here), as slime flattens them.
    assert all(isinstance(element, list) and len(element) == 1 for g in groups for element in g)
    samples = slime_rules.flatten_step(groups)
    for s in samples:
        fsm = s.metadata["fsm"]
        assert s.status.name == "COMPLETED", fsm.get("engine_error")
        whole(s)
        train_view(s)  # slime's conversion takes it: a reward, lengths that agree
    guess, order_named, order_default, math = samples[0], samples[2], samples[3], samples[4]
    # each sample got the environment its metadata names, or the default, or none
    assert guess.metadata["fsm"]["environment"] == {"name": "guess_mix", "reason": "guessed", "success": True}
    assert order_named.metadata["fsm"]["environment"]["name"] == "customer_mix"
    assert order_default.metadata["fsm"]["environment"]["name"] == "customer_mix"
    assert "environment" not in math.metadata["fsm"] and math.metadata["fsm"]["termination_reason"] == "answered"
    # rewards: each composed by the rule, acc the episode's success
    assert guess.reward["score"] == pytest.approx(0.9) and guess.reward["acc"] is True
    assert order_named.reward["score"] == pytest.approx(1.0) and order_named.reward["acc"] is True
    assert math.reward["score"] == pytest.approx(1.0) and math.reward["acc"] is True and math.reward["pred"] == "42"
    for s in (guess, order_named):  # the spans slime gets point at the model's own turns
        ids = s.tokens[len(s.tokens) - s.response_length:]
        for t in s.reward["turn_rewards"]:
            start, end = t["span"]
            assert set(s.loss_mask[start:end]) == {1} and end <= s.response_length
        start, end = s.reward["answer_span"]
        assert tok().decode(ids[start:end]).startswith(("It must be 7.", "I am sorry"))
    # the customer read the conversation: its tool turn, the tool's answer, its own reply, no special tokens
    last = max(customer.seen, key=lambda c: len(c.messages))
    roles = [m["role"] for m in last.messages]
    assert roles == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert last.messages[1]["tool_calls"] == [{"type": "function", "function": {"name": "lookup_order", "arguments": {"order": 42}}}]
    assert last.messages[2] == {"role": "tool", "name": "lookup_order", "content": "order 42: shipped"}
    assert last.text == "I am sorry: I will refund it now." and "<|im_end|>" not in json.dumps(last.messages)
    assert tok().decode([*last.prompt_ids, *last.response_ids]).endswith("I am sorry: I will refund it now.<|im_end|>")
    # time in the environments: per turn, per sample, and in flow
    dumps = [s.to_dict() for s in samples]
    answered = [t for s in samples for t in s.metadata["fsm"]["turns"] if "environment_seconds" in t]
    assert len(answered) == 2 * 2 + 2 * 2  # the guess game answers 2 turns of its 2 samples, the customer 2 of its 2
    table = flow_table(dumps)
    times = table.split("\ntime in", 1)[1].splitlines()
    row = next(line.split() for line in times if line.startswith("ENVIRONMENT"))
    assert row[2] == str(len(answered)) and float(row[1]) == pytest.approx(
        sum(s.metadata["fsm"]["environment_time"] for s in samples if "environment" in s.metadata["fsm"]), abs=1e-3)
    assert flow_overlay(spec_for_samples(dumps), dumps).states["ENVIRONMENT"].endswith(f"{len(answered)} answers")


def whole(s: Any) -> None:
    """I1-I4 on what slime gets: lengths agree, tokens are prompt + response, the text is the ids',
    mask 0 carries 0.0, mask 1 carries the server's logprobs in order."""
    n = s.response_length
    assert len(s.loss_mask) == len(s.rollout_log_probs) == n and len(s.tokens) > n
    ids = s.tokens[len(s.tokens) - n:]
    assert s.response == tok().decode(ids)
    assert len(s.tokens) <= 4096
    for kind, start, end, _ in s.metadata["fsm"]["segments"]:
        mask, lps = s.loss_mask[start:end], s.rollout_log_probs[start:end]
        if kind == "observation":
            assert set(mask) == {0} and set(lps) == {0.0}
        else:
            assert set(mask) == {1} and lps == fake_logprobs(ids[start:end])


def test_a_mixed_dataset_through_the_restated_group_function(registered: Customer) -> None:
    check_step(restated(dataset(Sample)), registered)


def test_a_mixed_dataset_through_slimes_own_group_function(registered: Customer) -> None:
    sglang_rollout, slime_sample = slimes_own()
    check_step(through_slime(sglang_rollout, dataset(slime_sample)), registered)
