"""Fault injection in the embedded server (`serve --faults`), and the soak command.

Each fault kind at rate 1.0 is checked twice: on the wire (httpx against a BackgroundServer
replaying the demo script), and through the engine, which must end the sample in the
terminal status the fault calls for with every invariant intact.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine import slime
from engine.local.invariants import sample_violations
from engine.local.demos import demo_file
from engine.local.server import BackgroundServer, ServerSettings
from engine.local.server.faults import ABORTED, KINDS, PRESETS, QUEUE_FULL, FaultInjector, FaultSpec
from engine.local.soak import main_soak, usable_reply
from engine.sglang.wire import error_message, is_context_error
from tests.conftest import run
from tests.support.episodes import prompt_ids
from tests.support.helpers import IM_END, SAMPLING, encode, make_args, tok
from engine.local.sample import Sample

pytestmark = pytest.mark.slow
PROMPT = "What is 17 * 23?"  # the demo replay answers it with a code turn, then the answer
STALL = 1.0  # seconds the server stalls; the clients below give up after REQUEST_TIMEOUT
REQUEST_TIMEOUT = 0.4
EXPECTED = {  # kind -> (status, termination reason) of a sample whose every request gets it
    "http500": ("ABORTED", "request_failed"),
    "reset": ("ABORTED", "request_failed"),
    "stall": ("ABORTED", "request_failed"),
    "malformed": ("ABORTED", "request_failed"),
    "no_meta": ("ABORTED", "reply_malformed"),
    "abort": ("ABORTED", "server_aborted"),
    "context400": ("TRUNCATED", "context_rejected"),
    "mismatch": ("ABORTED", "logprobs_mismatch"),
}


# -- the spec ----------------------------------------------------------------------------
def test_spec_parses_presets_overrides_and_round_trips() -> None:
    spec = FaultSpec.parse("default,seed=3,stall_seconds=0.5")
    assert spec == FaultSpec(**{**PRESETS["default"].rates(), "seed": 3, "stall_seconds": 0.5})
    assert FaultSpec.parse(spec.format()) == spec
    assert FaultSpec.parse("") == FaultSpec.parse("none") == FaultSpec()
    assert FaultSpec.parse("http500=1").rates() == {"http500": 1.0}
    assert set(EXPECTED) == set(KINDS)


@pytest.mark.parametrize("text, words", [
    ("bogus=0.1", "unknown fault key"), ("nightly", "unknown fault preset"), ("reset=1.5", "reset"),
    ("http500=0.6,abort=0.6", "add up to 1.2"), ("stall=x", "bad fault spec"), ("stall_seconds=0", "stall_seconds"),
])
def test_spec_rejects_bad_input_with_a_message(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        FaultSpec.parse(text)
    with pytest.raises(ValueError):
        ServerSettings(faults=text)  # refused when the settings are made, not at the first request


def test_draws_are_seeded_and_follow_the_rates() -> None:
    def draws(spec: FaultSpec, n: int) -> list[str | None]:
        injector = FaultInjector(spec, decode=lambda ids: "")
        return [injector.draw() for _ in range(n)]

    spec = PRESETS["default"]
    assert draws(spec, 500) == draws(spec, 500)
    assert draws(spec, 500) != draws(FaultSpec.parse("default,seed=8"), 500)
    many = draws(spec, 20000)
    for kind, rate in spec.rates().items():
        assert abs(many.count(kind) / len(many) - rate) < 0.01, kind
    assert set(draws(FaultSpec(mismatch=1.0), 50)) == {"mismatch"}
    assert set(draws(FaultSpec(), 50)) == {None}


def test_serve_accepts_faults_and_refuses_a_bad_spec(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli import build_parser

    ns = build_parser().parse_args(["serve", "--faults", "default,seed=2"])
    assert ns.faults == "default,seed=2"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--faults", "http500=2"])
    assert "--faults" in capsys.readouterr().err


# -- on the wire ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=KINDS)
def faulty(request: pytest.FixtureRequest) -> Iterator[tuple[str, BackgroundServer]]:
    """A demo-replay server injecting one fault kind into every /generate request."""
    kind = request.param
    settings = ServerSettings(port=0, replay_path=demo_file("replay.jsonl"),
                              faults=f"{kind}=1.0,seed=1,stall_seconds={STALL}")
    with BackgroundServer(settings) as server:
        yield kind, server


def first_turn_request() -> dict[str, Any]:
    """The engine's first request for PROMPT: the retool prompt, max_new_tokens 64."""
    params = {**SAMPLING, "max_new_tokens": 64}
    return {"input_ids": list(prompt_ids(PROMPT)), "sampling_params": params, "return_logprob": True}


def server_info(server: BackgroundServer) -> dict[str, Any]:
    return httpx.get(server.url + "/server_info", timeout=10, trust_env=False).json()


def test_each_fault_has_exactly_its_effect_on_the_wire(faulty: tuple[str, BackgroundServer]) -> None:
    kind, server = faulty
    payload = first_turn_request()
    outcomes: list[httpx.Response | Exception] = []
    with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT if kind == "stall" else 10.0), trust_env=False) as client:
        for _ in range(4):
            try:
                outcomes.append(client.post(server.url + "/generate", json=payload))
            except httpx.TransportError as exc:
                outcomes.append(exc)
    check_wire_effect(kind, outcomes)
    assert server_info(server)["faults_injected"] == {kind: 4}
    assert httpx.get(server.url + "/health", timeout=5, trust_env=False).status_code == 200  # other routes untouched


