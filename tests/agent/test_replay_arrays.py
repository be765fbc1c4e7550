"""Routing replay (R3) and top-p replay per segment of an agent's rollout, against the embedded server
(its synthetic routed experts and top-p sets): each segment's sample holds one row per token but its
last and the nucleus of each of its own model tokens, as if it were a rollout of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from engine import slime
from engine.agent import serving
from engine.local.demos import demo_file
from engine.local.sample import Sample
from engine.local.server import BackgroundServer
from engine.local.server.model import synthetic_routed_experts
from tests.slime.slime_rules import train_view
from tests.support.agent_harnesses import TASK
from tests.support.helpers import make_args

pytestmark = pytest.mark.slow
LAYERS, TOPK = 2, 3
R3 = {"use_rollout_routing_replay": True, "num_layers": LAYERS, "moe_router_topk": TOPK}
SAMPLING = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 0.9, "top_k": 4, "no_stop_trim": True,
            "skip_special_tokens": False, "custom_params": {"return_top_p_token_ids": True}}


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with BackgroundServer(replay_path=demo_file("replay-agent.jsonl"), routed_experts_layers=LAYERS,
                          routed_experts_topk=TOPK, context_length=4096) as s:
        yield s


def test_each_segment_carries_its_own_rows_and_nuclei(server: BackgroundServer) -> None:
    args = make_args(engine_server_url=server.url, engine_profile="chat", rollout_max_context_len=4096,
                     engine_agent="tests.support.agent_harnesses:compacting", **R3)

    async def go() -> list[Sample]:
        try:
            return await slime.generate(args, Sample(index=4, prompt=TASK), dict(SAMPLING))  # type: ignore[no-any-return]
        finally:
            await serving.close_served(slime.runtime_for(slime.EngineConfig.from_args(args)))

    out = asyncio.run(go())
    assert isinstance(out, list) and [s.metadata["fsm"]["termination_reason"] for s in out][0] == "history_compacted"
    for sample in out:
        experts = sample.rollout_routed_experts
        assert experts.shape == (len(sample.tokens) - 1, LAYERS, TOPK)
        real = sample.metadata["fsm"]["routed_experts_rows"]
        expected = np.array(synthetic_routed_experts(sample.tokens, 0, LAYERS, TOPK), dtype=np.int32).reshape(-1, LAYERS, TOPK)
        assert real > 0 and (experts[:real] == expected[:real]).all()  # the server's rows for this segment's tokens
        n = sample.response_length
        ids, offsets = sample.rollout_top_p_token_ids, sample.rollout_top_p_token_offsets
        assert len(offsets) == n + 1 and offsets[-1] == len(ids)
        for i, mask in enumerate(sample.loss_mask):  # a replayed token need not be in the model's own nucleus
            kept = ids[offsets[i]:offsets[i + 1]]
            assert 1 <= len(kept) <= 4 if mask else kept == []
        sample.reward = 0.0
        train_view(sample, routing_replay=True, top_p_asked=True)
