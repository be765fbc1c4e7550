"""The engine's settings: one declaration per setting, and everything read from it.

slime hands a generate function its argparse namespace; the keys of `--custom-config-path`
YAML become attributes of it. Every key the engine (or `python -m engine run`) reads is one
row of `SETTINGS`: its key, its kind, its default, the range it must lie in, what it means,
and, where `run` offers it, its command-line flag. From that one table come:

* `EngineConfig`'s fields: a field made by `setting_field(key)` takes its default, its
  conversion and its check from the row (and carries the row in its attrs `metadata`);
  a field derived from several keys (the server URL, the context, the HTTP pool, the retry
  policy) names a small function that computes it (`derived_field`);
* `EngineConfig.from_args`: slime's args read field by field through the rows;
* the YAML of `--config` and the flags of `python -m engine run` (engine/cli.py,
  engine/run.py), and `docs/settings.md` (`python -m engine settings`).

A value of the wrong kind or outside its range raises `SettingsError` naming the key and
what is allowed (the slime adapter then ends every sample with `engine_setup_failed` and
that message). A few sizes are *capped* instead: a value past the cap is usable but
pointless, so it is lowered with one warning (the HTTP pool is the one that matters:
`sglang_server_concurrency=10**8` would otherwise build clients until memory runs out).
An `engine_*` key of slime's args that no row declares is warned about once, with the
closest known key (slime's own keys are not the engine's to judge); in `run --config`
every key is the engine's, so any unknown one is.

To add a setting: one `Setting(...)` row below, and one field
`name: type = setting_field("engine_name")` in `EngineConfig`.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import math
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, NoReturn

import attrs
from attrs import validators as v

log = logging.getLogger(__name__)

DEFAULT_SERVER_URL = "http://127.0.0.1:30000"
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


# -- one row per setting --------------------------------------------------------------------


@attrs.frozen
class Flag:
    """How `python -m engine run` offers a setting on its command line.

    `help` and `unset` are `run`'s own words where they differ from the row's (what the
    option means to a person at a terminal; what `run` does when neither the flag nor the
    YAML sets it). `repeatable`: the flag may be given once per item (`--tool-module`).
    """

    name: str
    metavar: str = "N"
    group: str = "budgets and sampling"
    help: str | None = None
    unset: str | None = None
    repeatable: bool = False
    dest: str | None = None

    @property
    def destination(self) -> str:
        """The attribute of `run`'s parsed arguments."""
        return self.dest or self.name.lstrip("-").replace("-", "_")


Reader = Literal["engine", "run"]


