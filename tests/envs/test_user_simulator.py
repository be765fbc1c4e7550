"""The shipped user simulator against real loopback servers: the embedded server plays both the
policy and the simulated user (its chat API and its /generate); simulators that fail end the
episode with a recorded reason."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from engine import envs, slime, tools
from engine.envs.user_simulator import UserSimulator, chatml, clean
from engine.local.sample import Sample
from engine.local.server import BackgroundServer, ServerSettings
from engine.loop.runtime import Runtime
from engine.settings import EngineConfig
from tests.conftest import run
from tests.support.helpers import SAMPLING, make_args, tok

pytestmark = pytest.mark.slow

FIRST = "I need a table for two tonight."
INSTRUCTIONS = "You are Ada, simulated user number 7; you want a table for two at 8pm and you are in no hurry at all."
POLICY = [
    "Sure. What time would you like?",
    '<tool_call>\n{"name": "check_time", "arguments": {"time": "8pm"}}\n</tool_call>',
    '8pm is free.\n<tool_call>\n{"name": "book_table", "arguments": {"time": "8pm"}}\n</tool_call>',
    "Your table for two is booked for 8pm.",
]
USER = ["8pm, please.", "Thank you! ###STOP###"]


class Booking(tools.Tool):
    """A tool that scores the turn calling it."""

    description = "Book or check a table."
    parameters = {"type": "object", "properties": {"time": {"type": "string"}}, "required": ["time"]}

    def __init__(self, name: str, reward: float) -> None:
        self.name, self.reward = name, reward  # type: ignore[misc]

    async def execute(self, state: Any, **arguments: Any) -> tools.ToolResult:
        return tools.ToolResult(f"{self.name}: {arguments['time']} ok", reward=self.reward)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    script = tmp_path_factory.mktemp("replay") / "replay.jsonl"
    # One server, two parts: the policy's turns answer the first message; the simulated user's
    # (a longer prompt, so it wins where both match) answer its instructions.
    script.write_text("\n".join(json.dumps(e) for e in (
        {"prompt": FIRST, "turns": POLICY}, {"prompt": INSTRUCTIONS, "turns": USER})))
    with BackgroundServer(ServerSettings(port=0, replay_path=str(script), context_length=4096)) as s:
        yield s


def args_for(server: BackgroundServer, **kw: Any) -> Any:
    host, port = server.url.removeprefix("http://").split(":")
    base = dict(sglang_router_ip=host, sglang_router_port=int(port), engine_profile="chat",
                engine_environment="user_simulator", engine_user_sim_url=server.url, engine_tools="check_time,book_table",
                engine_tool_timeout=30)
    base.update(kw)
    return make_args(**base)


def roll(args: Any, metadata: dict[str, Any] | None = None) -> Sample:
    sample = Sample(prompt=[{"role": "user", "content": FIRST}], metadata=dict(metadata or {"user_instructions": INSTRUCTIONS}))

    async def go() -> None:
        with tools.registry.registered(Booking("check_time", 0.25)), tools.registry.registered(Booking("book_table", 0.5)):
            await slime.generate(args, sample, dict(SAMPLING))
            sample.reward = await slime.reward_func(args, sample)

    run(go())
    return sample


@pytest.mark.parametrize("api", ["chat", "generate"])
def test_the_simulated_user_and_the_model_hold_a_conversation_with_tool_calls_between(server, api):
    sample = roll(args_for(server, engine_user_sim_api=api))
    fsm = sample.metadata["fsm"]
    assert (sample.status.name, fsm["termination_reason"]) == ("COMPLETED", "environment_done"), fsm.get("engine_error")
    assert fsm["environment"] == {"name": "user_simulator", "reason": "user_stopped", "success": None}
    states = [step[2] for step in fsm["trace"]]
    assert states.count("ENVIRONMENT") == 2 and "TOOL_CHECK_TIME" in states and "TOOL_BOOK_TABLE" in states
    # the conversation as the model saw it: its turns, the user's reply, the tools' answers
    response = sample.response
    at = [response.index(t) for t in (POLICY[0], USER[0], POLICY[1], "check_time: 8pm ok", POLICY[2],
                                      "book_table: 8pm ok", POLICY[3])]
    assert at == sorted(at)
    assert "###STOP###" not in response  # the ending message is recorded, not trained on
    # per-turn rewards, each with its model turn's span of tokens
    assert [(t["turn"], t["reward"]) for t in fsm["turn_rewards"]] == [(2, 0.25), (3, 0.5)]
    ids = sample.tokens[len(sample.tokens) - sample.response_length:]
    for t in fsm["turn_rewards"]:
        start, end = t["span"]
        assert set(sample.loss_mask[start:end]) == {1}
        assert "<tool_call>" in tok().decode(ids[start:end])
    assert sample.reward["score"] == pytest.approx(0.75)
    # the user's turn: mask 0, logprob 0.0, the chat template's own markup
    user = next(s for s in fsm["segments"] if s[0] == "observation" and USER[0] in tok().decode(ids[s[1]:s[2]]))
    assert tok().decode(ids[user[1]:user[2]]) == f"\n<|im_start|>user\n{USER[0]}<|im_end|>\n<|im_start|>assistant\n"
    assert set(sample.loss_mask[user[1]:user[2]]) == {0} and set(sample.rollout_log_probs[user[1]:user[2]]) == {0.0}


async def _bad_server(kind: str, posts: list[int]) -> tuple[web.AppRunner, str]:
    async def handle(request: web.Request) -> web.StreamResponse:
        posts.append(1)
        if kind == "hang":
            await asyncio.sleep(3600)
        if kind == "nonsense":
            return web.Response(text="<html>no</html>", content_type="text/html")
        if kind == "empty":
            return web.json_response({"choices": [{"message": {"role": "assistant", "content": "  <|im_end|>"}}]})
        if kind == "huge":
            return web.json_response({"choices": [{"message": {"role": "assistant", "content": "x" * 100_000}}]})
        return web.json_response({"error": "overloaded"}, status=503)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)  # a hung handler is not waited for (60 s by default)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind, error, posted", [
    ("refused", "ConnectError", 0),
    ("hang", "did not answer within 1 seconds", 1),
    ("nonsense", "the body is not JSON", 1),  # a service answering HTML answers it again: not retried
    ("empty", "an empty message", 1),
    ("http503", "gave up after 3 attempt(s): HTTP 503", 3),  # transient: retried as /generate is
    ("huge", "over engine_max_reply_bytes=65536", 1),  # the engine's reply cap holds for the simulator too
])
def test_a_simulator_that_fails_ends_the_episode_with_a_recorded_reason(server, kind, error, posted):
    posts: list[int] = []

    async def go() -> Sample:
        if kind == "refused":
            runner, url = None, f"http://127.0.0.1:{_free_port()}"
        else:
            runner, url = await _bad_server(kind, posts)
        sample = Sample(prompt=[{"role": "user", "content": FIRST}], metadata={"user_instructions": INSTRUCTIONS})
        try:
            args = args_for(server, engine_user_sim_url=url, engine_tool_timeout=1, engine_retry_attempts=3,
                            engine_retry_base_delay=0.01, engine_max_reply_bytes=65536)
            with tools.registry.registered(Booking("check_time", 0.25)), tools.registry.registered(Booking("book_table", 0.5)):
                await slime.generate(args, sample, dict(SAMPLING))
        finally:
            if runner is not None:
                await runner.cleanup()
        return sample

    sample = run(go())
    fsm = sample.metadata["fsm"]
    assert (sample.status.name, fsm["termination_reason"]) == ("FAILED", "environment_failed")
    assert error in fsm["engine_error"] and sample.remove_sample is True
    assert tuple(fsm["trace"][-1]) == ("ENVIRONMENT", "environment_failed", "FAILED")
    assert len(posts) == posted


def test_the_simulator_asks_through_the_runtime_s_own_pool(server):
    async def go() -> tuple[object, object]:
        cfg = EngineConfig.from_args(args_for(server))
        async with Runtime.create(cfg) as rt:
            return rt.environment.http.http, rt.client.http

    simulator_pool, generate_pool = run(go())
    assert simulator_pool is generate_pool


def test_the_simulator_reads_the_policy_without_markup_and_renders_chatml():
    assert clean("<think>\nplan\n</think>\n\nHello there.<|im_end|>") == "Hello there."
    assert chatml([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == \
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="needs engine_user_sim_url"):
        EngineConfig.from_args(make_args()).set_up(UserSimulator())
    episode = run(UserSimulator().start(envs.Task("Hi", {"user_instructions": "Be Ada."})))
    assert episode[1] == {"role": "assistant", "content": "Hi"} and "Be Ada." in episode[0]["content"]
    # the sample's arguments for the environment win over its metadata
    episode = run(UserSimulator().start(envs.Task("Hi", {"user_instructions": "Be Ada."}, {"user_instructions": "Be Bo."})))
    assert "Be Bo." in episode[0]["content"] and "Be Ada." not in episode[0]["content"]
    assert isinstance(envs.get_environment("user_simulator"), UserSimulator)


def test_an_environment_gets_the_http_client_only_where_its_setup_takes_it():
    from engine.loop.environment import takes_http

    class Before(envs.Environment):  # written before setup took http
        def setup(self, cfg, settings=None):
            return self

    class Open(envs.Environment):
        def setup(self, cfg, settings=None, **given):
            return self

    assert takes_http(UserSimulator().setup) and takes_http(Open().setup) and takes_http(envs.Environment().setup)
    assert not takes_http(Before().setup) and not takes_http(len)
