"""Guards: the named predicates that choose an edge. Pure functions of a `Rollout`.

A guard's name is what the diagrams print on its edge, and, on an edge that ends the
sample, the termination reason recorded in `sample.metadata["fsm"]["termination_reason"]`.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.machine.rollout import Rollout

Guard = Callable[[Rollout], bool]


def otherwise(r: Rollout) -> bool:
    """The last row of a (source, trigger) group: taken when no row above it was (drawn `[else]`)."""
    return True


# -- RESET / RESUME (partial rollout) -------------------------------------------------
def checkpoint_valid(r: Rollout) -> bool:
    """The sample's checkpoint matches its fields: continue where it stopped."""
    return r.resume is not None


def tools_pending(r: Rollout) -> bool:
    """The sample stopped while its last turn's tool calls ran: they run again."""
    return r.resume is not None and r.resume.resume_at == "tools"


# -- BUDGET_CHECK ---------------------------------------------------------------------
def abort_requested(r: Rollout) -> bool:
    """slime (or the caller) is aborting the rollout step: start no new generation."""
    return bool(r.inputs.abort_check())  # transitions compares a condition with True: a truthy object would not pass


def prompt_over_budget(r: Rollout) -> bool:
    """The prompt alone is longer than the budget: nothing can be generated or trained."""
    return r.token_budget is not None and r.traj.prompt_length > r.token_budget


def compaction_due(r: Rollout) -> bool:
    """The open segment reached the compaction threshold (engine_compaction) with a model turn
    in it: compact it before it overflows."""
    at = r.inputs.compact_at
    return (at is not None and r.history is not None and bool(r.history.exchanges)
            and r.traj.total_length >= at)


def context_full(r: Rollout) -> bool:
    """No token of room is left: the prompt (and response) fill the budget exactly or more."""
    return r.token_budget is not None and r.traj.total_length >= r.token_budget


def max_turns_reached(r: Rollout) -> bool:
    """The model has had all its turns."""
    return r.turn_count >= r.cfg.max_turns


def no_new_tokens_asked(r: Rollout) -> bool:
    """The sampling params ask for `max_new_tokens` <= 0: nothing may be generated."""
    asked = r.inputs.asked_max_new_tokens
    return asked is not None and asked <= 0


# -- GENERATE: reading the reply ------------------------------------------------------
def reply_unusable(r: Rollout) -> bool:
    """Nothing of the reply can be trained on: no meta_info, no or mismatched logprobs, ids or
    values out of range... The reply's own problem name is recorded as the reason."""
    return r.turn.reply is None or r.turn.reply.problem is not None


def top_p_replay_dropped(r: Rollout) -> bool:
    """Earlier turns carry top-p replay but this one has none (a mixed or restarted server)."""
    reply = r.turn.reply
    return reply is not None and bool(reply.ids) and reply.top_p is None and r.traj.top_p_offsets is not None


def server_aborted(r: Rollout) -> bool:
    """The server aborted the request (weight update, `/abort_request`, disconnect)."""
    return r.turn.reply is not None and r.turn.reply.finish == "abort"


def reply_over_budget(r: Rollout) -> bool:
    """The server sent more tokens than the budget has room for (an abort's extra step too)."""
    reply, budget = r.turn.reply, r.token_budget
    return reply is not None and budget is not None and r.traj.total_length + len(reply.ids) > budget


RESUMES_PER_TURN = 8  # a server that aborts one turn more often than this is failing, not updating weights


def abort_resumed_inside(r: Rollout) -> bool:
    """An agent's turn the server aborted (a weight update): it goes on from its tokens, and the
    harness, which waits on the call, sees one ordinary reply (at most RESUMES_PER_TURN times a turn)."""
    return r.inputs.harness is not None and server_aborted(r) and r.turn_resumes < RESUMES_PER_TURN


def harness_answers(r: Rollout) -> bool:
    """An agent's session: the harness, not the engine, answers the turn (its calls, its end)."""
    return r.inputs.harness is not None


def finished_length(r: Rollout) -> bool:
    """The turn hit its `max_new_tokens`."""
    return r.turn.reply is not None and r.turn.reply.finish == "length"


def answered(r: Rollout) -> bool:
    """The model gave its final answer (or, in the chat profile, ended without a call)."""
    return r.turn.parsed is not None and r.turn.parsed.action == "answer"


def environment_answers(r: Rollout) -> bool:
    """An environment is chosen and the turn calls no tool: the environment answers it."""
    return r.inputs.environment is not None and r.turn.parsed is not None and r.turn.parsed.action != "tool"


def _wants_tools(r: Rollout) -> bool:
    return r.turn.parsed is not None and r.turn.parsed.action == "tool"


def tool_calls_exhausted(r: Rollout) -> bool:
    """The turn calls a tool but the trajectory has used all its tool calls."""
    return _wants_tools(r) and r.tool_call_count >= r.cfg.max_tool_calls


