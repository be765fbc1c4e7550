"""Frozen, validated settings of the engine, and how they are read from slime's `args`.

slime hands a generate function its argparse namespace; the keys of `--custom-config-path`
YAML become attributes of it. `EngineConfig.from_args` reads that namespace through one
table, `SETTINGS`: every key the engine reads, its type, its default, the range it must lie
in and what it means. A value of the wrong type or outside its range raises `SettingsError`
naming the key and what is allowed (the slime adapter then ends every sample with
`engine_setup_failed` and that message). A few sizes are *capped* instead: a value past the
cap is usable but pointless, so it is lowered with one warning (the HTTP pool is the one
that matters: `sglang_server_concurrency=10**8` would otherwise build clients until memory
runs out). An `engine_*` key the table does not know is warned about once, with the closest
known key. The command line (`python -m engine run --config engine.yaml`) goes through the
same table, so it reads a YAML exactly as a slime job would.
"""

from __future__ import annotations

import difflib
import logging
import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

import attrs
from attrs import validators as v

log = logging.getLogger(__name__)

DEFAULT_SERVER_URL = "http://127.0.0.1:30000"
HTTP_TRANSPORTS = ("auto", "asyncio", "httpx", "aiohttp", "aiohttp_direct")  # engine_http_transport; see engine.sglang.client
_positive = v.gt(0)
_non_negative = v.ge(0)


class SettingsError(ValueError):
    """A setting that cannot be used; the message names the key and what is allowed."""


@attrs.frozen
class RetryPolicy:
    """Retries of transient HTTP failures: exponential backoff with full jitter, bounded twice."""

    max_attempts: int = attrs.field(default=6, validator=_positive)
    base_delay: float = attrs.field(default=0.5, validator=_non_negative)
    max_delay: float = attrs.field(default=16.0, validator=_non_negative)
    # Seconds over all attempts and the waits between them, the one in flight included. As long as
    # the request timeout by default: a lower bound would cut long generations short.
    deadline: float = attrs.field(default=1800.0, validator=_positive)

    def delay(self, attempt: int, rand: float) -> float:
        """Sleep before retry number `attempt` (1-based), given a uniform `rand` in [0, 1)."""
        return rand * min(self.max_delay, self.base_delay * 2 ** (attempt - 1))


# -- the table of settings ------------------------------------------------------------------


