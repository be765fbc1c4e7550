"""What all samples of one event loop share: settings, tokenizer, profile, HTTP pool, tool slots."""

from __future__ import annotations

import asyncio
import collections
import gc
import importlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs

from engine import tools
from engine.aio import Gate
from engine.logs import warn_once
from engine.loop.abort import AbortSignal
from engine.loop.environment import Environments
from engine.loop.tool_calls import ToolRunner
from engine.profiles import Profile, make_profile
from engine.profiles.tokenizer import load_tokenizer
from engine.settings import EngineConfig, SettingsError
from engine.sglang.client import ServiceClient, SGLangClient, make_http_client
from engine.tools import mcp_servers

START_GATE = 32  # samples beginning their set-up per event-loop turn when many start at once
PROMPT_CACHE = 4096
ABORT_POLL_SECONDS = 0.2  # how soon running tool calls see the caller's abort flag
log = logging.getLogger(__name__)


def compaction_needs_chat(profile: str) -> str:
    """Why compaction cannot run with a profile that renders no chat messages."""
    return f"renders the compacted prompt with a chat template; the {profile} profile has none (use engine_profile: chat)"


@attrs.define(eq=False)
class Runtime:
    """Built once per (settings, event loop); cheap to look up per sample."""

    cfg: EngineConfig
    tokenizer: Any
    profile: Profile
    client: SGLangClient
    tool_runner: ToolRunner
    abort: AbortSignal = attrs.field(factory=AbortSignal)
    abort_check: Callable[[], bool] | None = None  # the caller's own flag (slime's, via the adapter)
    # The environments set up for this runtime, by name: the default (`engine_environment`) at once,
    # those samples name (`metadata["environment"]`) when one first does.
    environments: Environments = attrs.field(init=False)
    # Long rollouts (docs/long-rollouts.md), read once from the settings and the profile's template.
    compact_at: int | None = attrs.field(default=None, init=False)  # engine_compaction's threshold (None: off)
    reasoning_rule: str = attrs.field(default="kept", init=False)  # which earlier reasoning the prompt keeps
    # Samples starting in one burst take turns (`in_flight`), so the event loop gets a say
    # between every few dozen of them instead of after thousands.
    start_gate: Gate = attrs.field(factory=lambda: Gate(START_GATE))
    _prompts: OrderedDict[Any, tuple[int, ...]] = attrs.field(factory=OrderedDict)  # exact_key(prompt), tools, ... -> ids
    # Each registered tool as `setup` made it for these settings, beside the registered one it was made from.
    _tools: dict[str, tuple[tools.Tool, tools.Tool]] = attrs.field(factory=dict, init=False)
    # One poller of the abort check for every tool turn running, not a task or a timer per turn.
    _cut_on_abort: set[asyncio.Future[Any]] = attrs.field(factory=set, init=False)
    _abort_poller: asyncio.Future[None] | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        # Their services are asked through the loop's one pool, as /generate is.
        self.environments = Environments(self.cfg, self.profile, ServiceClient(self.client.http, self.cfg.retry))
        for name in tools.names():  # a tool's settings are checked now, not at its first call
            self.tool(name)
        self.compact_at = self.cfg.threshold()
        renders = callable(getattr(self.profile, "render_messages", None))
        if self.compact_at is not None and not renders:
            raise SettingsError(f"engine_compaction: {self.cfg.compaction} {compaction_needs_chat(self.cfg.profile)}")
        if self.cfg.earlier_reasoning == "as_template" and renders:
            self.reasoning_rule = self.profile.earlier_reasoning()  # type: ignore[attr-defined]
            if self.cfg.partial_rollout and self.reasoning_rule != "kept":  # its samples cannot fan out
                warn_once(f"partial_rollout: each sample stays one sequence, keeping the earlier reasoning the chat "
                          f"template drops ({self.reasoning_rule}), as engine_earlier_reasoning: keep", log)
                self.reasoning_rule = "kept"

    @property
    def keeps_history(self) -> bool:
        """Whether samples keep their conversation as messages: to compact it, or to render the next
        prompt as the template does where it drops earlier reasoning."""
        return self.compact_at is not None or self.reasoning_rule != "kept"

    def fans_out(self) -> bool:
        """Whether a sample may come back as several (slime's fan-out): an agent's session, a
        compaction, a template that drops earlier reasoning (after any turn, or after a user turn,
        which an environment a sample names may write), or one sample per turn. Then every sample
        comes back as a list, one of one included: slime flattens a step by its first element's
        shape, and a step mixing a `Sample` with lists fails there."""
        return self.keeps_history or self.cfg.samples == "per_turn" or self.cfg.agent is not None

    @property
    def environment(self) -> Any:
        """The default environment (`engine_environment`), set up for this runtime; None: none."""
        return self.environments.default

    def tool(self, name: str) -> tools.Tool | None:
        """The tool registered as `name`, set up for this runtime's settings (`Tool.setup`), or None.

        A tool registered after the runtime was made is set up at its first call.
        """
        registered = tools.get(name)
        if registered is None:
            return None
        made = self._tools.get(name)
        if made is None or made[0] is not registered:
            made = self._tools[name] = (registered, self.cfg.set_up(registered))
        return made[1]

    def in_flight(self) -> InFlight:
        """A sample's whole life in this runtime (`async with rt.in_flight():`), entered first thing by the adapter.

        Full collections are deferred from before the sample does anything
        (`engine_gc_defer_full`), and it waits for a start slot: at most `START_GATE` samples
        begin their set-up per event-loop turn. Thousands of samples handed over at once
        (slime's `gather`) would otherwise each read their input and build their rollout in one
        event-loop turn, one stall as long as all their set-ups together, and the tasks waiting
        to start would be walked by a full collection (the bench's stall figure measures both).
        """
        return InFlight(self.start_gate, self.cfg.gc_defer_full)

    async def prompt_ids(
        self, prompt: Any, allowed: frozenset[str], own_schemas: dict[str, dict[str, Any]] | None = None
    ) -> tuple[int, ...]:
        """The rendered prompt's ids. Cached: the samples of a GRPO group share one (immutable) tuple.

        `own_schemas` are the sample's own tool schemas (slime's `--tool-key`), shown instead of
        the registered ones for the tools they name by a profile that renders them (chat). A burst
        of starts is spread over event-loop turns before it gets here, by `in_flight`.
        """
        if not getattr(self.profile, "renders_sample_schemas", False):
            own_schemas = None  # retool shows the example's tool spec, whatever the dataset says
        # Keyed by exactly what is rendered (types, values, dict order): a prompt and its JSON text,
        # or 1 and "1", never share an entry. A prompt holding something that cannot be keyed
        # exactly is rendered every time instead.
        frozen, own = exact_key(prompt), exact_key(own_schemas or None)
        key = None if frozen is None or own is None else (frozen, allowed, own, tools.registry.version())
        ids = self._prompts.get(key) if key is not None else None
        if ids is None:
            schemas = self.tool_schemas(allowed, own_schemas)
            ids = tuple(self.profile.render_prompt(prompt, schemas))
            if key is not None:  # a re-registered tool may change its schema: the version is in the key
                self._prompts[key] = ids
                if len(self._prompts) > PROMPT_CACHE:
                    self._prompts.popitem(last=False)
        else:
            self._prompts.move_to_end(key)
        return ids

    def abort_requested(self) -> bool:
        """Whether samples should stop before their next generation."""
        return bool(self.abort) or (self.abort_check is not None and self.abort_check())

    def watch(self, work: asyncio.Future[Any]) -> None:
        """Cancel `work` as soon as the caller starts aborting (within ABORT_POLL_SECONDS).

        The abort check is a flag to poll (slime's `GenerateState.aborted`); one task per runtime
        polls it while anything is watched. Call `unwatch` once `work` is done.
        """
        self._cut_on_abort.add(work)
        if self._abort_poller is None or self._abort_poller.done():
            self._abort_poller = asyncio.ensure_future(self._poll_abort())

    def unwatch(self, work: asyncio.Future[Any]) -> None:
        """Stop watching `work`."""
        self._cut_on_abort.discard(work)

    async def _poll_abort(self) -> None:
        while self._cut_on_abort:
            await asyncio.sleep(ABORT_POLL_SECONDS)
            if self.abort_requested():
                for work in list(self._cut_on_abort):
                    work.cancel()

    @classmethod
    def create(
        cls, cfg: EngineConfig, *, tokenizer: Any = None, http: Any = None, abort_check: Callable[[], bool] | None = None
    ) -> Runtime:
        """Load the tokenizer and tool modules, open the HTTP pool. Call inside the event loop."""
        for module in cfg.tool_modules:
            importlib.import_module(module)
        mcp = cfg.plugin(mcp_servers.McpSettings)
        if mcp.servers:  # their tools register like a module's, before the machine is built
            mcp_servers.register_servers(mcp.servers, mcp.list_timeout, cfg.tool_timeout)
        configure_sandbox(cfg)
        tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer_path)
        if cfg.gc_freeze:
            freeze_long_lived_objects()
        http = http if http is not None else make_http_client(cfg)
        client = SGLangClient(cfg.server_url, http, cfg.retry, request_timeout=cfg.request_timeout,
                              vocab_size=vocabulary_size(tok))
        return cls(cfg, tok, make_profile(cfg.profile, tok, tool_parser=cfg.tool_parser, reasoning_parser=cfg.reasoning_parser,
                                               template_kwargs=cfg.chat_template_kwargs), client, ToolRunner(cfg), abort_check=abort_check)

    def tool_schemas(
        self, allowed: frozenset[str], own: dict[str, dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """The schemas shown in the prompt, in registry order; a sample's own schema where it gave one."""
        own = own or {}
        return [own.get(n) or tools.get(n).schema() for n in tools.names() if n in allowed]  # type: ignore[union-attr]

    def allowed_tools(self, requested: Any = None) -> frozenset[str]:
        """The tools a sample is offered: registered ones, narrowed by the settings (`engine_tools`)
        and by the sample's own list; with neither, the profile withholds some built-ins (retool:
        `python_session`, so its prompt offers `code_interpreter` alone, as slime's example does)."""
        allowed = set(tools.names())
        if self.cfg.tools is not None:
            allowed &= set(self.cfg.tools)
        if requested is not None:
            allowed &= set(requested)
        if self.cfg.tools is None and requested is None:
            allowed -= set(getattr(self.profile, "withheld_tools", ()))
        return frozenset(allowed)

    async def aclose(self) -> None:
        """Close the environments, the MCP servers this loop started, and the HTTP pool."""
        try:
            await self.environments.aclose()
            await mcp_servers.close_connections()  # the servers this loop started end with the run
        finally:
            await self.client.http.aclose()

    async def __aenter__(self) -> Runtime:
        """`async with Runtime.create(cfg) as rt:` closes the runtime however the block ends."""
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def exact_key(value: Any) -> Any:
    """A hashable key equal for two values only when they hold the same types and values all the way
    down (1, 1.0, True and "1" apart; -0.0 and 0.0 apart; dicts in their order), or None when a
    part is of a type that cannot be keyed so (then nothing may be cached for it)."""
    kind = type(value)
    if value is None or kind in (str, int, bool, bytes):
        return (kind, value)
    if kind is float:
        return (kind, repr(value))  # nan equals itself here, and -0.0 is not 0.0
    if kind in (list, tuple):
        parts = tuple(exact_key(v) for v in value)
        return None if any(p is None for p in parts) else (kind, parts)
    if kind is dict:
        items = tuple((exact_key(k), exact_key(v)) for k, v in value.items())
        return None if any(k is None or v is None for k, v in items) else (kind, items)
    return None


def vocabulary_size(tokenizer: Any) -> int | None:
    """How many ids the tokenizer knows (added special tokens included); None if it cannot say."""
    try:
        return len(tokenizer)
    except TypeError:
        size = getattr(tokenizer, "vocab_size", None)
        return size if isinstance(size, int) else None


_frozen = False


def freeze_long_lived_objects() -> None:
    """Move what exists now (tokenizer, torch, modules) out of the cyclic GC's sight, once.

    With thousands of samples in flight, full collections re-scan these few hundred
    thousand long-lived objects and stall the event loop for 100s of ms each; frozen, they
    are skipped. Garbage is collected first, so nothing collectable is frozen.
    """
    global _frozen
    if not _frozen:
        gc.collect()
        gc.freeze()
        _frozen = True


class InFlight:
    """`Runtime.in_flight()`: a class, not a generator-based context manager, as thousands are entered at once."""

    __slots__ = ("gate", "deferred")

    def __init__(self, gate: Gate, deferred: bool) -> None:
        self.gate, self.deferred = gate, deferred

    async def __aenter__(self) -> None:
        if self.deferred:
            full_collections.enter()
        try:
            await self.gate.acquire()
            try:
                await asyncio.sleep(0)
            finally:
                self.gate.release()
        except BaseException:  # cancelled while waiting to start
            if self.deferred:
                full_collections.exit()
            raise

    async def __aexit__(self, *exc: object) -> None:
        if self.deferred:
            full_collections.exit()


class FullCollections:
    """Automatic full (gen-2) collections deferred while samples are in flight, resumed when they drain.

    A full collection walks every tracked object; with thousands of samples in flight it
    stalls the event loop longer than anything else the engine does (the bench's stall
    figure, with and without this, shows by how much). Young
    generations still run, so short-lived cycles are still freed; what survives them waits
    for the drain. There one full collection runs if the collector's own count says one is due
    (then, while nothing is in flight, rather than in the next burst of starts), and none
    otherwise: a forced one made every drain pay a full walk of the heap (torch's objects
    included), even after a single short sample. The collector is the process's, so this is one counter per process.
    `drains` keeps when the last drains began and what their collection took (the bench tells
    a stall while samples are in flight from the drain's collection with it).
    """

    def __init__(self) -> None:
        self._in_flight = 0
        self._saved: tuple[int, int, int] | None = None
        self.drains: collections.deque[tuple[float, float]] = collections.deque(maxlen=64)  # (perf_counter, seconds)

    def enter(self) -> None:
        """A sample starts."""
        if self._in_flight == 0:
            self._saved = gc.get_threshold()
            gen0, gen1, _ = self._saved
            gc.set_threshold(gen0, gen1, 1 << 30)  # the third threshold gates full collections
        self._in_flight += 1

    def exit(self) -> None:
        """A sample ended; the last one out restores the thresholds, and collects if one is due."""
        self._in_flight -= 1
        if self._in_flight == 0 and self._saved is not None:
            gc.set_threshold(*self._saved)
            due = gc.get_count()[2] >= self._saved[2]  # young collections since the last full one
            self._saved = None
            started = time.perf_counter()
            if due:  # now, while nothing is in flight, not in the next burst of starts
                gc.collect()
            self.drains.append((started, time.perf_counter() - started))


full_collections = FullCollections()


def configure_sandbox(cfg: EngineConfig) -> None:
    """Point the sandbox at its backend: this machine, or workers on the Ray cluster.

    The backend is the process's (one pool of Ray workers serves every runtime of it), so it is
    set here once per settings rather than carried per call.
    """
    from engine.sandbox import backend

    backend.configure(cfg.sandbox_backend, backend.RaySettings(
        cfg.sandbox_workers, cfg.sandbox_worker_cpus, cfg.sandbox_resource, cfg.sandbox_queue))