def calls_tool(r: Rollout) -> bool:
    """The turn calls a tool (with calls left: the row above took the exhausted case)."""
    return _wants_tools(r)


def invalid_action(r: Rollout) -> bool:
    """The turn neither answers nor calls a tool: the profile answers with a note."""
    return r.turn.parsed is not None and r.turn.parsed.action == "invalid"


# -- ENVIRONMENT ----------------------------------------------------------------------
def environment_done(r: Rollout) -> bool:
    """The environment ended the episode (its own reason is recorded beside this one)."""
    return r.turn.env_reply is not None and r.turn.env_reply.done


# -- HARNESS: an agent's next call, matched onto what was sampled --------------------
def history_extends(r: Rollout) -> bool:
    """The call's history is what was sampled plus the messages the harness added."""
    h = r.turn.harness
    return h is not None and h.kind == "extends"


def _broke(r: Rollout, reason: str) -> bool:
    h = r.turn.harness
    if h is not None:
        return h.kind == "break" and h.reason == reason
    rendered = r.turn.rerender
    return rendered is not None and rendered.reason == reason


def reasoning_dropped(r: Rollout) -> bool:
    """A sampled turn comes back without (or with other) reasoning, its text and calls the same:
    the harness's history, or the chat template's own render of the next prompt (which drops an
    earlier turn's reasoning where it is served so: engine_earlier_reasoning: as_template)."""
    return _broke(r, "reasoning_dropped")


def turn_rewritten(r: Rollout) -> bool:
    """A sampled turn came back with other text or calls than the model wrote."""
    return _broke(r, "turn_rewritten")


def history_compacted(r: Rollout) -> bool:
    """Earlier messages were dropped or summarised: the history is shorter and parts after its start."""
    return _broke(r, "history_compacted")


def history_forked(r: Rollout) -> bool:
    """The history parts at its start (a sub-agent), stops before the last turn, or goes on from it otherwise."""
    return _broke(r, "history_forked")


def history_contradicts(r: Rollout) -> bool:
    """The history contradicts itself: a result for a call never made."""
    return _broke(r, "history_contradicts")


def _ended(r: Rollout, reason: str) -> bool:
    h = r.turn.harness
    return h is not None and h.kind == "end" and h.reason == reason


def harness_finished(r: Rollout) -> bool:
    """The harness ended its session (its process exited 0, its coroutine returned)."""
    return _ended(r, "harness_finished")


def harness_timed_out(r: Rollout) -> bool:
    """The harness ran past its time limit (engine_agent_timeout) and was stopped."""
    return _ended(r, "harness_timed_out")


def harness_crashed(r: Rollout) -> bool:
    """The harness failed (a non-zero exit, an exception): what was sampled is kept."""
    return _ended(r, "harness_crashed")


# -- COMPACT ----------------------------------------------------------------------------
def _summary(r: Rollout) -> bool:
    c = r.turn.compaction
    return c is not None and c.mode == "summarize"


def summary_unusable(r: Rollout) -> bool:
    """The summary's reply cannot be trained on (its own problem is recorded as the reason)."""
    return _summary(r) and r.turn.reply is not None and r.turn.reply.problem is not None


def summary_overflows(r: Rollout) -> bool:
    """The summary does not fit: no room is left to ask for it, it hit its cap unfinished, or the
    prompt with it reaches the threshold. The segments before stay whole."""
    c, reply = r.turn.compaction, r.turn.reply
    return (_summary(r) and c is not None
            and (not c.room or (reply is not None and reply.finish == "length") or (bool(c.summary) and not c.prompt_ids)))


def summary_refused(r: Rollout) -> bool:
    """The policy wrote no summary (nothing, or only reasoning)."""
    c = r.turn.compaction
    return _summary(r) and c is not None and not c.summary


def summarized(r: Rollout) -> bool:
    """The policy summarized the segment: the next starts from the prompt, the summary and the latest turns."""
    return _summary(r)


def compaction_overflows(r: Rollout) -> bool:
    """drop_oldest: even the prompt alone reaches the threshold, whatever is left out."""
    c = r.turn.compaction
    return c is not None and c.mode == "drop_oldest" and not c.prompt_ids


def oldest_dropped(r: Rollout) -> bool:
    """drop_oldest: the next segment starts from the prompt and the latest turns that fit."""
    c = r.turn.compaction
    return c is not None and c.mode == "drop_oldest"


# -- TOOL_CALL ------------------------------------------------------------------------
def calls_for(tool_name: str) -> Guard:
    """Guard of the edge into a tool's own state: a call to that tool is waiting."""

    def guard(r: Rollout) -> bool:
        return any(c.name == tool_name for c in r.turn.pending_calls)

    guard.__name__ = guard.__qualname__ = f"calls_{tool_name}"
    return guard


def observation_over_budget(r: Rollout) -> bool:
    """The observation would push prompt + response past the budget."""
    budget = r.token_budget
    return budget is not None and r.traj.total_length + len(r.turn.observation_ids) > budget

