"""Running an `Episode` through `engine.slime.generate` against a respx-mocked server.

One `respx.MockRouter` serves the whole session (entering it per episode costs ~0.5 ms);
each run swaps its side effect for a fresh `EpisodeServer`. The fake code interpreter is
registered once per module by the `fake` fixture of the tests that use it.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Iterator
from typing import Any

import pytest
import respx

from engine import tools
from engine import slime
from tests.support.episodes import PROMPTS, Episode, EpisodeServer, Reply, prompt_ids
from tests.support.helpers import SAMPLING, URL, FakeInterpreter, encode, make_args
from engine.local.sample import Sample

SESSION = "session-1"
USER_METADATA = {"source": "property-test"}  # the caller's own key: must survive every attempt
ROUTER = respx.MockRouter(assert_all_called=False)
ROUTE = ROUTER.post(URL + "/generate")
CODE = "Let me run it.\n<code>\nshow(0)\n</code>"
BASE = Episode(PROMPTS[0], ("none", 0), None, 256, 4, 4, 2, (), ("🦩",))  # for hand-written episodes


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeInterpreter]:
    """The in-process code_interpreter for a whole module (registering rebuilds the machine)."""
    with tools.registry.registered(FakeInterpreter()) as interpreter:
        yield interpreter


def turn_reply(text: str, *extra: int, **kw: Any) -> Reply:
    """A reply of `text`'s tokens followed by `extra` ids."""
    return Reply(tuple(encode(text)) + extra, **kw)


def tool_output(outputs: tuple[str | None, ...], code: str) -> str:
    """The fake interpreter's answer to `show(k)`: outputs[k], or a crash when it is None."""
    match = re.fullmatch(r"show\((\d+)\)", code.strip())
    if match is None or int(match[1]) >= len(outputs):
        return "NameError: name 'x' is not defined"
    out = outputs[int(match[1])]
    if out is None:
        raise RuntimeError("the tool crashed")
    return out


def budget_of(ep: Episode) -> int | None:
    """The prompt + response bound the engine must keep (EngineConfig.context_limit, re-derived)."""
    n = len(prompt_ids(ep.prompt, ep.profile))
    limits = [x for x in (ep.limit(n), ep.max_response_len and n + ep.max_response_len) if x]
    return min(limits) if limits else None


def args_of(ep: Episode, **overrides: Any) -> Any:
    """slime's args for the episode's profile and limits; retries without sleeping.

    One sample at a time needs one connection: a small pool keeps the runtime made for each
    episode's event loop cheap (one httpx client per 4 connections).
    """
    n = len(prompt_ids(ep.prompt, ep.profile))
    # The episodes model a caller that re-queues ABORTED samples (slime aborting the step, the
    # fully-async worker); the engine's own re-runs are tested in tests/slime.
    overrides.setdefault("engine_abort_status", "aborted")
    return make_args(engine_profile=ep.profile, rollout_max_context_len=ep.limit(n), sglang_server_concurrency=4,
                     engine_max_response_len=ep.max_response_len,
                     engine_max_turns=ep.max_turns, engine_max_tool_calls=ep.max_tool_calls,
                     engine_retry_attempts=ep.retry_attempts, engine_retry_base_delay=0.0,
                     engine_retry_deadline=30.0, **overrides)


def params_of(ep: Episode) -> dict[str, Any]:
    """The sampling params; `max_new_tokens` left out when the episode has none."""
    params = {k: v for k, v in SAMPLING.items() if k != "max_new_tokens"}
    if ep.max_new_tokens is not None:
        params["max_new_tokens"] = ep.max_new_tokens
    return params


def new_sample(ep: Episode) -> Sample:
    return Sample(prompt=ep.prompt, label="42", session_id=SESSION, metadata=dict(USER_METADATA))


def play(ep: Episode, fake: FakeInterpreter, samples: list[Sample], **overrides: Any) -> list[EpisodeServer]:
    """Run the episode once per sample, one after the other on one event loop; nothing may escape."""
    fake.output = functools.partial(tool_output, ep.outputs)
    servers = [EpisodeServer(ep) for _ in samples]

    async def go() -> None:
        for sample, server in zip(samples, servers):
            ROUTE.side_effect = server
            out = await slime.generate(args_of(ep, **overrides), sample, params_of(ep))
            # Where samples may fan out (the chat profile: Qwen3's template drops earlier reasoning
            # at a user turn) every sample comes back as a list; an episode has no user turn: one segment.
            assert out is sample or (isinstance(out, list) and len(out) == 1 and out[0] is sample), out

    with ROUTER:
        asyncio.run(go())
    return servers


def resume_until_done(ep: Episode, fake: FakeInterpreter, sample: Sample, check: Any,
                      attempts: int = 5) -> tuple[int, EpisodeServer]:
    """With --partial-rollout: call generate again while the sample ends ABORTED (at most
    `attempts` calls), the server's script going on; `check(sample, server, new_requests)`
    runs after each call. Returns the number of calls made and the server."""
    fake.output = functools.partial(tool_output, ep.outputs)
    server, ns, made = EpisodeServer(ep), args_of(ep, partial_rollout=True), 0

    async def go() -> None:
        nonlocal made
        while made < attempts and (made == 0 or sample.status == Sample.Status.ABORTED):
            made += 1
            before = len(server.requests)
            assert await slime.generate(ns, sample, params_of(ep)) is sample
            check(sample, server, len(server.requests) > before)

    ROUTE.side_effect = server
    with ROUTER:
        asyncio.run(go())
    return made, server
