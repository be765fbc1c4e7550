"""A slime-compatible `Sample` for running the engine without slime (the `run` command).

The fields and the nested `Status` enum mirror slime's `slime.utils.types.Sample`, so
the rollout JSONL this project writes reads like slime's own sample dicts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class Sample:
    """One prompt and, after a rollout, everything slime would train on."""

    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    label: str | None = None
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    reward: float | dict[str, Any] | None = None
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

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, the status as its value string (as slime's `to_dict` writes it)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["status"] = self.status.value
        return data
