"""SGLang's `/generate` wire format: building requests, reading replies and error bodies.

Pure functions on JSON values and bytes, no I/O, so every server quirk is testable on its
own. Keys are read with `.get()`: versions and routers differ in what they send.

Nothing a server sends is trusted: a reply is usable only if every id is an integer inside
the vocabulary and every logprob a finite number <= 0 (an id past the embedding kills the
trainer with a CUDA assert; an infinite logprob makes an infinite importance ratio).
`parse_reply` never raises, whatever it is given.

Request bodies are JSON bytes built by `RequestBody`, which encodes a sample's prompt ids once
and its response ids each turn. JSON goes through orjson when it is installed (8-14x
faster than the standard library on 1k-32k-id bodies), with the standard library as the
fallback for what orjson refuses (`NaN`, `-Infinity`, integers past 64 bits).
"""

from __future__ import annotations

import base64
import binascii
import email.utils
import itertools
import json
import math
import re
from array import array
from collections.abc import Sequence
from typing import Any, Literal

import attrs

try:  # an optional speed-up; the standard library gives the same bytes and values
    import orjson as _orjson
except ImportError:  # pragma: no cover - exercised where orjson is absent
    _orjson = None

FinishType = Literal["stop", "length", "abort"]

# Problems that make a 200 reply unusable for training. Each is also the termination reason of
# an attempt that ends on it (the machine's `reply_unusable` edge), so there is one name per fact.
LOGPROBS_MISSING = "logprobs_missing"
LOGPROBS_MISMATCH = "logprobs_mismatch"
LOGPROBS_INVALID = "logprobs_invalid"  # a logprob that is not a finite number <= 0
IDS_OUT_OF_VOCAB = "ids_out_of_vocab"  # an id that is not an integer in [0, vocabulary size)
MALFORMED = "reply_malformed"
TOP_P_MISSING = "top_p_replay_missing"  # top-p replay was asked for (custom_params) and not sent
ROUTED_EXPERTS_MISMATCH = "routed_experts_mismatch"  # R3 rows missing, undecodable or not one per token
PROBLEMS = (LOGPROBS_MISSING, LOGPROBS_MISMATCH, LOGPROBS_INVALID, IDS_OUT_OF_VOCAB, MALFORMED, TOP_P_MISSING,
            ROUTED_EXPERTS_MISMATCH)

# meta_info counters slime accumulates per call into its SpecInfo / PrefixCacheInfo.
STAT_KEYS = ("cached_tokens", "prompt_tokens", "completion_tokens",
             "spec_accept_token_num", "spec_draft_token_num", "spec_verify_ct")

INT32_LIMIT = 2**31  # the trainer's id tensors and the trajectory's arrays are int32


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

    def without_tokens(self) -> Reply:
        """The same verdict (finish, problem, stats) without the ids, logprobs and replay data
        (a hand-written `attrs.evolve`: this runs once a turn)."""
        return Reply(
            ids=[], logprobs=[], finish=self.finish, finish_detail=self.finish_detail, problem=self.problem,
            problem_detail=self.problem_detail, weight_version=self.weight_version,
            routed_experts_start_len=self.routed_experts_start_len, stats=self.stats,
        )


FailureKind = Literal["context_exceeded", "rejected", "unavailable"]


@attrs.frozen
class Failure:
    """A request that produced no usable reply.

    `context_exceeded`: the server said the input does not fit (400) -> TRUNCATED;
    `rejected`: another non-retryable 4xx, or a redirect (3xx) -> FAILED;
    `unavailable`: transient errors until retries ran out -> ABORTED.
    `status` is the HTTP status of the last response, None when none came (connect error, timeout).
    """

    kind: FailureKind
    message: str
    status: int | None = None


_CONTEXT_PATTERNS = re.compile(
    r"context length|maximum context length|maximum allowed length|longer than the model|KV memory budget",
    re.IGNORECASE,
)


# -- JSON -------------------------------------------------------------------------------
def loads(body: bytes | str) -> Any:
    """Parse JSON; orjson first, the standard library for what orjson refuses. Raises ValueError,
    also for a body nested deeper than the parser's stack (the standard library's RecursionError)."""
    if _orjson is not None:
        try:
            return _orjson.loads(body)
        except ValueError:  # NaN/Infinity literals, 65-bit integers: legal to json, checked later
            pass
    try:
        return json.loads(body)
    except RecursionError:  # orjson refuses past 1024 levels too: a body no SGLang sends
        raise ValueError("JSON nested too deep to read") from None


