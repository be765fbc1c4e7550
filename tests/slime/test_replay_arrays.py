"""Top-p replay and routing replay (R3) end to end: the embedded server, TRIM, partial rollout.

The embedded server answers `custom_params.return_top_p_token_ids` as slime's SGLang patch does
and returns deterministic synthetic routed experts (`synthetic_routed_experts`), so every row a
sample holds can be compared with what the server sent.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import respx

from engine import tools
from engine import slime
from engine.local.sample import Sample
from engine.local.server import BackgroundServer
from engine.local.server.model import synthetic_routed_experts
from tests.conftest import run
from tests.slime.slime_rules import generate_and_rm, train_view
from tests.support.helpers import IM_END, SAMPLING, URL, FakeInterpreter, ScriptedServer, encode, make_args, reply_body

LAYERS, TOPK = 2, 3
QUESTION = "Count with the tool, three times."
TURNS = ["<code>print(11)</code>", "<code>print(22)</code>", "<code>print(33)</code>", "Answer: \\boxed{3}"]
R3 = {"use_rollout_routing_replay": True, "num_layers": LAYERS, "moe_router_topk": TOPK}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    path = tmp_path_factory.mktemp("r3") / "script.jsonl"
    path.write_text(json.dumps({"prompt": QUESTION, "turns": TURNS}) + "\n")
    with BackgroundServer(replay_path=str(path), routed_experts_layers=LAYERS, routed_experts_topk=TOPK) as s:
        yield s


@pytest.fixture
def fake() -> Iterator[FakeInterpreter]:
    with tools.registry.registered(FakeInterpreter(lambda code: f"Output:\n{code[6:-1]}")) as f:
        yield f


def roll(server_url: str, sample: Sample, params: dict[str, Any] | None = None, **args_kw: Any) -> Sample:
    host, port = server_url.removeprefix("http://").split(":")
    args = make_args(sglang_router_ip=host, sglang_router_port=int(port), **args_kw)
    run(slime.generate(args, sample, dict(params or SAMPLING)))
    return sample


def expected_rows(tokens: list[int]) -> np.ndarray:
    flat = synthetic_routed_experts(tokens, 0, LAYERS, TOPK)
    return np.array(flat, dtype=np.int32).reshape(-1, LAYERS, TOPK)


def check_rows(sample: Sample) -> int:
    """rows == len(tokens) - 1; the server's rows kept as sent; the trailing ones valid padding."""
    experts = sample.rollout_routed_experts
    assert experts.dtype == np.int32 and experts.shape == (len(sample.tokens) - 1, LAYERS, TOPK)
    real = sample.metadata["fsm"]["routed_experts_rows"]
    assert (experts[:real] == expected_rows(sample.tokens)[:real]).all()
    if real < len(experts):
        assert (experts[real:] == experts[real - 1]).all()
    # every mask-1 token but the sequence's last model token has the row the server sent for it
    prompt_len = len(sample.tokens) - sample.response_length
    model_positions = [prompt_len + i for i, m in enumerate(sample.loss_mask) if m == 1]
    assert model_positions and real >= model_positions[-1]
    return real


def test_three_turns_with_a_trailing_observation(server: BackgroundServer, fake: FakeInterpreter) -> None:
    sample = roll(server.url, Sample(prompt=QUESTION, label="3"), engine_max_turns=3, **R3)
    fsm = sample.metadata["fsm"]
    assert (sample.status, fsm["termination_reason"]) == (Sample.Status.TRUNCATED, "max_turns_reached")
    assert len(fsm["turns"]) == 3 and fsm["segments"][-1][0] == "observation"
    real = check_rows(sample)
    assert real < len(sample.tokens) - 1  # the trailing observation has padded rows
    generate_and_rm(None, sample)
    train_view(sample, routing_replay=True)


def test_a_trim_cuts_the_rows_with_the_tokens(server: BackgroundServer, fake: FakeInterpreter) -> None:
    fake.output = lambda code: "Output:\n" + ("9" * 4000 if "33" in code else code)
    probe = roll(server.url, Sample(prompt=QUESTION), engine_max_turns=2, **R3)
    budget = len(probe.tokens) + 120  # room for turn 3, not for its 4000-character output
    sample = roll(server.url, Sample(prompt=QUESTION, label="3"), rollout_max_context_len=budget, **R3)
    fsm = sample.metadata["fsm"]
    assert fsm["termination_reason"] == "observation_over_budget" and len(sample.tokens) == budget
    assert len(fsm["turns"]) == 3
    check_rows(sample)


def test_routing_replay_asks_for_the_rows_it_does_not_hold(server: BackgroundServer, fake: FakeInterpreter) -> None:
    sample = roll(server.url, Sample(prompt=QUESTION, label="3"), **R3)
    assert sample.status == Sample.Status.COMPLETED
    check_rows(sample)


# -- partial rollout, through a scripted server computing the same synthetic rows ------------
def r3_reply(text: str, finish: str = "stop", rows_off_by: int = 0) -> Any:
    """A reply to whatever was asked: the turn's ids and the routed experts the request asked for."""

    def answer(payload: dict[str, Any]) -> httpx.Response:
        ids = encode(text) + ([IM_END] if finish == "stop" else [])
        body = reply_body(ids, finish=finish)
        tokens = payload["input_ids"] + ids + [0] * rows_off_by
        start = payload["routed_experts_start_len"]
        assert payload["return_routed_experts"] is True
        flat = synthetic_routed_experts(tokens, start, LAYERS, TOPK)
        body["meta_info"]["routed_experts"] = base64.b64encode(np.array(flat, dtype=np.int32).tobytes()).decode()
        body["meta_info"]["routed_experts_start_len"] = start
        return httpx.Response(200, json=body)

    return answer