@attrs.frozen
class Setting:
    """One key of slime's `args` (or of the YAML) that the engine reads.

    `kind` is int, float, bool, str, "names" (a list, or a comma-separated string) or
    "url". Numbers must lie in [low, high]; with `cap` a number above `high` is lowered to
    it (with a warning) instead of refused. `choices` limits a str. `None` is always
    allowed and means the default; for a setting whose default is None an empty value
    ("" or an empty list) means None too. `unset` says in words what None means.
    `reader`: "engine" (EngineConfig reads it, in a slime job too) or "run" (only
    `python -m engine run` reads it: slime checks its own sampling args). `run_default`:
    `run`'s own default where it differs (a person is waiting: fewer connections and retries).
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
    unset: str | None = None
    flag: Flag | None = None
    run_default: Any = None
    reader: Reader = "engine"

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

    def refuse(self, value: Any) -> NoReturn:
        """Raise the one sentence that names the key, what it allows and what it got."""
        raise SettingsError(f"{self.key} must be {self.allowed()}, got {value!r}")

    def convert(self, value: Any) -> Any:
        """`value` as the setting's kind (None and, with a None default, empty text: the default); range not checked.

        An empty list stays empty: `engine_tools: []` offers no tool (an environment-only episode).
        """
        if value is None:
            return self.default
        try:
            converted = _CONVERT[self.kind](value)
        except (TypeError, ValueError):
            self.refuse(value)
        if self.default is None and converted == "":
            return None
        return converted

    def fits(self, value: Any) -> bool:
        """Whether a converted value is in range (above a cap counts: it is usable, and lowered when read)."""
        if value is None or value is self.default:
            return True
        if self.choices and value not in self.choices:
            return False
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.low is not None and (value <= self.low if self.above_low else value < self.low):
                return False
            if self.high is not None and value > self.high and not self.cap:
                return False
        return True

    def validate(self, instance: Any, attribute: Any, value: Any) -> None:
        """attrs validator of the `EngineConfig` field made from this row."""
        if not self.fits(value):
            self.refuse(value)

    def read(self, value: Any) -> Any:
        """The value converted and checked (a capped one lowered, with one warning); raises SettingsError."""
        converted = self.convert(value)
        if not self.fits(converted):
            self.refuse(value)
        if self.cap and self.high is not None and isinstance(converted, (int, float)) and converted > self.high:
            warn_once(f"{self.key}={value!r} is more than the engine uses; capped at {_fmt(self.high)}")
            converted = type(converted)(self.high)
        return converted

    def default_text(self, for_run: bool = False) -> str:
        """The default in words: the value, or what leaving it unset means."""
        if for_run and self.flag is not None and self.flag.unset is not None:
            return self.flag.unset
        default = self.run_default if for_run and self.run_default is not None else self.default
        if default is None or default == ():
            return self.unset or "none"
        if isinstance(default, bool):
            return "true" if default else "false"
        if isinstance(default, int) and default >= 1 << 20 and default & (default - 1) == 0:
            return f"2^{default.bit_length() - 1}"
        return _fmt(default) if isinstance(default, (int, float)) else str(default)


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

SERVER, TOOLS, BUDGETS, AGENT = "server and settings", "tools", "budgets and sampling", "agents"
LONG = "long rollouts"
# The user message that asks the policy for a summary (engine_compaction: summarize).
COMPACTION_PROMPT = ("Your context is nearly full. Summarize the conversation so far for yourself: the task, what "
                     "you have tried, what you found, and what is left to do. Write only the summary; you will go on "
                     "from it and the latest turns.")

SETTINGS: dict[str, Setting] = {s.key: s for s in (
    # engine_* keys: set in the YAML of --custom-config-path (or `run --config`)
    Setting("engine_server_url", "url", None, "SGLang server or router URL", unset="slime's router",
            flag=Flag("--server", "URL", SERVER, unset="start the embedded CPU server")),
    Setting("engine_profile", str, "retool", "prompt and turn format: retool, chat, or one registered by an engine_tool_modules module",
            flag=Flag("--profile", "NAME", SERVER)),
    Setting("engine_tool_parser", str, None, "the chat profile's tool-call format, by SGLang's --tool-call-parser name",
            unset="from the chat template, else hermes", flag=Flag("--tool-parser", "NAME", SERVER)),
    Setting("engine_max_turns", int, 16, "model turns per sample", low=1, high=100_000, flag=Flag("--max-turns")),
    Setting("engine_max_tool_calls", int, 16, "tool calls per sample", low=0, high=1_000_000, flag=Flag("--max-tool-calls", group=TOOLS)),
    Setting("engine_max_calls_per_turn", int, 8, "tool calls run per turn (the rest get an error)", low=1, high=10_000),
    Setting("engine_max_response_len", int, None, "response tokens per sample, over all turns", low=1, high=10**9,
            unset="unbounded", flag=Flag("--max-response-len")),
    Setting("engine_tool_timeout", float, 120.0, "seconds a tool call may run", low=0, high=DAY, above_low=True,
            flag=Flag("--tool-timeout", "S", TOOLS)),
    Setting("engine_tool_concurrency", int, 32, "tool calls running at once (per event loop)", low=1, high=4096, cap=True),
    Setting("engine_tool_output_chars", int, 8192, "characters of a tool's output kept", low=1, high=10**8),
    Setting("engine_tools", "names", None, "the tools offered", unset="every registered tool",
            flag=Flag("--tools", "A,B", TOOLS, help="offer only these tools")),
    Setting("engine_tool_modules", "names", (), "modules imported so their tools register",
            flag=Flag("--tool-module", "MODULE", TOOLS, help="import this module so the tools it registers are offered",
                      repeatable=True, dest="tool_modules")),
    Setting("engine_environment", str, None, "the environment answering model turns that call no tool",
            unset="none; such a turn is the final answer",
            flag=Flag("--environment", "NAME", TOOLS, help="the environment answering turns that call no tool, e.g. user_simulator")),
    Setting("engine_user_sim_url", "url", None, "user_simulator: the second model's URL"),
    Setting("engine_user_sim_api", str, "chat", "user_simulator: chat (/v1/chat/completions) or generate (SGLang's /generate)", choices=("chat", "generate")),
    Setting("engine_user_sim_model", str, "default", "user_simulator: the model name sent to the chat API"),
    Setting("engine_user_sim_temperature", float, 0.7, "user_simulator: sampling temperature", low=0, high=100),
    Setting("engine_user_sim_max_tokens", int, 256, "user_simulator: tokens per user message", low=1, high=10**6),
    Setting("engine_mcp_servers", "names", (), "MCP servers whose tools are offered: each a command line (stdio) or an http(s) URL",
            flag=Flag("--mcp-server", "CMD_OR_URL", TOOLS, help="offer the tools of this MCP server: a command line (stdio) or an http(s) URL",
                      repeatable=True, dest="mcp_servers")),
    Setting("engine_agent", str, None, "what runs per sample as an agent: a coroutine `module:function` called with "
            "(base_url, api_key, sample), or a command line started with OPENAI_BASE_URL / ANTHROPIC_BASE_URL and their "
            "keys set to its session; its model calls are the sample's turns (needs engine_profile: chat)",
            unset="none: the engine's own loop answers the model",
            flag=Flag("--agent", "CMD", AGENT, help="run this agent per prompt: a command line (quoted) or module:function")),
    Setting("engine_agent_timeout", float, 1800.0, "seconds an agent may run; then it is stopped and the sample ends "
            "TRUNCATED (harness_timed_out), keeping what was sampled", low=0, high=7 * DAY, above_low=True,
            flag=Flag("--agent-timeout", "S", AGENT)),
    Setting("engine_agent_matcher", str, "json_calls", "how an agent's copy of a model turn must match what the model "
            "wrote: exact (text, reasoning, calls as written), json_calls (calls' arguments as JSON, reasoning may be "
            "left out) or role_content (role and text)", choices=("exact", "json_calls", "role_content"),
            flag=Flag("--agent-matcher", "NAME", AGENT)),
    Setting("engine_agent_models", "names", ("policy",), "the model names an agent may ask for (/v1/models lists them); "
            "* takes any name"),
    Setting("engine_compaction", str, "off", "what happens before a segment's context overflows: off (it ends "
            "TRUNCATED context_full), summarize (the policy writes a summary; a new segment starts from the prompt, the "
            "summary and the latest turns) or drop_oldest (a new segment starts without the oldest tool exchanges); "
            "needs engine_profile: chat", choices=("off", "summarize", "drop_oldest"), flag=Flag("--compaction", "MODE", LONG)),
    Setting("engine_compaction_threshold", int, None, "tokens (prompt + response of the open segment) at which it is "
            "compacted; below the context", low=1, high=10**9, unset="3/4 of the context",
            flag=Flag("--compaction-threshold", "N", LONG)),
    Setting("engine_compaction_keep_turns", int, 2, "the latest model turns (with what answered them) a compacted "
            "segment keeps; fewer where they would not fit under the threshold", low=0, high=100_000),
    Setting("engine_compaction_summary_tokens", int, 1024, "tokens the policy may write for a summary", low=1, high=10**7),
    Setting("engine_compaction_train_summary", bool, True, "train the summary the policy writes (false: it stays in "
            "its segment with mask 0)"),
    Setting("engine_compaction_prompt", str, COMPACTION_PROMPT, "the user message that asks the policy for a summary"),
    Setting("engine_earlier_reasoning", str, "as_template", "earlier turns' reasoning where the chat template drops "
            "it: as_template (each turn's prompt is the template's own render, as served; a new segment where that is "
            "not a prefix of the last) or keep (one sequence keeping it: a train-serve difference)",
            choices=("as_template", "keep"), flag=Flag("--earlier-reasoning", "MODE", LONG)),
    Setting("engine_samples", str, "trajectory", "what one sample is: trajectory (a segment: turns whose prompts "
            "extend each other, merged) or per_turn (one sample per model turn, its exact prompt and output)",
            choices=("trajectory", "per_turn"), flag=Flag("--samples", "MODE", LONG)),
    Setting("engine_segment_reward", str, "shared", "a rollout returned as several samples: each gets its reward "
            "(shared), or the last gets it and each earlier one engine_segment_discount times the next's (discounted)",
            choices=("shared", "discounted")),
    Setting("engine_segment_discount", float, 0.9, "the discount per sample back from the last (engine_segment_reward: "
            "discounted)", low=0, high=1),
    Setting("engine_request_timeout", float, 1800.0, "seconds one /generate request may take", low=0, high=7 * DAY, above_low=True),
    Setting("engine_connect_timeout", float, 10.0, "seconds to connect to the server", low=0, high=3600, above_low=True),
    Setting("engine_max_reply_bytes", int, 1 << 30, "bytes one /generate reply may hold; a larger one fails the request", low=1 << 16, high=1 << 40),
    Setting("engine_retry_attempts", int, 6, "attempts per request (1: no retry)", low=1, high=1000, run_default=4),
    Setting("engine_retry_deadline", float, None, "seconds over all attempts of one request, the one in flight included", low=0, high=7 * DAY,
            above_low=True, unset="the request timeout", run_default=60.0),
    Setting("engine_retry_base_delay", float, 0.5, "first backoff (doubles per retry)", low=0, high=3600),
    Setting("engine_retry_max_delay", float, 16.0, "longest backoff", low=0, high=3600),
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
    Setting("sglang_server_concurrency", int, 512, "requests in flight per engine", low=1, high=MAX_CONNECTIONS, cap=True,
            run_default=64, flag=Flag("--concurrency", help="samples in flight")),
    Setting("rollout_num_gpus", int, 1, "GPUs for inference", low=0, high=1_000_000),
    Setting("rollout_num_gpus_per_engine", int, 1, "GPUs per inference engine", low=1, high=1_000_000),
    Setting("rollout_max_context_len", int, None, "prompt + response tokens", low=1, high=10**9,
            unset="max_tokens_per_gpu x context_parallel_size, else the server's", flag=Flag("--max-context", unset="the server's context length")),
    Setting("max_tokens_per_gpu", int, None, "the context when rollout_max_context_len is unset", low=1, high=10**9),
    Setting("context_parallel_size", int, 1, "multiplies max_tokens_per_gpu", low=1, high=1_000_000),
    Setting("partial_rollout", bool, False, "resume aborted samples from their checkpoint",
            flag=Flag("--partial-rollout", help="aborted samples keep a checkpoint to resume from")),
    Setting("mask_offpolicy_in_partial_rollout", bool, False, "mask tokens of older weights on resume"),
    Setting("hf_checkpoint", str, None, "model directory; its tokenizer is used", unset="the shipped Qwen3 tokenizer",
            flag=Flag("--tokenizer", "DIR", SERVER, help="local tokenizer directory", unset="the shipped Qwen3 one")),
    Setting("use_rollout_routing_replay", bool, False, "routing replay (R3): ask for routed experts every turn"),
    Setting("num_layers", int, 0, "the model's layers (rows of routed experts per token)", low=0, high=100_000),
    Setting("moe_router_topk", int, 0, "experts per token (columns of routed experts)", low=0, high=100_000),
    Setting("rollout_function_path", str, None, "slime's rollout function; its fully-async worker re-queues ABORTED groups",
            unset="slime's default loop"),
    # slime's sampling arguments: slime checks them in a training job; only `run` reads them
    Setting("rollout_max_response_len", int, 512, "tokens per model turn", low=1, high=10**9, reader="run",
            flag=Flag("--max-new-tokens")),
    Setting("rollout_temperature", float, 1.0, "sampling temperature", low=0, high=1000, reader="run",
            flag=Flag("--temperature", "T")),
    Setting("rollout_top_p", float, 1.0, "nucleus sampling", low=0, high=1, above_low=True, reader="run",
            flag=Flag("--top-p", "P")),
    Setting("n_samples_per_prompt", int, 1, "samples per prompt, a GRPO group", low=1, high=100_000, reader="run",
            flag=Flag("--n-samples-per-prompt")),
)}

ENGINE_PREFIX = "engine_"
ENGINE_KEYS = tuple(k for k, s in SETTINGS.items() if s.reader == "engine")  # what EngineConfig reads


def setting(args: Any, key: str) -> Any:
    """The checked value of one key of `args` (its default when absent or None)."""
    return SETTINGS[key].read(getattr(args, key, None))


def flagged_settings() -> Iterator[Setting]:
    """The rows `python -m engine run` offers as flags, in table order."""
    return (s for s in SETTINGS.values() if s.flag is not None)


# -- unknown keys -----------------------------------------------------------------------------


def closest_key(key: str, known: Iterable[str]) -> str | None:
    """The known key `key` most likely misspells, or None."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_engine_keys(keys: Iterable[str]) -> dict[str, str | None]:
    """`engine_*` keys the table does not know, each with the closest known key (or None).

    For slime's namespace: slime's own keys (hundreds) are not the engine's to judge.
    """
    known = [k for k in SETTINGS if k.startswith(ENGINE_PREFIX)]
    return {key: closest_key(key, known) for key in keys if key.startswith(ENGINE_PREFIX) and key not in SETTINGS}


