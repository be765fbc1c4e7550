"""The engine's own settings: `EngineConfig`, its `RetryPolicy`, and the sampling arguments only `run` reads.

Each field is one setting's whole declaration (`engine.settings.declare`). A value made from
several keys (the server URL, the context, the HTTP pool, the retry deadline, slime's fully-async
worker) is computed from the fields before it, in one small function, by every construction alike:
`EngineConfig(sglang_router_ip=..., sglang_router_port=...)` gets the router's URL as slime's args do.
Where a default is the sandbox's own (a run's time limit, the Ray pool's size, the backend's
name), the declaration takes it from the sandbox rather than restating it.

To add a setting: one field `name: type = setting(default, help=..., ...)` below (`flag=Flag(...)`
offers it in `run`), then `python -m engine settings --out docs/settings.md`.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Iterable
from typing import Any, NoReturn, TypeVar

import attrs

from engine.logs import warn_once
from engine.sandbox.backend import BACKENDS
from engine.sandbox.dispatch import RaySettings
from engine.sandbox.runner import SandboxLimits
from engine.settings import sources
from engine.settings.declare import (
    Flag,
    Kind,
    Setting,
    SettingsError,
    derived,
    keyed,
    nested,
    plugins,
    rows,
    setting,
    settings,
    version,
)

log = logging.getLogger("engine.settings")
T = TypeVar("T")
P = TypeVar("P")

DEFAULT_SERVER_URL = "http://127.0.0.1:30000"
DAY = 86400.0
# The HTTP pool holds one small client per 4 connections: past this many connections the
# pool only costs memory and start-up time (a slime job's samples wait in slime's own semaphore).
MAX_CONNECTIONS = 16384
SERVER, TOOLS, BUDGETS, AGENT = "server and settings", "tools", "budgets and sampling", "agents"  # `run --help`'s sections
LONG = "long rollouts"
# The user message that asks the policy for a summary (engine_compaction: summarize).
COMPACTION_PROMPT = ("Your context is nearly full. Summarize the conversation so far for yourself: the task, what "
                     "you have tried, what you found, and what is left to do. Write only the summary; you will go on "
                     "from it and the latest turns.")
_LIMITS, _RAY = attrs.fields(SandboxLimits), attrs.fields(RaySettings)


@settings(prefix="engine_retry_", plugin=False)
class RetryPolicy:
    """Retries of transient HTTP failures: exponential backoff with full jitter, bounded twice."""

    max_attempts: int = setting(6, key="engine_retry_attempts", low=1, high=1000, run_default=4,
                                help="attempts per request (1: no retry)")
    # As long as the request timeout when unset: a lower bound would cut long generations short.
    deadline: float | None = setting(None, low=0, high=7 * DAY, above_low=True, unset="the request timeout", run_default=60.0,
                                     help="seconds over all attempts of one request, the one in flight included")
    base_delay: float = setting(0.5, low=0, high=3600, help="first backoff (doubles per retry)")
    max_delay: float = setting(16.0, low=0, high=3600, help="longest backoff")

    def __attrs_post_init__(self) -> None:
        if self.max_delay < self.base_delay:
            raise SettingsError(f"engine_retry_max_delay ({self.max_delay:g}) must be >= engine_retry_base_delay ({self.base_delay:g})")

    def delay(self, attempt: int, rand: float) -> float:
        """Sleep before retry number `attempt` (1-based), given a uniform `rand` in [0, 1)."""
        return rand * min(self.max_delay, self.base_delay * 2 ** (attempt - 1))


# -- values made from several settings: each computed from the fields declared before it ---------


def router_url(cfg: Any) -> str | None:
    """slime's router (sglang_router_ip:port) when engine_server_url is unset; else the default."""
    ip, port = cfg.router_ip, cfg.router_port
    return f"http://{ip}:{port}" if ip and port else None


