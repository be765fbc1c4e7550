"""Whatever the server does, generate() returns the sample with a status; nothing escapes."""

from __future__ import annotations

import httpx
import pytest
import respx

from engine import slime
from engine.sglang.wire import error_message, is_context_error, parse_reply
from tests.conftest import run
from tests.support.helpers import SAMPLING, URL, ScriptedServer, encode, make_args, reply_body, tok, turn
from engine.local.sample import Sample

CODE_TURN = "<code>\nprint(1)\n</code>"
ANSWER = "Answer: \\boxed{1}"


def generate(script: list, *, repeat_last: bool = False, **args_kw) -> tuple[Sample, ScriptedServer]:
    server = ScriptedServer(script, repeat_last=repeat_last)
    sample = Sample(prompt="What is 1?", label="1")
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        # ABORTED handed back as to a caller that re-queues: these tests judge one attempt
        # (the engine's own re-runs of a failed attempt are tests/slime/test_statuses.py's).
        run(slime.generate(make_args(**{"engine_abort_status": "aborted", **args_kw}), sample, dict(SAMPLING)))
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    assert sample.response == tok().decode(sample.tokens[len(sample.tokens) - sample.response_length :])
    return sample, server


def test_500_forever_ends_aborted_after_bounded_retries():
    s, server = generate([httpx.Response(500, text="Internal Server Error")], repeat_last=True)
    assert s.status == Sample.Status.ABORTED
    assert s.metadata["fsm"]["termination_reason"] == "request_failed"
    assert len(server.requests) == 3  # engine_retry_attempts
    assert "HTTP 500" in s.metadata["fsm"]["engine_error"]


def test_connection_refused_ends_aborted():
    s, server = generate([httpx.ConnectError("Connection refused")], repeat_last=True)
    assert s.status == Sample.Status.ABORTED
    assert "ConnectError" in s.metadata["fsm"]["engine_error"]


def test_transient_errors_are_retried_then_succeed(fake_interpreter):
    script = [httpx.Response(503, json={"object": "error", "message": "The request queue is full.", "code": 503}),
              httpx.ReadTimeout("stalled"), httpx.Response(200, content=b"{not json"), turn(ANSWER)]
    s, server = generate(script, engine_retry_attempts=5)
    assert s.status == Sample.Status.COMPLETED
    assert len(server.requests) == 4
    assert all(r == server.requests[0] for r in server.requests)  # the same request each time


@pytest.mark.parametrize("body", [b"<html>oops</html>", b'{"text": "hi"', b""])
def test_malformed_body_is_retried_then_aborted(body):
    s, _ = generate([httpx.Response(200, content=body)], repeat_last=True)
    assert s.status == Sample.Status.ABORTED
    assert "not JSON" in s.metadata["fsm"]["engine_error"]


def test_body_without_meta_info_aborts():
    s, _ = generate([httpx.Response(200, json={"text": "hello", "output_ids": [1, 2]})])
    assert s.status == Sample.Status.ABORTED
    assert s.metadata["fsm"]["termination_reason"] == "reply_malformed"


def test_logprobs_of_another_length_than_the_ids_abort(fake_interpreter):
    ids = encode("Answer: \\boxed{1}")
    body = reply_body(ids)
    body["output_ids"] = ids + [151645]  # one more id than logprob entries
    s, _ = generate([turn(CODE_TURN), httpx.Response(200, json=body)])
    assert s.status == Sample.Status.ABORTED
    assert s.metadata["fsm"]["termination_reason"] == "logprobs_mismatch"
    assert s.metadata["fsm"]["turns"][-1]["tokens"] == 0


def test_server_abort_keeps_the_partial_turn_aligned():
    s, _ = generate([turn("partial out", finish="abort")])
    assert s.status == Sample.Status.ABORTED
    assert s.metadata["fsm"]["termination_reason"] == "server_aborted"
    assert s.response == "partial out"


CONTEXT_MSG = "Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of 5000 tokens"


@pytest.mark.parametrize(
    "response, status, reason",
    [
        (httpx.Response(400, json={"error": {"message": CONTEXT_MSG}}), "TRUNCATED", "context_rejected"),
        (httpx.Response(400, json={"error": {"message": "The input (5000 tokens) is longer than the model's context length (4096 tokens)."}}), "TRUNCATED", "context_rejected"),
        (httpx.Response(400, json={"error": "unknown field `foo`, expected one of `max_new_tokens`"}), "FAILED", "request_rejected"),
        (httpx.Response(400, json={"object": "error", "message": "body invalid", "type": "Bad Request", "param": None, "code": 400}), "FAILED", "request_rejected"),
        (httpx.Response(400, json={"error": {"message": "top_p must be in (0, 1], got 0.0."}}), "FAILED", "request_rejected"),
        (httpx.Response(404, text="Not Found"), "FAILED", "request_rejected"),
    ],
)
def test_each_400_shape_ends_with_a_status_and_no_retry(response, status, reason):
    s, server = generate([response])
    assert len(server.requests) == 1
    assert s.status == Sample.Status[status]
    assert s.metadata["fsm"]["termination_reason"] == reason


def test_error_message_reads_every_shape():
    assert error_message(b'{"error": "plain"}') == "plain"
    assert error_message(b'{"error": {"message": "nested"}}') == "nested"
    assert error_message(b'{"object": "error", "message": "openai", "code": 503}') == "openai"
    assert error_message(b'{"error": {"type": "Service Unavailable", "code": "no_available_workers", "message": "router", "param": null}}') == "router"
    assert error_message(b"Internal Server Error") == "Internal Server Error"
    assert is_context_error(400, CONTEXT_MSG)
    assert not is_context_error(503, CONTEXT_MSG)


def test_parse_reply_variants():
    ok = parse_reply(reply_body([5, 6], finish="length"))
    assert (ok.ids, ok.finish, ok.finish_detail, ok.problem) == ([5, 6], "length", 2, None)
    queued_abort = {"text": "", "output_ids": [], "meta_info": {"id": "x", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}, "output_token_logprobs": [], "weight_version": "default"}}
    assert parse_reply(queued_abort).finish == "abort"
    zero = reply_body([], finish="length")
    zero["meta_info"]["output_token_logprobs"] = [[-0.1, 7, None]]  # max_new_tokens=0 quirk
    assert parse_reply(zero).problem == "logprobs_mismatch"
    assert parse_reply([reply_body([1])]).ids == [1]  # batch of one
    assert parse_reply({"meta_info": {"finish_reason": {"type": "weird"}}}).problem == "reply_malformed"
    bad_entries = reply_body([1])
    bad_entries["meta_info"]["output_token_logprobs"] = [[None, 1, None]]
    assert parse_reply(bad_entries).problem == "logprobs_mismatch"
