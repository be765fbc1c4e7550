"""Actions: the small synchronous repairs and bookkeeping done on an edge.

Each runs inside a transition, after its guard passed and before the state changes.
Per-token arrays are changed only through `Trajectory` methods.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.machine.rollout import ClosedSegment, Marks, Rollout, TurnScratch
from engine.machine.trajectory import InvariantViolation, Trajectory
from engine.profiles.base import ToolCall

Action = Callable[[Rollout], None]


def reset_rollout(r: Rollout) -> None:
    """RESET: forget everything an earlier attempt left and start from the prompt alone."""
    r.traj.reset(r.prompt_ids)
    r.token_budget = r.cfg.context_limit(len(r.prompt_ids))
    r.turn_count = r.tool_call_count = 0
    r.max_new_tokens = None
    r.turn = TurnScratch()
    r.record.turn_log, r.record.weight_versions = [], []
    r.record.env_reason = r.record.env_success = None
    r.closed, r.segment_start = [], Marks.of(r.record)


def restore_checkpoint(r: Rollout) -> None:
    """RESUME: forget the attempt's scratch, then put back the validated partial trajectory."""
    assert r.resume is not None
    cut_off = r.turn  # the cut-off turn, parsed by the driver when its tools are to run again
    reset_rollout(r)
    r.turn = cut_off
    restored = r.resume
    r.traj = restored.traj
    r.turn_count, r.tool_call_count = restored.turn_count, restored.tool_call_count
    r.record.turn_log = list(restored.turn_log)
    r.record.weight_versions = [str(t["weight_version"]) for t in r.record.turn_log if t.get("weight_version") is not None]
    r.partial_turn_tokens = restored.partial_turn_tokens
    r.attempt = restored.attempt + 1
    r.history = None  # a checkpoint holds the sequence, not the conversation: it goes on as one sequence


def clamp_max_new_tokens(r: Rollout) -> None:
    """The next turn may use what the context has left, never more and never 0."""
    remaining = None if r.token_budget is None else r.token_budget - r.traj.total_length
    asked = r.inputs.asked_max_new_tokens
    if asked is not None and r.partial_turn_tokens:
        asked = max(1, asked - r.partial_turn_tokens)  # a resumed turn keeps its per-turn cap
    caps = [n for n in (asked, remaining, r.call_max_new_tokens) if n is not None]
    # BUDGET_CHECK let us here only with both caps >= 1; max() is a belt for the braces.
    r.max_new_tokens = max(1, min(caps)) if caps else None


def append_model_turn(r: Rollout) -> None:
    """Take the server's ids and logprobs, exactly, into the trajectory (mask 1)."""
    reply = r.turn.reply
    assert reply is not None
    start = reply.routed_experts_start_len
    r.traj.append_model_turn(reply.ids, reply.logprobs, reply.top_p, reply.weight_version,
                             reply.routed_experts, r.traj.routed_rows if start is None else start)
    r.partial_turn_tokens = r.turn_resumes = 0
    _log_turn(r)
    # The trajectory holds the turn now. The reply's boxed ids and logprobs (a Python object each)
    # would otherwise stay until the next turn; only its verdict (finish, problem) is read again.
    r.turn.reply = reply.without_tokens()


def append_partial_turn(r: Rollout) -> None:
    """An agent's turn the server aborted: its tokens are kept (mask 1) and the turn goes on
    from them, within its own cap; the harness gets the whole turn as one reply."""
    reply = r.turn.reply
    assert reply is not None
    held, resumes = r.partial_turn_tokens + len(reply.ids), r.turn_resumes + 1
    append_model_turn(r)
    r.record.turn_log[-1]["aborted"] = True
    r.turn_count -= 1  # the turn it goes on with is the same turn
    r.partial_turn_tokens, r.turn_resumes = held, resumes


def record_unusable_reply(r: Rollout) -> None:
    """A reply that cannot be trained on adds no token; its turn is logged, its problem is the reason."""
    _log_turn(r, appended=False)
    reply = r.turn.reply
    if reply is None or reply.problem:  # else the edge's guard names it (top_p_replay_dropped)
        r.stop_because(reply.problem if reply is not None and reply.problem else "reply_malformed")


def _log_turn(r: Rollout, appended: bool = True) -> None:
    reply = r.turn.reply
    r.turn_count += 1
    if reply is not None and reply.weight_version is not None:
        r.record.weight_versions.append(str(reply.weight_version))
    r.record.turn_log.append(
        {
            "turn": r.turn_count,
            "tokens": len(reply.ids) if reply is not None and appended else 0,
            "max_new_tokens": r.max_new_tokens,
            "finish": reply.finish if reply is not None else None,
            "problem": reply.problem if reply is not None else None,
            "weight_version": reply.weight_version if reply is not None else None,
            "cached_tokens": reply.stats.get("cached_tokens") if reply is not None else None,
        }
    )
    parsed = r.turn.parsed
    if parsed is not None and parsed.foreign:  # an answer holding another format's call: counted by runs
        r.record.turn_log[-1]["foreign_format"] = parsed.foreign


