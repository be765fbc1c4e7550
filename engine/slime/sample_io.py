"""Reading and writing slime's `Sample`, duck-typed: with `engine.slime`, the only code that knows it.

slime is not importable here, so nothing checks `isinstance`; statuses are set through
`type(sample).Status` so slime's own enum is used. Everything the engine records goes under
one key, `sample.metadata["fsm"]`; the rest of `metadata` belongs to the user and to slime.
"""

from __future__ import annotations

from typing import Any

from engine.machine import checkpoint
from engine.machine.rollout import Rollout, Saved
from engine.machine.states import State, Trigger
from engine.machine.table import get_machine

FSM = "fsm"  # the one key of sample.metadata that the engine writes


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
    )


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


def write_sample(sample: Any, r: Rollout) -> None:
    """Hand the rollout to the sample: every per-token field from the one trajectory."""
    traj = r.traj
    sample.tokens = traj.prompt_ids.tolist() + traj.response_ids.tolist()
    sample.response = r.text
    sample.response_length = traj.response_length
    sample.loss_mask = traj.loss_mask.tolist()
    sample.rollout_log_probs = traj.logprobs.tolist()
    _set(sample, "rollout_top_p_token_ids", traj.top_p_ids.tolist() if traj.top_p_ids is not None else None)
    _set(sample, "rollout_top_p_token_offsets", traj.top_p_offsets.tolist() if traj.top_p_offsets is not None else None)
    _set(sample, "weight_versions", list(r.record.weight_versions))
    if hasattr(sample, "non_generation_time"):
        sample.non_generation_time = float(sample.non_generation_time or 0.0) + r.record.tools.seconds
    if r.reason == "prompt_over_budget":
        _set(sample, "remove_sample", True)  # slime drops it from training: no token of it fits
    status = getattr(type(sample), "Status", None)
    if status is not None and r.state in status.__members__:
        sample.status = status[r.state]
    metadata = getattr(sample, "metadata", None)
    if not isinstance(metadata, dict):
        metadata = {}
        _set(sample, "metadata", metadata)
    metadata[FSM] = rollout_metadata(r)


def rollout_metadata(r: Rollout) -> dict[str, Any]:
    """What the trace tools read back: the path, why it ended, per-turn and per-tool records."""
    record = r.record
    meta: dict[str, Any] = {
        "trace": [list(edge) for edge in record.trace],
        "guards": list(record.guards),
        "termination_reason": record.reason,
        "turns": list(record.turn_log),
        "tool_stats": record.tools.as_dict(),
        "generation_time": round(record.generation_time, 6),
        "tool_time": round(record.tools.seconds, 6),
        "profile": r.cfg.profile,
    }
    segments = r.traj.segments
    meta["segments"] = [[s.kind, s.start, s.end, s.weight_version] for s in segments]
    meta["policy_versions"] = len({s.weight_version for s in segments if s.kind == "model"})
    meta["attempt"] = r.attempt
    if r.resume_rejected:
        meta["checkpoint_rejected"] = r.resume_rejected
    if r.cfg.partial_rollout and r.state == State.ABORTED and record.reason != Trigger.INVARIANT_VIOLATED:
        meta["checkpoint"] = checkpoint.make_checkpoint(r, frozenset(get_machine().spec.tool_states))
    if record.error:
        meta["engine_error"] = record.error
    if record.violation:
        meta["invariant_violation"] = record.violation
    return meta
