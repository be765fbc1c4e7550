"""Property-based tests: random episodes through `engine.slime.generate`, every invariant checked.

An episode (tests/support/episodes.py) is a prompt, budgets and limits, and a script of what the server
does turn by turn: usable replies of every finish reason and length (0 tokens included,
emojis split across turns, logprobs drawn or faked), unusable ones (logprobs missing or
mismatched, no meta_info), HTTP faults between turns (5xx, connect errors, bodies that are
not JSON, 400 context errors, other 400s), and tool outputs from empty to far over the budget
from an in-process fake `code_interpreter`. Each episode is run twice: on a fresh sample and
on one pre-filled with garbage in every field; both must end identical (I5). Every run is
checked from the outside by `engine.local.invariants.sample_violations` (I1-I4, I6) with the real
Qwen3 tokenizer and the replies the scripted server recorded. What these tests found is pinned
as plain tests in test_property_findings.py.

Profiles, chosen with the environment variable HYPOTHESIS_PROFILE:
    ci (default)  derandomized: 300 examples of the main property, 100 of each other one (~25 s)
    soak          10,000 examples of the main property and 3,333 of each other one, random
                  seed (a failure prints the blob to replay it with @reproduce_failure):
                  HYPOTHESIS_PROFILE=soak python -m pytest tests/properties/test_properties.py
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import attrs
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from engine.local.invariants import sample_violations
from tests.support.episode_runner import (
    BASE, CODE, SESSION, USER_METADATA, budget_of, fake, new_sample, play, resume_until_done, turn_reply,
)
from tests.support.episodes import (
    FINAL_ANSWER, FLAMINGO_HEAD, FLAMINGO_TAIL, Episode, EpisodeServer, Fault, Reply, conversations, decode, episodes,
    prompt_ids, reasons_after,
)
from tests.support.helpers import IM_END, FakeInterpreter
from engine.local.sample import Sample

__all__ = ["fake"]  # the module-scoped fixture, imported so pytest finds it here

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
settings.register_profile("ci", max_examples=300, derandomize=True, database=None, **_COMMON)
settings.register_profile("soak", max_examples=10_000, **_COMMON)
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
NO_STALE: dict[str, Any] = {"engine_keys": set(), "cached": 0}
# Keys an earlier attempt of the engine may have left under metadata["fsm"].
STALE_KEYS = ("trace", "guards", "termination_reason", "turns", "tool_stats", "engine_error", "invariant_violation",
              "checkpoint", "checkpoint_rejected", "segments", "policy_versions", "attempt")


def check_run(ep: Episode, sample: Sample, server: EpisodeServer) -> None:
    """I1-I4 and I6 from the outside, plus what each request must have looked like."""
    budget = budget_of(ep)
    usable = [s.usable for s in server.sent if s.usable is not None]
    problems = sample_violations(sample, prompt_ids=prompt_ids(ep.prompt, ep.profile), budget=budget,
                                 decode=decode, sent=usable)
    assert not problems, problems
    reason = sample.metadata["fsm"]["termination_reason"]
    allowed = reasons_after(server.sent[-1] if server.sent else None)
    assert reason in allowed, f"{reason} after {server.sent[-1:] or 'no request'}"
    assert sample.metadata["source"] == USER_METADATA["source"]
    assert len(sample.metadata["fsm"]["turns"]) <= ep.max_turns
    check_requests(ep, sample, server)
    check_top_p(ep, sample, server)


def check_top_p(ep: Episode, sample: Sample, server: EpisodeServer) -> None:
    """Top-p replay (I1, I4): a span per response token; mask-1 tokens keep the server's, mask-0 none."""
    offsets, kept = sample.rollout_top_p_token_offsets, sample.rollout_top_p_token_ids
    usable = [s for s in server.sent if s.usable is not None]
    if offsets is None or kept is None:
        assert offsets is None and kept is None, "half of the top-p replay"
        assert all(s.spans is None for s in usable), "top-p replay was sent but not kept"
        return
    n = sample.response_length
    assert len(offsets) == n + 1 and offsets[0] == 0 and offsets[-1] == len(kept)
    assert all(a <= b for a, b in zip(offsets, offsets[1:]))
    spans = [tuple(kept[offsets[i] : offsets[i + 1]]) for i in range(n)]
    assert not any(span for span, m in zip(spans, sample.loss_mask) if m == 0)
    model = [span for span, m in zip(spans, sample.loss_mask) if m == 1]
    # A turn before the first replayed one gets empty spans, as slime pads them.
    expected = [span for s in usable for span in (s.spans if s.spans is not None else [()] * len(s.usable[0]))]
    trimmed = sample.metadata["fsm"]["termination_reason"] == "reply_over_budget"
    assert model == expected or (trimmed and model == expected[: len(model)]), "top-p spans differ from the server's"


