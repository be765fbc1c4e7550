"""The wire format on its own: hostile reply values, `parse_reply` never raising, request bodies.

Where a value must never reach the trainer, it is also driven through `engine.slime.generate`
with the stand-in `Sample` (respx: the fault lives in the body, not the transport), and the
returned sample is searched for it.
"""

from __future__ import annotations

import base64
import email.utils
import json
import math
import tracemalloc
from array import array

import httpx
import pytest
import respx
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import slime
from engine.local.invariants import REASON_STATUS
from engine.local.sample import Sample
from engine.sglang import wire
from engine.sglang.client import find_vocab_size, settle_vocabulary
from engine.sglang.wire import RequestBody, generate_payload, parse_reply, retry_after_seconds
from tests.conftest import run
from tests.support.helpers import IM_END, SAMPLING, URL, ScriptedServer, encode, make_args, reply_body, turn

VOCAB = 151669  # the Qwen3 tokenizer's ids, added special tokens included
CODE_TURN = "<code>\nprint(1)\n</code>"


# -- ids ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 5000, -1, 2**31, 2**40, 2**70, True, 7.0, "12", None])
def test_an_id_that_is_not_an_integer_inside_the_vocabulary_makes_the_reply_unusable(bad) -> None:
    body = reply_body([5, 6, 7])
    body["meta_info"]["output_token_logprobs"][1][1] = bad
    body["output_ids"][1] = bad
    reply = parse_reply(body, VOCAB)
    assert (reply.problem, reply.ids, reply.logprobs) == ("ids_out_of_vocab", [], [])
    assert reply.finish == "stop"  # what could be read is kept for the turn log


def test_the_last_id_of_the_vocabulary_is_usable_and_without_a_size_int32_bounds_ids() -> None:
    assert parse_reply(reply_body([0, VOCAB - 1]), VOCAB).problem is None
    assert parse_reply(reply_body([VOCAB + 10]), None).problem is None
    assert parse_reply(reply_body([2**31]), None).problem == "ids_out_of_vocab"


def test_top_p_replay_ids_are_bounded_too_and_bad_base64_is_unusable_not_a_crash() -> None:
    def with_top_p(kept, offsets):
        body = reply_body([5, 6])
        body["meta_info"]["top_p_token_ids"], body["meta_info"]["top_p_token_offsets"] = kept, offsets
        return parse_reply(body, VOCAB)

    def b64(values):
        return base64.b64encode(array("i", values).tobytes()).decode()

    assert with_top_p(b64([5, 9, 6]), b64([0, 2, 3])).top_p == ([5, 9, 6], [0, 2, 3])
    assert with_top_p([5, VOCAB, 6], [0, 2, 3]).problem == "ids_out_of_vocab"
    assert with_top_p(b64([5, -3, 6]), b64([0, 2, 3])).problem == "ids_out_of_vocab"
    for broken in ("!!!not base64!!!", "AAE=", "QUJD", 17, {"a": 1}, ["x"]):  # bad alphabet, 1 or 3 bytes, not a list
        assert with_top_p(broken, b64([0, 2, 3])).problem == "reply_malformed"
    assert with_top_p(b64([5, 9, 6]), b64([0, 3, 2, 3])).problem == "logprobs_mismatch"
    assert with_top_p(b64([5, 9, 6]), b64([0, 3, 1])).problem == "logprobs_mismatch"  # offsets go backwards


# -- logprobs ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("-inf"), float("inf"), float("nan"), 0.25, 1e-300, -1e309])
def test_a_logprob_that_is_not_finite_and_at_most_zero_makes_the_reply_unusable(bad) -> None:
    reply = parse_reply(reply_body([5, 6, 7], logprobs=[-0.5, bad, -0.25]), VOCAB)
    assert (reply.problem, reply.ids, reply.logprobs) == ("logprobs_invalid", [], [])


def test_zero_and_integer_logprobs_are_usable_and_non_numbers_are_not_entries() -> None:
    assert parse_reply(reply_body([5, 6], logprobs=[0.0, -3]), VOCAB).logprobs == [0.0, -3]
    for bad in (None, "x", True, [1]):
        assert parse_reply(reply_body([5, 6], logprobs=[-0.5, bad]), VOCAB).problem == "logprobs_mismatch"


def test_non_finite_literals_and_huge_integers_parse_to_an_unusable_reply() -> None:
    ids = [5, 6]
    text = json.dumps(reply_body(ids)).replace("-0.015625", "-Infinity", 1)  # the first fake logprob
    assert "-Infinity" in text
    assert parse_reply(wire.loads(text.encode()), VOCAB).problem == "logprobs_invalid"
    huge = json.dumps(reply_body(ids)).replace('[-0.015625, 5, null]', f'[-0.015625, {2**80}, null]')
    assert str(2**80) in huge  # past orjson's 64 bits: the standard library reads it, the check refuses it
    assert parse_reply(wire.loads(huge.encode()), VOCAB).problem == "ids_out_of_vocab"