def dumps(value: Any) -> bytes:
    """Compact JSON bytes, orjson when installed (byte-identical to the standard library's compact form)."""
    if _orjson is not None:
        try:
            return _orjson.dumps(value)
        except TypeError:  # a key or value orjson does not take (non-str keys, huge ints)
            pass
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _ids_json(ids: Sequence[int]) -> bytes:
    """`1,2,3` (no brackets): ids as they go inside the body's `input_ids` list."""
    global _numpy_view
    if not len(ids):
        return b""
    if isinstance(ids, array):
        view = _numpy_int32() if len(ids) >= _NUMPY_FROM and ids.typecode == "i" and ids.itemsize == 4 else None
        if view is not None:  # orjson reads the numpy view in place, far quicker for long arrays than via a list
            try:
                return _orjson.dumps(view(ids), option=_orjson.OPT_SERIALIZE_NUMPY)[1:-1]  # type: ignore[union-attr]
            except TypeError:  # a numpy this orjson cannot read: the list gives the same bytes, from now on
                _numpy_view = None
        return dumps(ids.tolist())[1:-1]
    return dumps(ids if isinstance(ids, list) else list(ids))[1:-1]


_NUMPY_FROM = 512  # ids; below this a list is as quick as the view's set-up
_numpy_view: Any = False  # not looked for yet; None when numpy or orjson is absent


def prepare_encoder() -> None:
    """Import what body encoding uses (numpy) now, at start-up, not inside the first long turn's
    request (the import would stall every sample in flight)."""
    _numpy_int32()


def _numpy_int32() -> Any:
    """A function viewing an int32 `array` as a numpy array, or None; numpy is imported on first use."""
    global _numpy_view
    if _numpy_view is False:
        try:
            import numpy
        except ImportError:  # pragma: no cover - numpy comes with torch and slime
            numpy = None
        _numpy_view = None if numpy is None or _orjson is None else (lambda ids: numpy.frombuffer(ids, numpy.int32))
    return _numpy_view


# -- requests -----------------------------------------------------------------------------
def generate_payload(
    input_ids: list[int], sampling_params: dict[str, Any], max_new_tokens: int | None,
    routed_experts_start: int | None = None,
) -> dict[str, Any]:
    """The token-in/token-out request body, the same shape slime sends.

    `routed_experts_start` (routing replay) asks for the routed experts of rows from that one on.
    """
    params = dict(sampling_params)
    if max_new_tokens is not None:
        params["max_new_tokens"] = int(max_new_tokens)
    payload: dict[str, Any] = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True}
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


_HEAD = b'{"input_ids":['


def _tail(sampling_params: dict[str, Any], max_new_tokens: int | None, routed_experts_start: int | None) -> bytes:
    """`],"sampling_params":{...},"return_logprob":true[,...]}`: what follows the ids."""
    rest = generate_payload([], sampling_params, max_new_tokens, routed_experts_start)
    del rest["input_ids"]
    return b"]," + dumps(rest)[1:]


class RequestBody:
    """One sample's `/generate` bodies as bytes: its prompt's ids encoded once, the response's per turn.

    Only the prompt's part is kept between turns (its identity says when a reset or a restored
    checkpoint put another prompt in place). The response's ids are encoded afresh each turn
    from the trajectory's array, and the body is not kept: a long sample would otherwise hold
    its JSON digits, most of the size of its arrays again, for the whole of its life. What the
    encoding costs per turn, and what not keeping the body saves, is bench figure 5's.
    """

    __slots__ = ("_head", "_prompt", "_prompt_length", "prompt_encodings")

    def __init__(self) -> None:
        self._head = _HEAD  # `{"input_ids":[` and the prompt's ids
        self._prompt: Sequence[int] | None = None
        self._prompt_length = 0
        self.prompt_encodings = 0  # prompts encoded (tests and benchmarks read it)

    def render(
        self,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        sampling_params: dict[str, Any],
        max_new_tokens: int | None,
        routed_experts_start: int | None = None,
    ) -> bytes:
        """The body for prompt + response ids; equal (as JSON) to `generate_payload` of the same."""
        if prompt_ids is not self._prompt or len(prompt_ids) != self._prompt_length:
            self.prompt_encodings += 1
            self._head = _HEAD + _ids_json(prompt_ids)
            self._prompt, self._prompt_length = prompt_ids, len(prompt_ids)
        response = _ids_json(response_ids)
        seam = b"," if response and self._prompt_length else b""
        return b"".join((self._head, seam, response, _tail(sampling_params, max_new_tokens, routed_experts_start)))


