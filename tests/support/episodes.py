"""Random episodes for the property tests: what the server answers, turn by turn, and a
respx side effect that plays it back while recording what it sent.

An `Episode` is plain data (hypothesis draws and shrinks it): the prompt, the budgets and
limits, and a script of server behaviours, each a `Reply` (a 200 body, usable or not) or a
`Fault` (an HTTP error, a transport error, a body that is not JSON). Requests beyond the
script get `FINAL_ANSWER`, so every episode ends. Tool outputs are part of the episode too:
a code turn runs `show(k)` and the fake interpreter answers `outputs[k]`.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import attrs
import httpx
from hypothesis import strategies as st

from engine import tools
from engine.profiles.retool import RetoolProfile, render_retool_prompt
from engine.local.server.protocol import input_too_long_message, request_too_long_message
from tests.support.helpers import IM_END, encode, fake_logprobs, reply_body, tok

FLAMINGO_HEAD, FLAMINGO_TAIL = 123918, 102  # decode to one emoji only together
VOCAB = 151669
ID_POOL = (FLAMINGO_HEAD, FLAMINGO_TAIL, IM_END, 151643, 151644, 198, 271, 220, 17, 30, 9707, 45, 13)
PROMPTS: tuple[Any, ...] = (
    "What is 6*7?",
    "🦩🦩 How many flamingos stand on one leg? 火烈鸟 ∑ é",
    "Explain " + "very " * 300 + "carefully what 2+2 is.",
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Compute 3**5 🦩"}],
)
TRANSIENT = ("http503", "http500", "http502", "http429", "connect", "read_timeout", "disconnect", "not_json")
CONTEXT = ("context400", "input400")
REJECTED = ("unknown_field400", "bad_request400", "top_p400", "http404")
USABLE_ENDS = frozenset({"reply_over_budget", "finished_length", "answered", "tool_calls_exhausted",
                         "observation_over_budget", "context_full", "max_turns_reached"})
PROBLEM_REASON = {"missing": "logprobs_missing", "extra_id": "logprobs_mismatch", "bad_entry": "logprobs_mismatch",
                  "zero_quirk": "logprobs_mismatch", "bad_value": "logprobs_invalid", "no_meta": "reply_malformed",
                  "bad_finish": "reply_malformed", "top_p_dropped": "top_p_replay_dropped"}
SPOILERS = sorted(set(PROBLEM_REASON) - {"top_p_dropped"})  # what a reply may be drawn with; the last is the
# server's doing: a reply without top-p replay after replayed ones (see EpisodeServer)


@attrs.frozen
class Reply:
    """A 200 reply. `problem` makes it unusable; `obey_cap` cuts it to the request's max_new_tokens."""

    ids: tuple[int, ...]
    finish: str = "stop"
    logprobs: tuple[float, ...] | None = None  # None: distinct fake values
    problem: str | None = None
    obey_cap: bool = True
    weight_version: str = "default"
    top_p: bool = True  # carries top-p replay when the episode's top_p mode is "mixed"


@attrs.frozen
class Fault:
    """A request that gets no usable reply: one of TRANSIENT, CONTEXT or REJECTED."""

    kind: str


@attrs.frozen
class Episode:
    """One sample's whole story. `budget` is relative to the prompt's length (see `limit`)."""

    prompt: Any
    budget: tuple[str, int]  # ("none"|"over"|"exact"|"near", delta)
    max_response_len: int | None
    max_new_tokens: int | None  # None: not in the sampling params
    max_turns: int
    max_tool_calls: int
    retry_attempts: int
    script: tuple[Reply | Fault, ...]
    outputs: tuple[str | None, ...]  # show(k) prints outputs[k]; None: the tool raises
    top_p: str = "none"  # top-p replay (kept ids per token) on "none", "all" or "mixed" replies
    profile: str = "retool"  # or "chat": the tokenizer's own template, <tool_call> JSON turns

    def limit(self, prompt_len: int) -> int | None:
        """rollout_max_context_len for a prompt of this length."""
        kind, delta = self.budget
        return {"none": None, "over": prompt_len - delta, "exact": prompt_len, "near": prompt_len + delta}[kind]


FINAL_ANSWER = Reply(tuple(encode("Answer: \\boxed{42}")) + (IM_END,))


def prompt_ids(prompt: Any, profile: str = "retool") -> tuple[int, ...]:
    """The prompt's ids in a profile, rendered with the tools registered now (the fake one, in tests)."""
    offered = [n for n in tools.names() if profile != "retool" or n not in RetoolProfile.withheld_tools]
    schemas = [tools.get(n).schema() for n in offered]  # type: ignore[union-attr]
    return _rendered(json.dumps(prompt, ensure_ascii=False), json.dumps(schemas), profile)