def plan_tool_calls(r: Rollout) -> None:
    """Decide which calls of the turn run, and which are refused (and why) without running.

    Calls beyond the per-turn limit or the trajectory's tool-call budget, unknown tools and
    calls that could not be parsed are never dropped silently: each is refused with a kind,
    and the tool runner answers it with an error observation like any failed call.
    """
    parsed = r.turn.parsed
    assert parsed is not None
    r.turn.pending_calls, r.turn.results = [], []
    r.turn.refused = []
    r.tool_calls_before_turn = r.tool_call_count
    allowed = min(r.cfg.max_calls_per_turn, r.cfg.max_tool_calls - r.tool_call_count)
    for call in parsed.calls:
        kind = _refusal(r, call, allowed)
        if kind is None:
            r.turn.pending_calls.append(call)
        else:
            r.turn.refused.append((call, kind))
    r.tool_call_count += len(r.turn.pending_calls)


def _refusal(r: Rollout, call: ToolCall, allowed: int) -> str | None:
    if call.error:
        return call.error
    if call.name not in r.inputs.allowed_tools:
        return "unknown_tool"
    if len(r.turn.pending_calls) >= allowed:
        return "surplus_call"
    return None


def record_env_reply(r: Rollout) -> None:
    """Keep the environment's reward and its time with the model turn it answers; if it ended the episode, why."""
    reply = r.turn.env_reply
    assert reply is not None
    if r.record.turn_log:
        last = r.record.turn_log[-1]
        last["environment_seconds"] = round(r.turn.env_seconds, 6)
        if r.turn.env_blocked:  # it held the event loop (the loop says when): every sample waited
            last["environment_blocked_seconds"] = round(r.turn.env_blocked, 6)
        add_turn_reward(r, reply.reward)
    if reply.done:
        r.record.env_reason = reply.reason
        r.record.env_success = reply.success


_SHARED: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def _shared(names: tuple[Any, ...]) -> tuple[Any, ...]:
    """One tuple object for every turn that names the same tools (or errors): a few kinds repeat."""
    known = _SHARED.get(names)
    if known is not None:
        return known
    if len(_SHARED) < 4096:
        _SHARED[names] = names
    return names


def add_turn_reward(r: Rollout, reward: float | None) -> None:
    """Add `reward` to the last model turn's (several tool calls of one turn add theirs up)."""
    if reward is None or not r.record.turn_log:
        return
    last = r.record.turn_log[-1]
    last["reward"] = (last.get("reward") or 0.0) + float(reward)
    if "span" not in last:
        # The scored turn's tokens in the response, [start, end), kept only for a turn with a
        # reward: one more key on every turn's dict would double its table.
        model = next((s for s in reversed(r.traj.segments) if s.kind == "model"), None) if last.get("tokens") else None
        last["span"] = (model.start, model.end) if model is not None else None


def append_user_turn(r: Rollout) -> None:
    """Append the environment's reply as the next user turn (mask 0, logprob 0.0); TRIM cuts an overflow."""
    r.traj.append_observation(r.turn.observation_ids)
    if r.record.turn_log:
        r.record.turn_log[-1]["user_tokens"] = len(r.turn.observation_ids)


def append_observation(r: Rollout) -> None:
    """Append the observation tokens (mask 0, logprob 0.0); they may overflow, TRIM cuts them."""
    r.traj.append_observation(r.turn.observation_ids)
    if r.record.turn_log:
        r.record.turn_log[-1]["observation_tokens"] = len(r.turn.observation_ids)
    record_tool_results(r)


def record_tool_results(r: Rollout) -> None:
    """The turn's answers in its log (tools, errors, rewards), whether they are glued onto the
    sequence or rendered into the next segment's prompt."""
    if r.record.turn_log:
        # Tuples: a turn's dict then holds no container the collector must keep walking.
        r.record.turn_log[-1]["tools"] = _shared(tuple(res.call.name for res in r.turn.results))
        r.record.turn_log[-1]["errors"] = _shared(tuple(res.error for res in r.turn.results))
    for res in r.turn.results:
        add_turn_reward(r, res.reward)


