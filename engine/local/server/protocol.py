"""SGLang's `/generate` wire format: request validation, error bodies, response objects.

Messages and shapes follow SGLang 0.5.x (the `/generate` format of SGLang's `GenerateReqInput` and its replies): validation
errors are 400 `{"error": {"message": ...}}`, an unknown sampling key is 400 `{"error": "..."}`
(the 0.5.23 schema gate), and a body that is not JSON is the FastAPI-style
`{"object": "error", ..., "type": "Bad Request", "code": 400}`.
"""

from __future__ import annotations

import base64
import math
import time
from array import array
import uuid
from typing import Any

import attrs

from engine.local.server.model import LMBackend, SamplerParams, synthetic_routed_experts

DEFAULT_MAX_NEW_TOKENS = 128
UNBOUNDED_NEW_TOKENS = 1 << 30  # what SGLang uses for `max_new_tokens: null` before clamping
SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)  # accepted keys; the ones this server does not implement are accepted and ignored


class RequestError(Exception):
    """A request SGLang would refuse: carries the HTTP status and the exact JSON body."""

    def __init__(self, body: dict[str, Any], status: int = 400) -> None:
        super().__init__(str(body))
        self.body = body
        self.status = status

    @classmethod
    def message(cls, text: str, status: int = 400) -> RequestError:
        """The common shape, `{"error": {"message": text}}`."""
        return cls({"error": {"message": text}}, status)

    @classmethod
    def schema(cls, text: str) -> RequestError:
        """The 0.5.23 schema-gate shape, `{"error": text}`."""
        return cls({"error": text})

    @classmethod
    def bad_request(cls, text: str) -> RequestError:
        """The FastAPI body-parse shape (malformed JSON)."""
        return cls({"object": "error", "message": text, "type": "Bad Request", "param": None, "code": 400})


@attrs.frozen
class GenerateSpec:
    """One validated generation request, with every limit already resolved."""

    rid: str
    input_ids: tuple[int, ...]
    sampler: SamplerParams
    max_new_tokens: int  # effective cap after SGLang's silent clamp to the context
    stop_ids: frozenset[int]  # EOS ids + stop_token_ids; empty with ignore_eos
    stop_strs: tuple[str, ...]
    seed: int | None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    return_top_p: bool = False  # slime's custom_params.return_top_p_token_ids
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0

    @property
    def stop_window(self) -> int:
        """Tokens to decode at the tail to see any stop string (a token holds >= 1 byte)."""
        return max((len(s.encode()) for s in self.stop_strs), default=0) + 2


def _serde_kind(value: Any) -> str:
    """How serde names a JSON value in 'invalid type' errors."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def _typed(params: dict[str, Any], key: str, kind: str, default: Any) -> Any:
    """params[key] checked against a JSON type ('i64', 'f64', 'bool'); null gives the default.

    An 'f64' may be a JSON integer; it is returned as sent so error messages quote it unchanged.
    """
    value = params.get(key)
    if value is None:
        return default
    ok = {
        "i64": isinstance(value, int) and not isinstance(value, bool),
        "f64": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
    }[kind]
    if not ok:
        raise RequestError.message(f"invalid type: {_serde_kind(value)}, expected {kind} (sampling_params.{key})")
    return value


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise RequestError.message(f"invalid type: {_serde_kind(value)}, expected a string or a list of strings (stop)")
    if len(items) > 32:
        raise RequestError.message(f"stop must have at most 32 entries, got {len(items)}.")
    return tuple(s for s in items if s)


def _sampler(params: dict[str, Any]) -> SamplerParams:
    # Messages quote the value as sent (SGLang does not coerce JSON ints to floats first).
    temperature = _typed(params, "temperature", "f64", 1.0)
    top_p = _typed(params, "top_p", "f64", 1.0)
    top_k = _typed(params, "top_k", "i64", -1)
    min_p = _typed(params, "min_p", "f64", 0.0)
    if not math.isfinite(temperature) or temperature < 0:
        raise RequestError.message(f"temperature must be non-negative, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise RequestError.message(f"top_p must be in (0, 1], got {top_p}.")
    if top_k != -1 and top_k < 1:
        raise RequestError.message(f"top_k must be -1 (disable), or at least 1, got {top_k}.")
    if not 0.0 <= min_p <= 1.0:
        raise RequestError.message(f"min_p must be in [0, 1], got {min_p}.")
    return SamplerParams(temperature=float(temperature), top_p=float(top_p), top_k=top_k)


def input_too_long_message(n_input: int, context_length: int) -> str:
    """SGLang's 400 message for an input that alone fills the context (TokenizerManager)."""
    return f"The input ({n_input} tokens) is longer than the model's context length ({context_length} tokens)."