def context_from_gpus(cfg: Any) -> int | None:
    """max_tokens_per_gpu x context_parallel_size when rollout_max_context_len is unset; else the server bounds it."""
    return cfg.context_parallel_size * cfg.max_tokens_per_gpu if cfg.max_tokens_per_gpu else None


def connections(cfg: Any) -> int:
    """sglang_server_concurrency per engine, for every engine; capped at MAX_CONNECTIONS with a warning."""
    engines = max(1, cfg.num_gpus // cfg.gpus_per_engine)
    total = int(cfg.server_concurrency * engines)
    if total > MAX_CONNECTIONS:
        warn_once(f"sglang_server_concurrency x engines = {total} connections; the HTTP pool is capped at {MAX_CONNECTIONS}", log)
        total = MAX_CONNECTIONS
    return total


def retry_deadline(retry: RetryPolicy, cfg: Any) -> RetryPolicy:
    """An unset retry deadline is the request timeout (a long generation is not cut)."""
    return retry if retry.deadline is not None else attrs.evolve(retry, deadline=cfg.request_timeout)


def from_rollout_function(cfg: Any) -> bool:
    """Whether slime's fully-async rollout worker drives generate (it re-queues ABORTED groups)."""
    return cfg.rollout_function_path is not None and "fully_async" in cfg.rollout_function_path


# What the engine itself decides in a render; a template kwarg may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "tokenize",
                                      "add_generation_prompt", "continue_final_message", "return_dict",
                                      "return_tensors", "return_assistant_tokens_mask", "chat_template"})


class TemplateKwargs(dict):  # type: ignore[type-arg]
    """The chat template's variables: a mapping that cannot change and hashes by its content, so a
    frozen settings object holding it stays hashable (and equal only to the same variables)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(json.dumps(self, sort_keys=True, default=repr))

    def _read_only(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("chat template kwargs cannot change once read")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only  # type: ignore[assignment]


def check_template_kwargs(kwargs: Any) -> TemplateKwargs:
    """`kwargs` as the chat template's extra variables: a mapping of names, none the engine sets
    itself; ValueError (one sentence) otherwise."""
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise ValueError(f"chat template kwargs must be a mapping of names to values, got {kwargs!r}")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"chat template kwargs may not set {', '.join(reserved)}: the engine sets it per render")
    return TemplateKwargs(kwargs)


def _template_kwargs(value: Any) -> dict[str, Any]:
    """A mapping, or its JSON text (slime's `--apply-chat-template-kwargs` before OmegaConf, `run`'s flag)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON ({exc.msg} at character {exc.pos})") from None
    if hasattr(value, "items") and not isinstance(value, dict):  # an OmegaConf DictConfig, a MappingProxy
        value = dict(value.items())
    return check_template_kwargs(value)


TEMPLATE_KWARGS = Kind('a mapping of the chat template\'s variables, or its JSON text, e.g. {"enable_thinking": false}',
                       _template_kwargs)


def _plugin_settings(value: Any) -> tuple[Any, ...]:
    items = tuple(value or ())
    for item in items:
        if type(item) not in plugins():
            raise SettingsError(f"plugin_settings must hold instances of plugins' settings classes, got {item!r}")
    return items


# -- the settings ---------------------------------------------------------------------------------


