"""Actions: the small synchronous repairs and bookkeeping done on an edge.

Each runs inside a transition, after its guard passed and before the state changes.
Per-token arrays are changed only through `Trajectory` methods.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.profiles.base import CallResult
from engine.machine.rollout import Rollout

Action = Callable[[Rollout], None]


def reset_rollout(r: Rollout) -> None:
    """RESET: forget everything an earlier attempt left and start from the prompt alone."""
    r.traj.reset(r.prompt_ids)
    r.limit = r.cfg.context_limit(len(r.prompt_ids))
    r.turns = r.tool_calls = 0
    r.max_new_tokens = None
    r.reply = r.turn = None
    r.calls, r.results, r.observation_ids = [], [], []
    r.weight_versions, r.turn_log = [], []
    r.tool_stats = {"calls": 0, "errors": {}, "timeouts": 0, "seconds": 0.0}
    r.generation_time = r.tool_time = 0.0


def restore_checkpoint(r: Rollout) -> None:
    """RESUME: forget the attempt's scratch, then put back the validated partial trajectory."""
    assert r.resume is not None
    turn = r.turn  # the cut-off turn, parsed by the driver when tools are to run again
    reset_rollout(r)
    r.turn = turn
    restored = r.resume
    r.traj = restored.traj
    r.turns, r.tool_calls = restored.turns, restored.tool_calls
    r.turn_log = list(restored.turn_log)
    r.weight_versions = [str(t["weight_version"]) for t in r.turn_log if t.get("weight_version") is not None]
    r.partial_turn_tokens = restored.partial_turn_tokens
    r.attempt = restored.attempt + 1


def clamp_max_new_tokens(r: Rollout) -> None:
    """The next turn may use what the context has left, never more and never 0."""
    remaining = None if r.limit is None else r.limit - r.traj.total_length
    asked = r.asked_max_new_tokens
    if asked is not None and r.partial_turn_tokens:
        asked = max(1, asked - r.partial_turn_tokens)  # a resumed turn keeps its per-turn cap
    caps = [n for n in (asked, remaining) if n is not None]
    # BUDGET_CHECK let us here only with both caps >= 1; max() is a belt for the braces.
    r.max_new_tokens = max(1, min(caps)) if caps else None


def append_model_turn(r: Rollout) -> None:
    """Take the server's ids and logprobs, exactly, into the trajectory (mask 1)."""
    assert r.reply is not None
    reply = r.reply
    start = reply.routed_experts_start_len
    r.traj.append_model_turn(reply.ids, reply.logprobs, reply.top_p, reply.weight_version,
                             reply.routed_experts, r.traj.routed_rows if start is None else start)
    r.partial_turn_tokens = 0
    _log_turn(r)


def record_unusable_reply(r: Rollout) -> None:
    """A reply that cannot be trained on adds no token; its turn is logged, its problem is the reason."""
    _log_turn(r, appended=False)
    if r.reply is None or r.reply.problem:  # else the edge's guard names it (top_p_replay_dropped)
        r.stop_because(r.reply.problem if r.reply is not None else "reply_malformed")


def _log_turn(r: Rollout, appended: bool = True) -> None:
    reply = r.reply
    r.turns += 1
    if reply is not None and reply.weight_version is not None:
        r.weight_versions.append(str(reply.weight_version))
    r.turn_log.append(
        {
            "turn": r.turns,
            "tokens": len(reply.ids) if reply is not None and appended else 0,
            "max_new_tokens": r.max_new_tokens,
            "finish": reply.finish if reply is not None else None,
            "problem": reply.problem if reply is not None else None,
            "weight_version": reply.weight_version if reply is not None else None,
            "cached_tokens": reply.stats.get("cached_tokens") if reply is not None else None,
        }
    )


def plan_tool_calls(r: Rollout) -> None:
    """Decide which calls of the turn run; the others are answered at once with an error.

    Calls beyond the per-turn limit or the trajectory's tool-call budget, and calls that
    could not be parsed, are never dropped silently: each gets an error observation.
    """
    assert r.turn is not None
    r.calls, r.results = [], []
    r.tool_calls_before_turn = r.tool_calls
    allowed = min(r.cfg.max_calls_per_turn, r.cfg.max_tool_calls - r.tool_calls)
    for call in r.turn.calls:
        if call.error:
            r.results.append(CallResult(call, f"Error: {call.detail or call.error}", call.error))
        elif call.name not in r.allowed_tools:
            r.results.append(CallResult(call, f"Error: unknown tool {call.name!r}", "unknown_tool"))
        elif len(r.calls) >= allowed:
            r.results.append(CallResult(call, "Error: too many tool calls in this turn; this one was not run", "surplus_call"))
        else:
            r.calls.append(call)
    r.tool_calls += len(r.calls)
    for result in r.results:
        r.count_tool_error(result.error or "error")


def append_observation(r: Rollout) -> None:
    """Append the observation tokens (mask 0, logprob 0.0); they may overflow, TRIM cuts them."""
    r.traj.append_observation(r.observation_ids)
    if r.turn_log:
        r.turn_log[-1]["observation_tokens"] = len(r.observation_ids)
        r.turn_log[-1]["tools"] = [res.call.name for res in r.results]
    r.calls, r.results = [], []


def trim_to_budget(r: Rollout) -> None:
    """Cut every per-token array to the budget together; the text is rebuilt from the ids."""
    assert r.limit is not None
    cut = r.traj.trim(r.limit - r.traj.prompt_length)
    if r.turn_log:
        r.turn_log[-1]["trimmed_tokens"] = cut


def discard_response(r: Rollout) -> None:
    """After an invariant violation nothing of the response can be trusted: keep the prompt only."""
    r.traj.reset(r.prompt_ids)