def request_too_long_message(n_input: int, requested: int, context_length: int) -> str:
    """SGLang's 400 message for input + max_new_tokens over the context (TokenizerManager)."""
    return (
        f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
        f"You requested a total of {n_input + requested} tokens: {n_input} tokens from the input messages "
        f"and {requested} tokens for the completion. Please reduce the number of tokens in the input "
        "messages or the completion to fit within the limit.")


def _check_context(n_input: int, requested: int | None, context_length: int) -> int:
    """SGLang's two-stage context check; returns the effective (clamped) max_new_tokens."""
    if n_input >= context_length:
        raise RequestError.message(input_too_long_message(n_input, context_length))
    if requested is not None and n_input + requested > context_length:
        raise RequestError.message(request_too_long_message(n_input, requested, context_length))
    # The scheduler's own limits: max_req_len = context - 1, max_req_input_len = max_req_len - 5.
    max_req_len = context_length - 1
    if n_input >= max_req_len - 5:
        raise RequestError.message(
            f"Input length ({n_input} tokens) exceeds the maximum allowed length ({max_req_len - 5} tokens). "
            "Use a shorter input or enable --allow-auto-truncate.")
    return min(UNBOUNDED_NEW_TOKENS if requested is None else requested, max_req_len - n_input - 1)


def parse_one(*, rid: str, input_ids: Any, params: Any, flags: dict[str, Any], backend: LMBackend,
              context_length: int) -> GenerateSpec:
    """Validate one request (one batch item) into a GenerateSpec, or raise RequestError."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise RequestError.message(f"invalid type: {_serde_kind(params)}, expected a map (sampling_params)")
    unknown = [k for k in params if k not in SAMPLING_KEYS]
    if unknown:
        expected = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
        raise RequestError.schema(f"unknown field `{unknown[0]}`, expected one of {expected}")
    if not isinstance(input_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
        raise RequestError.message("input_ids must be a list of integers or a list of lists of integers.")
    if not input_ids:
        raise RequestError.message("input_ids cannot be empty.")
    bad = [t for t in input_ids if not 0 <= t < backend.vocab_size]
    if bad:
        raise RequestError.message(f"Token ID {bad[0]} is out of the vocabulary range [0, {backend.vocab_size}).")
    max_new = _typed(params, "max_new_tokens", "i64", DEFAULT_MAX_NEW_TOKENS)
    if "max_new_tokens" in params and params["max_new_tokens"] is None:
        max_new = None  # explicit null: no client limit, the server clamps to the context
    if max_new is not None and max_new < 0:
        raise RequestError.message(f"max_new_tokens must be at least 0, got {max_new}.")
    sampler = _sampler(params)
    stop_token_ids = params.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(isinstance(t, int) for t in stop_token_ids):
        kind = _serde_kind(stop_token_ids)
        raise RequestError.message(f"invalid type: {kind}, expected a list of i64 (stop_token_ids)")
    seed = _typed(params, "sampling_seed", "i64", None)
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise RequestError.message(f"sampling_seed must be a 64-bit integer, got {seed}.")
    ignore_eos = _typed(params, "ignore_eos", "bool", False)
    custom = params.get("custom_params")
    flags = {**flags, "return_top_p": isinstance(custom, dict) and bool(custom.get("return_top_p_token_ids"))}
    start = flags.get("routed_experts_start_len", 0)
    if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < len(input_ids):
        raise RequestError.message(f"routed_experts_start_len must be in [0, {len(input_ids)}), got {start!r}.")
    return GenerateSpec(
        rid=rid,
        input_ids=tuple(input_ids),
        sampler=sampler,
        max_new_tokens=_check_context(len(input_ids), max_new, context_length),
        stop_ids=frozenset() if ignore_eos else backend.eos_ids | frozenset(stop_token_ids),
        stop_strs=_stop_strings(params.get("stop")),
        seed=seed,
        skip_special_tokens=_typed(params, "skip_special_tokens", "bool", True),
        no_stop_trim=_typed(params, "no_stop_trim", "bool", False),
        **flags,
    )


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    """A per-item list for a batch: a JSON list is taken item by item, anything else is shared."""
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError.message(f"The length of {name} ({len(value)}) does not match the batch size ({n}).")
        return value
    return [value] * n


def parse_generate(body: Any, backend: LMBackend, context_length: int) -> tuple[list[GenerateSpec], bool]:
    """Validate a `/generate` body; returns the specs and whether the body was a batch."""
    if not isinstance(body, dict):
        raise RequestError.bad_request(f"Input should be a valid dictionary, got {type(body).__name__}")
    if body.get("stream"):
        raise RequestError.message("stream=true is not supported by the embedded server.")
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise RequestError.message("Either text, input_ids or input_embeds should be provided.")
    if text is not None and input_ids is not None:
        raise RequestError.message("Only one of text, input_ids, or input_embeds should be provided.")
    if input_ids is None:
        if isinstance(text, str):
            input_ids = backend.encode(text)
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            input_ids = [backend.encode(t) for t in text]
        else:
            raise RequestError.message("text must be a string or a list of strings.")
    batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
    items = input_ids if batch else [input_ids]
    n = len(items)
    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(n)] if batch else [rid]
    elif isinstance(rid, list) and len(rid) == n and all(isinstance(r, str) for r in rid):
        rids = rid
    else:
        raise RequestError.message("rid must be a string, or a list of strings of the batch size.")
    params = _per_item(body.get("sampling_params"), n, "sampling_params")
    logprob = _per_item(body.get("return_logprob") or False, n, "return_logprob")
    specs = []
    for i in range(n):
        flags = {
            "return_logprob": bool(logprob[i]),
            "return_text_in_logprobs": bool(body.get("return_text_in_logprobs")),
            "return_prompt_token_ids": bool(body.get("return_prompt_token_ids")),
            "return_routed_experts": bool(body.get("return_routed_experts")),
            "routed_experts_start_len": body.get("routed_experts_start_len") or 0,
        }
        specs.append(parse_one(rid=rids[i], input_ids=items[i], params=params[i], flags=flags, backend=backend,
                               context_length=context_length))
    return specs, batch


def output_text(backend: LMBackend, spec: GenerateSpec, output_ids: list[int], finish: dict[str, Any]) -> str:
    """`text` of a finished request, stop-trimmed the way SGLang's detokenizer does it."""
    matched = finish.get("matched") if finish.get("type") == "stop" else None
    if isinstance(matched, int) and not spec.no_stop_trim:
        output_ids = output_ids[:-1]  # the stop token itself is left out of the text
    text = backend.decode(output_ids, skip_special_tokens=spec.skip_special_tokens)
    if isinstance(matched, str):
        pos = text.find(matched)
        if pos != -1:
            text = text[: pos + len(matched)] if spec.no_stop_trim else text[:pos]
    return text