def check_requests(ep: Episode, sample: Sample, server: EpisodeServer) -> None:
    """Every request: a clamped max_new_tokens within the budget, the sample's own tokens as input."""
    budget = budget_of(ep)
    for payload, headers in zip(server.requests, server.headers):
        asked = payload["sampling_params"].get("max_new_tokens")
        if budget is not None or ep.max_new_tokens is not None:
            assert asked is not None and asked >= 1  # BUDGET_CHECK never sends 0 or less
        if budget is not None:
            assert len(payload["input_ids"]) + asked <= budget
        common = min(len(payload["input_ids"]), len(sample.tokens))
        assert payload["input_ids"][:common] == sample.tokens[:common]  # token in: never re-tokenized
        assert payload["return_logprob"] is True and headers["X-SMG-Routing-Key"] == SESSION


@st.composite
def stale_fields(draw: st.DrawFn) -> dict[str, Any]:
    """Garbage for every per-sample field an earlier attempt may leave behind."""
    ints = st.lists(st.integers(-5, 200_000), max_size=8)
    floats = st.floats(allow_nan=False)
    return {
        "tokens": draw(ints), "response": draw(st.text(max_size=20)), "response_length": draw(st.integers(-3, 50)),
        "loss_mask": draw(st.none() | st.lists(st.integers(0, 1), max_size=8)),
        "rollout_log_probs": draw(st.none() | st.lists(floats, max_size=8)),
        "rollout_top_p_token_ids": draw(st.none() | ints), "rollout_top_p_token_offsets": draw(st.none() | ints),
        "rollout_routed_experts": draw(st.none() | st.just([[1, 2]])),
        "weight_versions": draw(st.lists(st.sampled_from(["v0", "v1", "default"]), max_size=3)),
        "remove_sample": draw(st.booleans()), "reward": draw(st.none() | floats | st.just({"score": 1.0})),
        "status": draw(st.sampled_from(list(Sample.Status))), "non_generation_time": draw(st.floats(0, 1e6)),
        "engine_keys": draw(st.sets(st.sampled_from(STALE_KEYS))), "cached": draw(st.integers(0, 99)),
    }


def stale_sample(ep: Episode, fields: dict[str, Any]) -> Sample:
    sample = new_sample(ep)
    for name, value in fields.items():
        if hasattr(sample, name):
            setattr(sample, name, value)
    sample.spec_info.spec_accept_token_num = fields["cached"]
    sample.prefix_cache_info.cached_tokens = fields["cached"]
    if fields["engine_keys"]:
        sample.metadata["fsm"] = {key: ["stale", key] for key in fields["engine_keys"]}
    return sample


def outcome(sample: Sample) -> dict[str, Any]:
    """Everything of a finished sample but wall-clock times."""
    data = dataclasses.asdict(sample)
    del data["non_generation_time"]
    meta = data["metadata"]["fsm"]
    meta.pop("generation_time"), meta.pop("tool_time")
    meta["tool_stats"] = {k: v for k, v in meta["tool_stats"].items() if k != "seconds"}
    return data


