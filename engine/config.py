"""Frozen, validated settings of the engine, and how they are read from slime's `args`."""

from __future__ import annotations

from typing import Any

import attrs
from attrs import validators as v

DEFAULT_SERVER_URL = "http://127.0.0.1:30000"
_positive = v.gt(0)
_non_negative = v.ge(0)


@attrs.frozen
class RetryPolicy:
    """Retries of transient HTTP failures: exponential backoff with full jitter, bounded twice."""

    max_attempts: int = attrs.field(default=6, validator=_positive)
    base_delay: float = attrs.field(default=0.5, validator=_non_negative)
    max_delay: float = attrs.field(default=16.0, validator=_non_negative)
    deadline: float = attrs.field(default=300.0, validator=_positive)  # seconds over all attempts

    def delay(self, attempt: int, rand: float) -> float:
        """Sleep before retry number `attempt` (1-based), given a uniform `rand` in [0, 1)."""
        return rand * min(self.max_delay, self.base_delay * 2 ** (attempt - 1))


@attrs.frozen
class EngineConfig:
    """Everything one rollout needs to know besides the sample and the sampling params.

    `max_context_len` bounds prompt + response (None: only the server bounds it);
    `max_response_len` bounds the whole response of a trajectory (None: unbounded);
    the per-turn cap is `sampling_params["max_new_tokens"]`. The three stay separate.
    """

    server_url: str = DEFAULT_SERVER_URL
    profile: str = "retool"
    max_turns: int = attrs.field(default=16, validator=_positive)
    max_tool_calls: int = attrs.field(default=16, validator=_non_negative)
    max_calls_per_turn: int = attrs.field(default=8, validator=_positive)
    max_context_len: int | None = attrs.field(default=None, validator=v.optional(_positive))
    max_response_len: int | None = attrs.field(default=None, validator=v.optional(_positive))
    tool_timeout: float = attrs.field(default=120.0, validator=_positive)
    tool_concurrency: int = attrs.field(default=32, validator=_positive)
    tool_output_chars: int = attrs.field(default=8192, validator=_positive)
    tools: tuple[str, ...] | None = None  # None: every registered tool
    tool_modules: tuple[str, ...] = ()  # modules imported so their tools register
    request_timeout: float = attrs.field(default=1800.0, validator=_positive)
    connect_timeout: float = attrs.field(default=10.0, validator=_positive)
    max_connections: int = attrs.field(default=512, validator=_positive)
    retry: RetryPolicy = attrs.field(factory=RetryPolicy)
    partial_rollout: bool = False
    mask_offpolicy: bool = False
    tokenizer_path: str | None = None
    gc_freeze: bool = True  # see engine.loop.runtime.freeze_long_lived_objects
    # Where sandboxed tool code runs: "local" (this machine) or "ray" (a pool of workers on the
    # Ray cluster; see tools.sandbox.backend). The ray_* settings size and place that pool.
    sandbox_backend: str = attrs.field(default="local")
    sandbox_workers: int = attrs.field(default=4, validator=_positive)
    sandbox_worker_cpus: float = attrs.field(default=1.0, validator=_positive)
    sandbox_resource: str | None = None  # a custom Ray resource the workers need (CPU nodes only)
    sandbox_queue: int = attrs.field(default=256, validator=_non_negative)

    @sandbox_backend.validator
    def _check_sandbox_backend(self, attribute: Any, value: str) -> None:
        from tools.sandbox.backend import check_backend  # refuses "ray" where ray is not installed

        check_backend(value)

    def context_limit(self, prompt_length: int) -> int | None:
        """The most tokens prompt + response may hold for a prompt of this length."""
        limits = [n for n in (self.max_context_len, self.max_response_len and prompt_length + self.max_response_len) if n]
        return min(limits) if limits else None

    @classmethod
    def from_args(cls, args: Any) -> EngineConfig:
        """Read slime's argparse namespace; `engine_*` keys come from `--custom-config-path` YAML."""

        def get(name: str, default: Any) -> Any:
            value = getattr(args, name, None)
            return default if value is None else value

        ip, port = getattr(args, "sglang_router_ip", None), getattr(args, "sglang_router_port", None)
        max_context = getattr(args, "rollout_max_context_len", None)
        if max_context is None:
            per_gpu = getattr(args, "max_tokens_per_gpu", None)
            if per_gpu:
                max_context = int(get("context_parallel_size", 1)) * int(per_gpu)
        tools = get("engine_tools", None)
        modules = get("engine_tool_modules", ())
        retry = RetryPolicy(
            max_attempts=int(get("engine_retry_attempts", 6)),
            deadline=float(get("engine_retry_deadline", 300.0)),
            base_delay=float(get("engine_retry_base_delay", 0.5)),
        )
        concurrency = int(get("sglang_server_concurrency", 512))
        engines = max(1, int(get("rollout_num_gpus", 1)) // max(1, int(get("rollout_num_gpus_per_engine", 1))))
        return cls(
            server_url=get("engine_server_url", f"http://{ip}:{port}" if ip and port else DEFAULT_SERVER_URL),
            profile=str(get("engine_profile", "retool")),
            max_turns=int(get("engine_max_turns", 16)),
            max_tool_calls=int(get("engine_max_tool_calls", 16)),
            max_calls_per_turn=int(get("engine_max_calls_per_turn", 8)),
            max_context_len=max_context,
            max_response_len=get("engine_max_response_len", None),
            tool_timeout=float(get("engine_tool_timeout", 120.0)),
            tool_concurrency=int(get("engine_tool_concurrency", 32)),
            tool_output_chars=int(get("engine_tool_output_chars", 8192)),
            tools=tuple(tools.split(",") if isinstance(tools, str) else tools) if tools else None,
            tool_modules=tuple(modules.split(",") if isinstance(modules, str) else modules),
            request_timeout=float(get("engine_request_timeout", 1800.0)),
            max_connections=concurrency * engines,
            retry=retry,
            partial_rollout=bool(get("partial_rollout", False)),
            mask_offpolicy=bool(get("mask_offpolicy_in_partial_rollout", False)),
            tokenizer_path=get("hf_checkpoint", None),
            gc_freeze=bool(get("engine_gc_freeze", True)),
            sandbox_backend=str(get("engine_sandbox_backend", "local")),
            sandbox_workers=int(get("engine_sandbox_workers", 4)),
            sandbox_worker_cpus=float(get("engine_sandbox_worker_cpus", 1.0)),
            sandbox_resource=get("engine_sandbox_resource", None) or None,
            sandbox_queue=int(get("engine_sandbox_queue", 256)),
        )