@functools.lru_cache(maxsize=128)
def _rendered(prompt_json: str, schemas_json: str, profile: str) -> tuple[int, ...]:
    prompt, schemas = json.loads(prompt_json), json.loads(schemas_json)
    if profile == "chat":  # the template is the reference: apply_chat_template, as the profile says
        text = tok().apply_chat_template(_messages(prompt), tools=schemas or None, tokenize=False,
                                         add_generation_prompt=True)
        return tuple(encode(text))
    return tuple(encode(render_retool_prompt(prompt, schemas)))


def _messages(prompt: Any) -> list[dict[str, str]]:
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


# -- strategies -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _ids(text: str) -> tuple[int, ...]:
    return tuple(encode(text))


def _turn_text(kind: str, k: int) -> str:
    code = f"show({k})"
    return {
        "code": f"Let me run it.\n<code>\n{code}\n</code>",
        "tool_json": '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "%s"}}\n</tool_call>' % code,
        "answer": "So it is 42.\nAnswer: \\boxed{42}",
        "invalid": "Hmm, let me think about this 🦩 some more.",
        "unknown_tool": '<tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>',
        "malformed_call": '<tool_call>{"name": "code_interpreter", "arguments": {"code": </tool_call>',
        "random": "",
    }[kind]


def weighted(*choices: tuple[int, Any]) -> st.SearchStrategy[Any]:
    """One of the values, each as often as its weight (shrinks towards the first)."""
    return st.sampled_from([value for weight, value in choices for _ in range(weight)])


@st.composite
def replies(draw: st.DrawFn, n_outputs: int) -> Reply:
    kind = draw(weighted((4, "code"), (2, "tool_json"), (1, "answer"), (1, "invalid"), (1, "random"),
                         (1, "unknown_tool"), (1, "malformed_call")))
    body = list(_ids(_turn_text(kind, draw(st.integers(0, n_outputs - 1)))))
    filler = st.one_of(st.sampled_from(ID_POOL), st.integers(0, VOCAB - 1))
    body += draw(st.lists(filler, max_size=300 if kind == "random" else 20))
    ids = ([FLAMINGO_TAIL] if draw(st.booleans()) else []) + body  # completes an emoji a turn left open
    if draw(st.booleans()):
        ids.append(FLAMINGO_HEAD)  # leaves an emoji open for the next turn
    finish = draw(weighted((8, "stop"), (1, "length"), (1, "abort")))
    if finish == "stop" and draw(st.booleans()):
        ids.append(IM_END)
    logprobs = None
    if draw(st.booleans()):
        values = st.one_of(st.floats(-30.0, 0.0), st.just(-0.0))
        logprobs = tuple(draw(st.lists(values, min_size=len(ids), max_size=len(ids))))
    problem = draw(st.sampled_from(SPOILERS)) if draw(st.integers(0, 9)) == 0 else None
    return Reply(tuple(ids), finish, logprobs, problem, draw(weighted((3, True), (1, False))),
                 draw(st.sampled_from(["default", "v2"])), draw(weighted((3, True), (1, False))))


