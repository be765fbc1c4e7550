"""What all samples of one event loop share: settings, tokenizer, profile, HTTP pool, tool slots."""

from __future__ import annotations

import asyncio
import gc
import importlib
import json
from collections import OrderedDict
from typing import Any

import attrs

import tools
from collections.abc import Callable

from engine.loop.abort import AbortSignal
from engine.sglang.client import SGLangClient, make_http_client
from engine.config import EngineConfig
from engine.profiles import Profile, make_profile
from engine.profiles.tokenizer import load_tokenizer
from engine.loop.tool_calls import ToolRunner


START_GATE = 32  # prompts rendered per event-loop turn when many samples start at once
PROMPT_CACHE = 4096


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
    # Samples starting in one burst take turns rendering their prompts, so the event loop
    # gets a say between every few dozen of them instead of after thousands.
    start_gate: asyncio.Semaphore = attrs.field(factory=lambda: asyncio.Semaphore(START_GATE))
    _prompts: OrderedDict[tuple[str, frozenset[str], int], tuple[int, ...]] = attrs.field(factory=OrderedDict)

    async def prompt_ids(self, prompt: Any, allowed: frozenset[str]) -> list[int]:
        """The rendered prompt's ids. Cached: the samples of a GRPO group share one prompt.

        Every start passes the gate and yields once: thousands of samples started together
        would otherwise each run to their first request in a single event-loop turn.
        """
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)
        key = (text, allowed, tools.registry.version())  # a re-registered tool may change its schema
        async with self.start_gate:
            await asyncio.sleep(0)
            ids = self._prompts.get(key)
            if ids is None:
                ids = self._prompts[key] = tuple(self.profile.render_prompt(prompt, self.tool_schemas(allowed)))
                if len(self._prompts) > PROMPT_CACHE:
                    self._prompts.popitem(last=False)
            else:
                self._prompts.move_to_end(key)
        return list(ids)

    def abort_requested(self) -> bool:
        """Whether samples should stop before their next generation."""
        return bool(self.abort) or (self.abort_check is not None and self.abort_check())

    @classmethod
    def create(
        cls, cfg: EngineConfig, *, tokenizer: Any = None, http: Any = None, abort_check: Callable[[], bool] | None = None
    ) -> Runtime:
        """Load the tokenizer and tool modules, open the HTTP pool. Call inside the event loop."""
        for module in cfg.tool_modules:
            importlib.import_module(module)
        configure_builtin_tools(cfg)
        tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer_path)
        if cfg.gc_freeze:
            freeze_long_lived_objects()
        http = http if http is not None else make_http_client(cfg)
        client = SGLangClient(cfg.server_url, http, cfg.retry)
        return cls(cfg, tok, make_profile(cfg.profile, tok), client, ToolRunner(cfg), abort_check=abort_check)

    def tool_schemas(self, allowed: frozenset[str]) -> list[dict[str, Any]]:
        """The schemas shown in the prompt, in registry order."""
        return [tools.get(n).schema() for n in tools.names() if n in allowed]  # type: ignore[union-attr]

    def allowed_tools(self, requested: Any = None) -> frozenset[str]:
        """Registered tools, narrowed by the settings and by a sample's own list."""
        allowed = set(tools.names())
        if self.cfg.tools is not None:
            allowed &= set(self.cfg.tools)
        if requested is not None:
            allowed &= set(requested)
        return frozenset(allowed)

    async def aclose(self) -> None:
        await self.client.http.aclose()


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


def configure_builtin_tools(cfg: EngineConfig) -> None:
    """Give the shipped code interpreter the configured time limit, and the sandbox its backend."""
    try:
        from tools import code_interpreter
    except ImportError:  # pragma: no cover - shipped with the package
        return
    configure = getattr(code_interpreter, "configure", None)
    if configure is not None:
        configure(timeout_s=cfg.tool_timeout)
    from tools.sandbox import backend

    backend.configure(cfg.sandbox_backend, backend.RaySettings(
        cfg.sandbox_workers, cfg.sandbox_worker_cpus, cfg.sandbox_resource, cfg.sandbox_queue))