def unknown_keys(keys: Iterable[str]) -> dict[str, str | None]:
    """Every key the table does not know, each with the closest known key: for `run --config`,
    where every key is the engine's (nothing but `run` reads that YAML)."""
    return {key: closest_key(key, SETTINGS) for key in keys if key not in SETTINGS}


def unknown_key_message(key: str, closest: str | None) -> str:
    """The warning for a key nothing reads."""
    hint = f"; did you mean {closest}?" if closest else ""
    what = "engine setting" if key.startswith(ENGINE_PREFIX) else "setting"
    return f"unknown {what} {key} (ignored){hint}"


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
    """A value as a cache key of its type and value (lists, from YAML, item by item); TypeError
    when it has none (then the settings are read afresh: an id could be reused by another value)."""
    if type(value) in (list, tuple):
        return (type(value), tuple(_hashable(v) for v in value))
    hash(value)  # TypeError for the unhashable
    return (type(value), value)  # 1, 1.0 and True stay apart: they read differently


# -- EngineConfig's fields from the rows ----------------------------------------------------------

SETTING, DERIVED = "setting", "derived"  # keys of an EngineConfig field's attrs metadata
Get = Callable[[str], Any]  # a key -> its checked value (from slime's args)


def setting_field(key: str) -> Any:
    """An `EngineConfig` field holding the setting `key`: default, conversion and check from its row."""
    row = SETTINGS[key]
    return attrs.field(default=row.default, converter=row.convert, validator=row.validate, metadata={SETTING: row})