def _b64_int32(values: list[int]) -> str:
    """Base64 of int32 values, as SGLang (and slime's top-p patch) send arrays in meta_info."""
    return base64.b64encode(array("i", values).tobytes()).decode("ascii")


@attrs.define
class GenerationResult:
    """What a finished request produced; `queued_abort` marks SGLang's reduced meta_info case."""

    output_ids: list[int]
    logprobs: list[tuple[float, int]]  # (logprob, id); one entry even for max_new_tokens=0
    finish: dict[str, Any]
    text: str
    token_texts: list[str] | None
    prompt_tokens: int
    queued_abort: bool = False
    top_p: list[list[int]] | None = None  # per output token, the ids the sampler could draw


def build_response(spec: GenerateSpec, result: GenerationResult, *, weight_version: str,
                   e2e_latency: float, routed_experts: tuple[int, int] = (0, 0),
                   top_p_replay: bool = True) -> dict[str, Any]:
    """The SGLang response object, meta_info keys in SGLang 0.5.23's order.

    `routed_experts` is (layers, top-k) of the synthetic router; (0, 0) when the server has none,
    so a request asking for routed experts gets none, like SGLang started without
    `--enable-return-routed-experts`. `top_p_replay=False` ignores slime's top-p replay request,
    as stock SGLang (without slime's patch) does.
    """
    completion = len(result.output_ids)
    meta: dict[str, Any] = {"id": spec.rid, "finish_reason": result.finish}
    if not result.queued_abort:  # an abort in the waiting queue reports a reduced meta_info
        meta.update(prompt_tokens=result.prompt_tokens)
    meta["weight_version"] = weight_version
    if not result.queued_abort:
        meta["num_retractions"] = 0
    if spec.return_logprob:
        texts = result.token_texts or [None] * len(result.logprobs)
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[lp, tid, txt] for (lp, tid), txt in zip(result.logprobs, texts)]
        meta["output_token_logprobs_length"] = len(result.logprobs)
    if not result.queued_abort:
        meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = completion
    if not result.queued_abort:
        meta.update(cached_tokens=0, cached_tokens_details=None, dp_rank=0)
    if top_p_replay and spec.return_top_p and result.top_p is not None:
        offsets = [0]
        for kept in result.top_p:
            offsets.append(offsets[-1] + len(kept))
        meta["top_p_token_ids"] = _b64_int32([t for kept in result.top_p for t in kept])
        meta["top_p_token_offsets"] = _b64_int32(offsets)
    layers, topk = routed_experts
    if spec.return_routed_experts and layers and topk:
        tokens = list(spec.input_ids) + list(result.output_ids)
        start = spec.routed_experts_start_len
        meta["routed_experts"] = _b64_int32(synthetic_routed_experts(tokens, start, layers, topk))
        meta["routed_experts_start_len"] = start
    meta["weight_versions"] = [{"version": weight_version, "start": 0, "end": completion}]
    meta["e2e_latency"] = e2e_latency
    meta["response_sent_to_client_ts"] = time.time()
    out: dict[str, Any] = {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}
    if spec.return_prompt_token_ids:
        out["prompt_token_ids"] = list(spec.input_ids)
    return out