# -- error bodies and headers ---------------------------------------------------------------
def error_message(body: bytes | str) -> str:
    """The human message of an error body, in any of SGLang's and the router's shapes."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = loads(text)
    except ValueError:
        return text.strip()[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, str):
            return err[:500]
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
        if data.get("message"):
            return str(data["message"])[:500]
    return text.strip()[:500]


def is_context_error(status: int, message: str) -> bool:
    """True when a 4xx says the request does not fit the model's context."""
    return status == 400 and bool(_CONTEXT_PATTERNS.search(message))


def retry_after_seconds(value: str | None, now: float) -> float | None:
    """Seconds to wait from a `Retry-After` header (delay-seconds or an HTTP date), given the
    Unix time `now`; None when absent or unreadable. Never negative."""
    if not value:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when is None:
            return None
        try:
            seconds = when.timestamp() - now  # a date without a zone is taken as UTC by RFC 9110
        except (OverflowError, OSError, ValueError):
            return None
    return max(0.0, seconds) if math.isfinite(seconds) else None


# -- replies ------------------------------------------------------------------------------
class _Unusable(Exception):
    """Raised inside parsing to leave with a problem name and a detail."""

    def __init__(self, problem: str, detail: str) -> None:
        super().__init__(detail)
        self.problem, self.detail = problem, detail


def _int32s(value: Any, what: str) -> list[int] | None:
    """A list of int32 from a JSON list or base64 of little-endian int32; None when absent."""
    if value is None:
        return None
    try:
        if isinstance(value, str):
            raw = base64.b64decode(value, validate=True)
            return array("i", raw).tolist()
        if not isinstance(value, list):
            raise TypeError(type(value).__name__)
        array("i", value)  # TypeError for non-ints, OverflowError past int32
        return value  # as sent: `check_ids` still sees a bool for what it is
    except (binascii.Error, TypeError, ValueError, OverflowError) as exc:
        raise _Unusable(MALFORMED, f"{what} is not a list of int32 ({type(exc).__name__})") from None


def check_ids(ids: list[Any], vocab_size: int | None, what: str = "output ids") -> None:
    """Raise `_Unusable(IDS_OUT_OF_VOCAB)` unless every id is an int in [0, vocab_size)."""
    if not ids:
        return
    if set(map(type, ids)) != {int}:  # bool, float, str, None...: not an id (bool is an int subclass)
        raise _Unusable(IDS_OUT_OF_VOCAB, f"{what} hold a value that is not an integer")
    lowest, highest = min(ids), max(ids)
    bound = vocab_size if vocab_size is not None else INT32_LIMIT
    if lowest < 0 or highest >= bound:
        bad = lowest if lowest < 0 else highest
        raise _Unusable(IDS_OUT_OF_VOCAB, f"{what} hold {bad}, outside the vocabulary [0, {bound})")


def check_logprobs(logprobs: list[Any]) -> None:
    """Raise `_Unusable` unless every value is a number (else LOGPROBS_MISMATCH: not an entry)
    that is finite and <= 0 (else LOGPROBS_INVALID)."""
    if not logprobs:
        return
    if not set(map(type, logprobs)) <= {float, int}:  # null, str, bool, lists: not [logprob, id, text]
        raise _Unusable(LOGPROBS_MISMATCH, "output_token_logprobs entries are not [logprob, id, text]")
    # A sum is finite only if every term is (NaN and +-inf propagate; finite values so large that
    # they overflow are absurd too); max catches the positives.
    if not math.isfinite(sum(logprobs)) or max(logprobs) > 0:
        raise _Unusable(LOGPROBS_INVALID, "output_token_logprobs hold a value > 0, NaN or infinite")