@attrs.frozen
class Derivation:
    """How a field is computed from several keys (`keys`: the rows it reads, for the docs and the checks)."""

    compute: Callable[[Get], Any]
    keys: tuple[str, ...]


def derived_field(keys: tuple[str, ...], compute: Callable[[Get], Any], **field: Any) -> Any:
    """An `EngineConfig` field computed from the settings `keys` by `compute(get)` (`field`: its attrs default, validator)."""
    return attrs.field(metadata={DERIVED: Derivation(compute, keys)}, **field)


def server_url(get: Get) -> str:
    """engine_server_url, else slime's router (sglang_router_ip:port), else the default."""
    ip, port = get("sglang_router_ip"), get("sglang_router_port")
    return get("engine_server_url") or (f"http://{ip}:{port}" if ip and port else DEFAULT_SERVER_URL)


def max_context(get: Get) -> int | None:
    """rollout_max_context_len, else max_tokens_per_gpu x context_parallel_size, else None (the server bounds it)."""
    limit = get("rollout_max_context_len")
    if limit is None and get("max_tokens_per_gpu"):
        limit = get("context_parallel_size") * get("max_tokens_per_gpu")
    return limit  # type: ignore[no-any-return]


def connections(get: Get) -> int:
    """sglang_server_concurrency per engine, for every engine; capped at MAX_CONNECTIONS with a warning."""
    engines = max(1, get("rollout_num_gpus") // get("rollout_num_gpus_per_engine"))
    total = get("sglang_server_concurrency") * engines
    if total > MAX_CONNECTIONS:
        warn_once(f"sglang_server_concurrency x engines = {total} connections; the HTTP pool is capped at {MAX_CONNECTIONS}")
        total = MAX_CONNECTIONS
    return total  # type: ignore[no-any-return]


def retry_policy(get: Get) -> RetryPolicy:
    """The engine_retry_* keys; an unset deadline is the request timeout (a long generation is not cut)."""
    base, top = get("engine_retry_base_delay"), get("engine_retry_max_delay")
    if top < base:
        raise SettingsError(f"engine_retry_max_delay ({top:g}) must be >= engine_retry_base_delay ({base:g})")
    deadline = get("engine_retry_deadline")
    return RetryPolicy(max_attempts=get("engine_retry_attempts"),
                       deadline=get("engine_request_timeout") if deadline is None else deadline, base_delay=base, max_delay=top)


def fully_async(get: Get) -> bool:
    """Whether slime's fully-async rollout worker drives generate (it re-queues ABORTED groups)."""
    path = get("rollout_function_path")
    return path is not None and "fully_async" in path


_PLAIN_NAMESPACES = (argparse.Namespace, types.SimpleNamespace)


def _args_key(args: Any) -> Any | None:
    """What `from_args` remembers a config by: the object and the value (and type) of every key read;
    None when a value has no exact key (then nothing is cached: an id could be reused by another value).

    Built in C where it can (the namespace's dict, `map`): slime asks once per sample.
    """
    if type(args) in _PLAIN_NAMESPACES:  # every attribute is in its __dict__
        values = tuple(map(vars(args).get, ENGINE_KEYS))
    else:
        values = tuple(getattr(args, key, None) for key in ENGINE_KEYS)
    types = tuple(map(type, values))  # 1, 1.0 and True stay apart: they read differently
    try:
        if list in types or tuple in types:  # engine_tools from YAML: item by item, with their types
            return (id(args), tuple(map(_hashable, values)))
        key = (id(args), values, types)
        hash(key)
    except TypeError:  # a value without an exact key (a dict, a set)
        return None
    return key


_FROM_ARGS_CACHE = 64
_from_args_cache: dict[Any, EngineConfig] = {}


# -- the settings ---------------------------------------------------------------------------


@attrs.frozen
class EngineConfig:
    """Everything one rollout needs to know besides the sample and the sampling params.

    Each field holds one setting (`setting_field`: see its row in `SETTINGS`) or is derived
    from several (`derived_field`). `max_context_len` bounds prompt + response (None: only
    the server bounds it); `max_response_len` bounds the whole response of a trajectory
    (None: unbounded); the per-turn cap is `sampling_params["max_new_tokens"]`. The three stay separate.
    """

    server_url: str = derived_field(("engine_server_url", "sglang_router_ip", "sglang_router_port"), server_url,
                                    default=DEFAULT_SERVER_URL)
    profile: str = setting_field("engine_profile")
    tool_parser: str | None = setting_field("engine_tool_parser")  # the chat profile's tool-call format (SGLang parser name)
    max_turns: int = setting_field("engine_max_turns")
    max_tool_calls: int = setting_field("engine_max_tool_calls")
    max_calls_per_turn: int = setting_field("engine_max_calls_per_turn")
    max_context_len: int | None = derived_field(("rollout_max_context_len", "max_tokens_per_gpu", "context_parallel_size"),
                                                max_context, default=None, validator=v.optional(_positive))
    max_response_len: int | None = setting_field("engine_max_response_len")
    tool_timeout: float = setting_field("engine_tool_timeout")
    tool_concurrency: int = setting_field("engine_tool_concurrency")
    tool_output_chars: int = setting_field("engine_tool_output_chars")
    tools: tuple[str, ...] | None = setting_field("engine_tools")  # None: every registered tool
    tool_modules: tuple[str, ...] = setting_field("engine_tool_modules")
    environment: str | None = setting_field("engine_environment")  # a registered engine.envs environment
    user_sim_url: str | None = setting_field("engine_user_sim_url")
    user_sim_api: str = setting_field("engine_user_sim_api")
    user_sim_model: str = setting_field("engine_user_sim_model")
    user_sim_temperature: float = setting_field("engine_user_sim_temperature")
    user_sim_max_tokens: int = setting_field("engine_user_sim_max_tokens")
    mcp_servers: tuple[str, ...] = setting_field("engine_mcp_servers")  # command lines (stdio) or http(s) URLs
    # An agent brings its own loop (engine.agent): its model calls are the sample's turns.
    agent: str | None = setting_field("engine_agent")
    agent_timeout: float = setting_field("engine_agent_timeout")
    agent_matcher: str = setting_field("engine_agent_matcher")
    agent_models: tuple[str, ...] = setting_field("engine_agent_models")
    # Long rollouts (docs/long-rollouts.md): compaction, earlier reasoning, what one sample is, its reward.
    compaction: str = setting_field("engine_compaction")
    compaction_threshold: int | None = setting_field("engine_compaction_threshold")  # None: 3/4 of the context
    compaction_keep_turns: int = setting_field("engine_compaction_keep_turns")
    compaction_summary_tokens: int = setting_field("engine_compaction_summary_tokens")
    compaction_train_summary: bool = setting_field("engine_compaction_train_summary")
    compaction_prompt: str = setting_field("engine_compaction_prompt")
    earlier_reasoning: str = setting_field("engine_earlier_reasoning")
    samples: str = setting_field("engine_samples")
    segment_reward: str = setting_field("engine_segment_reward")
    segment_discount: float = setting_field("engine_segment_discount")
    request_timeout: float = setting_field("engine_request_timeout")
    connect_timeout: float = setting_field("engine_connect_timeout")
    max_reply_bytes: int = setting_field("engine_max_reply_bytes")  # routing replay replies run to 100s of MB
    max_connections: int = derived_field(("sglang_server_concurrency", "rollout_num_gpus", "rollout_num_gpus_per_engine"),
                                         connections, default=512, validator=_positive)
    retry: RetryPolicy = derived_field(("engine_retry_attempts", "engine_retry_deadline", "engine_retry_base_delay",
                                        "engine_retry_max_delay", "engine_request_timeout"), retry_policy, factory=RetryPolicy)
    partial_rollout: bool = setting_field("partial_rollout")
    mask_offpolicy: bool = setting_field("mask_offpolicy_in_partial_rollout")
    tokenizer_path: str | None = setting_field("hf_checkpoint")
    gc_freeze: bool = setting_field("engine_gc_freeze")  # see engine.loop.runtime.freeze_long_lived_objects
    gc_defer_full: bool = setting_field("engine_gc_defer_full")  # see engine.loop.runtime.FullCollections
    # What a sample that cannot finish hands back (see engine.loop.attempts): "retry" re-runs it
    # from RESET up to `sample_attempts` times within `sample_deadline` seconds, then ends it
    # FAILED with remove_sample; "aborted" hands ABORTED back at once, for a caller that re-queues.
    abort_status: str = setting_field("engine_abort_status")
    sample_attempts: int = setting_field("engine_sample_attempts")
    sample_deadline: float = setting_field("engine_sample_deadline")
    # Routing replay (R3): ask for routed experts each turn; a row is num_layers x moe_router_topk int32.
    routing_replay: bool = setting_field("use_rollout_routing_replay")
    num_layers: int = setting_field("num_layers")
    moe_router_topk: int = setting_field("moe_router_topk")
    # slime's fully-async worker is the caller: it re-queues ABORTED groups
    fully_async: bool = derived_field(("rollout_function_path",), fully_async, default=False)
    # Where sandboxed tool code runs: "local" (this machine) or "ray" (a pool of workers on the
    # Ray cluster; see engine.sandbox.backend). The sandbox_* settings size and place that pool.
    sandbox_backend: str = setting_field("engine_sandbox_backend")
    sandbox_workers: int = setting_field("engine_sandbox_workers")
    sandbox_worker_cpus: float = setting_field("engine_sandbox_worker_cpus")
    sandbox_resource: str | None = setting_field("engine_sandbox_resource")  # CPU nodes only, say
    sandbox_queue: int = setting_field("engine_sandbox_queue")

    @sandbox_backend.validator
    def _check_sandbox_backend(self, attribute: Any, value: str) -> None:
        from engine.sandbox.backend import check_backend  # refuses "ray" where ray is not installed

        check_backend(value)

    def __attrs_post_init__(self) -> None:
        if self.routing_replay and not (self.num_layers and self.moe_router_topk):
            raise ValueError("routing replay needs num_layers and moe_router_topk (slime args) to be set")
        if self.compaction != "off":
            self.threshold()  # refuses a threshold the context cannot hold, with one sentence

    def threshold(self) -> int | None:
        """Tokens of the open segment at which it is compacted (None: compaction is off).

        Refused (SettingsError) when it is at or above the context, or when neither it nor a
        context is known: a segment would overflow before it could be compacted.
        """
        if self.compaction == "off":
            return None
        context, asked = self.max_context_len, self.compaction_threshold
        if asked is None:
            if context is None:
                raise SettingsError(f"engine_compaction: {self.compaction} needs engine_compaction_threshold or a "
                                    "context (rollout_max_context_len)")
            return context * 3 // 4
        if context is not None and asked >= context:
            raise SettingsError(f"engine_compaction_threshold must be below the context ({context} tokens), got {asked}")
        return asked

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

        Every key is checked against its row of `SETTINGS`; raises SettingsError with one clear
        sentence. slime calls this once per sample with the same `args`: the result is remembered
        by the values it was read from, and the namespace is scanned for unknown keys once per object.
        """
        seen = _args_key(args)
        if seen is None:  # a value without an exact key (a dict, a set): nothing cached
            return cls._read_args(args)
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
        read: dict[str, Any] = {}

        def get(key: str) -> Any:
            if key not in read:
                read[key] = setting(args, key)
            return read[key]

        values = {}
        for name, source in field_sources().items():
            values[name] = source.compute(get) if isinstance(source, Derivation) else get(source.key)
        return cls(**values)


def field_sources() -> dict[str, Setting | Derivation]:
    """Each `EngineConfig` field read from slime's args, and what it is read from.

    A field made by `setting_field` or `derived_field` says so in its metadata. A field
    declared by hand (`attrs.field(default=...)`) is read from the row `engine_<name>` when
    there is one: the older style of a row, kept working until it is ported.
    """
    global _SOURCES
    if _SOURCES is None:
        sources: dict[str, Setting | Derivation] = {}
        for f in attrs.fields(EngineConfig):
            source = f.metadata.get(SETTING) or f.metadata.get(DERIVED) or SETTINGS.get(ENGINE_PREFIX + f.name)
            if source is not None:
                sources[f.name] = source
        _SOURCES = sources
    return _SOURCES


_SOURCES: dict[str, Setting | Derivation] | None = None


def readers_of(key: str) -> list[str]:
    """The `EngineConfig` fields that read `key` (empty for a key only `run` reads)."""
    return [name for name, source in field_sources().items()
            if (source.key == key if isinstance(source, Setting) else key in source.keys)]


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


# -- docs/settings.md ------------------------------------------------------------------------

SETTINGS_PAGE = "docs/settings.md"
_SECTIONS = (
    ("Engine settings", "Set in the YAML of slime's `--custom-config-path` (or `python -m engine run --config`).",
     lambda s: s.key.startswith(ENGINE_PREFIX)),
    ("slime's arguments the engine reads", "slime's own flags (`--sglang-router-ip` is `sglang_router_ip`); the engine reads them as slime set them.",
     lambda s: not s.key.startswith(ENGINE_PREFIX) and s.reader == "engine"),
    ("slime's arguments only `run` reads", "slime checks these itself in a training job; `python -m engine run` reads them from its flags or `--config`.",
     lambda s: s.reader == "run"),
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_table(rows: Iterable[Setting]) -> str:
    """The Markdown table of `rows`: key, what it accepts, default (and `run`'s), flag, meaning."""
    lines = ["| key | accepts | default | `run` flag | meaning |", "|---|---|---|---|---|"]
    for s in rows:
        default = s.default_text()
        if s.flag is not None or s.run_default is not None:
            ran = s.default_text(for_run=True)
            if ran != default:
                default += f" (`run`: {ran})"
        flag = f"`{s.flag.name}`" if s.flag is not None else ""
        cap = f"; above {_fmt(s.high)} lowered to it" if s.cap and s.high is not None else ""
        lines.append(f"| `{s.key}` | {_cell(s.allowed() + cap)} | {_cell(default)} | {flag} | {_cell(s.help)} |")
    return "\n".join(lines)


def settings_page() -> str:
    """docs/settings.md, every word of it made from `SETTINGS` (`python -m engine settings --out docs/settings.md`)."""
    parts = [
        "# Settings",
        "",
        "<!-- Generated from engine/config.py's SETTINGS by `python -m engine settings --out docs/settings.md`; "
        "a test keeps it current. Do not edit by hand. -->",
        "",
        "Every key the engine reads, as slime hands it over (the keys of `--custom-config-path` become "
        "attributes of slime's `args`). A value of the wrong kind or outside its range ends every sample with "
        "`engine_setup_failed` and one sentence naming the key and what it accepts; `python -m engine run` "
        "says the same sentence and exits 2. An `engine_*` key no row declares is warned about once, with the "
        "closest known key; in `run --config` every unknown key is.",
        "",
        "`python -m engine run` reads the same keys from `--config` (a YAML as slime's) and from its flags; "
        "a flag wins over the file. Where `run`'s default differs from a training job's, both are shown.",
        "",
        "To add a setting: one `Setting(...)` row in `SETTINGS` (engine/config.py) and one field "
        "`name: type = setting_field(\"engine_name\")` in `EngineConfig` (a value made from several keys: "
        "`derived_field` and a small function); `Flag(...)` on the row offers it in `run`. Then "
        "`python -m engine settings --out docs/settings.md`.",
    ]
    for title, words, chosen in _SECTIONS:
        parts += ["", f"## {title}", "", words, "", settings_table(s for s in SETTINGS.values() if chosen(s))]
    return "\n".join(parts) + "\n"


def main_settings(ns: Any) -> int:
    """`python -m engine settings`: print the tables, or write (`--out`) or check (`--check`) the page."""
    import sys

    page = settings_page()
    if not ns.out:
        if ns.check:
            print("error: --check needs --out PATH (the page to check)", file=sys.stderr)
            return 2
        print(page, end="")
        return 0
    if ns.check:
        try:
            with open(ns.out, encoding="utf-8") as f:
                current = f.read() == page
        except OSError:
            current = False
        if not current:
            print(f"error: {ns.out} is not current: run python -m engine settings --out {ns.out}", file=sys.stderr)
            return 1
        return 0
    try:
        with open(ns.out, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as exc:
        print(f"error: --out {ns.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"wrote {ns.out}")
    return 0
