"""Reading and writing slime's `Sample`, duck-typed: with `engine.slime`, the only code that knows it.

slime is not importable here, so nothing checks `isinstance`; statuses are set through
`type(sample).Status` so slime's own enum is used. Everything the engine records goes under
one key, `sample.metadata["fsm"]`; the rest of `metadata` belongs to the user and to slime.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import attrs

from engine.machine import checkpoint
from engine.machine.rollout import Marks, Rollout, Saved
from engine.machine.trajectory import Trajectory
from engine.machine.states import LOGS_A_TURN, State, Trigger
from engine.machine.table import get_machine
from engine.sglang.wire import top_p_asked

FSM = "fsm"  # the one key of sample.metadata that the engine writes
# Reasons whose sample slime must not train on (`remove_sample`): no token of it fits the budget,
# or a tool or the environment it needed could not work (not the model's doing).
NOT_TRAINED = frozenset({"prompt_over_budget", "tool_unavailable", "environment_failed"})
BAD_INPUT = "bad_sample_input"  # the sample, its sampling params or its tools cannot be read
SETUP_FAILED = "engine_setup_failed"  # settings or tokenizer unusable
ADAPTER_CRASHED = "crashed"  # a bug outside the machine; the sample still comes back


class BadInput(ValueError):
    """The sample (prompt, metadata["tools"]) or the sampling params cannot be used."""


@attrs.frozen
class SampleInput:
    """What the engine reads off a sample and its sampling params, checked."""

    prompt: str | list[dict[str, Any]]
    sampling_params: dict[str, Any]
    tool_names: frozenset[str] | None  # None: the sample names no tools
    tool_schemas: dict[str, dict[str, Any]] | None  # the sample's own schemas, by name
    routing_key: str | None
    metadata: dict[str, Any] | None = None  # the sample's own metadata, for an environment's episode


def read_input(sample: Any, sampling_params: Any) -> SampleInput:
    """The sample's prompt, tools and sampling params, or BadInput saying what is wrong."""
    prompt = getattr(sample, "prompt", None)
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt):
            raise BadInput("prompt: a list of messages must hold dicts with a string 'role'")
    elif not isinstance(prompt, str):
        raise BadInput(f"prompt: expected a string or a list of messages, got {type(prompt).__name__}")
    metadata = getattr(sample, "metadata", None)
    names, schemas = read_tools(metadata.get("tools") if isinstance(metadata, dict) else None)
    session = getattr(sample, "session_id", None)
    own = {k: v for k, v in metadata.items() if k != FSM} if isinstance(metadata, dict) else None
    return SampleInput(prompt, read_sampling_params(sampling_params), names, schemas,
                       str(session) if session is not None else None, own)


def read_sampling_params(params: Any) -> dict[str, Any]:
    """A private copy of the sampling params with `max_new_tokens` an int (or absent)."""
    if not isinstance(params, dict):
        raise BadInput(f"sampling_params: expected a dict, got {type(params).__name__}")
    out = dict(params)  # never mutate slime's: evaluation shares one dict between samples
    if out.get("max_new_tokens") is not None:
        out["max_new_tokens"] = read_max_new_tokens(out["max_new_tokens"])
    return out