def parse_reply(data: Any, vocab_size: int | None = None) -> Reply:
    """Read a 200 `/generate` body. Never raises: anything unusable becomes `problem`.

    `vocab_size` bounds the ids (output and top-p replay); None bounds them by int32 only.
    """
    try:
        return _parse(data, vocab_size)
    except _Unusable as exc:
        return Reply([], [], None, problem=exc.problem, problem_detail=exc.detail)
    except Exception as exc:  # whatever shape slipped past the checks: unusable, never a crash
        return Reply([], [], None, problem=MALFORMED, problem_detail=f"unreadable reply ({type(exc).__name__}: {exc})"[:300])


def _parse(data: Any, vocab_size: int | None) -> Reply:
    if isinstance(data, list) and len(data) == 1:
        data = data[0]  # a batch of one
    meta = data.get("meta_info") if isinstance(data, dict) else None
    if not isinstance(meta, dict):
        return Reply([], [], None, problem=MALFORMED, problem_detail="reply has no meta_info")
    finish_reason = meta.get("finish_reason")
    finish = finish_reason.get("type") if isinstance(finish_reason, dict) else None
    if finish not in ("stop", "length", "abort"):
        return Reply([], [], None, problem=MALFORMED, problem_detail=f"unknown finish_reason {finish_reason!r}"[:300])
    detail = finish_reason.get("matched", finish_reason.get("length", finish_reason.get("message")))
    version = meta.get("weight_version")
    version = None if version is None else str(version)[:200]

    def unusable(problem: str, why: str) -> Reply:
        return Reply([], [], finish, detail, problem, why, version)

    entries = meta.get("output_token_logprobs")
    if entries is None:
        return unusable(LOGPROBS_MISSING, "meta_info has no output_token_logprobs")
    # Every entry a list of at least [logprob, id], checked at C speed (map over builtins).
    if not isinstance(entries, list) or (entries and (set(map(type, entries)) != {list} or min(map(len, entries)) < 2)):
        return unusable(LOGPROBS_MISMATCH, "output_token_logprobs entries are not [logprob, id, text]")
    ids = [e[1] for e in entries]
    logprobs = [e[0] for e in entries]
    try:
        check_ids(ids, vocab_size)
        # Not a log-probability: refused here as a bad reply, not later as a broken invariant (I4),
        # which would throw away the turns before it as well.
        check_logprobs(logprobs)
        output_ids = data.get("output_ids")
        if output_ids is not None and output_ids != ids:
            # max_new_tokens=0 gives one logprob for no id; speculative decoding once gave extra ones.
            count = len(output_ids) if isinstance(output_ids, list) else "non-list"
            return unusable(LOGPROBS_MISMATCH, f"{len(ids)} logprobs for {count} output ids")
        top_p = _top_p(meta, len(ids), vocab_size)
    except _Unusable as exc:
        return unusable(exc.problem, exc.detail)
    experts = None
    if meta.get("routed_experts") is not None:
        experts = _int32_bytes(meta["routed_experts"])
        if experts is None:
            return unusable(ROUTED_EXPERTS_MISMATCH, "routed_experts is not base64 int32")
    start = meta.get("routed_experts_start_len")
    start = start if isinstance(start, int) and not isinstance(start, bool) else None
    return Reply(ids, logprobs, finish, detail, None, "", version, top_p, experts, start, _stats(meta))


def _top_p(meta: dict[str, Any], count: int, vocab_size: int | None) -> tuple[list[int], list[int]] | None:
    """The turn's top-p replay (kept ids, offsets), checked against the ids and the vocabulary."""
    kept = _int32s(meta.get("top_p_token_ids", meta.get("top_p_kept_token_ids")), "top-p replay ids")
    offsets = _int32s(meta.get("top_p_token_offsets", meta.get("top_p_kept_token_offsets")), "top-p replay offsets")
    if kept is None and offsets is None:
        return None
    if kept is None or offsets is None or len(offsets) != count + 1 or offsets[0] != 0 or offsets[-1] != len(kept):
        raise _Unusable(LOGPROBS_MISMATCH, "top-p replay does not match the ids")
    if any(b < a for a, b in itertools.pairwise(offsets)):
        raise _Unusable(LOGPROBS_MISMATCH, "top-p replay offsets go backwards")
    check_ids(kept, vocab_size, "top-p replay ids")
    return kept, offsets