def check_wire_effect(kind: str, outcomes: list[httpx.Response | Exception]) -> None:
    """What each kind must look like to a client."""
    if kind in ("reset", "stall"):
        expected = httpx.RemoteProtocolError if kind == "reset" else httpx.ReadTimeout
        assert all(isinstance(o, expected) for o in outcomes), outcomes
        return
    responses = [o for o in outcomes if isinstance(o, httpx.Response)]
    assert len(responses) == len(outcomes), outcomes
    if kind == "http500":
        assert {r.status_code for r in responses} == {500, 503}  # seed 1 gives both within 4 draws
        for r in responses:
            assert r.json() == QUEUE_FULL if r.status_code == 503 else r.text == "Internal Server Error"
        return
    if kind == "context400":
        for r in responses:
            message = r.json()["error"]["message"]
            assert r.status_code == 400 and is_context_error(400, error_message(r.content))
            assert message.startswith("Requested token count exceeds the model's maximum context length of ")
        return
    assert {r.status_code for r in responses} == {200}
    if kind == "malformed":
        for r in responses:
            with pytest.raises(ValueError):
                json.loads(r.content)
            assert r.content.startswith(b'{"text": ')
        return
    bodies = [r.json() for r in responses]
    full = encode("Let me compute this with Python.\n<code>\nprint(17 * 23)\n</code>") + [IM_END]
    for body in bodies:
        meta = body.get("meta_info")
        if kind == "no_meta":
            assert meta is None and body["output_ids"] == full[: len(body["output_ids"])]
        elif kind == "mismatch":
            assert len(meta["output_token_logprobs"]) == len(body["output_ids"]) - 1
            assert usable_reply(json.dumps(body).encode()) is None
        elif kind == "abort":
            ids = body["output_ids"]
            assert meta["finish_reason"] == ABORTED
            assert ids == full[: len(ids)] and [e[1] for e in meta["output_token_logprobs"]] == ids
            assert meta["completion_tokens"] == len(ids) and body["text"] == tok().decode(ids)
    if kind == "abort":
        assert len({len(b["output_ids"]) for b in bodies}) > 1  # a random prefix each time


# -- through the engine ------------------------------------------------------------------------
def test_the_engine_ends_each_faulted_sample_in_its_status_with_the_invariants_intact(
    faulty: tuple[str, BackgroundServer],
) -> None:
    kind, server = faulty
    host, port = server.url.removeprefix("http://").split(":")
    timeout = REQUEST_TIMEOUT if kind == "stall" else 60.0  # a busy CI machine must not turn others into stalls
    # Every request faults: this judges one attempt, so ABORTED is handed back as to a caller
    # that re-queues it (the engine's re-runs are tests/slime/test_statuses.py's).
    args = make_args(sglang_router_ip=host, sglang_router_port=int(port), engine_retry_attempts=2,
                     engine_retry_base_delay=0.0, engine_request_timeout=timeout, engine_abort_status="aborted")
    samples = [Sample(prompt=PROMPT, label="391", session_id=f"{kind}-{i}") for i in range(3)]

    async def go() -> None:
        import asyncio

        await asyncio.gather(*(slime.generate(args, s, dict(SAMPLING)) for s in samples))

    run(go())
    status, reason = EXPECTED[kind]
    prompt = prompt_ids(PROMPT)
    for s in samples:
        assert (s.status.name, s.metadata["fsm"]["termination_reason"]) == (status, reason), s.metadata["fsm"].get("engine_error")
        assert not sample_violations(s, prompt_ids=prompt, budget=4096, decode=tok().decode)
        if kind == "abort":
            assert s.response_length == s.metadata["fsm"]["turns"][0]["tokens"]  # the partial turn is kept


# -- the soak command ----------------------------------------------------------------------
def test_soak_smoke_run_has_every_must_be_zero_figure_at_zero(capsys: pytest.CaptureFixture[str]) -> None:
    ns = argparse.Namespace(samples=40, concurrency=16, faults="default", seed=0, json=True)
    code = main_soak(ns)
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"], report["problems"]
    assert sum(report["statuses"].values()) == 40
    assert report["invariant_violations"] == report["escaped_exceptions"] == 0
    assert report["leftover_processes"] == report["unfinished_samples"] == 0
    assert report["tool_calls"] > 0 and sum(report["faults_injected"].values()) > 0
    assert report["peak_rss_mib"] > 0 and report["wall_seconds"] > 0


def test_soak_refuses_a_bad_fault_spec(capsys: pytest.CaptureFixture[str]) -> None:
    ns = argparse.Namespace(samples=1, concurrency=1, faults="http500=7", seed=0, json=False)
    assert main_soak(ns) == 2
    assert "--faults" in capsys.readouterr().err


def test_the_wire_record_starts_again_at_a_new_attempt_even_when_its_first_request_is_never_answered() -> None:
    """An attempt whose first request timed out holds none of the earlier attempt's replies."""
    from engine.local.soak import WireRecorder

    def request(ids: list[int]) -> httpx.Request:
        return httpx.Request("POST", "http://127.0.0.1:1/generate", headers={"X-SMG-Routing-Key": "s"},
                             content=json.dumps({"input_ids": ids}).encode())

    reply = {"text": "", "output_ids": [7], "meta_info": {"finish_reason": {"type": "stop"},
                                                         "output_token_logprobs": [[-0.5, 7, None]]}}
    recorder = WireRecorder()
    first = request([1, 2, 3])
    run(recorder.on_request(first))
    run(recorder(httpx.Response(200, json=reply, request=first)))
    assert recorder.replies["s"] == [([7], [-0.5])]
    run(recorder.on_request(request([1, 2, 3])))  # the next attempt, from the bare prompt: no answer comes
    assert recorder.replies["s"] == []
    run(recorder.on_request(request([1, 2, 3, 7])))  # a later turn of the same attempt keeps what it has
    assert recorder.prompt_lengths["s"] == 3
