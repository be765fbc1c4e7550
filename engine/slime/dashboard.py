"""The engine's figures on slime's dashboard: `--custom-rollout-log-function-path engine.slime.log_rollout`.

slime calls the custom rollout log function first, with `(rollout_id, args, samples,
rollout_extra_metrics, rollout_time)`, and skips its own logging when it returns True; its own
logging starts from `rollout_extra_metrics`. So `log_rollout` adds the engine's figures to that
dict and returns False: slime then logs its own rollout metrics and the engine's in one call,
at the rollout step, to wandb and/or tensorboard as configured. When slime hands no dict
(`None`), the engine's figures are logged through slime's own logger at the same step.

Every figure is read from `sample.metadata["fsm"]` (and `status`, `remove_sample`); a sample the
engine did not write counts under the termination reason `unknown`. Nothing here raises into
slime: a figure that cannot be computed is left out, with one warning.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, MutableMapping
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "engine/"
TRIM_REASONS = frozenset({"reply_over_budget", "observation_over_budget"})


def _fsm(sample: Any) -> dict[str, Any]:
    metadata = getattr(sample, "metadata", None)
    fsm = metadata.get("fsm") if isinstance(metadata, dict) else None
    return fsm if isinstance(fsm, dict) else {}


def _status(sample: Any) -> str:
    status = getattr(sample, "status", None)
    name = getattr(status, "name", None)
    return str(name if name is not None else status).rsplit(".", 1)[-1].upper()


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def engine_metrics(samples: Iterable[Any]) -> dict[str, float]:
    """The engine's figures of one rollout step, each key under `engine/`.

    Samples per status and termination reason (counts), attempts, turns and tool calls per
    sample (mean, max), calls and error rate per tool, samples per environment, the shares of
    rollout time spent in tools and in environments, and the samples cut to the budget (trimmed)
    or handed back untrained (removed).
    """
    samples = list(samples)
    out: dict[str, float] = {"samples": float(len(samples))}
    statuses: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    attempts: list[float] = []
    turns: list[float] = []
    tool_calls: list[float] = []
    tool_time = generation_time = environment_time = 0.0
    environments: Counter[str] = Counter()
    trimmed = removed = 0
    for sample in samples:
        fsm = _fsm(sample)
        statuses[_status(sample)] += 1
        reason = fsm.get("termination_reason")
        reasons[str(reason) if reason else "unknown"] += 1
        attempts.append(float(len(fsm["attempts"]) if isinstance(fsm.get("attempts"), list) else 1))
        log_of_turns = fsm.get("turns") if isinstance(fsm.get("turns"), (list, tuple)) else []
        turns.append(float(len(log_of_turns)))
        made = 0
        for turn in log_of_turns:
            names = turn.get("tools") if isinstance(turn, dict) else None
            kinds = turn.get("errors") if isinstance(turn, dict) else None
            if not isinstance(names, (list, tuple)):
                continue
            kinds = kinds if isinstance(kinds, (list, tuple)) and len(kinds) == len(names) else [None] * len(names)
            for name, kind in zip(names, kinds):
                tool = str(name) if name else "unparsed"
                made += 1
                calls[tool] += 1
                if kind and kind != "output_truncated":  # a cut output is a call that worked
                    errors[tool] += 1
        tool_calls.append(float(made))
        tool_time += _number(fsm.get("tool_time"))
        generation_time += _number(fsm.get("generation_time"))
        environment_time += _number(fsm.get("environment_time"))
        env = fsm.get("environment")
        if isinstance(env, dict) and env.get("name"):
            environments[str(env["name"])] += 1
        trimmed += reason in TRIM_REASONS
        removed += bool(getattr(sample, "remove_sample", False))
    for name, n in statuses.items():
        out[f"status/{name}"] = float(n)
    for name, n in reasons.items():
        out[f"termination_reason/{name}"] = float(n)
    for key, values in (("attempts", attempts), ("turns", turns), ("tool_calls", tool_calls)):
        out[f"{key}/mean"] = sum(values) / len(values) if values else 0.0
        out[f"{key}/max"] = max(values) if values else 0.0
    for tool, n in calls.items():
        out[f"tool/{tool}/calls"] = float(n)
        out[f"tool/{tool}/error_rate"] = errors[tool] / n
    busy = tool_time + generation_time + environment_time
    out["tool_time_share"] = tool_time / busy if busy > 0 else 0.0
    out["environment_time_share"] = environment_time / busy if busy > 0 else 0.0
    for name, n in environments.items():
        out[f"environment/{name}/samples"] = float(n)
    out["trimmed"] = float(trimmed)
    out["removed"] = float(removed)
    return {PREFIX + key: value for key, value in out.items()}


def log_rollout(rollout_id: int, args: Any, samples: Any, rollout_extra_metrics: Any, rollout_time: Any) -> bool:
    """slime's custom rollout log function: adds the engine's figures, lets slime log its own.

    Returns False (slime's own logging runs, with the engine's figures in it); never raises.
    """
    try:
        figures = engine_metrics(samples or [])
    except Exception as exc:  # a figure is not worth a training step
        log.warning("engine metrics of rollout %s left out: %s: %s", rollout_id, type(exc).__name__, exc)
        return False
    if isinstance(rollout_extra_metrics, MutableMapping):
        rollout_extra_metrics.update(figures)
        return False
    try:  # no dict to add to: log them at the same step through slime's own logger
        from slime.observability import logging_utils
        from slime.observability.metric_utils import compute_rollout_step

        figures["rollout/step"] = compute_rollout_step(args, rollout_id)
        logging_utils.log(args, figures, step_key="rollout/step")
    except Exception as exc:
        log.warning("engine metrics of rollout %s not logged: %s: %s", rollout_id, type(exc).__name__, exc)
    return False


__all__ = ["engine_metrics", "log_rollout"]
