"""The real sglang-router in front of two embedded servers (starts a Rust binary: marked slow).

The engine reaches it on its one HTTP path (httpx's client over the engine's transport), as users run it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx
import pytest

from engine import slime
from engine.settings import EngineConfig
from engine.local.demos import demo_file
from engine.local.server import BackgroundServer
from engine.sglang.http1 import AsyncioTransport
from tests.conftest import run
from tests.support.helpers import SAMPLING, make_args, tok
from engine.local.sample import Sample

pytestmark = pytest.mark.slow
ROUTING_KEY = "X-SMG-Routing-Key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(what)


@attrs.frozen
class Cluster:
    client: httpx.Client
    workers: tuple[BackgroundServer, BackgroundServer]
    log_path: Path
    proc: subprocess.Popen


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    # Any outbound HTTP the router might attempt goes to a dead proxy (discard port) and fails fast;
    # loopback (the workers) bypasses it. The hub is also switched off for good measure.
    dead_proxy = "http://127.0.0.1:9"
    env = dict(os.environ, HTTP_PROXY=dead_proxy, HTTPS_PROXY=dead_proxy, ALL_PROXY=dead_proxy,
               NO_PROXY="127.0.0.1,localhost", HF_HUB_OFFLINE="1")
    replay = demo_file("replay.jsonl")  # so engine rollouts through the router walk real tool calls
    with BackgroundServer(replay_path=replay) as a, BackgroundServer(replay_path=replay) as b, \
            open(log_path, "w") as log:
        port = _free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", a.url, b.url,
               # manual = sticky by routing key; min_group = a new key goes to the worker with fewest keys,
               # which makes the spread over two workers deterministic.
               "--policy", "manual", "--assignment-mode", "min_group",
               "--health-check-interval-secs", "2", "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(_free_port()), "--log-level", "info"]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=30)
        try:
            _wait(lambda: client.get("/health").status_code == 200, 30, "router /health")
            probe = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
            _wait(lambda: client.post("/generate", json=probe).status_code == 200, 30, "first forwarded /generate")
            yield Cluster(client=client, workers=(a, b), log_path=log_path, proc=proc)
        finally:
            client.close()
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode is not None


def _by_key(worker: BackgroundServer) -> dict[str, int]:
    return dict(worker.state.routing_keys)


def test_router_lists_both_workers(cluster: Cluster) -> None:
    urls = {w["url"] for w in cluster.client.get("/workers").json()["workers"]}
    assert urls == {w.url for w in cluster.workers}


def test_routing_key_is_forwarded_and_sticky(cluster: Cluster) -> None:
    keys = [f"session-{i}" for i in range(4)]
    for round_ in range(3):
        for key in keys:
            body = {"input_ids": [10, 20, 30 + round_], "sampling_params": {"max_new_tokens": 2}}
            r = cluster.client.post("/generate", json=body, headers={ROUTING_KEY: key})
            assert r.status_code == 200, r.text
    seen = [_by_key(w) for w in cluster.workers]
    for key in keys:
        counts = [s.get(key, 0) for s in seen]
        assert sorted(counts) == [0, 3], f"{key} split over workers: {counts}"  # every request, one worker
    # Which worker owns a new key is the router's policy (not always a spread over both): not asserted.


def test_body_comes_back_unchanged(cluster: Cluster) -> None:
    body = {
        "input_ids": [151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198, 151644, 77091, 198],
        "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 7,
                            "no_stop_trim": True, "skip_special_tokens": False},
        "return_logprob": True,
        "rid": "via-router-1",
    }
    before = [w.state.generate_requests for w in cluster.workers]
    via = cluster.client.post("/generate", json=body, headers={ROUTING_KEY: "unchanged"})
    assert via.status_code == 200, via.text
    served = [i for i, w in enumerate(cluster.workers) if w.state.generate_requests > before[i]]
    assert len(served) == 1
    direct = httpx.post(cluster.workers[served[0]].url + "/generate", json={**body, "rid": "direct-1"},
                        trust_env=False, timeout=30)
    got, want = via.json(), direct.json()
    assert got["meta_info"]["id"] == "via-router-1"  # the rid inside the body reached the worker
    volatile = {"id", "e2e_latency", "response_sent_to_client_ts"}
    assert {k: v for k, v in got["meta_info"].items() if k not in volatile} == {
        k: v for k, v in want["meta_info"].items() if k not in volatile}
    assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]


def test_router_loaded_the_local_tokenizer(cluster: Cluster) -> None:
    def registered() -> bool:
        return "Successfully registered tokenizer" in cluster.log_path.read_text(errors="replace")

    _wait(registered, 15, "tokenizer registration in the router log")
    text = cluster.log_path.read_text(errors="replace").lower()
    assert "huggingface.co" not in text and "download" not in text
    assert cluster.proc.poll() is None  # still running; the fixture kills it


def test_engine_rollouts_through_the_router_stay_on_one_worker(cluster: Cluster) -> None:
    """The engine talks only to the router; each sample's turns carry its session id and stick."""
    port = int(str(cluster.client.base_url).rstrip("/").rsplit(":", 1)[1])
    args = make_args(sglang_router_ip="127.0.0.1", sglang_router_port=port, rollout_max_context_len=4096)
    prompts = ["What is 17 * 23?", "What is 2 to the power of 20?", "What is 123 + 456?", "What is 9 squared?"]
    samples = [Sample(prompt=p, session_id=f"engine-{i}") for i, p in enumerate(prompts)]

    async def go() -> None:
        import asyncio

        pool = slime.runtime_for(EngineConfig.from_args(args)).client.http
        assert isinstance(pool.transport, AsyncioTransport)  # the default path, as users run it
        await asyncio.gather(*(slime.generate(args, s, dict(SAMPLING)) for s in samples))
        await pool.aclose()

    run(go())
    seen = [_by_key(w) for w in cluster.workers]
    for s in samples:
        assert s.status == Sample.Status.COMPLETED, s.metadata
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
        assert s.response == tok().decode(s.tokens[len(s.tokens) - s.response_length:])
        turns = len(s.metadata["fsm"]["turns"])
        counts = sorted(w.get(s.session_id, 0) for w in seen)
        assert counts == [0, turns], f"{s.session_id}: {counts}"  # every turn on one worker