outputs = st.one_of(
    st.just(""), st.text(max_size=40), st.just("🦩" * 7 + "火烈鸟"),
    st.integers(200, 20000).map(lambda n: ("digits 1234567890 " * (n // 18 + 1))[:n]),
    st.none(),
)
budgets = weighted((6, "roomy"), (2, "none"), (2, "tight"), (1, "exact"), (1, "over")).flatmap(lambda kind: {
    "roomy": st.tuples(st.just("near"), st.integers(61, 3000)), "none": st.just(("none", 0)),
    "tight": st.tuples(st.just("near"), st.integers(1, 60)), "exact": st.just(("exact", 0)),
    "over": st.tuples(st.just("over"), st.integers(1, 3))}[kind])
max_new_tokens = weighted((6, "big"), (1, "small"), (2, "absent"), (1, "edge")).flatmap(lambda kind: {
    "big": st.integers(65, 400), "small": st.integers(2, 64), "absent": st.none(),
    "edge": st.sampled_from([1, 0, -1])}[kind])


@st.composite
def episodes(draw: st.DrawFn) -> Episode:
    n_outputs = draw(st.integers(1, 3))
    length = draw(weighted((1, 0), (1, 1), (2, 3), (3, 6), (3, 10)))  # hypothesis favours tiny sizes otherwise
    faults = st.sampled_from(TRANSIENT + CONTEXT + REJECTED).map(Fault)
    item = weighted((5, "reply"), (1, "fault")).flatmap(lambda k: replies(n_outputs) if k == "reply" else faults)
    return Episode(
        prompt=draw(st.sampled_from(PROMPTS)),
        budget=draw(budgets),
        max_response_len=draw(st.one_of(st.none(), st.none(), st.integers(1, 400))),
        max_new_tokens=draw(max_new_tokens),
        max_turns=draw(weighted((1, 1), (1, 2), (3, 4), (4, 8))),
        max_tool_calls=draw(st.integers(0, 4)),
        retry_attempts=draw(st.integers(1, 4)),
        script=tuple(draw(st.lists(item, min_size=length, max_size=length))),
        outputs=tuple(draw(st.lists(outputs, min_size=n_outputs, max_size=n_outputs))),
        top_p=draw(weighted((6, "none"), (1, "all"), (1, "mixed"))),
        profile=draw(weighted((3, "retool"), (1, "chat"))),
    )


# -- playing an episode back ----------------------------------------------------------------
@attrs.frozen
class Sent:
    """What one request got: the script item, and the (ids, logprobs) when the reply was usable."""

    item: Reply | Fault
    usable: tuple[tuple[int, ...], tuple[float, ...]] | None
    problem: str | None = None  # the reply's problem as sent (a spoiler needs a token to spoil)
    spans: tuple[tuple[int, ...], ...] | None = None  # top-p kept ids of each token, when sent


class EpisodeServer:
    """A respx side effect that answers `/generate` from an episode's script, recording everything."""

    def __init__(self, episode: Episode) -> None:
        self.script = list(episode.script)
        self.top_p = episode.top_p
        self.replayed = False  # whether the sample's trajectory carries top-p replay by now
        self.requests: list[dict[str, Any]] = []
        self.headers: list[httpx.Headers] = []
        self.sent: list[Sent] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content)
        self.requests.append(payload)
        self.headers.append(request.headers)
        n = len(self.requests) - 1
        item = self.script[n] if n < len(self.script) else FINAL_ANSWER
        if isinstance(item, Fault):
            self.sent.append(Sent(item, None))
            return fault_response(item.kind, payload)
        body, usable, problem = self._reply(item, payload)
        carries = self.top_p == "all" or self.top_p == "mixed" and item.top_p
        spans = add_top_p(body) if carries else None
        if usable is not None and spans is not None:
            self.replayed = True  # a usable reply is always appended, with its replay
        elif usable is not None and usable[0] and self.replayed:
            usable, problem = None, "top_p_dropped"  # replay stops mid-sample: refused, not appended
        self.sent.append(Sent(item, usable, problem, spans))
        # json.dumps, not httpx's json=: -Infinity and NaN must reach the client as SGLang writes them.
        return httpx.Response(200, content=json.dumps(body).encode(), headers={"content-type": "application/json"})

    @staticmethod
    def _reply(item: Reply, payload: dict[str, Any]) -> tuple[dict[str, Any], Any, str | None]:
        ids, finish = list(item.ids), item.finish
        lps = list(item.logprobs) if item.logprobs is not None else fake_logprobs(ids, seed=len(ids))
        cap = payload["sampling_params"].get("max_new_tokens")
        if item.obey_cap and cap is not None and len(ids) > cap:
            ids, lps = ids[:cap], lps[:cap]
            finish = "abort" if finish == "abort" else "length"
        problem = item.problem if item.problem != "bad_value" or lps else None  # no token to spoil
        if problem == "bad_value":
            lps[len(lps) // 2] = [0.25, float("nan"), float("inf"), float("-inf")][len(ids) % 4]
        body = reply_body(ids, finish=finish, logprobs=lps, weight_version=item.weight_version,
                          with_logprobs=problem != "missing")
        meta = body["meta_info"]
        if problem == "extra_id":
            body["output_ids"] = ids + [IM_END]
        elif problem == "bad_entry":
            meta["output_token_logprobs"] = [[None, t, None] for t in ids] or [["x"]]
        elif problem == "zero_quirk":
            body["output_ids"], body["text"] = [], ""
            meta["output_token_logprobs"] = [[-0.25, 17, None]]
        elif problem == "no_meta":
            del body["meta_info"]
        elif problem == "bad_finish":
            meta["finish_reason"] = {"type": "weird"} if ids else None
        usable = None if problem is not None else (tuple(ids), tuple(float(x) for x in lps))
        return body, usable, problem


def add_top_p(body: dict[str, Any]) -> tuple[tuple[int, ...], ...] | None:
    """Give a reply top-p replay data, 0 to 2 kept ids per token; returns the spans sent."""
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        return None
    spans = tuple(tuple(t + j for j in range(i % 3)) for i, t in enumerate(body["output_ids"]))
    offsets = [0]
    for span in spans:
        offsets.append(offsets[-1] + len(span))
    meta["top_p_token_ids"] = [t for span in spans for t in span]
    meta["top_p_token_offsets"] = offsets
    return spans


def fault_response(kind: str, payload: dict[str, Any]) -> httpx.Response:
    """The response (or raised transport error) of one fault kind."""
    n_input = len(payload["input_ids"])
    asked = payload["sampling_params"].get("max_new_tokens") or 1
    if kind == "connect":
        raise httpx.ConnectError("[Errno 111] Connection refused")
    if kind == "read_timeout":
        raise httpx.ReadTimeout("timed out")
    if kind == "disconnect":
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
    responses = {
        "http503": lambda: httpx.Response(503, json={"object": "error", "message": "The request queue is full.",
                                                     "type": "503", "param": None, "code": 503}),
        "http500": lambda: httpx.Response(500, text="Internal Server Error"),
        "http502": lambda: httpx.Response(502, text="Bad Gateway"),
        "http429": lambda: httpx.Response(429, json={"error": {"message": "Too many requests"}}),
        "not_json": lambda: httpx.Response(200, content=b'{"text": "cut in ha'),
        "context400": lambda: httpx.Response(400, json={"error": {"message": request_too_long_message(
            n_input, asked, n_input + asked - 1)}}),
        "input400": lambda: httpx.Response(400, json={"error": {"message": input_too_long_message(
            n_input, n_input - 1)}}),
        "unknown_field400": lambda: httpx.Response(400, json={"error": "unknown field `foo`, expected one of `stop`"}),
        "bad_request400": lambda: httpx.Response(400, json={"object": "error", "message": "body invalid",
                                                            "type": "Bad Request", "param": None, "code": 400}),
        "top_p400": lambda: httpx.Response(400, json={"error": {"message": "top_p must be in (0, 1], got 0.0."}}),
        "http404": lambda: httpx.Response(404, text="Not Found"),
    }
    return responses[kind]()


def reasons_after(last: Sent | None) -> frozenset[str]:
    """The termination reasons the last request's outcome allows (None: no request was made)."""
    if last is None:
        return frozenset({"prompt_over_budget", "context_full", "no_new_tokens_asked"})
    item = last.item
    if isinstance(item, Fault):
        if item.kind in TRANSIENT:
            return frozenset({"request_failed"})
        return frozenset({"context_rejected" if item.kind in CONTEXT else "request_rejected"})
    if last.problem is not None:
        return frozenset({PROBLEM_REASON[last.problem]})
    # An abort reply longer than the room left is trimmed first (`reply_over_budget`).
    return frozenset({"server_aborted", "reply_over_budget"}) if item.finish == "abort" else USABLE_ENDS


def decode(ids: list[int]) -> str:
    return tok().decode(ids)


@st.composite
def conversations(draw: st.DrawFn) -> Episode:
    """Many well-formed tool turns, emoji-heavy, against a budget that runs out anywhere."""
    n_outputs = draw(st.integers(1, 3))
    turns = []
    for _ in range(draw(st.integers(1, 8))):
        ids = list(_ids(_turn_text("code", draw(st.integers(0, n_outputs - 1)))))
        ids += draw(st.lists(st.sampled_from((FLAMINGO_HEAD, FLAMINGO_TAIL, 9707, 220)), max_size=12))
        turns.append(Reply(tuple(ids + [IM_END]), obey_cap=draw(st.booleans())))
    text = st.text(alphabet="🦩火烈鸟é ab1\n<>/", min_size=draw(st.integers(0, 60)), max_size=400)
    return Episode(
        prompt=draw(st.sampled_from(PROMPTS)),
        budget=("near", draw(weighted((3, 300), (1, 1500)).flatmap(lambda top: st.integers(1, top)))),
        max_response_len=None,
        max_new_tokens=draw(st.one_of(st.none(), st.integers(1, 400))),
        max_turns=8,
        max_tool_calls=8,
        retry_attempts=1,
        script=tuple(turns),
        outputs=tuple(draw(st.lists(text, min_size=n_outputs, max_size=n_outputs))),
        top_p=draw(st.sampled_from(["none", "all"])),
    )
