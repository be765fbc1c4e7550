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
    input_ids: list[int], sampling_params: dict[str, Any], max_new_tokens: int | None, rid: str | None = None
) -> dict[str, Any]:
    """The token-in/token-out request body, the same shape slime sends."""
    params = dict(sampling_params)
    if max_new_tokens is not None:
        params["max_new_tokens"] = int(max_new_tokens)
    payload: dict[str, Any] = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True}
    if rid is not None:
        payload["rid"] = rid
    return payload


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
    return Reply(ids, logprobs, finish, detail, None, "", version, top_p)
