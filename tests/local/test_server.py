"""The embedded SGLang-compatible server: wire format, sampler, errors, abort, replay."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.local.server import BackgroundServer, LMBackend, ReplayEntry, ReplayScript, SamplerParams, load_replay
from engine.local.server.model import reported_logprobs
from engine.profiles.tokenizer import load_tokenizer

IM_END, ENDOFTEXT = 151645, 151643
QUESTION = "What is 17 times 3? Use the python tool."
TURN_1 = "I will compute it.\n<code>print(17*3)</code>"
TURN_2 = "The tool printed 51. Answer: \\boxed{51}<|im_end|>"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with BackgroundServer() as s:
        yield s


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, trust_env=False, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def replay_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    path = tmp_path_factory.mktemp("replay") / "script.jsonl"
    entries = [{"prompt": QUESTION, "turns": [TURN_1, TURN_2]},
               {"prompt": "Unrelated question", "turns": ["nope<|im_end|>"]}]
    path.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    # A small context too, to check SGLang's silent max_new_tokens clamp cheaply.
    with BackgroundServer(replay_path=str(path), context_length=128) as s:
        yield s


@pytest.fixture(scope="module")
def replay_client(replay_server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=replay_server.url, trust_env=False, timeout=60) as c:
        yield c


def chat_ids(tok: Any, question: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def gen(client: httpx.Client, input_ids: list[int], **params: Any) -> dict[str, Any]:
    r = client.post("/generate", json={"input_ids": input_ids, "sampling_params": params, "return_logprob": True})
    assert r.status_code == 200, r.text
    return r.json()


def prompt(tok: Any) -> list[int]:
    return chat_ids(tok, "Tell me a long story about a lighthouse keeper. " * 30)  # ~300 tokens


# ---- generation and the response shape -------------------------------------------------------
def test_generate_logprobs_are_well_formed(client: httpx.Client, tok: Any) -> None:
    ids = prompt(tok)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 16, "sampling_seed": 1},
            "return_logprob": True, "rid": "shape-1"}
    out = client.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert set(out) == {"text", "output_ids", "meta_info"}
    for key in ("id", "finish_reason", "prompt_tokens", "weight_version", "completion_tokens", "cached_tokens",
                "e2e_latency", "input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"):
        assert key in meta
    assert meta["id"] == "shape-1" and meta["prompt_tokens"] == len(ids) and meta["weight_version"] == "default"
    assert meta["input_token_logprobs"] == []
    triples = meta["output_token_logprobs"]
    assert all(len(t) == 3 and isinstance(t[0], float) and t[0] <= 0 and t[2] is None for t in triples)
    assert [t[1] for t in triples] == out["output_ids"]
    assert len(triples) == meta["completion_tokens"] == meta["output_token_logprobs_length"] == 16
    assert meta["finish_reason"] == {"type": "length", "length": 16}
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)


def test_logprobs_omitted_without_return_logprob(client: httpx.Client) -> None:
    out = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}).json()
    assert "output_token_logprobs" not in out["meta_info"] and len(out["output_ids"]) == 2


def test_sampling_seed_is_deterministic(client: httpx.Client, tok: Any) -> None:
    ids = prompt(tok)
    a, b = (gen(client, ids, max_new_tokens=12, temperature=1.0, sampling_seed=42) for _ in range(2))
    c = gen(client, ids, max_new_tokens=12, temperature=1.0, sampling_seed=43)
    assert a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    assert c["output_ids"] != a["output_ids"]


def test_sampler_restricts_the_draw_not_the_reported_logprob() -> None:
    import torch

    from engine.local.server.model import sample_token

    logits = torch.tensor([0.0, 1.0, 2.0, -1e9, 0.5])
    g = torch.Generator().manual_seed(0)
    full = torch.log_softmax(logits / 0.5, dim=0)
    for params, allowed in [(SamplerParams(0.5, 1.0, 2), {1, 2}), (SamplerParams(0.5, 0.8, -1), {2, 1}),
                            (SamplerParams(0.5, 0.5, 3), {2}), (SamplerParams(0.5, 1.0, -1), {0, 1, 2, 4})]:
        draws = [sample_token(logits, params, g) for _ in range(300)]
        assert {t for t, _ in draws} <= allowed
        assert all(abs(lp - float(full[t])) < 1e-5 for t, lp in draws)  # SGLang: temperature only
    assert sample_token(logits, SamplerParams(0.0), g) == (2, pytest.approx(float(torch.log_softmax(logits, 0)[2])))


def test_greedy_reports_raw_logprobs(server: BackgroundServer, client: httpx.Client, tok: Any) -> None:
    ids = prompt(tok)
    out = gen(client, ids, max_new_tokens=3, temperature=0.0)
    backend: LMBackend = server.state.backend
    logits = backend.score(ids, out["output_ids"], backend.new_cache())
    want = reported_logprobs(logits, SamplerParams(temperature=0.0))
    for i, (lp, tid, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert tid == int(want[i].argmax()) and abs(lp - float(want[i, tid])) < 1e-4


# A seeded sampler replays the same tokens, so a second request with a stop condition taken from a
# first one's output stops exactly there. (Greedy is useless here: the random model with tied
# embeddings greedily repeats the last input token.)
SEEDED = {"temperature": 1.0, "sampling_seed": 5}


def test_stop_token_id_and_text_trimming(client: httpx.Client, tok: Any) -> None:
    ids = prompt(tok)
    ref = gen(client, ids, max_new_tokens=8, **SEEDED)["output_ids"]
    stop = ref[4]
    k = ref.index(stop)
    out = gen(client, ids, max_new_tokens=8, **SEEDED, stop_token_ids=[stop])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ref[: k + 1] == [t[1] for t in out["meta_info"]["output_token_logprobs"]]
    assert out["text"] == tok.decode(ref[:k], skip_special_tokens=True)  # stop token left out of the text
    kept = gen(client, ids, max_new_tokens=8, **SEEDED, stop_token_ids=[stop], no_stop_trim=True)
    assert kept["output_ids"] == out["output_ids"]
    assert kept["text"] == tok.decode(ref[: k + 1], skip_special_tokens=True)
    # SGLang checks the length cap before stop tokens: a stop on the last allowed token is "length".
    capped = gen(client, ids, max_new_tokens=k + 1, **SEEDED, stop_token_ids=[stop])
    assert capped["meta_info"]["finish_reason"] == {"type": "length", "length": k + 1}


def test_stop_string_and_text_trimming(client: httpx.Client, tok: Any) -> None:
    ids = prompt(tok)
    ref = gen(client, ids, max_new_tokens=32, **SEEDED)["output_ids"]
    pieces = [tok.decode([t]).strip() for t in ref[3:]]
    stop = next(p for p in pieces if len(p) >= 2 and p.isascii() and p.isalnum())
    end = next(i for i in range(len(ref)) if stop in tok.decode(ref[: i + 1]))
    full = tok.decode(ref[: end + 1], skip_special_tokens=True)
    out = gen(client, ids, max_new_tokens=32, **SEEDED, stop=[stop])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ref[: end + 1]  # ids run through the token completing the stop string
    assert out["text"] == full[: full.find(stop)]
    kept = gen(client, ids, max_new_tokens=32, **SEEDED, stop=stop, no_stop_trim=True)
    assert kept["text"] == full[: full.find(stop) + len(stop)] and kept["text"].endswith(stop)


def test_max_new_tokens_zero_reports_one_logprob(client: httpx.Client) -> None:
    out = gen(client, [1, 2, 3], max_new_tokens=0)
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert out["meta_info"]["completion_tokens"] == 0 and len(out["meta_info"]["output_token_logprobs"]) == 1


def test_batch_and_text_inputs(client: httpx.Client, tok: Any) -> None:
    r = client.post("/generate", json={"input_ids": [[1, 2], [3, 4, 5]], "rid": "b",
                                       "sampling_params": {"max_new_tokens": 3}})
    items = r.json()
    assert isinstance(items, list) and [i["meta_info"]["id"] for i in items] == ["b_0", "b_1"]
    assert [i["meta_info"]["prompt_tokens"] for i in items] == [2, 3]
    out = client.post("/generate", json={"text": "Hello there", "sampling_params": {"max_new_tokens": 2}}).json()
    assert out["meta_info"]["prompt_tokens"] == len(tok.encode("Hello there"))


def test_concurrent_requests_interleave(client: httpx.Client, tok: Any) -> None:
    results: dict[int, dict[str, Any]] = {}

    def run(i: int) -> None:
        results[i] = gen(client, prompt(tok), max_new_tokens=20 + i, sampling_seed=i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(r["meta_info"]["completion_tokens"] for r in results.values()) == [20, 21, 22, 23]


# ---- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "message"), [
    ({"input_ids": [1] * 4096}, "The input (4096 tokens) is longer than the model's context length (4096 tokens)."),
    ({"input_ids": [1] * 4000, "sampling_params": {"max_new_tokens": 200}},
     "Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of "
     "4200 tokens: 4000 tokens from the input messages and 200 tokens for the completion."),
    ({"input_ids": []}, "input_ids cannot be empty."),
    ({"input_ids": [1], "sampling_params": {"top_p": 0.0}}, "top_p must be in (0, 1], got 0.0."),
    ({"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "top_p must be in (0, 1], got 1.5."),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be at least 0, got -1."),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 5.0}},
     "invalid type: floating point `5.0`, expected i64"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature must be non-negative, got -1."),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1], got 0."),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k must be -1 (disable), or at least 1, got 0."),
    ({"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided."),
    ({"input_ids": [1, 999999]}, "Token ID 999999 is out of the vocabulary range"),
])
def test_validation_errors(client: httpx.Client, body: dict[str, Any], message: str) -> None:
    r = client.post("/generate", json=body)
    assert r.status_code == 400
    assert set(r.json()) == {"error"} and r.json()["error"]["message"].startswith(message)


def test_unknown_sampling_key_uses_the_schema_shape(client: httpx.Client) -> None:
    r = client.post("/generate", json={"input_ids": [1], "sampling_params": {"foo": 1}})
    assert r.status_code == 400 and r.json()["error"].startswith("unknown field `foo`")


def test_malformed_json(client: httpx.Client) -> None:
    r = client.post("/generate", content=b'{"input_ids": [1,', headers={"content-type": "application/json"})
    body = r.json()
    assert r.status_code == 400 and body["object"] == "error" and body["type"] == "Bad Request"
    assert body["code"] == 400 and body["param"] is None and "JSON decode error" in body["message"]


def test_duplicate_rid_is_rejected(client: httpx.Client, tok: Any) -> None:
    first = threading.Thread(target=gen_long, args=(client, "dup-rid", 400))
    first.start()
    wait_running(client, 1)
    r = client.post("/generate", json={"input_ids": [1, 2], "rid": "dup-rid"})
    client.post("/abort_request", json={"rid": "dup-rid"})
    first.join(30)
    assert r.status_code == 400 and r.json()["error"]["message"] == "Duplicate request ID detected: dup-rid"


# ---- abort -------------------------------------------------------------------------------------
def gen_long(client: httpx.Client, rid: str, n: int, sink: dict[str, Any] | None = None) -> None:
    r = client.post("/generate", json={"input_ids": [1, 2, 3], "rid": rid, "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": n, "ignore_eos": True}})
    if sink is not None:
        sink[rid] = r


def wait_running(client: httpx.Client, n: int) -> None:
    deadline = time.monotonic() + 10
    while client.get("/v1/loads").json()["loads"][0]["num_running_reqs"] < n:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.01)


@pytest.mark.parametrize("abort_body", [{"rid": "abort-me"}, {"abort_all": True}])
def test_abort_in_flight_request(client: httpx.Client, abort_body: dict[str, Any]) -> None:
    sink: dict[str, Any] = {}
    t = threading.Thread(target=gen_long, args=(client, "abort-me-1", 3000, sink))
    t.start()
    wait_running(client, 1)
    time.sleep(0.05)  # let it produce a few tokens
    r = client.post("/abort_request", json=abort_body)
    assert r.status_code == 200 and r.content == b""
    t.join(10)
    resp = sink["abort-me-1"]
    assert resp.status_code == 200
    out = resp.json()
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                                 "err_type": None}
    assert 0 < len(out["output_ids"]) < 3000
    assert out["meta_info"]["completion_tokens"] == len(out["meta_info"]["output_token_logprobs"])
    loads = client.get("/v1/loads").json()["loads"][0]
    assert loads["num_running_reqs"] + loads["num_waiting_reqs"] == 0


def test_abort_in_waiting_queue_uses_the_reduced_shape() -> None:
    with BackgroundServer(max_running_requests=1) as single, \
            httpx.Client(base_url=single.url, trust_env=False, timeout=60) as c:
        sink: dict[str, Any] = {}
        running = threading.Thread(target=gen_long, args=(c, "first", 3000, sink))
        running.start()
        wait_running(c, 1)
        queued = threading.Thread(target=gen_long, args=(c, "second", 5, sink))
        queued.start()
        deadline = time.monotonic() + 10
        while c.get("/v1/loads").json()["loads"][0]["num_waiting_reqs"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        c.post("/abort_request", json={"rid": "second"})
        queued.join(10)
        c.post("/abort_request", json={"rid": "first"})
        running.join(10)
    meta = sink["second"].json()["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert "prompt_tokens" not in meta and meta["completion_tokens"] == 0
    assert sink["first"].json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_client_disconnect_aborts_the_request(client: httpx.Client) -> None:
    with pytest.raises(httpx.TimeoutException):
        client.post("/generate", timeout=0.3, json={"input_ids": [1, 2], "rid": "gone-1",
                                                    "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})
    deadline = time.monotonic() + 5
    while client.get("/v1/loads").json()["loads"][0]["num_running_reqs"]:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.02)


def test_pause_blocks_new_requests_until_continue(client: httpx.Client) -> None:
    assert client.post("/pause_generation", json={}).json()["status"] == "ok"
    sink: dict[str, Any] = {}
    t = threading.Thread(target=gen_long, args=(client, "paused-1", 2, sink))
    t.start()
    time.sleep(0.3)
    assert "paused-1" not in sink
    client.post("/continue_generation", json={})
    t.join(10)
    assert sink["paused-1"].json()["meta_info"]["finish_reason"]["type"] == "length"


# ---- info endpoints ----------------------------------------------------------------------------
def test_health_and_info_endpoints(client: httpx.Client) -> None:
    for path in ("/health", "/health_generate"):
        r = client.get(path)
        assert r.status_code == 200 and r.content == b""
    for path in ("/model_info", "/get_model_info"):
        info = client.get(path).json()
        assert os.path.isfile(os.path.join(info["tokenizer_path"], "tokenizer.json"))
        assert info["model_path"] == info["tokenizer_path"]  # local, so sglang-router never reaches the hub
        assert info["is_generation"] is True and info["weight_version"] == "default"
        assert info["model_type"] == "qwen3" and info["architectures"] == ["Qwen3ForCausalLM"]
    for path in ("/server_info", "/get_server_info"):
        si = client.get(path).json()
        assert si["tp_size"] == 1 and si["dp_size"] == 1 and si["context_length"] == 4096
        assert os.path.isdir(si["model_path"]) and si["tokenizer_path"] == si["model_path"] and si["version"]
    for method in ("GET", "POST"):
        r = client.request(method, "/flush_cache")
        assert r.status_code == 200 and r.text.startswith("Cache flushed.\n")
    loads = client.get("/v1/loads").json()["loads"][0]
    assert {"num_running_reqs", "num_waiting_reqs"} <= set(loads)
    assert client.get("/v1/models").json()["data"][0]["id"]


def test_update_weight_version(client: httpx.Client) -> None:
    assert client.post("/update_weight_version", json={"new_version": "v2"}).json()["success"] is True
    try:
        assert client.get("/model_info").json()["weight_version"] == "v2"
        assert gen(client, [1, 2], max_new_tokens=1)["meta_info"]["weight_version"] == "v2"
    finally:
        client.post("/update_weight_version", json={"new_version": "default"})


# ---- replay ------------------------------------------------------------------------------------
def observation_ids(tok: Any, text: str) -> list[int]:
    return tok.encode(f"<|im_end|>\n<|im_start|>user\n<interpreter>\n{text}\n</interpreter><|im_end|>\n"
                      "<|im_start|>assistant\n", add_special_tokens=False)


def test_replay_teacher_forces_turn_one(replay_client: httpx.Client, tok: Any) -> None:
    ids = chat_ids(tok, QUESTION)
    out = gen(replay_client, ids, max_new_tokens=60, temperature=1.0, stop=["</code>"])
    script = tok.encode(TURN_1, add_special_tokens=False)
    assert out["output_ids"] == script
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "</code>"}
    assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in out["meta_info"]["output_token_logprobs"])
    assert out["text"] == TURN_1[: TURN_1.find("</code>")]
    kept = gen(replay_client, ids, max_new_tokens=60, stop=["</code>"], no_stop_trim=True)
    assert kept["text"] == TURN_1 and kept["output_ids"] == script


def test_replay_logprobs_are_the_models(replay_server: BackgroundServer, replay_client: httpx.Client,
                                        tok: Any) -> None:
    ids = chat_ids(tok, QUESTION)
    out = gen(replay_client, ids, max_new_tokens=60, temperature=0.8, stop=["</code>"])
    backend: LMBackend = replay_server.state.backend
    want = reported_logprobs(backend.score(ids, out["output_ids"], backend.new_cache()), SamplerParams(0.8))
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx([float(want[i, t]) for i, t in enumerate(out["output_ids"])], abs=1e-4)


def test_replay_picks_turn_two_after_turn_one(replay_client: httpx.Client, tok: Any) -> None:
    ids = chat_ids(tok, QUESTION) + tok.encode(TURN_1, add_special_tokens=False) + observation_ids(tok, "51")
    out = gen(replay_client, ids, max_new_tokens=60, stop=["</code>"])
    assert out["output_ids"] == tok.encode(TURN_2, add_special_tokens=False)
    assert out["output_ids"][-1] == IM_END
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": IM_END}
    assert out["text"] == "The tool printed 51. Answer: \\boxed{51}"
    raw = gen(replay_client, ids, max_new_tokens=60, no_stop_trim=True, skip_special_tokens=False)
    assert raw["text"] == TURN_2
    cut = gen(replay_client, ids, max_new_tokens=5)
    assert cut["output_ids"] == out["output_ids"][:5]
    assert cut["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_replay_falls_back_to_sampling(replay_client: httpx.Client, tok: Any) -> None:
    done = chat_ids(tok, QUESTION) + tok.encode(TURN_1 + TURN_2, add_special_tokens=False)
    unknown = chat_ids(tok, "Something nobody scripted")
    for ids in (done, unknown):
        out = gen(replay_client, ids, max_new_tokens=4, ignore_eos=True)
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_silent_clamp_to_the_context(replay_client: httpx.Client) -> None:
    # context 128: input 100 + 28 passes validation, but SGLang clamps to context - input - 2.
    out = gen(replay_client, list(range(1000, 1100)), max_new_tokens=28, ignore_eos=True)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 26}
    assert len(out["output_ids"]) == 26


def test_replay_script_matching_rules(tmp_path: Path) -> None:
    script = ReplayScript(entries=[ReplayEntry("17 times 3", ["a<|im_end|>", "b"]),
                                   ReplayEntry("What is 17 times 3?", ["long-a\n", "long-b"])])
    assert script.select("user: What is 17 times 3? assistant:") == (script.entries[1], 0)
    # A turn re-rendered without its trailing <|im_end|> / whitespace still counts as present.
    assert script.select("What is 17 times 3? long-a<|im_end|> tool long-b") is None
    assert script.select("What is 17 times 3? long-a tool") == (script.entries[1], 1)
    assert script.select("17 times 3 ... a ...") == (script.entries[0], 1)
    assert script.select("nothing") is None
    # a turn no longer in the context is skipped: a compacted one goes on from the latest it holds
    long = ReplayScript(entries=[ReplayEntry("Task", ["t1", "t2", "t3", "t4"]), ReplayEntry("Summarize", ["S1"]),
                                 ReplayEntry("Quiz", ["q"])])
    assert long.select("Task t1 t2") == (long.entries[0], 2)
    assert long.select("Task [summary] t3") == (long.entries[0], 3)
    assert long.select("Task t4") is None
    # the longest prompt wins, then the one ending latest: a question asked after the task's prompt is answered
    assert long.select("Task t1 t2 Summarize") == (long.entries[1], 0)
    assert long.select("Summarize ... Task t1") == (long.entries[1], 0)
    assert long.select("Quiz Task t1") == (long.entries[0], 1) and long.select("Task t1 Quiz") == (long.entries[2], 0)
    # A history re-rendered by a template that drops earlier turns' reasoning still shows the turn.
    thinking = ReplayEntry("Add 3+4.", ["<think>\nadd\n</think>\n\n<tool_call>add</tool_call>",
                                        "<think>\nmul\n</think>\n\n<tool_call>mul</tool_call>", "done"])
    script = ReplayScript(entries=[thinking])
    assert script.select("Add 3+4. <think>\nadd\n</think>\n\n<tool_call>add</tool_call> 7") == (thinking, 1)
    assert script.select("Add 3+4. <tool_call>add</tool_call> 7") == (thinking, 1)
    assert script.select("Add 3+4. <tool_call>add</tool_call> 7 <tool_call>mul</tool_call> 35") == (thinking, 2)
    assert script.select("Add 3+4. <think>\nelse\n</think> 7") == (thinking, 0)
    lines = tmp_path / "s.jsonl"
    lines.write_text('{"prompt": "p", "turns": ["t"]}\n\n{"prompt": "q", "turns": ["u", "v"]}\n')
    as_list = tmp_path / "s.json"
    as_list.write_text(json.dumps({"entries": [{"prompt": "p", "turns": ["t"]}, {"prompt": "q", "turns": ["u", "v"]}]}))
    assert load_replay(lines) == load_replay(as_list)
    bad = tmp_path / "bad.json"
    bad.write_text('[{"prompt": "p"}]')
    with pytest.raises(ValueError):
        load_replay(bad)


# ---- slime's replay fields: top-p kept ids, routed experts ------------------------------------
def b64_int32(value: str) -> list[int]:
    import base64
    from array import array

    return array("i", base64.b64decode(value)).tolist()


def test_top_p_replay_in_slimes_format(client: httpx.Client, tok: Any) -> None:
    out = gen(client, chat_ids(tok, "Hi"), max_new_tokens=5, temperature=1.0, top_p=0.9, top_k=3, sampling_seed=3,
              custom_params={"return_top_p_token_ids": True})
    meta = out["meta_info"]
    kept, offsets = b64_int32(meta["top_p_token_ids"]), b64_int32(meta["top_p_token_offsets"])
    assert len(offsets) == len(out["output_ids"]) + 1 and offsets[0] == 0 and offsets[-1] == len(kept)
    for i, token in enumerate(out["output_ids"]):
        assert token in kept[offsets[i]:offsets[i + 1]] and offsets[i + 1] - offsets[i] <= 3
    plain = gen(client, chat_ids(tok, "Hi"), max_new_tokens=2)["meta_info"]
    assert "top_p_token_ids" not in plain  # only when asked


def test_routed_experts_only_from_a_server_that_has_them(client: httpx.Client, tok: Any) -> None:
    body = {"input_ids": chat_ids(tok, "Hi"), "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
            "return_routed_experts": True}
    assert "routed_experts" not in client.post("/generate", json=body).json()["meta_info"]


def test_routed_experts_rows_from_the_start_asked(tok: Any) -> None:
    from engine.local.server.model import synthetic_routed_experts

    ids = chat_ids(tok, "Hi")
    with BackgroundServer(routed_experts_layers=2, routed_experts_topk=4) as s, \
            httpx.Client(base_url=s.url, trust_env=False, timeout=60) as c:
        for start in (0, 5):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3}, "return_logprob": True,
                    "return_routed_experts": True, "routed_experts_start_len": start}
            out = c.post("/generate", json=body).json()
            meta = out["meta_info"]
            rows = b64_int32(meta["routed_experts"])
            sequence = ids + out["output_ids"]
            assert meta["routed_experts_start_len"] == start
            assert len(rows) == (len(sequence) - 1 - start) * 2 * 4
            assert rows == synthetic_routed_experts(sequence, start, 2, 4)
        bad = c.post("/generate", json={**body, "routed_experts_start_len": len(ids)})
        assert bad.status_code == 400 and "routed_experts_start_len" in bad.text
