"""Partial rollout: the checkpoint an ABORTED sample carries, and its validation on resume.

With slime's `--partial-rollout`, an aborted sample comes back later with the tokens it
had. The checkpoint (`sample.metadata["fsm"]["checkpoint"]`) says what those tokens are:
prompt and response lengths, fingerprints of the prompt ids and of the response ids and
logprobs, the segments (model turn / observation) with the weight version of each model
turn, and where to continue (generate, or re-run the tool calls a turn asked for). With routing
replay it also counts and fingerprints the routed-expert rows that came from the server (the
sample holds them padded to one per token but the last; the padding is dropped on resume, so
the next request asks the server for the real rows of those tokens). A
checkpoint that does not match the sample's fields in every respect is not trusted: the
sample restarts from RESET, so tokens that do not belong together are never stitched.

This module never sees the caller's sample: the slime adapter reads the checkpoint and the
sample's arrays into a `Saved`, and `validate` judges that.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

from engine.machine.rollout import Restored, ResumeAt, Rollout, Saved
from engine.machine.states import State
from engine.machine.trajectory import LossMask, Segment, Trajectory, as_float64

VERSION = 1


def _sha(*parts: array | bytes | bytearray) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.tobytes() if isinstance(part, array) else bytes(part))
    return h.hexdigest()[:32]


def _top_p_arrays(kept: Any, offsets: Any) -> tuple[array, ...]:
    """Top-p replay as int32 arrays for fingerprinting, () when the sample carries none."""
    if kept is None or offsets is None:
        return ()
    return array("i", list(kept)), array("i", list(offsets))


def resume_point(r: Rollout, tool_states: frozenset[str]) -> ResumeAt:
    """Where an aborted rollout continues: its tools if it stopped while running them."""
    trace = r.record.trace
    source = trace[-1][0] if trace else State.GENERATE
    in_tools = source == State.TOOL_CALL or source in tool_states or (source == State.RESUME and bool(r.turn.pending_calls))
    return "tools" if in_tools and r.traj.segments and r.traj.segments[-1].kind == "model" else "generate"


def make_checkpoint(r: Rollout, tool_states: frozenset[str]) -> dict[str, Any]:
    """What a later call needs to continue `r` and to prove the sample was not changed since.

    `tool_states` are the machine's tool states (a sample stopped in one resumes its calls).
    """
    t = r.traj
    at = resume_point(r, tool_states)
    trace = r.record.trace
    last = t.segments[-1] if t.segments else None
    partial = last.end - last.start if at == "generate" and last is not None and last.kind == "model" else 0
    return {
        "version": VERSION,
        "prompt_length": t.prompt_length,
        "prompt_sha": _sha(t.prompt_ids),
        "response_length": t.response_length,
        "response_sha": _sha(t.response_ids, as_float64(t.logprobs), *_top_p_arrays(t.top_p_ids, t.top_p_offsets)),
        "segments": [[s.kind, s.start, s.end, s.weight_version] for s in t.segments],
        "resume_at": at,
        "partial_turn_tokens": partial,
        # A turn the abort cut short is not counted: the resumed one takes its place.
        "turns": r.turn_count - (1 if trace and trace[-1][0] == State.GENERATE and r.turn.reply is not None else 0),
        "tool_calls": r.tool_calls_before_turn if at == "tools" else r.tool_call_count,
        "turn_log": list(r.record.turn_log),
        "attempt": r.attempt,
        **({"routed_rows": t.routed_rows, "experts_sha": _sha(t.experts)} if t.experts is not None else {}),
    }


def _restored_experts(saved: Saved, cp: dict[str, Any], row_bytes: int, n_tokens: int) -> bytes | str:
    """The server's routed-expert rows the checkpoint vouches for, or why they are not trusted."""
    if "routed_rows" not in cp:
        return "the checkpoint has no routed experts"
    rows, data = int(cp["routed_rows"]), saved.routed_experts
    if data is None or not 0 <= rows <= max(0, n_tokens - 1) or len(data) < rows * row_bytes:
        return "routed experts do not cover the checkpoint's rows"
    real = data[: rows * row_bytes]
    if _sha(real) != cp["experts_sha"]:
        return "routed experts were changed"
    return real


def validate(saved: Saved, prompt_ids: Sequence[int], mask_offpolicy: bool, expert_row_bytes: int = 0) -> Restored | str:
    """The restored trajectory, or the reason the checkpoint is not trusted."""
    cp = saved.checkpoint
    if not isinstance(cp, dict) or cp.get("version") != VERSION:
        return "no usable checkpoint"
    try:
        n_prompt, n_resp = int(cp["prompt_length"]), int(cp["response_length"])
        tokens = list(saved.tokens or [])
        mask = list(saved.loss_mask or [])
        logprobs = list(saved.logprobs or [])
        if n_prompt != len(prompt_ids) or tokens[:n_prompt] != list(prompt_ids):
            return "the prompt differs from the checkpoint's"
        if _sha(array("i", prompt_ids)) != cp["prompt_sha"]:
            return "the prompt fingerprint differs"
        if not (len(tokens) == n_prompt + n_resp == n_prompt + int(saved.response_length)):
            return "token counts disagree with the checkpoint"
        if not (len(mask) == len(logprobs) == n_resp):
            return "loss mask or logprobs length disagrees with the checkpoint"
        ids, lps = array("i", tokens[n_prompt:]), array("d", logprobs)
        top_p = _top_p_arrays(saved.top_p_ids, saved.top_p_offsets)
        if _sha(ids, lps, *top_p) != cp["response_sha"]:
            return "response ids, logprobs or top-p replay were changed"
        if any(m not in (0, 1) for m in mask):
            return "loss mask holds values other than 0 and 1"
        segments = [Segment(k, int(a), int(b), weight_version=v) for k, a, b, v in cp["segments"]]
        starts = [0, *(s.end for s in segments)]
        if [s.start for s in segments] != starts[:-1] or starts[-1] != n_resp:
            return "segments do not tile the response"
        at = cp["resume_at"]
        if at not in ("generate", "tools") or (at == "tools" and (not segments or segments[-1].kind != "model")):
            return "unknown resume point"
        if top_p and len(top_p[1]) != n_resp + 1:
            return "top-p replay does not span the response"
        experts = None
        if expert_row_bytes:
            experts = _restored_experts(saved, cp, expert_row_bytes, n_prompt + n_resp)
            if isinstance(experts, str):
                return experts
        traj = Trajectory.restore(prompt_ids, ids, lps, LossMask.of(mask), segments, top_p or None,
                                  experts, expert_row_bytes)
        if mask_offpolicy:
            traj.mask_tokens_before(n_resp)  # slime may have done it already; doing it twice is harmless
        return Restored(traj, at, int(cp["partial_turn_tokens"]), int(cp["turns"]), int(cp["tool_calls"]),
                        list(cp["turn_log"]), int(cp.get("attempt", 1)))
    except (KeyError, TypeError, ValueError) as exc:
        return f"malformed checkpoint: {exc}"
