"""A stand-in for slime's `Sample`, for running and testing the engine without slime.

slime is not installable from a package registry, so `python -m engine run` and the tests use
this class instead. Its fields and the nested `Status` enum mirror `slime.utils.types.Sample`
(the fields a generate function touches, with the same five statuses), and so do the two
per-call statistics objects slime accumulates from `meta_info`. The adapter (`engine.slime`)
works on it by duck typing alone, exactly as on slime's class: nothing checks `isinstance`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class SpecInfo:
    """slime's speculative-decoding statistics of a sample."""

    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0

    def add(self, meta_info: dict[str, Any]) -> None:
        """Accumulate one `/generate` reply's `meta_info`, as slime's does."""
        self.spec_accept_token_num += int(meta_info.get("spec_accept_token_num", 0) or 0)
        self.spec_draft_token_num += int(meta_info.get("spec_draft_token_num", 0) or 0)
        self.spec_verify_ct += int(meta_info.get("spec_verify_ct", 0) or 0)
        self.completion_token_num += int(meta_info.get("completion_tokens", 0) or 0)


@dataclass
class PrefixCacheInfo:
    """slime's prefix-cache statistics of a sample."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0

    def add(self, meta_info: dict[str, Any]) -> None:
        """Accumulate one `/generate` reply's `meta_info`, as slime's does."""
        self.cached_tokens += int(meta_info.get("cached_tokens", 0) or 0)
        self.total_prompt_tokens += int(meta_info.get("prompt_tokens", 0) or 0)


@dataclass
class Sample:
    """One prompt and, after a rollout, everything slime would train on."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None  # shared by the samples one rollout fans out to (None: its `index`)
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
    metadata: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, the status as its value string (as slime's `to_dict` writes it)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["status"] = self.status.value
        for name in ("spec_info", "prefix_cache_info"):
            value = data[name]
            data[name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        experts = data["rollout_routed_experts"]
        if experts is not None and hasattr(experts, "tolist"):
            data["rollout_routed_experts"] = experts.tolist()
        return data