def scripted(sample: Sample, script: list[Any], **args_kw: Any) -> ScriptedServer:
    server = ScriptedServer(script)
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        run(slime.generate(make_args(**R3, **args_kw), sample, dict(SAMPLING)))
    return server


def test_a_partial_rollout_keeps_its_rows_and_asks_for_the_rest(fake: FakeInterpreter) -> None:
    sample = Sample(prompt=QUESTION, label="3")
    first = scripted(sample, [r3_reply(TURNS[0]), r3_reply("So the", finish="abort")],
                     partial_rollout=True, engine_abort_status="aborted")
    assert sample.status == Sample.Status.ABORTED
    held = check_rows(sample)
    assert held == len(sample.tokens) - 1  # the cut turn's rows came with its reply
    assert first.requests[1]["routed_experts_start_len"] == len(first.requests[0]["input_ids"]) + len(
        encode(TURNS[0])) + 1 - 1
    second = scripted(sample, [r3_reply(" answer: Answer: \\boxed{3}")], partial_rollout=True,
                      engine_abort_status="aborted")
    assert sample.status == Sample.Status.COMPLETED and sample.metadata["fsm"]["attempt"] == 2
    assert second.requests[0]["routed_experts_start_len"] == held
    check_rows(sample)
    generate_and_rm(None, sample)
    train_view(sample, routing_replay=True)


def test_a_partial_rollout_whose_rows_were_changed_restarts(fake: FakeInterpreter) -> None:
    sample = Sample(prompt=QUESTION, label="3")
    scripted(sample, [r3_reply(TURNS[0]), r3_reply("So", finish="abort")], partial_rollout=True,
             engine_abort_status="aborted")
    sample.rollout_routed_experts[3, 0, 0] += 1
    second = scripted(sample, [r3_reply(TURNS[3])], partial_rollout=True)
    assert sample.metadata["fsm"]["checkpoint_rejected"] == "routed experts were changed"
    assert second.requests[0]["routed_experts_start_len"] == 0
    check_rows(sample)


def test_a_reply_with_the_wrong_row_count_is_unusable_and_rerun(fake: FakeInterpreter) -> None:
    sample = Sample(prompt=QUESTION, label="3")
    scripted(sample, [r3_reply(TURNS[3], rows_off_by=1), r3_reply(TURNS[3])])
    fsm = sample.metadata["fsm"]
    assert sample.status == Sample.Status.COMPLETED
    assert [a["reason"] for a in fsm["attempts"]] == ["routed_experts_mismatch"]
    check_rows(sample)


# -- top-p replay through the embedded server ------------------------------------------------
TOP_P = {**SAMPLING, "top_p": 0.9, "top_k": 4, "max_new_tokens": 6,
         "custom_params": {"return_top_p_token_ids": True}}


def test_top_p_asked_and_delivered(server: BackgroundServer, fake: FakeInterpreter) -> None:
    sample = roll(server.url, Sample(prompt="An unscripted question"), TOP_P, engine_max_turns=2)
    n = sample.response_length
    ids, offsets = sample.rollout_top_p_token_ids, sample.rollout_top_p_token_offsets
    assert n > 0 and len(offsets) == n + 1 and offsets[-1] == len(ids)
    response = sample.tokens[-n:]
    for i, (token, mask) in enumerate(zip(response, sample.loss_mask)):
        kept = ids[offsets[i] : offsets[i + 1]]
        if mask:
            assert token in kept and 1 <= len(kept) <= 4  # the sampled token was in its nucleus
        else:
            assert kept == []  # observation tokens keep no nucleus
    generate_and_rm(None, sample)
    train_view(sample, top_p_asked=True)


def test_top_p_asked_and_missing_is_unusable(tmp_path: Path) -> None:
    with BackgroundServer(top_p_replay=False) as stock:  # SGLang without slime's patch
        sample = roll(stock.url, Sample(prompt="An unscripted question", label="3"), TOP_P, engine_sample_attempts=2)
    fsm = sample.metadata["fsm"]
    assert (fsm["termination_reason"], fsm["last_reason"]) == ("attempts_exhausted", "top_p_replay_missing")
    assert sample.status == Sample.Status.FAILED and sample.remove_sample
    generate_and_rm(None, sample)
    train_view(sample, top_p_asked=True)  # empty spans: slime's conversion accepts it, trains none of it


def test_an_abort_in_the_waiting_queue_needs_no_rows(fake: FakeInterpreter) -> None:
    """SGLang's queued abort has no tokens and no routed experts: still server_aborted, not a mismatch."""
    sample = Sample(prompt=QUESTION, label="3")
    queued = httpx.Response(200, json=reply_body([], finish="abort"))
    scripted(sample, [r3_reply(TURNS[0]), queued], partial_rollout=True, engine_abort_status="aborted")
    assert sample.metadata["fsm"]["termination_reason"] == "server_aborted"
    check_rows(sample)
