"""SGLang's `/generate` wire format: building requests, reading replies and error bodies.

Pure functions on JSON values, no I/O, so every server quirk is testable on its own.
Keys are read with `.get()`: versions and routers differ in what they send.
"""

from __future__ import annotations

import base64
import json
import re
from array import array
from typing import Any, Literal

import attrs

FinishType = Literal["stop", "length", "abort"]

# Problems that make a 200 reply unusable for training. Each is also the termination reason of
# an attempt that ends on it (the machine's `reply_unusable` edge), so there is one name per fact.
LOGPROBS_MISSING = "logprobs_missing"
LOGPROBS_MISMATCH = "logprobs_mismatch"
MALFORMED = "reply_malformed"
TOP_P_MISSING = "top_p_replay_missing"  # top-p replay was asked for (custom_params) and not sent
ROUTED_EXPERTS_MISMATCH = "routed_experts_mismatch"  # R3 rows missing, undecodable or not one per token

# meta_info counters slime accumulates per call into its SpecInfo / PrefixCacheInfo.
STAT_KEYS = ("cached_tokens", "prompt_tokens", "completion_tokens",
             "spec_accept_token_num", "spec_draft_token_num", "spec_verify_ct")


@attrs.frozen
class Reply:
    """A parsed 200 reply. `problem` is set when the reply cannot be trained on."""

    ids: list[int]
    logprobs: list[float]
    finish: FinishType | None
    finish_detail: Any = None  # the matched stop, the length, or the abort message
    problem: str | None = None
    problem_detail: str = ""
    weight_version: str | None = None
    top_p: tuple[list[int], list[int]] | None = None
    routed_experts: bytes | None = None  # int32 rows, raw; checked against the tokens by the caller
    routed_experts_start_len: int | None = None  # the server's echo of the request's start row
    stats: dict[str, int] = attrs.field(factory=dict)  # STAT_KEYS present in meta_info


FailureKind = Literal["context_exceeded", "rejected", "unavailable"]


@attrs.frozen
class Failure:
    """A request that produced no usable reply.

    `context_exceeded`: the server said the input does not fit (400) -> TRUNCATED;
    `rejected`: another non-retryable 4xx -> FAILED;
    `unavailable`: transient errors until retries ran out -> ABORTED.
    """

    kind: FailureKind
    message: str
    status: int | None = None
    attempts: int = 1


_CONTEXT_PATTERNS = re.compile(
    r"context length|maximum context length|maximum allowed length|longer than the model|KV memory budget",
    re.IGNORECASE,
)


def generate_payload(
    input_ids: list[int],
    sampling_params: dict[str, Any],
    max_new_tokens: int | None,
    rid: str | None = None,
    routed_experts_start: int | None = None,
) -> dict[str, Any]:
    """The token-in/token-out request body, the same shape slime sends.

    `routed_experts_start` (routing replay) asks for the routed experts of rows from that one on.
    """
    params = dict(sampling_params)
    if max_new_tokens is not None:
        params["max_new_tokens"] = int(max_new_tokens)
    payload: dict[str, Any] = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True}
    if rid is not None:
        payload["rid"] = rid
    if routed_experts_start is not None:
        payload["return_routed_experts"] = True
        payload["routed_experts_start_len"] = int(routed_experts_start)
    return payload


def top_p_asked(sampling_params: dict[str, Any]) -> bool:
    """Whether the request asks for top-p replay (slime's `custom_params.return_top_p_token_ids`)."""
    custom = sampling_params.get("custom_params")
    return isinstance(custom, dict) and bool(custom.get("return_top_p_token_ids"))


def require_top_p(reply: Reply) -> Reply:
    """The reply, unusable if it has tokens but lacks the top-p replay that was asked for."""
    if reply.problem is None and reply.ids and reply.top_p is None:
        return attrs.evolve(reply, problem=TOP_P_MISSING, problem_detail="top-p replay was asked for and not sent")
    return reply


def require_routed_experts(reply: Reply, *, sequence_length: int, start: int, row_bytes: int) -> Reply:
    """The reply, unusable unless it carries one routed-expert row per token from `start` on.

    `sequence_length` is the request's input plus the reply's ids; rows cover every token but
    the last (`[start, sequence_length - 1)`), as SGLang's `routed_experts_start_len` defines.
    """
    if reply.problem is not None or (reply.routed_experts is None and not reply.ids):
        return reply  # no token to append, so no row is needed (an abort in the waiting queue)
    expected = max(0, sequence_length - 1 - start)
    echoed = reply.routed_experts_start_len
    data = reply.routed_experts
    if data is None:
        detail = "routed experts were asked for and not sent"
    elif echoed not in (None, start):
        detail = f"routed_experts_start_len {echoed} is not the {start} asked for"
    elif len(data) != expected * row_bytes:
        detail = f"{len(data)} bytes of routed experts, expected {expected} rows of {row_bytes}"
    else:
        return reply
    return attrs.evolve(reply, problem=ROUTED_EXPERTS_MISMATCH, problem_detail=detail)