@settings(prefix="engine_", plugin=False)
class EngineConfig:
    """Everything one rollout needs to know besides the sample and the sampling params.

    `max_context_len` bounds prompt + response (None: only the server bounds it); `max_response_len`
    bounds the whole response of a trajectory (None: unbounded); the per-turn cap is
    `sampling_params["max_new_tokens"]`. The three stay separate. `plugin_settings` holds the
    settings of the plugins declared when it was read (`plugin(cls)` finds one).
    """

    router_ip: str | None = setting(key="sglang_router_ip", help="slime's router address")
    router_port: int | None = setting(key="sglang_router_port", low=1, high=65535, help="slime's router port")
    server_url: str = setting(DEFAULT_SERVER_URL, kind="url", derive=router_url, unset="slime's router",
                              flag=Flag("--server", "URL", SERVER, unset="start the embedded CPU server"),
                              help="SGLang server or router URL")
    profile: str = setting("retool", flag=Flag("--profile", "NAME", SERVER),
                           help="prompt and turn format: retool, chat, or one registered by an engine_tool_modules module")
    # the chat profile's tool-call format (SGLang parser name)
    tool_parser: str | None = setting(unset="from the chat template, else hermes", flag=Flag("--tool-parser", "NAME", SERVER),
                                      help="the chat profile's tool-call format, by SGLang's --tool-call-parser name")
    # the chat profile's reasoning format (SGLang reasoning-parser name)
    reasoning_parser: str | None = setting(unset="from the chat template, else none", flag=Flag("--reasoning-parser", "NAME", SERVER),
                                           help="the chat profile's reasoning format, by SGLang's --reasoning-parser name "
                                                "(none: no reasoning); a call inside the reasoning is not run")
    # slime's own argument: its dataset's prompts are rendered with it; every later render must be too.
    chat_template_kwargs: dict[str, Any] = setting(TemplateKwargs(), key="apply_chat_template_kwargs", kind=TEMPLATE_KWARGS,
                                                   flag=Flag("--chat-template-kwargs", "JSON", SERVER),
                                                   help="the chat profile's template variables in every render (e.g. "
                                                        "enable_thinking), as slime renders its dataset and SGLang a "
                                                        "chat request; slime's --apply-chat-template-kwargs")
    max_turns: int = setting(16, low=1, high=100_000, flag=Flag("--max-turns"), help="model turns per sample")
    max_tool_calls: int = setting(16, low=0, high=1_000_000, flag=Flag("--max-tool-calls", group=TOOLS),
                                  help="tool calls per sample")
    max_calls_per_turn: int = setting(8, low=1, high=10_000, help="tool calls run per turn (the rest get an error)")
    max_tokens_per_gpu: int | None = setting(key="max_tokens_per_gpu", low=1, high=10**9,
                                             help="the context when rollout_max_context_len is unset")
    context_parallel_size: int = setting(1, key="context_parallel_size", low=1, high=1_000_000, help="multiplies max_tokens_per_gpu")
    max_context_len: int | None = setting(key="rollout_max_context_len", low=1, high=10**9, derive=context_from_gpus,
                                          unset="max_tokens_per_gpu x context_parallel_size, else the server's",
                                          flag=Flag("--max-context", unset="the server's context length"),
                                          help="prompt + response tokens")
    max_response_len: int | None = setting(low=1, high=10**9, unset="unbounded", flag=Flag("--max-response-len"),
                                           help="response tokens per sample, over all turns")
    tool_timeout: float = setting(_LIMITS.timeout_s.default, low=0, high=DAY, above_low=True,
                                  flag=Flag("--tool-timeout", "S", TOOLS), help="seconds a tool call may run")
    tool_concurrency: int = setting(32, low=1, high=4096, cap=True, help="tool calls running at once (per event loop)")
    tool_output_chars: int = setting(8192, low=1, high=10**8, help="characters of a tool's output kept")
    tools: tuple[str, ...] | None = setting(unset="every registered tool",
                                            flag=Flag("--tools", "A,B", TOOLS, help='offer only these tools ("": none)'),
                                            help="the tools offered ([] or \"\": none, e.g. for an environment's episodes)")
    tool_modules: tuple[str, ...] = setting((), flag=Flag("--tool-module", "MODULE", TOOLS, repeatable=True, dest="tool_modules",
                                                          help="import this module so the tools it registers are offered"),
                                            help="modules imported so their tools (and environments, formats, settings) register")
    environment: str | None = setting(unset="none; such a turn is the final answer",
                                      flag=Flag("--environment", "NAME", TOOLS,
                                                help="the environment answering turns that call no tool, e.g. user_simulator"),
                                      help="the environment answering model turns that call no tool")
    # How reward_func combines per-turn rewards and the answer's (engine.profiles.reward.RewardRule).
    reward_rule: str = setting("sum", choices=("sum", "discounted", "last", "weighted"),
                               help="how reward_func combines the per-turn rewards (environment's, tools') and the answer's: "
                                    "sum, discounted (turn t weighs discount^(t-1)), last (the last turn's alone) or weighted")
    reward_discount: float = setting(0.9, low=0, high=1, above_low=True, help="the discounted rule's factor per model turn")
    reward_turn_weight: float = setting(1.0, low=-1e6, high=1e6, help="the weighted rule's weight of the per-turn rewards' sum")
    reward_answer_weight: float = setting(1.0, low=-1e6, high=1e6, help="the weighted rule's weight of the answer's reward")
    # An agent brings its own loop (engine.agent): its model calls are the sample's turns.
    agent: str | None = setting(unset="none: the engine's own loop answers the model",
                                flag=Flag("--agent", "CMD", AGENT,
                                          help="run this agent per prompt: a command line (quoted) or module:function"),
                                help="what runs per sample as an agent: a coroutine `module:function` called with "
                                     "(base_url, api_key, sample), or a command line started with OPENAI_BASE_URL / "
                                     "ANTHROPIC_BASE_URL and their keys set to its session; its model calls are the "
                                     "sample's turns (needs engine_profile: chat)")
    agent_timeout: float = setting(1800.0, low=0, high=7 * DAY, above_low=True, flag=Flag("--agent-timeout", "S", AGENT),
                                   help="seconds an agent may run; then it is stopped and the sample ends TRUNCATED "
                                        "(harness_timed_out), keeping what was sampled")
    agent_matcher: str = setting("json_calls", choices=("exact", "json_calls", "role_content"),
                                 flag=Flag("--agent-matcher", "NAME", AGENT),
                                 help="how an agent's copy of a model turn must match what the model wrote: exact (text, "
                                      "reasoning, calls as written), json_calls (calls' arguments as JSON, reasoning may be "
                                      "left out) or role_content (role and text)")
    agent_models: tuple[str, ...] = setting(("policy",), help="the model names an agent may ask for (/v1/models lists "
                                                              "them); * takes any name")
    # Long rollouts (docs/long-rollouts.md): compaction, earlier reasoning, what one sample is, its reward.
    compaction: str = setting("off", choices=("off", "summarize", "drop_oldest"), flag=Flag("--compaction", "MODE", LONG),
                              help="what happens before a segment's context overflows: off (it ends TRUNCATED "
                                   "context_full), summarize (the policy writes a summary; a new segment starts from the "
                                   "prompt, the summary and the latest turns) or drop_oldest (a new segment starts without "
                                   "the oldest tool exchanges); needs engine_profile: chat")
    compaction_threshold: int | None = setting(low=1, high=10**9, unset="3/4 of the context",
                                               flag=Flag("--compaction-threshold", "N", LONG),
                                               help="tokens (prompt + response of the open segment) at which it is "
                                                    "compacted; below the context")
    compaction_keep_turns: int = setting(2, low=0, high=100_000,
                                         help="the latest model turns (with what answered them) a compacted segment "
                                              "keeps; fewer where they would not fit under the threshold")
    compaction_summary_tokens: int = setting(1024, low=1, high=10**7, help="tokens the policy may write for a summary")
    compaction_train_summary: bool = setting(True, help="train the summary the policy writes (false: it stays in its "
                                                        "segment with mask 0)")
    compaction_prompt: str = setting(COMPACTION_PROMPT, help="the user message that asks the policy for a summary")
    earlier_reasoning: str = setting("as_template", choices=("as_template", "keep"),
                                     flag=Flag("--earlier-reasoning", "MODE", LONG),
                                     help="earlier turns' reasoning where the chat template drops it: as_template (each "
                                          "turn's prompt is the template's own render, as served; a new segment where "
                                          "that is not a prefix of the last) or keep (one sequence keeping it: a "
                                          "train-serve difference)")
    samples: str = setting("trajectory", choices=("trajectory", "per_turn"), flag=Flag("--samples", "MODE", LONG),
                           help="what one sample is: trajectory (a segment: turns whose prompts extend each other, "
                                "merged) or per_turn (one sample per model turn, its exact prompt and output)")
    segment_reward: str = setting("shared", choices=("shared", "discounted"),
                                  help="a rollout returned as several samples: each gets its reward (shared), or the last "
                                       "gets it and each earlier one engine_segment_discount times the next's (discounted)")
    segment_discount: float = setting(0.9, low=0, high=1, help="the discount per sample back from the last "
                                                               "(engine_segment_reward: discounted)")
    request_timeout: float = setting(1800.0, low=0, high=7 * DAY, above_low=True, help="seconds one /generate request may take")
    connect_timeout: float = setting(10.0, low=0, high=3600, above_low=True, help="seconds to connect to the server")
    # routing replay replies run to 100s of MB
    max_reply_bytes: int = setting(1 << 30, low=1 << 16, high=1 << 40,
                                   help="bytes one /generate reply may hold; a larger one fails the request")
    server_concurrency: int = setting(512, key="sglang_server_concurrency", low=1, high=MAX_CONNECTIONS, cap=True, run_default=64,
                                      flag=Flag("--concurrency", help="samples in flight"), help="requests in flight per engine")
    num_gpus: int = setting(1, key="rollout_num_gpus", low=0, high=1_000_000, help="GPUs for inference")
    gpus_per_engine: int = setting(1, key="rollout_num_gpus_per_engine", low=1, high=1_000_000, help="GPUs per inference engine")
    max_connections: int = derived(connections, low=1, help="the HTTP pool: sglang_server_concurrency for every engine")
    retry: RetryPolicy = nested(RetryPolicy, complete=retry_deadline)
    partial_rollout: bool = setting(False, key="partial_rollout", flag=Flag("--partial-rollout",
                                                                              help="aborted samples keep a checkpoint to resume from"),
                                    help="resume aborted samples from their checkpoint")
    mask_offpolicy: bool = setting(False, key="mask_offpolicy_in_partial_rollout", help="mask tokens of older weights on resume")
    tokenizer_path: str | None = setting(key="hf_checkpoint", unset="the shipped Qwen3 tokenizer",
                                         flag=Flag("--tokenizer", "DIR", SERVER, help="local tokenizer directory",
                                                   unset="the shipped Qwen3 one"),
                                         help="model directory; its tokenizer is used")
    gc_freeze: bool = setting(True, help="gc.freeze() long-lived objects once at start-up")  # engine.loop.runtime.freeze_long_lived_objects
    gc_defer_full: bool = setting(True, help="defer automatic full GC collections while samples are in flight; "
                                  "resumed when they drain")  # see engine.loop.runtime.FullCollections
    # What a sample that cannot finish hands back (see engine.loop.attempts): "retry" re-runs it
    # from RESET up to `sample_attempts` times within `sample_deadline` seconds, then ends it
    # FAILED with remove_sample; "aborted" hands ABORTED back at once, for a caller that re-queues.
    abort_status: str = setting("retry", choices=("retry", "aborted"),
                                help="a sample whose attempt failed: re-run it (retry), or hand ABORTED back at once "
                                "(aborted, for a caller that re-queues)")
    sample_attempts: int = setting(3, low=1, high=1000, help="attempts of one sample before it ends FAILED with remove_sample")
    sample_deadline: float = setting(1800.0, low=0, high=7 * DAY, above_low=True, help="seconds after which no new attempt of a sample starts")
    # Routing replay (R3): ask for routed experts each turn; a row is num_layers x moe_router_topk int32.
    routing_replay: bool = setting(False, key="use_rollout_routing_replay", help="routing replay (R3): ask for routed experts every turn")
    num_layers: int = setting(0, key="num_layers", low=0, high=100_000, help="the model's layers (rows of routed experts per token)")
    moe_router_topk: int = setting(0, key="moe_router_topk", low=0, high=100_000, help="experts per token (columns of routed experts)")
    rollout_function_path: str | None = setting(key="rollout_function_path", unset="slime's default loop",
                                                help="slime's rollout function; its fully-async worker re-queues ABORTED groups")
    # slime's fully-async worker is the caller: it re-queues ABORTED groups
    fully_async: bool = derived(from_rollout_function, help="slime's fully-async worker drives generate (from rollout_function_path)")
    # Where sandboxed tool code runs: "local" (this machine) or "ray" (a pool of workers on the
    # Ray cluster; see engine.sandbox.backend). The sandbox_* settings size and place that pool.
    sandbox_backend: str = setting("local", choices=BACKENDS,
                                   help="where sandboxed code runs: local (this machine) or ray (workers on the Ray cluster)")
    sandbox_workers: int = setting(_RAY.workers.default, low=1, high=100_000, help="Ray sandbox workers")
    sandbox_worker_cpus: float = setting(_RAY.cpus.default, low=0, high=1024, above_low=True, help="CPUs each Ray sandbox worker reserves")
    sandbox_resource: str | None = setting(_RAY.resource.default,
                                           help="a custom Ray resource the sandbox workers need (to keep them on CPU nodes)")
    sandbox_queue: int = setting(_RAY.queue.default, low=0, high=10**7, help="calls that may wait for a free Ray worker")
    plugin_settings: tuple[Any, ...] = attrs.field(default=(), converter=_plugin_settings)

    @sandbox_backend.validator
    def _check_sandbox_backend(self, attribute: Any, value: str) -> None:
        from engine.sandbox.backend import check_backend  # refuses "ray" where ray is not installed

        check_backend(value)

    def __attrs_post_init__(self) -> None:
        if self.routing_replay and not (self.num_layers and self.moe_router_topk):
            raise SettingsError("routing replay needs num_layers and moe_router_topk (slime args) to be set")
        if self.compaction != "off" and self.max_context_len is not None:
            self.threshold()  # refuses a threshold the context cannot hold, with one sentence
        if self.partial_rollout:
            # slime's abort() reads each element of a group as a Sample, and a re-queued group comes
            # back to generate as it was: a rollout handed back as a list of samples cannot resume.
            fans_out = [f"{key}: {value}" for key, value, off in (
                ("engine_compaction", self.compaction, "off"), ("engine_samples", self.samples, "trajectory"),
                ("engine_agent", self.agent, None)) if value != off]
            if fans_out:
                raise SettingsError(f"partial_rollout cannot resume a rollout that comes back as several samples "
                                    f"({', '.join(fans_out)}): turn one of them off")

    def threshold(self) -> int | None:
        """Tokens of the open segment at which it is compacted (None: compaction is off).

        Refused (SettingsError) when it is at or above the context, or when neither it nor a
        context is known: a segment would overflow before it could be compacted. The runtime asks
        (`run` knows the server's context only then); settings that hold a context are checked when made.
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

    def set_up(self, plugin: P, **given: Any) -> P:
        """What `plugin.setup` makes of these settings: with its own as well when it declares them (`plugin.Settings`).
        `given` is what the engine hands it besides (an environment's `http`)."""
        own = getattr(plugin, "Settings", None)
        if own is None:
            return plugin.setup(self, **given)  # type: ignore[attr-defined, no-any-return]
        return plugin.setup(self, self.plugin(own), **given)  # type: ignore[attr-defined, no-any-return]

    def plugin(self, cls: type[T]) -> T:
        """The settings of the plugin whose settings class is `cls` (its defaults when they were not read)."""
        for item in self.plugin_settings:
            if type(item) is cls:
                return item  # type: ignore[no-any-return]
        return cls()

    @classmethod
    def from_args(cls, args: Any) -> EngineConfig:
        """Read slime's argparse namespace (`engine_*` keys come from `--custom-config-path` YAML).

        The modules `engine_tool_modules` names are imported first, so the settings their plugins
        declare are read too. Every key is converted and checked by its declaration; raises
        SettingsError with one clear sentence. slime calls this once per sample with the same `args`:
        the result is remembered by the values it was read from, and the namespace is scanned for
        unknown keys once per object.
        """
        seen = sources.args_key(args, _watched())
        if seen is None:  # a value without an exact key (a dict, a set): nothing cached
            return _read_args(args)
        cached = _from_args_cache.get(seen)
        if cached is not None:
            return cached
        cfg = _read_args(args)
        seen = sources.args_key(args, _watched())  # the modules imported may have declared more keys
        if seen is not None:
            if len(_from_args_cache) >= _FROM_ARGS_CACHE:
                _from_args_cache.clear()
            _from_args_cache[seen] = cfg
        return cfg


@settings(plugin=False)
class Sampling:
    """slime's sampling arguments: slime checks them itself in a training job; only `run` reads them."""

    rollout_max_response_len: int = setting(512, low=1, high=10**9, flag=Flag("--max-new-tokens"), help="tokens per model turn")
    rollout_temperature: float = setting(1.0, low=0, high=1000, flag=Flag("--temperature", "T"), help="sampling temperature")
    rollout_top_p: float = setting(1.0, low=0, high=1, above_low=True, flag=Flag("--top-p", "P"), help="nucleus sampling")
    n_samples_per_prompt: int = setting(1, low=1, high=100_000, flag=Flag("--n-samples-per-prompt"),
                                        help="samples per prompt, a GRPO group")


# -- reading slime's args -------------------------------------------------------------------------

# packages whose shipped plugins declare settings (the user simulator, the MCP servers' tools)
BUILT_IN_PLUGINS = ("engine.envs", "engine.tools.mcp_servers")
_FROM_ARGS_CACHE = 64
_from_args_cache: dict[Any, EngineConfig] = {}
_watching: tuple[int, tuple[str, ...]] = (-1, ())


def _watched() -> tuple[str, ...]:
    """Every key a read depends on: the engine's and the declared plugins' (recomputed when one is declared)."""
    global _watching
    if _watching[0] != version():
        keys = [*keyed(EngineConfig), *(k for p in plugins() for k in keyed(p))]
        _watching = (version(), tuple(keys))
    return _watching[1]


def load_plugins(modules: Iterable[str], key: str = "engine_tool_modules") -> None:
    """Import the shipped plugins and `modules` (their tools, environments and settings register);
    a module that cannot be imported is a SettingsError naming it."""
    for module in (*BUILT_IN_PLUGINS, *modules):
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise SettingsError(f"{key} {module}: cannot import it ({type(exc).__name__}: {exc})") from None


def _read_args(args: Any) -> EngineConfig:
    load_plugins(keyed(EngineConfig)["engine_tool_modules"].read(getattr(args, "engine_tool_modules", None)))
    for key, closest in sources.unknown_engine_keys(sources.namespace_keys(args)).items():
        warn_once(sources.unknown_key_message(key, closest), log)
    read = (sources.read(p, args) for p in plugins())  # what a plugin leaves at its defaults is not kept
    return sources.read(EngineConfig, args, plugin_settings=tuple(s for s in read if s != type(s)()))


def run_rows() -> list[Setting]:
    """Every keyed setting `python -m engine run` reads: the engine's, the sampling arguments, the plugins' declared now."""
    return [r for r in (*rows(EngineConfig), *rows(Sampling), *(r for p in plugins() for r in rows(p))) if r.key]


def flagged_settings() -> list[Setting]:
    """The settings `python -m engine run` offers as flags, in declaration order."""
    return [r for r in run_rows() if r.flag is not None]


__all__ = [
    "AGENT",
    "BUDGETS",
    "COMPACTION_PROMPT",
    "DEFAULT_SERVER_URL",
    "LONG",
    "MAX_CONNECTIONS",
    "SERVER",
    "TOOLS",
    "EngineConfig",
    "RetryPolicy",
    "Sampling",
    "flagged_settings",
    "load_plugins",
    "run_rows",
]