@attrs.frozen
class Setting:
    """One key of slime's `args` (or of the YAML) that the engine reads.

    `kind` is int, float, bool, str, "names" (a list, or a comma-separated string) or
    "url". Numbers must lie in [low, high]; with `cap` a number above `high` is lowered to
    it (with a warning) instead of refused. `choices` limits a str. `None` is always
    allowed and means the default.
    """

    key: str
    kind: Any
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    cap: bool = False
    choices: tuple[str, ...] | None = None
    above_low: bool = False  # low itself is not allowed (a timeout of 0)

    def allowed(self) -> str:
        """What the setting accepts, in words."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.kind is bool:
            return "true or false"
        if self.kind == "names":
            return "a list of names (or one comma-separated string)"
        if self.kind == "url":
            return "an http:// or https:// URL"
        what = "a whole number" if self.kind is int else "a number" if self.kind is float else "text"
        if self.low is not None and self.high is not None and not self.cap:
            return f"{what} {'>' if self.above_low else 'from'} {_fmt(self.low)}{' and <=' if self.above_low else ' to'} {_fmt(self.high)}"
        if self.low is not None:
            return f"{what} {'>' if self.above_low else '>='} {_fmt(self.low)}"
        return what

    def read(self, value: Any) -> Any:
        """The value converted and checked; raises SettingsError saying what is allowed."""
        if value is None:
            return self.default
        try:
            converted = _CONVERT[self.kind](value)
        except (TypeError, ValueError):
            raise SettingsError(f"{self.key} must be {self.allowed()}, got {value!r}") from None
        if self.choices and converted not in self.choices:
            raise SettingsError(f"{self.key} must be {self.allowed()}, got {value!r}")
        if isinstance(converted, (int, float)) and not isinstance(converted, bool):
            too_low = self.low is not None and (converted <= self.low if self.above_low else converted < self.low)
            if too_low or (self.high is not None and converted > self.high and not self.cap):
                raise SettingsError(f"{self.key} must be {self.allowed()}, got {value!r}")
            if self.high is not None and converted > self.high:
                warn_once(f"{self.key}={value!r} is more than the engine uses; capped at {_fmt(self.high)}")
                converted = type(converted)(self.high)
        return converted


def _fmt(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) and not x.is_integer() else f"{int(x)}"


def _int(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("a bool is not a count")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("not whole")
        return int(value)
    if isinstance(value, str):
        return int(value.strip())
    if isinstance(value, int):
        return value
    raise TypeError(type(value).__name__)


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError("a bool is not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError("not finite")
    return number


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _names(value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(n, str) for n in items):
        raise TypeError("not a list of names")
    return tuple(n.strip() for n in items if n.strip())


def _url(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith(("http://", "https://")) or len(value) < 10:
        raise ValueError("not an http(s) URL")
    return value.rstrip("/")


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("not text")
    return value


_CONVERT: dict[Any, Callable[[Any], Any]] = {int: _int, float: _float, bool: _bool, str: _str, "names": _names, "url": _url}

DAY = 86400.0
# The HTTP pool holds one small client per 4 connections: past this many connections the
# pool only costs memory and start-up time (a slime job's samples wait in slime's own semaphore).
MAX_CONNECTIONS = 16384

SETTINGS: dict[str, Setting] = {s.key: s for s in (
    # engine_* keys: set in the YAML of --custom-config-path (or `run --config`)
    Setting("engine_server_url", "url", None, "SGLang server or router URL (default: slime's router)"),
    Setting("engine_profile", str, "retool", "prompt and turn format: retool, chat, or a registered profile"),
    Setting("engine_tool_parser", str, None, "the chat profile's tool-call format, by SGLang's --tool-call-parser name (default: from the chat template, else hermes)"),
    Setting("engine_max_turns", int, 16, "model turns per sample", low=1, high=100_000),
    Setting("engine_max_tool_calls", int, 16, "tool calls per sample", low=0, high=1_000_000),
    Setting("engine_max_calls_per_turn", int, 8, "tool calls run per turn (the rest get an error)", low=1, high=10_000),
    Setting("engine_max_response_len", int, None, "response tokens per sample, over all turns", low=1, high=10**9),
    Setting("engine_tool_timeout", float, 120.0, "seconds a tool call may run", low=0, high=DAY, above_low=True),
    Setting("engine_tool_concurrency", int, 32, "tool calls running at once (per event loop)", low=1, high=4096, cap=True),
    Setting("engine_tool_output_chars", int, 8192, "characters of a tool's output kept", low=1, high=10**8),
    Setting("engine_tools", "names", None, "the tools offered (default: every registered tool)"),
    Setting("engine_tool_modules", "names", (), "modules imported so their tools register"),
    Setting("engine_request_timeout", float, 1800.0, "seconds one /generate request may take", low=0, high=7 * DAY, above_low=True),
    Setting("engine_connect_timeout", float, 10.0, "seconds to connect to the server", low=0, high=3600, above_low=True),
    Setting("engine_max_reply_bytes", int, 1 << 30, "bytes one /generate reply may hold; a larger one fails the request", low=1 << 16, high=1 << 40),
    Setting("engine_retry_attempts", int, 6, "attempts per request (1: no retry)", low=1, high=1000),
    Setting("engine_retry_deadline", float, None, "seconds over all attempts of one request, the one in flight included (default: the request timeout)", low=0, high=7 * DAY, above_low=True),
    Setting("engine_retry_base_delay", float, 0.5, "first backoff (doubles per retry)", low=0, high=3600),
    Setting("engine_retry_max_delay", float, 16.0, "longest backoff", low=0, high=3600),
    Setting("engine_http_transport", str, "auto", "the HTTP client: auto (asyncio, or httpx while respx mocks it), asyncio (the engine's own HTTP/1.1 client), httpx, aiohttp (httpx over httpx-aiohttp), aiohttp_direct (aiohttp's client)", choices=HTTP_TRANSPORTS),
    Setting("engine_sandbox_backend", str, "local", "where sandboxed code runs: local (this machine) or ray (workers on the Ray cluster)", choices=("local", "ray")),
    Setting("engine_sandbox_workers", int, 4, "Ray sandbox workers", low=1, high=100_000),
    Setting("engine_sandbox_worker_cpus", float, 1.0, "CPUs each Ray sandbox worker reserves", low=0, high=1024, above_low=True),
    Setting("engine_sandbox_resource", str, None, "a custom Ray resource the sandbox workers need (to keep them on CPU nodes)"),
    Setting("engine_sandbox_queue", int, 256, "calls that may wait for a free Ray worker", low=0, high=10**7),
    Setting("engine_gc_freeze", bool, True, "gc.freeze() long-lived objects once at start-up"),
    Setting("engine_gc_defer_full", bool, True, "defer automatic full GC collections while samples are in flight; resumed when they drain"),
    Setting("engine_abort_status", str, "retry", "a sample whose attempt failed: re-run it (retry), or hand ABORTED back at once (aborted, for a caller that re-queues)", choices=("retry", "aborted")),
    Setting("engine_sample_attempts", int, 3, "attempts of one sample before it ends FAILED with remove_sample", low=1, high=1000),
    Setting("engine_sample_deadline", float, 1800.0, "seconds after which no new attempt of a sample starts", low=0, high=7 * DAY, above_low=True),
    # slime's own arguments that the engine reads
    Setting("sglang_router_ip", str, None, "slime's router address"),
    Setting("sglang_router_port", int, None, "slime's router port", low=1, high=65535),
    Setting("sglang_server_concurrency", int, 512, "requests in flight per engine", low=1, high=MAX_CONNECTIONS, cap=True),
    Setting("rollout_num_gpus", int, 1, "GPUs for inference", low=0, high=1_000_000),
    Setting("rollout_num_gpus_per_engine", int, 1, "GPUs per inference engine", low=1, high=1_000_000),
    Setting("rollout_max_context_len", int, None, "prompt + response tokens", low=1, high=10**9),
    Setting("max_tokens_per_gpu", int, None, "the context when rollout_max_context_len is unset", low=1, high=10**9),
    Setting("context_parallel_size", int, 1, "multiplies max_tokens_per_gpu", low=1, high=1_000_000),
    Setting("partial_rollout", bool, False, "resume aborted samples from their checkpoint"),
    Setting("mask_offpolicy_in_partial_rollout", bool, False, "mask tokens of older weights on resume"),
    Setting("hf_checkpoint", str, None, "model directory; its tokenizer is used"),
    Setting("use_rollout_routing_replay", bool, False, "routing replay (R3): ask for routed experts every turn"),
    Setting("num_layers", int, 0, "the model's layers (rows of routed experts per token)", low=0, high=100_000),
    Setting("moe_router_topk", int, 0, "experts per token (columns of routed experts)", low=0, high=100_000),
)}

ENGINE_PREFIX = "engine_"


def setting(args: Any, key: str) -> Any:
    """The checked value of one key of `args` (its default when absent or None)."""
    return SETTINGS[key].read(getattr(args, key, None))


def unknown_engine_keys(keys: Iterable[str]) -> dict[str, str | None]:
    """`engine_*` keys the table does not know, each with the closest known key (or None)."""
    known = [k for k in SETTINGS if k.startswith(ENGINE_PREFIX)]
    out: dict[str, str | None] = {}
    for key in keys:
        if key.startswith(ENGINE_PREFIX) and key not in SETTINGS:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            out[key] = close[0] if close else None
    return out


def unknown_key_message(key: str, closest: str | None) -> str:
    """The warning for an `engine_*` key nothing reads."""
    hint = f"; did you mean {closest}?" if closest else ""
    return f"unknown engine setting {key} (ignored){hint}"


_warned: set[str] = set()
_warned_lock = threading.Lock()


def log_once(message: str, level: int = logging.WARNING, logger: logging.Logger = log) -> bool:
    """Log `message` the first time this process sees it (from_args runs once per sample); True if logged."""
    with _warned_lock:
        if message in _warned:
            return False
        _warned.add(message)
    logger.log(level, message)
    return True


def warn_once(message: str) -> None:
    """A warning, once per process."""
    log_once(message)


def _namespace_keys(args: Any) -> list[str]:
    try:
        return list(vars(args))
    except TypeError:
        return [k for k in dir(args) if not k.startswith("_")]


def _hashable(value: Any) -> Any:
    """A value as a cache key: lists (engine_tools from YAML) become tuples, the rest by identity if unhashable."""
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return ("unhashable", id(value))
    return (type(value), value)  # 1, 1.0 and True stay apart: they read differently


_FROM_ARGS_CACHE = 64
_from_args_cache: dict[Any, EngineConfig] = {}


# -- the settings ---------------------------------------------------------------------------


@attrs.frozen
class EngineConfig:
    """Everything one rollout needs to know besides the sample and the sampling params.

    `max_context_len` bounds prompt + response (None: only the server bounds it);
    `max_response_len` bounds the whole response of a trajectory (None: unbounded);
    the per-turn cap is `sampling_params["max_new_tokens"]`. The three stay separate.
    """

    server_url: str = DEFAULT_SERVER_URL
    profile: str = "retool"
    tool_parser: str | None = None  # the chat profile's tool-call format (SGLang parser name)
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
    max_reply_bytes: int = attrs.field(default=1 << 30, validator=_positive)  # routing replay replies run to 100s of MB
    max_connections: int = attrs.field(default=512, validator=_positive)
    # asyncio | httpx | aiohttp (httpx-aiohttp) | aiohttp_direct | auto: asyncio unless respx is
    # mocking httpx, then httpx. See engine.sglang.client.
    http_transport: str = attrs.field(default="auto", validator=v.in_(HTTP_TRANSPORTS))
    retry: RetryPolicy = attrs.field(factory=RetryPolicy)
    partial_rollout: bool = False
    mask_offpolicy: bool = False
    tokenizer_path: str | None = None
    gc_freeze: bool = True  # see engine.loop.runtime.freeze_long_lived_objects
    gc_defer_full: bool = True  # see engine.loop.runtime.FullCollections
    # What a sample that cannot finish hands back (see engine.loop.attempts): "retry" re-runs it
    # from RESET up to `sample_attempts` times within `sample_deadline` seconds, then ends it
    # FAILED with remove_sample; "aborted" hands ABORTED back at once, for a caller that re-queues.
    abort_status: str = attrs.field(default="retry", validator=v.in_(("retry", "aborted")))
    sample_attempts: int = attrs.field(default=3, validator=_positive)
    sample_deadline: float = attrs.field(default=1800.0, validator=_positive)
    # Routing replay (R3): ask for routed experts each turn; a row is num_layers x moe_router_topk int32.
    routing_replay: bool = False
    num_layers: int = attrs.field(default=0, validator=_non_negative)
    moe_router_topk: int = attrs.field(default=0, validator=_non_negative)
    fully_async: bool = False  # slime's fully-async worker is the caller: it re-queues ABORTED groups
    # Where sandboxed tool code runs: "local" (this machine) or "ray" (a pool of workers on the
    # Ray cluster; see engine.tools.sandbox.backend). The ray_* settings size and place that pool.
    sandbox_backend: str = attrs.field(default="local")
    sandbox_workers: int = attrs.field(default=4, validator=_positive)
    sandbox_worker_cpus: float = attrs.field(default=1.0, validator=_positive)
    sandbox_resource: str | None = None  # a custom Ray resource the workers need (CPU nodes only)
    sandbox_queue: int = attrs.field(default=256, validator=_non_negative)

    @sandbox_backend.validator
    def _check_sandbox_backend(self, attribute: Any, value: str) -> None:
        from engine.tools.sandbox.backend import check_backend  # refuses "ray" where ray is not installed

        check_backend(value)

    def __attrs_post_init__(self) -> None:
        if self.routing_replay and not (self.num_layers and self.moe_router_topk):
            raise ValueError("routing replay needs num_layers and moe_router_topk (slime args) to be set")

    @property
    def expert_row_bytes(self) -> int:
        """Bytes of one token's routed experts (int32 per layer and top-k slot); 0 without R3."""
        return 4 * self.num_layers * self.moe_router_topk if self.routing_replay else 0

    def context_limit(self, prompt_length: int) -> int | None:
        """The most tokens prompt + response may hold for a prompt of this length."""
        limits = [n for n in (self.max_context_len, self.max_response_len and prompt_length + self.max_response_len) if n]
        return min(limits) if limits else None

    @classmethod
    def from_args(cls, args: Any) -> EngineConfig:
        """Read slime's argparse namespace (`engine_*` keys come from `--custom-config-path` YAML).

        Every key is checked against `SETTINGS`; raises SettingsError with one clear sentence.
        slime calls this once per sample with the same `args`: the result is remembered by the
        values it was read from, and the namespace is scanned for unknown keys once per object.
        """
        seen = (id(args), tuple(_hashable(getattr(args, key, None)) for key in SETTINGS))
        cached = _from_args_cache.get(seen)
        if cached is not None:
            return cached
        cfg = cls._read_args(args)
        if len(_from_args_cache) >= _FROM_ARGS_CACHE:
            _from_args_cache.clear()
        _from_args_cache[seen] = cfg
        return cfg

    @classmethod
    def _read_args(cls, args: Any) -> EngineConfig:
        for key, closest in unknown_engine_keys(_namespace_keys(args)).items():
            warn_once(unknown_key_message(key, closest))

        def get(key: str) -> Any:
            return setting(args, key)

        ip, port = get("sglang_router_ip"), get("sglang_router_port")
        max_context = get("rollout_max_context_len")
        if max_context is None and get("max_tokens_per_gpu"):
            max_context = get("context_parallel_size") * get("max_tokens_per_gpu")
        base, top = get("engine_retry_base_delay"), get("engine_retry_max_delay")
        if top < base:
            raise SettingsError(f"engine_retry_max_delay ({top:g}) must be >= engine_retry_base_delay ({base:g})")
        request_timeout = get("engine_request_timeout")
        deadline = get("engine_retry_deadline")  # unset: the request timeout (a long generation is not cut)
        retry = RetryPolicy(max_attempts=get("engine_retry_attempts"),
                            deadline=request_timeout if deadline is None else deadline, base_delay=base, max_delay=top)
        engines = max(1, get("rollout_num_gpus") // get("rollout_num_gpus_per_engine"))
        connections = get("sglang_server_concurrency") * engines
        if connections > MAX_CONNECTIONS:
            warn_once(f"sglang_server_concurrency x engines = {connections} connections; the HTTP pool is capped at {MAX_CONNECTIONS}")
            connections = MAX_CONNECTIONS
        url = get("engine_server_url") or (f"http://{ip}:{port}" if ip and port else DEFAULT_SERVER_URL)
        tools = get("engine_tools")
        return cls(
            server_url=url,
            profile=get("engine_profile"),
            tool_parser=get("engine_tool_parser"),
            max_turns=get("engine_max_turns"),
            max_tool_calls=get("engine_max_tool_calls"),
            max_calls_per_turn=get("engine_max_calls_per_turn"),
            max_context_len=max_context,
            max_response_len=get("engine_max_response_len"),
            tool_timeout=get("engine_tool_timeout"),
            tool_concurrency=get("engine_tool_concurrency"),
            tool_output_chars=get("engine_tool_output_chars"),
            tools=tools if tools else None,
            tool_modules=get("engine_tool_modules"),
            request_timeout=request_timeout,
            connect_timeout=get("engine_connect_timeout"),
            max_reply_bytes=get("engine_max_reply_bytes"),
            max_connections=connections,
            http_transport=get("engine_http_transport"),
            retry=retry,
            partial_rollout=get("partial_rollout"),
            mask_offpolicy=get("mask_offpolicy_in_partial_rollout"),
            tokenizer_path=get("hf_checkpoint"),
            gc_freeze=get("engine_gc_freeze"),
            gc_defer_full=get("engine_gc_defer_full"),
            abort_status=get("engine_abort_status"),
            sample_attempts=get("engine_sample_attempts"),
            sample_deadline=get("engine_sample_deadline"),
            routing_replay=get("use_rollout_routing_replay"),
            num_layers=get("num_layers"),
            moe_router_topk=get("moe_router_topk"),
            fully_async=is_fully_async(args),
            sandbox_backend=get("engine_sandbox_backend"),
            sandbox_workers=get("engine_sandbox_workers"),
            sandbox_worker_cpus=get("engine_sandbox_worker_cpus"),
            sandbox_resource=get("engine_sandbox_resource") or None,
            sandbox_queue=get("engine_sandbox_queue"),
        )


def is_fully_async(args: Any) -> bool:
    """Whether slime's fully-async rollout worker drives generate (it re-queues ABORTED groups)."""
    path = getattr(args, "rollout_function_path", None)
    return isinstance(path, str) and "fully_async" in path


# -- the YAML of --custom-config-path --------------------------------------------------------


def load_yaml_settings(path: str) -> dict[str, Any]:
    """The mapping in a YAML file, read as slime reads `--custom-config-path` (safe_load, {} when empty).

    Raises SettingsError for a file that cannot be read or is not a mapping of names.
    """
    try:
        import yaml  # PyPI: PyYAML (comes with transformers); only the command line needs it
    except ImportError:
        raise SettingsError("reading a YAML config needs PyYAML (pip install pyyaml)") from None
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as exc:
        raise SettingsError(f"cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise SettingsError(f"{path} is not valid YAML{at}") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise SettingsError(f"{path} must hold a mapping of setting names to values, as slime's --custom-config-path")
    return data