def _int32_bytes(value: Any) -> bytes | None:
    """Raw int32 bytes of base64 text or a list of ints; None for anything else. Never raises."""
    try:
        if isinstance(value, str):
            data = base64.b64decode(value, validate=True)
            return data if len(data) % 4 == 0 else None
        if isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            return array("i", value).tobytes()
    except (ValueError, OverflowError):
        pass
    return None


def _stats(meta: dict[str, Any]) -> dict[str, int]:
    return {k: v for k in STAT_KEYS if isinstance(v := meta.get(k), int) and not isinstance(v, bool)}


def error_message(body: bytes | str) -> str:
    """The human message of an error body, in any of SGLang's and the router's shapes."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, str):
            return err
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if data.get("message"):
            return str(data["message"])
    return text.strip()[:500]


def is_context_error(status: int, message: str) -> bool:
    """True when a 4xx says the request does not fit the model's context."""
    return status == 400 and bool(_CONTEXT_PATTERNS.search(message))


def _decode_int32(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return array("i", base64.b64decode(value)).tolist()
    return [int(x) for x in value]


def parse_reply(data: Any) -> Reply:
    """Read a 200 `/generate` body. Never raises: anything unusable becomes `problem`."""
    if isinstance(data, list) and len(data) == 1:
        data = data[0]  # a batch of one
    meta = data.get("meta_info") if isinstance(data, dict) else None
    if not isinstance(meta, dict):
        return Reply([], [], None, problem=MALFORMED, problem_detail="reply has no meta_info")
    finish_reason = meta.get("finish_reason")
    finish = finish_reason.get("type") if isinstance(finish_reason, dict) else None
    if finish not in ("stop", "length", "abort"):
        return Reply([], [], None, problem=MALFORMED, problem_detail=f"unknown finish_reason {finish_reason!r}")
    detail = finish_reason.get("matched", finish_reason.get("length", finish_reason.get("message")))
    version = meta.get("weight_version")
    entries = meta.get("output_token_logprobs")
    if entries is None:
        return Reply([], [], finish, detail, LOGPROBS_MISSING, "meta_info has no output_token_logprobs", version)
    try:
        ids = [int(e[1]) for e in entries]
        logprobs = [float(e[0]) for e in entries]
    except (TypeError, ValueError, IndexError):
        return Reply([], [], finish, detail, LOGPROBS_MISMATCH, "output_token_logprobs entries are not [logprob, id, text]", version)
    if not all(lp <= 0.0 for lp in logprobs):  # NaN fails `<=` too
        # Not a log-probability: refused here as a bad reply, not later as a broken invariant (I4),
        # which would throw away the turns before it as well.
        return Reply([], [], finish, detail, LOGPROBS_MISMATCH, "output_token_logprobs holds a value > 0 or NaN", version)
    output_ids = data.get("output_ids")
    if output_ids is not None and list(output_ids) != ids:
        # max_new_tokens=0 gives one logprob for no id; speculative decoding once gave extra ones.
        return Reply([], [], finish, detail, LOGPROBS_MISMATCH, f"{len(ids)} logprobs for {len(output_ids)} output ids", version)
    top_p = None
    kept = _decode_int32(meta.get("top_p_token_ids", meta.get("top_p_kept_token_ids")))
    offsets = _decode_int32(meta.get("top_p_token_offsets", meta.get("top_p_kept_token_offsets")))
    if kept is not None or offsets is not None:
        if kept is None or offsets is None or len(offsets) != len(ids) + 1 or offsets[0] != 0 or offsets[-1] != len(kept):
            return Reply([], [], finish, detail, LOGPROBS_MISMATCH, "top-p replay does not match the ids", version)
        top_p = (kept, offsets)
    experts = None
    if meta.get("routed_experts") is not None:
        experts = _int32_bytes(meta["routed_experts"])
        if experts is None:
            return Reply([], [], finish, detail, ROUTED_EXPERTS_MISMATCH, "routed_experts is not base64 int32", version)
    start = meta.get("routed_experts_start_len")
    start = start if isinstance(start, int) and not isinstance(start, bool) else None
    return Reply(ids, logprobs, finish, detail, None, "", version, top_p, experts, start, _stats(meta))