# -- never raises ------------------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
KEYS = st.sampled_from(["output_token_logprobs", "finish_reason", "weight_version", "top_p_token_ids",
                        "top_p_token_offsets", "top_p_kept_token_ids"])


@settings(max_examples=300, deadline=None)
@given(value=JSON, key=KEYS, top=st.sampled_from(["output_ids", "meta_info", "text"]))
def test_parse_reply_never_raises(value, key, top) -> None:
    """Any JSON value anywhere a reply has a key: a Reply comes back, usable only if it passes every check."""
    for body in (value, {"meta_info": value}, {**reply_body([5, 6]), top: value}):
        reply = parse_reply(body, VOCAB)
        assert reply.problem is None or reply.problem in wire.PROBLEMS
        assert reply.problem is not None or (len(reply.ids) == len(reply.logprobs) and all(0 <= i < VOCAB for i in reply.ids))
    body = reply_body([5, 6])
    body["meta_info"][key] = value
    reply = parse_reply(body, VOCAB)
    assert reply.problem is None or reply.problem in wire.PROBLEMS
    if reply.problem is None:
        assert all(math.isfinite(lp) and lp <= 0 for lp in reply.logprobs)


def test_every_problem_name_has_a_status() -> None:
    assert all(REASON_STATUS[p] == "ABORTED" for p in wire.PROBLEMS)


# -- through the adapter: planted values never reach a returned sample -------------------------
def generate(script: list, **args_kw) -> Sample:
    server = ScriptedServer(script)
    sample = Sample(prompt="What is 1?", label="1")
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        # One attempt is judged: the caller re-queues (else a failed attempt is run again).
        args = {"engine_abort_status": "aborted", **args_kw}
        run(slime.generate(make_args(**args), sample, dict(SAMPLING)))
    return sample


PLANTED_ID = 987654  # far past the vocabulary
PLANTED_LOGPROB = -123.0625  # exact in binary; only -inf is planted with it below


@pytest.mark.parametrize("plant", ["id_past_vocab", "negative_id", "id_past_int32", "minus_infinity"])
def test_planted_ids_and_logprobs_never_appear_in_a_returned_sample(fake_interpreter, plant: str) -> None:
    ids = encode("Answer: \\boxed{1}") + [IM_END]
    logprobs = [-0.5] * len(ids)
    planted_id = {"id_past_vocab": PLANTED_ID, "negative_id": -PLANTED_ID, "id_past_int32": 2**33}.get(plant)
    if planted_id is None:
        logprobs[2] = float("-inf")
        logprobs[3] = PLANTED_LOGPROB
    body = reply_body(ids, logprobs=logprobs)
    if planted_id is not None:  # planted after the helper decoded the text (the tokenizer refuses such ids)
        body["output_ids"][2] = body["meta_info"]["output_token_logprobs"][2][1] = planted_id
    text = json.dumps(body)  # the standard library writes -Infinity, as a careless proxy would
    spoiled = httpx.Response(200, content=text.encode(), headers={"Content-Type": "application/json"})
    s = generate([turn(CODE_TURN), spoiled])
    fsm = s.metadata["fsm"]
    assert s.status == Sample.Status.ABORTED
    assert fsm["termination_reason"] == ("logprobs_invalid" if planted_id is None else "ids_out_of_vocab")
    assert planted_id not in s.tokens and PLANTED_LOGPROB not in s.rollout_log_probs
    assert all(math.isfinite(lp) and lp <= 0 for lp in s.rollout_log_probs)
    assert all(0 <= t < VOCAB for t in s.tokens)
    assert fsm["turns"][-1]["tokens"] == 0 and fsm["turns"][0]["tokens"] > 0  # the first turn is kept
    assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length > 0


# -- request bodies ---------------------------------------------------------------------------
class Traj:
    """The two arrays a trajectory gives the client."""

    def __init__(self, prompt, response=()) -> None:
        self.prompt_ids = array("i", prompt)
        self.response_ids = array("i", response)


def payload_of(body: bytes) -> dict:
    return json.loads(body)


def test_each_turns_body_equals_one_built_from_scratch_with_the_prompt_encoded_once() -> None:
    t, body = Traj(range(100, 140)), RequestBody()
    params = {"temperature": 1.0, "stop": ["</code>"], "max_new_tokens": 99}
    # 5,300 ids cross the size where the response goes through a numpy view.
    for turn_no, new in enumerate([[], [1, 2, 3], [], [151645], list(range(5000, 5300)), [7] * 5000]):
        t.response_ids.extend(new)
        sent = body.render(t.prompt_ids, t.response_ids, params, 50 - turn_no, routed_experts_start=turn_no)
        expected = generate_payload(t.prompt_ids.tolist() + t.response_ids.tolist(), params, 50 - turn_no, turn_no)
        assert payload_of(sent) == expected
    assert body.prompt_encodings == 1