@PROFILE
@example(ep=attrs.evolve(BASE, script=(turn_reply(CODE, FLAMINGO_HEAD), Reply((FLAMINGO_TAIL, *FINAL_ANSWER.ids)))),
         stale=NO_STALE)  # an emoji split across two model turns
@example(ep=attrs.evolve(BASE, budget=("exact", 0)), stale=NO_STALE)  # the prompt fills the budget exactly
@example(ep=attrs.evolve(BASE, budget=("over", 1)), stale=NO_STALE)  # the prompt alone is over it
@example(ep=attrs.evolve(BASE, budget=("near", 40), script=(turn_reply(CODE, IM_END),), outputs=("9" * 20000,)),
         stale=NO_STALE)  # a tool output far over the budget
@example(ep=attrs.evolve(BASE, script=(Fault("http503"), Fault("context400"))), stale=NO_STALE)
@given(ep=episodes(), stale=stale_fields())
def test_random_episodes_keep_every_invariant_and_a_retry_ends_as_fresh(
    fake: FakeInterpreter, ep: Episode, stale: dict[str, Any]
) -> None:
    """I1-I4 and I6 on a fresh run and on a retried sample full of stale state; I5 between them."""
    fresh, retried = new_sample(ep), stale_sample(ep, stale)
    fresh_server, retried_server = play(ep, fake, [fresh, retried])
    check_run(ep, fresh, fresh_server)
    check_run(ep, retried, retried_server)
    assert retried_server.requests == fresh_server.requests
    assert outcome(retried) == outcome(fresh)
    event(f"{fresh.status.name} {fresh.metadata['fsm']['termination_reason']}")  # --hypothesis-show-statistics
    event(f"requests: {len(fresh_server.requests)}, turns: {len(fresh.metadata['fsm']['turns'])}")


@settings(PROFILE, max_examples=max(50, PROFILE.max_examples // 3))
@given(ep=conversations())
def test_long_tool_conversations_trimmed_anywhere_stay_aligned(fake: FakeInterpreter, ep: Episode) -> None:
    """TRIM may cut inside an observation, inside a model turn or inside an emoji: I1-I4 hold."""
    (sample,) = samples = [new_sample(ep)]
    (server,) = play(ep, fake, samples)
    check_run(ep, sample, server)
    event(f"{sample.metadata['fsm']['termination_reason']}, turns: {len(sample.metadata['fsm']['turns'])}")


@settings(PROFILE, max_examples=max(50, PROFILE.max_examples // 3))
@example(ep=attrs.evolve(BASE, script=(turn_reply("So the 🦩 is", FLAMINGO_HEAD, finish="abort"),
                                        Reply((FLAMINGO_TAIL, *FINAL_ANSWER.ids)))))  # emoji split by an abort
@given(ep=episodes())
def test_partial_rollout_resumes_keep_every_invariant_across_attempts(fake: FakeInterpreter, ep: Episode) -> None:
    """With --partial-rollout an ABORTED sample comes back and resumes; the server's script goes on.

    After every attempt I1-I4 and I6 hold, and the mask-1 tokens are all usable replies of all
    attempts in order: an aborted turn's tokens and its continuation join, so an emoji split
    between them decodes whole, and the top-p replay of the turns before an abort is kept.
    """

    def check(sample: Sample, server: EpisodeServer, requested: bool) -> None:
        usable = [s.usable for s in server.sent if s.usable is not None]
        problems = sample_violations(sample, prompt_ids=prompt_ids(ep.prompt, ep.profile), budget=budget_of(ep),
                                     decode=decode, sent=usable)
        assert not problems, problems
        assert sample.metadata["fsm"].get("checkpoint_rejected") is None
        if requested:
            assert sample.metadata["fsm"]["termination_reason"] in reasons_after(server.sent[-1])

    sample = new_sample(ep)
    attempts, server = resume_until_done(ep, fake, sample, check)
    check_requests(ep, sample, server)  # a resumed request continues from the kept tokens
    check_top_p(ep, sample, server)
    event(f"attempts: {attempts}, {sample.status.name} {sample.metadata['fsm']['termination_reason']}")
