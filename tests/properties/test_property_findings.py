"""What the property tests found, pinned as plain tests.

Each was a bug the property tests found, now fixed:
- a logprob that is not a log-probability (> 0, NaN, +inf) ends the sample as a bad reply
  (`logprobs_mismatch`, in `engine.sglang.wire.parse_reply`), not as a broken invariant that
  discarded every earlier turn too;
- an abort reply longer than the room left is trimmed (`reply_over_budget` is tried before
  `server_aborted`), keeping what fits;
- a turn without top-p replay after turns with it ends ABORTED (`top_p_replay_dropped`), not
  on the `crashed` edge;
- a resumed sample keeps the top-p replay of its earlier turns (the checkpoint covers it).
"""

from __future__ import annotations

import asyncio
from typing import Any

import attrs
import httpx
import pytest

from engine import slime
from engine.local.invariants import sample_violations
from tests.support.episode_runner import BASE, CODE, ROUTER, ROUTE, args_of, fake, new_sample, params_of, play, turn_reply
from tests.support.episodes import FINAL_ANSWER, Episode, Reply, decode, prompt_ids
from tests.support.helpers import IM_END, FakeInterpreter, encode, fake_logprobs, reply_body
from engine.local.sample import Sample

__all__ = ["fake"]  # the module-scoped fixture, imported so pytest finds it here


def generate(sample: Sample, replies: list[dict[str, Any]], ep: Episode = BASE, **args: Any) -> None:
    """One generate call for `ep`'s limits; the server answers with `replies` in order."""
    queue = list(replies)
    ROUTE.side_effect = lambda request: httpx.Response(200, json=queue.pop(0))
    with ROUTER:
        asyncio.run(slime.generate(args_of(ep, **args), sample, params_of(ep)))


def with_top_p(body: dict[str, Any]) -> dict[str, Any]:
    """Top-p replay data for every token of a reply body: two kept ids each."""
    ids = body["output_ids"]
    body["meta_info"]["top_p_token_ids"] = [t for t in ids for _ in range(2)]
    body["meta_info"]["top_p_token_offsets"] = list(range(0, 2 * len(ids) + 1, 2))
    return body


CODE_IDS = encode(CODE) + [IM_END]


def test_values_that_are_not_logprobs_end_the_sample_without_losing_earlier_turns(fake: FakeInterpreter) -> None:
    """A logprob > 0, NaN, +inf or -inf is a bad reply (ABORTED logprobs_invalid), not a broken invariant."""
    for bad in (0.25, float("nan"), float("inf"), float("-inf")):
        answer = FINAL_ANSWER.ids
        spoiled = tuple(-0.5 if i != 1 else bad for i in range(len(answer)))
        ep = attrs.evolve(BASE, script=(turn_reply(CODE, IM_END), Reply(answer, logprobs=spoiled)))
        (sample,) = samples = [new_sample(ep)]
        (server,) = play(ep, fake, samples)
        assert sample.status == Sample.Status.ABORTED
        assert sample.metadata["fsm"]["termination_reason"] == "logprobs_invalid"
        assert "invariant_violation" not in sample.metadata["fsm"]
        first = server.sent[0].usable
        assert first is not None and sample.response_length > len(first[0])  # turn 1 and its observation
        assert not sample_violations(sample, prompt_ids=prompt_ids(ep.prompt, ep.profile), budget=None, decode=decode,
                                     sent=[first])


def test_an_aborted_reply_over_the_budget_keeps_the_invariants(fake: FakeInterpreter) -> None:
    """`server_aborted` is tried before `reply_over_budget`, and its action appends every token.

    SGLang sends an abort with the tokens made so far, "one more decode step" included, so a
    reply may exceed `max_new_tokens`; the tokens that fit should be kept, the rest trimmed.
    Today: I2 fails at the terminal, the driver's fallback empties the response, and the
    reason stays `server_aborted` with `invariant_violation` set.
    """
    prompt = prompt_ids(BASE.prompt)
    ids = encode("one two three four five six")
    sample = new_sample(BASE)
    generate(sample, [reply_body(ids, finish="abort")], attrs.evolve(BASE, budget=("near", 3)))
    assert "invariant_violation" not in sample.metadata["fsm"], sample.metadata["fsm"]["invariant_violation"]
    assert sample.status in (Sample.Status.ABORTED, Sample.Status.TRUNCATED)
    assert sample.tokens == list(prompt) + ids[:3]  # the three tokens that fit are kept
    assert sample.rollout_log_probs == fake_logprobs(ids)[:3]
    assert not sample_violations(sample, prompt_ids=prompt, budget=len(prompt) + 3, decode=decode)


def test_a_turn_without_top_p_after_one_with_it_is_not_a_crash(fake: FakeInterpreter) -> None:
    """A server that stops sending top-p replay mid-sample (a router over mixed workers, a
    restarted worker) is the server's problem, not an engine crash: the sample should end
    with a named reason (or pad the turn with empty spans, as turns before the first replayed
    one are padded), never `crashed`."""
    sample = new_sample(BASE)
    generate(sample, [with_top_p(reply_body(CODE_IDS)), reply_body(FINAL_ANSWER.ids)])
    assert sample.metadata["fsm"]["termination_reason"] != "crashed", sample.metadata["fsm"].get("engine_error")
    assert not sample_violations(sample, prompt_ids=prompt_ids(BASE.prompt), budget=None, decode=decode)


def test_a_resumed_sample_keeps_the_top_p_replay_of_its_earlier_turns(fake: FakeInterpreter) -> None:
    """With --partial-rollout, turns generated before the abort lose their top-p replay."""
    sample = new_sample(BASE)
    first = [with_top_p(reply_body(CODE_IDS)), with_top_p(reply_body(encode("So the"), finish="abort"))]
    generate(sample, first, partial_rollout=True)
    assert sample.status == Sample.Status.ABORTED
    kept_before = list(sample.rollout_top_p_token_ids)
    offsets_before = list(sample.rollout_top_p_token_offsets)
    generate(sample, [with_top_p(reply_body(encode(" Answer: \\boxed{42}") + [IM_END]))], partial_rollout=True)
    assert sample.status == Sample.Status.COMPLETED
    assert sample.rollout_top_p_token_offsets[: len(offsets_before)] == offsets_before
    assert sample.rollout_top_p_token_ids[: len(kept_before)] == kept_before
