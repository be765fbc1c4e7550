"""slime's consumers of fan-out, given the shape they read: one sample per rollout in a group.

A generate function that fans out makes each element of a group a `list[Sample]` (one rollout's
segments or turns, sharing `rollout_id`). slime's dynamic-sampling filters read one reward per
element and fail on a list (slime #2374). Set `--dynamic-sampling-filter-path` to the filter here
of the same name: it hands slime's own filter each rollout's last sample (whose reward is the
rollout's whole, shared or discounted: docs/long-rollouts.md).

slime's default reward post-processing runs on the flattened step: it normalizes GRPO groups by
reshaping the rewards to `n_samples_per_prompt` columns only when the step holds exactly
`rollout_batch_size x n_samples_per_prompt` samples, and otherwise normalizes the whole step as
one group. Set `--custom-reward-post-process-path engine.slime.fanout.normalize_rewards_by_group`
to normalize per prompt (`group_index`) over one reward per rollout.
"""

from __future__ import annotations

import math
from typing import Any

# slime's advantage estimators whose rewards are normalized per group, and those divided by the std too.
GROUP_NORMALIZED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
STD_NORMALIZED = ("grpo", "gspo", "cispo")
_EPS = 1e-6  # slime's


def one_per_rollout(group: list[Any]) -> list[Any]:
    """Each element of a group as one sample: a rollout's last, a plain sample itself."""
    return [element[-1] if isinstance(element, list) else element for element in group]


def check_reward_nonzero_std(args: Any, samples: list[Any], **kwargs: Any) -> Any:
    """slime's `check_reward_nonzero_std` over one sample per rollout."""
    from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std as slimes

    return slimes(args, one_per_rollout(samples), **kwargs)


def check_reward_nonzero_std_with_fallback(args: Any, samples: list[Any], **kwargs: Any) -> Any:
    """slime's `check_reward_nonzero_std_with_fallback` over one sample per rollout."""
    from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std_with_fallback as slimes

    return slimes(args, one_per_rollout(samples), **kwargs)


def normalize_rewards_by_group(args: Any, samples: list[Any]) -> tuple[list[float], list[float]]:
    """slime's reward post-processing (`--custom-reward-post-process-path`) for a step whose rollouts
    fan out: (each sample's reward, what it trains on).

    As slime's default where it applies (`advantage_estimator` grpo, gspo, cispo or
    reinforce_plus_plus_baseline with `rewards_normalization`; divided by the std, plus 1e-6, for
    the first three with `grpo_std_normalization`), but a group is the rollouts of one prompt
    (`group_index`) and each rollout counts once, however many samples it came back as: its reward
    is its last sample's (the whole of it), and each of its samples gets its share
    (`metadata["fsm"]["reward_weight"]`, 1 when shared) of the rollout's normalized reward.
    Elsewhere the rewards are handed back as they are.
    """
    raw = [_reward_value(args, s) for s in samples]
    if getattr(args, "advantage_estimator", None) not in GROUP_NORMALIZED or not getattr(args, "rewards_normalization", False):
        return raw, list(raw)
    rollout_of = [_rollout_key(s, k) for k, s in enumerate(samples)]
    whole = {key: raw[k] for k, key in enumerate(rollout_of)}  # the last sample of a rollout wins
    groups: dict[Any, list[float]] = {}
    for key, value in whole.items():
        groups.setdefault(key[0], []).append(value)
    divide = getattr(args, "advantage_estimator", None) in STD_NORMALIZED and getattr(args, "grpo_std_normalization", False)
    normalized = {}
    for group, values in groups.items():
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        normalized[group] = (mean, std + _EPS if divide else 1.0)
    out = []
    for k, key in enumerate(rollout_of):
        mean, scale = normalized[key[0]]
        out.append(_share(samples[k]) * (whole[key] - mean) / scale)
    return raw, out


def _reward_value(args: Any, sample: Any) -> float:
    """The number slime trains on (`--reward-key` picks it from a dict)."""
    key = getattr(args, "reward_key", None)
    return float(sample.reward[key] if key else sample.reward)


def _rollout_key(sample: Any, position: int) -> tuple[Any, Any]:
    """(its prompt's group, its rollout): the engine's fanned-out samples share `rollout_id`."""
    rollout = getattr(sample, "rollout_id", None)
    return getattr(sample, "group_index", None), ("rollout", rollout) if rollout is not None else ("sample", position)


def _share(sample: Any) -> float:
    fsm = (getattr(sample, "metadata", None) or {}).get("fsm")
    weight = fsm.get("reward_weight") if isinstance(fsm, dict) else None
    return float(weight) if isinstance(weight, (int, float)) and not isinstance(weight, bool) else 1.0