def append_harness_delta(r: Rollout) -> None:
    """Append what the harness added after the turn (tool results, a user turn, a reminder), as
    the template renders it: mask 0, logprob 0.0; TRIM cuts an overflow. Its call's cap applies next."""
    r.traj.append_observation(r.turn.observation_ids)
    if r.turn.harness is not None:
        r.take_call(r.turn.harness)
    if r.record.turn_log:
        r.record.turn_log[-1]["observation_tokens"] = len(r.turn.observation_ids)


def break_segment(r: Rollout) -> None:
    """The history no longer extends the sequence (the harness's, or the template's own render of
    the next prompt): close the segment and open the next from the history as given. Its call's
    cap applies next."""
    harness = r.turn.harness
    if harness is not None:
        assert harness.reason is not None
        close_segment(r, harness.reason, harness.prompt_ids)
        r.take_call(harness)
        return
    rendered = r.turn.rerender
    assert rendered is not None
    close_segment(r, rendered.reason, rendered.prompt_ids)


def close_segment(r: Rollout, reason: str, prompt_ids: Sequence[int]) -> None:
    """Close the open segment (checked whole: I1-I4, I2) and open the next from `prompt_ids`: its
    own prompt, its own budget, its own arrays. `reason` ends the closed one; the rollout's own
    reason is its last segment's."""
    closing = r.traj
    try:
        closing.check(max_total_length=r.budget_at_end(), full=True)
    except InvariantViolation as exc:
        r.record.violation = f"segment {len(r.closed)}: {exc}"
    end = Marks.of(r.record, edges_ahead=1)  # the break's own edge ends the closed segment's path
    r.closed.append(ClosedSegment(closing, reason, r.segment_start, end))
    r.segment_start = end
    r.prompt_ids = tuple(prompt_ids)
    r.traj = Trajectory(expert_row_bytes=r.cfg.expert_row_bytes)
    r.traj.reset(r.prompt_ids)
    r.token_budget = r.cfg.context_limit(len(r.prompt_ids))
    r.partial_turn_tokens = 0


def append_summary(r: Rollout) -> None:
    """The summary's request and reply join the segment it summarizes: the generation prompt the
    segment ended with gives way to the question (mask 0), then the policy's summary follows, as
    the server sent it: trained (mask 1), or mask 0 with engine_compaction_train_summary off."""
    c = r.turn.compaction
    assert c is not None
    reply = r.turn.reply
    entry: dict[str, Any] = {"turn": r.turn_count, "compaction": c.mode, "tokens": 0, "dropped": c.dropped}
    if reply is not None and c.asked:
        r.traj.trim(r.traj.response_length - c.cut)
        r.traj.append_observation(c.asked)
        if r.cfg.compaction_train_summary and reply.ids:
            start = reply.routed_experts_start_len
            r.traj.append_model_turn(reply.ids, reply.logprobs, reply.top_p, reply.weight_version,
                                     reply.routed_experts, r.traj.routed_rows if start is None else start)
            entry["tokens"] = len(reply.ids)
        else:
            r.traj.append_observation(reply.ids)
        entry.update(summary_tokens=len(reply.ids), finish=reply.finish, weight_version=reply.weight_version,
                     cached_tokens=reply.stats.get("cached_tokens"))
        if reply.weight_version is not None:
            r.record.weight_versions.append(str(reply.weight_version))
        r.turn.reply = reply.without_tokens()
    r.record.turn_log.append(entry)


def log_compaction(r: Rollout) -> None:
    """drop_oldest, or a compaction that ends the sample before asking: its entry in the turn log."""
    c = r.turn.compaction
    assert c is not None
    r.record.turn_log.append({"turn": r.turn_count, "compaction": c.mode, "tokens": 0, "dropped": c.dropped})


def compact_segment(r: Rollout) -> None:
    """Close the segment compacted (its reason the mode's edge: summarized, oldest_dropped) and
    open the next from the prompt COMPACT rendered; its conversation is the compacted one."""
    c = r.turn.compaction
    assert c is not None and c.prompt_ids
    close_segment(r, "summarized" if c.mode == "summarize" else "oldest_dropped", c.prompt_ids)
    r.history = c.history


def trim_to_budget(r: Rollout) -> None:
    """Cut every per-token array to the budget together (the text is made from the ids at the end)."""
    assert r.token_budget is not None
    cut = r.traj.trim(r.token_budget - r.traj.prompt_length)
    if r.record.turn_log:
        r.record.turn_log[-1]["trimmed_tokens"] = cut


def discard_response(r: Rollout) -> None:
    """After an invariant violation nothing of the response can be trusted: keep the prompt only
    (of every segment an agent's session closed, too)."""
    r.traj.reset(r.prompt_ids)
    for segment in r.closed:
        segment.traj.reset(segment.traj.prompt_ids)
