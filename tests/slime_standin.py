"""A faithful stand-in for slime's `Sample` (slime is not installable here).

Mirrors the fields of slime/utils/types.py that a generate function touches, with the
nested `Status` enum of the same five members. The adapter must work on it by duck
typing alone, exactly as on slime's class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class SpecInfo:
    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0


@dataclass
class PrefixCacheInfo:
    cached_tokens: int = 0
    total_prompt_tokens: int = 0


@dataclass
class Sample:
    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    session_id: str | None = None
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)
