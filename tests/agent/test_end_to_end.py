"""Unmodified clients, only their base URL changed, finish a 5-turn tool task against the embedded
server: the front door, the sessions and the machine together, the model taught by the demo's replay.

Each protocol's client (OpenAI Chat Completions and Responses, Anthropic Messages, each streamed and
not; the OpenAI Agents SDK) replays its history as its SDK hands it back: one segment, one sample,
no break, five turns, the invariants whole from the outside.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from engine import slime
from engine.agent import serving
from engine.local.demos import demo_file
from engine.local.invariants import sample_violations
from engine.local.sample import Sample
from engine.local.server import BackgroundServer, ServerSettings
from engine.profiles.chat import ChatProfile
from engine.profiles.tokenizer import load_tokenizer
from tests.support.agent_harnesses import TASK
from tests.support.helpers import make_args

pytestmark = pytest.mark.slow
SAMPLING = {"max_new_tokens": 256, "temperature": 1.0, "no_stop_trim": True, "skip_special_tokens": False}
ANSWER = "The sums are 3, 7, 30 and 105. Answer: \\boxed{105}"
CLIENTS = ["chat_task", "chat_stream_task", "responses_task", "responses_stream_task", "messages_task",
           "messages_stream_task", "agents_sdk_task"]


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with BackgroundServer(ServerSettings(port=0, replay_path=demo_file("replay-agent.jsonl"), context_length=4096)) as s:
        yield s


@pytest.mark.parametrize("client", CLIENTS)
def test_an_unmodified_client_finishes_a_five_turn_tool_task(server: BackgroundServer, client: str) -> None:
    args = make_args(engine_server_url=server.url, engine_profile="chat", rollout_max_context_len=4096,
                     engine_agent=f"tests.support.agent_harnesses:{client}")
    sample = Sample(index=0, prompt=TASK, label="105")

    async def go() -> Any:
        try:
            return await slime.generate(args, sample, dict(SAMPLING))
        finally:
            await serving.close_served(slime.runtime_for(slime.EngineConfig.from_args(args)))

    returned = asyncio.run(go())
    assert returned == [sample], "one segment, one sample (in a list: slime's one shape for an agent's step)"
    out = returned[0]
    fsm = out.metadata["fsm"]
    assert (out.status, fsm["termination_reason"], fsm["breaks"]) == (Sample.Status.COMPLETED, "harness_finished", []), fsm
    assert fsm["agent"]["result"].strip() == ANSWER  # the answer as the client read it
    assert fsm["agent"]["refused"] == [] and fsm["agent"]["retries"] == 0
    assert len(fsm["turns"]) == 5 and fsm["tool_stats"]["calls"] == 4
    decode = ChatProfile(load_tokenizer(None)).decode
    prompt = out.tokens[:len(out.tokens) - out.response_length]
    assert sample_violations(out, prompt_ids=prompt, budget=4096, decode=decode) == []
    assert out.response.endswith(ANSWER + "<|im_end|>")
    assert out.loss_mask.count(1) == sum(t["tokens"] for t in fsm["turns"])
