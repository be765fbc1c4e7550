"""An embedded, SGLang-compatible generation server on the CPU.

It speaks SGLang's native `/generate` wire format (token ids in, ids + logprobs out, the same
finish reasons and error bodies) and the endpoints sglang-router needs, so the rollout engine,
and the real router, can run against it end to end without a GPU.

    from engine.local.server import BackgroundServer
    with BackgroundServer() as server:          # tiny Qwen3 on a free loopback port
        httpx.post(server.url + "/generate", json={"input_ids": [...], "return_logprob": True})

From a CLI: `add_serve_arguments(parser)` then `main_serve(parser.parse_args())`.
"""

from typing import Any

from engine.local.server.settings import ServerSettings, add_serve_arguments, settings_from_namespace

# The rest loads torch and transformers: imported on first use, so `python -m engine --help`
# and the settings stay light.
_LAZY = {
    "build_app": "engine.local.server.app",
    "LMBackend": "engine.local.server.model",
    "SamplerParams": "engine.local.server.model",
    "ReplayEntry": "engine.local.server.replay",
    "ReplayScript": "engine.local.server.replay",
    "load_replay": "engine.local.server.replay",
    "BackgroundServer": "engine.local.server.runner",
    "main_serve": "engine.local.server.runner",
    "serve": "engine.local.server.runner",
    "wait_healthy": "engine.local.server.runner",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.local.server' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "BackgroundServer",
    "LMBackend",
    "ReplayEntry",
    "ReplayScript",
    "SamplerParams",
    "ServerSettings",
    "add_serve_arguments",
    "build_app",
    "load_replay",
    "main_serve",
    "serve",
    "settings_from_namespace",
    "wait_healthy",
]