def test_a_reply_without_tokens_keeps_its_verdict() -> None:
    import attrs

    full = wire.Reply(ids=[1, 2], logprobs=[-0.5, -0.25], finish="stop", finish_detail="</code>", problem="p",
                      problem_detail="d", weight_version="w", top_p=([1], [0, 1, 1]), routed_experts=b"\0" * 8,
                      routed_experts_start_len=3, stats={"cached_tokens": 4})
    assert full.without_tokens() == attrs.evolve(full, ids=[], logprobs=[], top_p=None, routed_experts=None)


def test_a_body_follows_a_trimmed_response_and_a_new_prompt() -> None:
    t, body = Traj([1, 2, 3], [4, 5]), RequestBody()
    body.render(t.prompt_ids, t.response_ids, {}, None)
    del t.response_ids[1:]  # shrunk in place (a trim), then grown past the old length with other ids
    t.response_ids.extend([9, 9])
    assert payload_of(body.render(t.prompt_ids, t.response_ids, {}, None))["input_ids"] == [1, 2, 3, 4, 9, 9]
    assert body.prompt_encodings == 1
    t.prompt_ids = array("i", [7])  # a reset puts new arrays in place
    t.response_ids = array("i")
    assert payload_of(body.render(t.prompt_ids, t.response_ids, {}, 3))["input_ids"] == [7]
    assert body.prompt_encodings == 2
    assert payload_of(RequestBody().render([], [], {}, None))["input_ids"] == []
    assert payload_of(RequestBody().render([], array("i", range(600)), {}, None))["input_ids"] == list(range(600))


def test_a_body_keeps_no_response_bytes_between_turns() -> None:
    t, body = Traj(range(10)), RequestBody()
    t.response_ids.extend(range(100000, 132000))
    RequestBody().render(t.prompt_ids, t.response_ids, {}, 5)  # numpy imported outside the count
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(2):
            sent = body.render(t.prompt_ids, t.response_ids, {}, 5)
        size = len(sent)
        del sent
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert size > 32000 * 7
    assert held < 1000  # the prompt's ten ids, not the 32k of the response


def test_the_client_keeps_each_samples_own_prompt_encoded() -> None:
    from engine.settings import RetryPolicy
    from engine.sglang.client import SGLangClient

    client = SGLangClient(URL, http=None, retry=RetryPolicy())  # type: ignore[arg-type]
    a, b = Traj([1, 2]), Traj([3])
    for step in range(3):
        a.response_ids.append(10 + step)
        assert payload_of(client.body(a, {}, 5))["input_ids"] == [1, 2] + list(range(10, 11 + step))
        assert payload_of(client.body(b, {}, 5))["input_ids"] == [3]
    assert payload_of(client.body([4, 5], {}, None))["input_ids"] == [4, 5]  # a plain list still works
    assert [body.prompt_encodings for body in client._bodies.values()] == [1, 1]


# -- headers and model info -------------------------------------------------------------------
def test_retry_after_reads_seconds_and_http_dates() -> None:
    now = 1_700_000_000.0
    assert retry_after_seconds("3", now) == 3.0 and retry_after_seconds(" 1.5 ", now) == 1.5
    assert retry_after_seconds(email.utils.formatdate(now + 7, usegmt=True), now) == pytest.approx(7, abs=1)
    assert retry_after_seconds(email.utils.formatdate(now - 60, usegmt=True), now) == 0.0  # in the past: now
    assert retry_after_seconds("-4", now) == 0.0
    for junk in (None, "", "soon", "nan", "inf", "Mon, 99 Foo 2020"):
        assert retry_after_seconds(junk, now) is None


def test_the_vocabulary_bound_takes_the_smaller_size() -> None:
    assert find_vocab_size({"model_path": "m"}) is None
    assert find_vocab_size({"vocab_size": 151936}) == 151936
    assert find_vocab_size({"hf_config": {"vocab_size": 32000}}) == 32000
    assert find_vocab_size({"vocab_size": "big"}) is None and find_vocab_size([1]) is None
    assert settle_vocabulary(VOCAB, None) == VOCAB and settle_vocabulary(None, 1000) == 1000
    assert settle_vocabulary(VOCAB, 151936) == VOCAB  # padded embedding: the tokenizer's bound stands
    assert settle_vocabulary(VOCAB, 32000) == 32000
