"""Whatever a slime dataset holds, every sample the engine hands back is whole (I1-I6).

slime hands a generate function whatever its dataset's `--input-key` column held: a string, a
list of chat messages, the JSON text of one, None, a number, nested junk; `metadata` and `label`
likewise. Here hypothesis draws batches of such values, and every batch goes through ONE
process, one event loop and one runtime (as in a slime job), so a cache keyed by less than what
it caches (a prompt and its JSON text, 1 and 1.0 and True, dict orders) shows up as a sample
whose tokens do not start with its own prompt. Each returned sample, the placeholders of
`bad_sample_input` included, is checked from the outside (`engine.local.invariants`): per-token
arrays aligned (I1), within the budget (I2), tokens = prompt ids + response ids and response =
their decode (I3), mask-1 tokens the server's (I4), the status the reason's (I6). I5 (a sample
already used ends as a fresh one) is checked by running each value on a fresh and on a used sample.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import respx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import slime
from engine.local.invariants import sample_violations
from engine.local.sample import Sample
from tests.support.episodes import decode, prompt_ids
from tests.support.helpers import IM_END, SAMPLING, URL, encode, make_args, reply_body

ANSWER = encode("Answer: \\boxed{42}") + [IM_END]
BUDGET = 4096
REPLY = reply_body(ANSWER)
SENT = [(ANSWER, [lp for lp, _, _ in REPLY["meta_info"]["output_token_logprobs"]])]  # (ids, logprobs) of the one reply

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40))
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=12)
roles = st.sampled_from(["system", "user", "assistant", "tool", "Developer", ""])
message = st.fixed_dictionaries({"role": roles, "content": st.one_of(st.text(max_size=60), junk)},
                                optional={"name": st.text(max_size=8), "tool_calls": junk})
messages = st.lists(message, min_size=1, max_size=4)
# A value and its JSON text side by side: the pair a cache keyed by the JSON text confuses.
with_json_text = messages.flatmap(lambda m: st.sampled_from([[m, json.dumps(m)], [json.dumps(m), m]]))
prompts = st.one_of(st.text(max_size=80), messages, messages.map(json.dumps), scalars, junk)
metadata = st.one_of(st.none(), junk, st.fixed_dictionaries({}, optional={"tools": junk, "source": junk}))
batches = st.one_of(st.lists(st.tuples(prompts, metadata, junk), min_size=1, max_size=4),
                    with_json_text.map(lambda pair: [(p, {}, "42") for p in pair]))


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for every example: one runtime, its caches shared by the whole run."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _json_able(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=True)
        return True
    except (TypeError, ValueError):
        return False


def expected_prompt(prompt: Any) -> tuple[int, ...] | None:
    """The prompt's ids as a reference rendering makes them; None when it renders no prompt."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _json_able(prompt)
                                   and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt)):
        try:
            return prompt_ids(prompt)
        except Exception:  # the reference itself cannot render it: the engine must refuse it too
            return None
    return None


def check(sample: Sample, prompt: Any) -> None:
    reason = sample.metadata["fsm"]["termination_reason"]
    n = sample.response_length
    if reason == "bad_sample_input":  # a placeholder: whole in itself, nothing of it trained
        assert sample.remove_sample and sample.loss_mask == [0] * n
        ids = tuple(sample.tokens[: len(sample.tokens) - n])
    else:
        ids = expected_prompt(prompt)
        assert ids is not None, f"rolled out a prompt the reference cannot render: {prompt!r} ({reason})"
    problems = sample_violations(sample, prompt_ids=ids, budget=BUDGET, decode=decode,
                                 sent=None if reason == "bad_sample_input" else SENT)
    assert not problems, (problems, prompt)


def used_sample() -> Sample:
    """A sample an earlier run left full of fields (I5: it must end as a fresh one)."""
    s = Sample(prompt="old", tokens=[1, 2, 3], response="old", response_length=2, loss_mask=[1, 1],
               rollout_log_probs=[-0.5, -0.5], remove_sample=True, metadata={"fsm": {"trace": [["X", "y", "Z"]]}})
    s.status = Sample.Status.TRUNCATED
    return s


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
@given(batch=batches)
def test_every_sample_handed_back_for_any_dataset_value_is_whole(loop: asyncio.AbstractEventLoop, batch: list) -> None:
    args = make_args(rollout_max_context_len=BUDGET)
    fresh = [Sample(prompt=p, label=label, metadata=m, index=i) for i, (p, m, label) in enumerate(batch)]
    used = []
    for i, (p, m, label) in enumerate(batch):
        s = used_sample()
        s.prompt, s.label, s.metadata, s.index = p, label, m, i
        used.append(s)

    async def roll(samples: list[Sample]) -> None:
        await asyncio.gather(*(slime.generate(args, s, dict(SAMPLING)) for s in samples))

    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=lambda request: httpx.Response(200, json=REPLY))
        loop.run_until_complete(roll(fresh))
        loop.run_until_complete(roll(used))
    for (prompt, _, _), a, b in zip(batch, fresh, used):
        check(a, prompt)
        check(b, prompt)
        same = ("tokens", "response", "response_length", "loss_mask", "rollout_log_probs", "status", "remove_sample")
        assert {k: getattr(a, k) for k in same} == {k: getattr(b, k) for k in same}, prompt


def test_the_prompt_cache_key_is_exact() -> None:
    from engine.loop.runtime import exact_key

    values = [1, 1.0, True, "1", -0.0, 0.0, None, "null", [1], (1,), ["1"], {"a": 1, "b": 2}, {"b": 2, "a": 1},
              [{"role": "user", "content": "x"}], json.dumps([{"role": "user", "content": "x"}])]
    keys = [exact_key(v) for v in values]
    assert len(set(keys)) == len(values)  # no two of them share a key
    assert exact_key(float("nan")) == exact_key(float("nan"))
    assert exact_key([object()]) is None and exact_key({"a": {1, 2}}) is None  # not keyable: not cached


def test_the_settings_cache_key_is_exact() -> None:
    from engine.settings.sources import _hashable

    assert len({_hashable(v) for v in (1, 1.0, True, "1", ["a"], ("a",), [1], [1.0])}) == 8
    with pytest.raises(TypeError):  # no exact key: read afresh rather than keyed by an id another value may reuse
        _hashable([{"a": 1}])