def read_max_new_tokens(value: Any) -> int:
    """An int, or a float that is one (YAML may give 512.0); anything else is BadInput."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadInput(f"max_new_tokens: expected an integer, got {value!r}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise BadInput(f"max_new_tokens: expected an integer, got {value!r}")
    return int(value)


def read_tools(value: Any) -> tuple[frozenset[str] | None, dict[str, dict[str, Any]] | None]:
    """The tool names a sample asks for, and its own schemas where it gave them.

    slime's `--tool-key` puts OpenAI-style schemas there (`{"type": "function", "function":
    {"name", ...}}`); a dataset may also hold bare function objects (`{"name", ...}`) or names.
    None means the sample names no tools. Any other shape is BadInput.
    """
    if value is None:
        return None, None
    if not isinstance(value, (list, tuple)):
        raise BadInput(f"metadata['tools']: expected a list of tool schemas or names, got {type(value).__name__}")
    names: set[str] = set()
    schemas: dict[str, dict[str, Any]] = {}
    for item in value:
        if isinstance(item, str) and item:
            names.add(item)
            continue
        function = item.get("function", item) if isinstance(item, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise BadInput(f"metadata['tools']: {str(item)[:80]!r} is neither a tool name nor a schema with a name")
        names.add(name)
        schemas[name] = item if "function" in item else {"type": "function", "function": item}
    return frozenset(names), schemas or None


def engine_metadata(sample: Any) -> dict[str, Any]:
    """What the engine recorded on `sample` ({} when nothing)."""
    metadata = getattr(sample, "metadata", None)
    fsm = metadata.get(FSM) if isinstance(metadata, dict) else None
    return fsm if isinstance(fsm, dict) else {}


def read_checkpoint(sample: Any) -> Saved | None:
    """A partial-rollout checkpoint and the arrays it vouches for, read off the sample before it is cleared."""
    cp = engine_metadata(sample).get("checkpoint")
    if cp is None:
        return None

    def listed(name: str) -> list[Any]:
        value = getattr(sample, name, None)
        return list(value) if isinstance(value, (list, tuple)) else []

    length = getattr(sample, "response_length", 0)
    return Saved(
        checkpoint=cp,
        tokens=listed("tokens"),
        response_length=length if isinstance(length, int) else -1,
        loss_mask=listed("loss_mask"),
        logprobs=listed("rollout_log_probs"),
        top_p_ids=getattr(sample, "rollout_top_p_token_ids", None),
        top_p_offsets=getattr(sample, "rollout_top_p_token_offsets", None),
        routed_experts=int32_bytes(getattr(sample, "rollout_routed_experts", None)),
    )


def int32_bytes(value: Any) -> bytes | None:
    """The int32 bytes of an array-like of ints (numpy, a CPU tensor, nested lists); None if not one."""
    if value is None:
        return None
    import numpy as np  # a dependency of transformers; only needed with routing replay

    try:
        return np.ascontiguousarray(np.asarray(value), dtype=np.int32).tobytes()
    except (TypeError, ValueError):
        return None


def _set(sample: Any, name: str, value: Any) -> None:
    """Set a field the sample has (a stand-in may lack optional ones)."""
    if hasattr(sample, name):
        setattr(sample, name, value)


def _fresh(value: Any) -> Any:
    """A new empty instance of a stats object's class (slime's SpecInfo, PrefixCacheInfo)."""
    try:
        return type(value)()
    except Exception:
        return value


def clear_sample(sample: Any) -> None:
    """Forget every per-sample field an earlier attempt may have left (I5)."""
    sample.tokens = []
    sample.response = ""
    sample.response_length = 0
    sample.loss_mask = None
    sample.rollout_log_probs = None
    _set(sample, "remove_sample", False)
    for name in ("rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_routed_experts", "reward"):
        _set(sample, name, None)
    _set(sample, "weight_versions", [])
    _set(sample, "non_generation_time", 0.0)
    for name in ("spec_info", "prefix_cache_info"):
        if getattr(sample, name, None) is not None:
            setattr(sample, name, _fresh(getattr(sample, name)))
    status = getattr(type(sample), "Status", None)
    if status is not None:
        sample.status = status.PENDING
    metadata = getattr(sample, "metadata", None)
    if isinstance(metadata, dict):
        metadata.pop(FSM, None)  # the user's own keys stay
    else:
        _set(sample, "metadata", {})


def write_sample(
    sample: Any, r: Rollout, *, attempts: list[dict[str, Any]] | None = None, exhausted: bool = False
) -> None:
    """Hand the rollout to the sample: every per-token field from the one trajectory.

    `exhausted`: no attempt could finish (see engine.loop.attempts). The sample ends FAILED
    with `remove_sample=True`: slime computes its reward and keeps it in its group, but trains
    none of its tokens; the last attempt's reason is kept beside `attempts_exhausted`.
    """
    write_arrays(sample, r, r.traj, r.text, r.record.weight_versions, r.record.call_stats)
    if hasattr(sample, "non_generation_time"):
        sample.non_generation_time = float(sample.non_generation_time or 0.0) + r.record.tools.seconds + r.record.env_seconds
    if r.reason in NOT_TRAINED or exhausted:
        sample.remove_sample = True  # slime keeps it in its group, trains none of it
    set_status(sample, "FAILED" if exhausted else r.state)
    meta = rollout_metadata(r)
    if attempts:
        meta["attempts"] = attempts
    if exhausted:
        meta["last_reason"] = meta["termination_reason"]
        meta["termination_reason"] = "attempts_exhausted"
        meta.pop("checkpoint", None)  # nothing resumes a FAILED sample
    own_metadata(sample)[FSM] = meta


def write_arrays(sample: Any, r: Rollout, traj: Trajectory, text: str, versions: list[str],
                 call_stats: list[dict[str, int]]) -> None:
    """The per-token fields of one trajectory (a rollout's, or one segment of an agent's), its
    text, weight versions and per-call statistics."""
    sample.tokens = traj.prompt_ids.tolist() + traj.response_ids.tolist()
    sample.response = text
    sample.response_length = traj.response_length
    sample.loss_mask = traj.loss_mask.tolist()
    sample.rollout_log_probs = traj.logprobs.tolist()
    _set(sample, "rollout_top_p_token_ids", traj.top_p_ids.tolist() if traj.top_p_ids is not None else None)
    _set(sample, "rollout_top_p_token_offsets", traj.top_p_offsets.tolist() if traj.top_p_offsets is not None else None)
    if traj.top_p_offsets is None and top_p_asked(r.inputs.sampling_params):
        # slime asked, and no reply carried any (none usable, or none sent): empty spans, which
        # slime's conversion accepts. Such a sample trains no model token from a reply anyway.
        _set(sample, "rollout_top_p_token_ids", [])
        _set(sample, "rollout_top_p_token_offsets", [0] * (traj.response_length + 1))
    if traj.experts is not None:
        _set(sample, "rollout_routed_experts", routed_experts_array(traj.padded_routed_experts() or b"", r))
    _set(sample, "weight_versions", list(versions))
    add_call_stats(sample, call_stats)


def set_status(sample: Any, state: str) -> None:
    """slime's own status of that name (a stand-in's, duck-typed)."""
    status = getattr(type(sample), "Status", None)
    if status is not None and state in status.__members__:
        sample.status = status[state]


def own_metadata(sample: Any) -> dict[str, Any]:
    """The sample's metadata dict (one made where it has none)."""
    metadata = getattr(sample, "metadata", None)
    if not isinstance(metadata, dict):
        metadata = {}
        _set(sample, "metadata", metadata)
    return metadata


@attrs.frozen
class Piece:
    """One sample of a rollout: a segment (or one model turn of it), its arrays, why it ended, its stretch of the record."""

    traj: Trajectory
    reason: str | None
    start: Marks
    end: Marks
    last: bool


def pieces(r: Rollout, per_turn: bool = False) -> list[Piece]:
    """The rollout's samples in order: the segments its breaks closed, then the last; with
    `per_turn`, each segment's model turns one by one (a segment without one stays whole)."""
    closed = [Piece(s.traj, s.reason, s.start, s.end, False) for s in r.closed]
    whole = [*closed, Piece(r.traj, r.reason, r.segment_start, Marks.of(r.record), True)]
    if not per_turn:
        return whole
    return [turn for piece in whole for turn in turn_pieces(r, piece)]


def turn_pieces(r: Rollout, piece: Piece) -> list[Piece]:
    """A segment's model turns, each its own piece: its prompt all before it, its tokens the model's.

    Each model run of the segment is the turn whose log entry has tokens (in order); a turn's path
    is its stretch of the segment's, up to and through the edge that logged it, the last turn's to
    the segment's end. The last turn ends as the segment does; the others end with `per_turn`.
    """
    runs = [s for s in piece.traj.segments if s.kind == "model"]
    if not runs:
        return [piece]
    trace = r.record.trace[piece.start.trace:piece.end.trace]
    logging = [piece.start.trace + k + 1 for k, step in enumerate(trace) if (str(step[0]), str(step[1])) in LOGS_A_TURN]
    entries = piece.end.turns - piece.start.turns
    restored = max(0, entries - len(logging))  # a resumed sample's first entries came from its checkpoint
    ends = [piece.start.trace] * restored + logging  # where each entry's path ends
    out: list[Piece] = []
    begin = Marks(piece.start.turns, piece.start.versions, piece.start.stats, piece.start.trace)
    versions, stats = piece.start.versions, piece.start.stats
    made = 0
    for i in range(piece.start.turns, piece.end.turns):
        entry = r.record.turn_log[i]
        versions += 1 if entry.get("weight_version") is not None else 0
        stats += 1 if "cached_tokens" in entry else 0
        if not entry.get("tokens") or made >= len(runs):
            continue
        run = runs[made]
        made += 1
        last = made == len(runs)
        end = piece.end if last else Marks(i + 1, versions, stats, ends[i - piece.start.turns])
        out.append(Piece(piece.traj.turn(run.start, run.end), piece.reason if last else "per_turn", begin, end,
                         piece.last and last))
        begin = end
    return out


def reward_weights(cfg: Any, count: int) -> list[float]:
    """What each of a rollout's `count` samples gets of its reward: all of it (shared), or the last all
    of it and each earlier one engine_segment_discount times the next's (discounted)."""
    if cfg.segment_reward != "discounted":
        return [1.0] * count
    return [cfg.segment_discount ** (count - 1 - k) for k in range(count)]


def weighted_reward(reward: Any, weight: float) -> Any:
    """A reward given to a whole rollout, as one of its samples' share (`reward_weights`): a number
    times `weight`; a dict with its `score` (what engine.slime.reward_func's are trained by) times
    `weight`, the rest as given; anything else as given."""
    if weight == 1.0:
        return reward
    if isinstance(reward, (int, float)) and not isinstance(reward, bool):
        return reward * weight
    score = reward.get("score") if isinstance(reward, dict) else None
    if isinstance(score, (int, float)) and not isinstance(score, bool):
        return {**reward, "score": score * weight}
    return reward


def write_segments(sample: Any, r: Rollout, decode: Callable[[list[int]], str], *, requeued: bool,
                   agent: dict[str, Any] | None = None, per_turn: bool = False) -> list[Any]:
    """One sample per segment of a rollout (slime's fan-out), `sample` the first; with `per_turn`,
    one per model turn.

    Siblings are copies of `sample` (the user's metadata kept, the engine's fields their own)
    sharing its `rollout_id` (its `index` when it has none), so slime keeps them together. A
    segment a break closed ends COMPLETED with the break as its reason; the last ends as the
    rollout did (with `remove_sample` when it holds no token: a break opened it with the budget
    spent). An ABORTED rollout is handed back ABORTED whole only to a caller that re-queues
    it (`requeued`); else its last segment ends FAILED with nothing of it trained, the reason kept.
    Each sample's metadata says what it is of the rollout (`segment`), the rollout's last words
    and turn rewards, which its reward is read from, and its share of that reward (`reward_weight`).
    """
    parts = pieces(r, per_turn)
    user = {k: v for k, v in own_metadata(sample).items() if k != FSM}
    samples = [sample] + [_sibling(sample, user) for _ in parts[1:]]
    rollout_id = getattr(sample, "rollout_id", None)
    if rollout_id is None:
        rollout_id = getattr(sample, "index", None)
    whole = rollout_metadata(r)
    whole.pop("checkpoint", None)  # a harness cannot be resumed: an aborted agent runs again whole
    weights = reward_weights(r.cfg, len(parts))
    rewards = whole.pop("turn_rewards", None)
    for k, (out, piece) in enumerate(zip(samples, parts)):
        text = decode(piece.traj.response_ids.tolist())
        write_arrays(out, r, piece.traj, text, r.record.weight_versions[piece.start.versions:piece.end.versions],
                     r.record.call_stats[piece.start.stats:piece.end.stats])
        state = r.state if piece.last else State.COMPLETED.value
        if r.state == State.ABORTED and requeued:
            state = State.ABORTED.value
        elif piece.last and r.state == State.ABORTED:
            state, out.remove_sample = State.FAILED.value, True
        elif piece.last and (r.reason in NOT_TRAINED or not len(piece.traj.response_ids)):
            out.remove_sample = True  # also a segment a break opened with the budget already spent: no token
        set_status(out, state)
        meta = dict(whole, **segment_metadata(r, piece, decode, text))
        meta["segment"] = {"index": k, "count": len(parts), "ended_by": None if piece.last else piece.reason}
        if per_turn:
            meta["segment"]["per_turn"] = True
        meta["breaks"] = [p.reason for p in parts[:-1] if p.reason != "per_turn"]
        if len(parts) > 1:
            meta["rollout_final_text"] = r.final_text
            meta["rollout_turns"] = len(r.record.turn_log)
            meta["reward_weight"] = weights[k]
        if rewards:
            own = turn_rewards(r.record.turn_log[piece.start.turns:piece.end.turns])
            if per_turn:  # the turn is the whole response: its span is all of it
                own = [dict(t, span=(0, piece.traj.response_length)) for t in own]
            meta["turn_rewards"] = own if per_turn else rewards
            if len(parts) > 1:
                meta["rollout_turn_rewards"] = rewards
        if agent is not None:
            meta["agent"] = agent
        own_metadata(out)[FSM] = meta
        if len(parts) > 1:
            _set(out, "rollout_id", rollout_id)
    return samples


def _sibling(sample: Any, user: dict[str, Any]) -> Any:
    twin = copy.copy(sample)
    _set(twin, "metadata", dict(user))
    for name in ("spec_info", "prefix_cache_info"):
        if getattr(twin, name, None) is not None:
            setattr(twin, name, _fresh(getattr(twin, name)))
    _set(twin, "weight_versions", [])
    return twin


def segment_metadata(r: Rollout, piece: Piece, decode: Callable[[list[int]], str], text: str) -> dict[str, Any]:
    """What differs per segment: its path, its turns (each with its span and the sum of its
    logprobs), its token runs, why it ended, its own last words."""
    traj = piece.traj
    runs = iter([s for s in traj.segments if s.kind == "model"])
    turns = []
    for t in r.record.turn_log[piece.start.turns:piece.end.turns]:
        t = dict(t)
        if t.get("tokens"):
            run = next(runs, None)
            if run is not None:
                t["span"] = (run.start, run.end)
                t["logprob"] = float(sum(traj.logprobs[run.start:run.end]))
        turns.append(t)
    last_observation = next((s.end for s in reversed(traj.segments) if s.kind == "observation"), 0)
    final = text if last_observation == 0 else decode(traj.response_ids[last_observation:].tolist())
    return {
        "trace": list(r.record.trace[piece.start.trace:piece.end.trace]),
        "guards": list(r.record.guards[piece.start.trace:piece.end.trace]),
        "termination_reason": piece.reason,
        "turns": turns,
        "segments": [(s.kind, s.start, s.end, s.weight_version) for s in traj.segments],
        "policy_versions": len({s.weight_version for s in traj.segments if s.kind == "model"}),
        "final_text": final,
    }


def routed_experts_array(data: bytes, r: Rollout) -> Any:
    """slime's int32 array of shape (len(tokens) - 1, num_layers, moe_router_topk)."""
    import numpy as np  # a dependency of transformers; only needed with routing replay

    return np.frombuffer(data, dtype=np.int32).reshape(-1, r.cfg.num_layers, r.cfg.moe_router_topk).copy()


def add_call_stats(sample: Any, calls: list[dict[str, int]]) -> None:
    """Accumulate each call's meta_info counters into slime's SpecInfo / PrefixCacheInfo, as its generate does."""
    cache = getattr(sample, "prefix_cache_info", None)
    spec = getattr(sample, "spec_info", None)
    for stats in calls:
        _add(cache, stats)
        if any(k.startswith("spec_") for k in stats):  # slime adds spec figures only under speculative decoding
            _add(spec, stats)


def _add(info: Any, stats: dict[str, int]) -> None:
    add = getattr(info, "add", None)
    if add is None:
        return
    try:
        add(meta_info=dict(stats))
    except TypeError:  # an older signature
        add(dict(stats))


def write_unrolled(sample: Any, reason: str, error: str, cfg: Any = None, sampling_params: Any = None,
                   placeholder: tuple[int, str] = (0, "")) -> None:
    """End a sample that never reached the machine (bad input, setup failed, an adapter bug).

    slime trains FAILED samples, so it gets the dummy slime's own coding-agent example uses: a
    one-token response with mask 0 and `remove_sample=True`, so conversion and the trainer see
    well-formed arrays (top-p replay and routed experts included when they are on) and nothing
    of it is trained. `placeholder` is the token of the prompt and the response, with its text
    (the response is the decode of its one id, I3); (0, "") only when no tokenizer could be had.
    """
    clear_sample(sample)
    token, text = placeholder
    sample.tokens = [token, token]
    sample.response = text
    sample.response_length = 1
    sample.loss_mask = [0]
    sample.rollout_log_probs = [0.0]
    sample.remove_sample = True  # set even on a stand-in without the field: it is what matters here
    if cfg is not None and getattr(cfg, "routing_replay", False):
        import numpy as np

        row = np.arange(cfg.moe_router_topk, dtype=np.int32)
        _set(sample, "rollout_routed_experts", np.tile(row, (1, cfg.num_layers, 1)))
    if isinstance(sampling_params, dict) and top_p_asked(sampling_params):
        _set(sample, "rollout_top_p_token_ids", [])  # slime's conversion asserts these when it asked
        _set(sample, "rollout_top_p_token_offsets", [0, 0])
    status = getattr(type(sample), "Status", None)
    if status is not None:
        sample.status = status.FAILED
    metadata = getattr(sample, "metadata", None)
    if isinstance(metadata, dict):
        metadata[FSM] = {"termination_reason": reason, "engine_error": error, "trace": [], "final_text": ""}


def turn_rewards(turn_log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turns an environment or a tool scored: `{"turn", "span", "reward"}`, `span` the
    turn's `[start, end)` in the response tokens."""
    return [{"turn": t["turn"], "span": t.get("span"), "reward": t["reward"]} for t in turn_log if t.get("reward") is not None]


def rollout_metadata(r: Rollout) -> dict[str, Any]:
    """What the trace tools read back: the path, why it ended, per-turn and per-tool records."""
    record = r.record
    meta: dict[str, Any] = {
        # Tuples of strings and numbers: the collector stops tracking them, so the thousands of
        # samples a step holds cost every full collection less (lists would each be walked).
        "trace": list(record.trace),
        "guards": list(record.guards),
        "termination_reason": record.reason,
        "turns": list(record.turn_log),
        "tool_stats": record.tools.as_dict(),
        "generation_time": round(record.generation_time, 6),
        "tool_time": round(record.tools.seconds, 6),
        "profile": r.cfg.profile,
    }
    segments = r.traj.segments
    meta["segments"] = [(s.kind, s.start, s.end, s.weight_version) for s in segments]
    meta["policy_versions"] = len({s.weight_version for s in segments if s.kind == "model"})
    meta["attempt"] = r.attempt
    meta["final_text"] = r.final_text
    rewards = turn_rewards(record.turn_log)
    if rewards:
        meta["turn_rewards"] = rewards
    env = r.inputs.environment
    if env is not None:
        meta["environment"] = {"name": getattr(env, "name", type(env).__name__), "reason": record.env_reason,
                               "success": record.env_success}
        meta["environment_time"] = round(record.env_seconds, 6)
    if r.traj.experts is not None:
        meta["routed_experts_rows"] = r.traj.routed_rows  # from the server; the rest are padding
    if r.resume_rejected:
        meta["checkpoint_rejected"] = r.resume_rejected
    # An environment's episode lives in its own memory, which no checkpoint holds: such a sample
    # re-queued starts again from its prompt.
    if (r.cfg.partial_rollout and r.state == State.ABORTED and record.reason != Trigger.INVARIANT_VIOLATED
            and r.inputs.environment is None):
        meta["checkpoint"] = checkpoint.make_checkpoint(r, frozenset(get_machine().spec.tool_states))
    if record.error:
        meta["engine_error"] = record.error
    if record.violation:
        meta["invariant_violation"] = record.violation
    return meta
