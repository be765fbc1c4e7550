"""An embedded, SGLang-compatible generation server on the CPU.

It speaks SGLang's native `/generate` wire format (token ids in, ids + logprobs out, the same
finish reasons and error bodies) and the endpoints sglang-router needs, so the rollout engine,
and the real router, can run against it end to end without a GPU.

    from engine.server import BackgroundServer
    with BackgroundServer() as server:          # tiny Qwen3 on a free loopback port
        httpx.post(server.url + "/generate", json={"input_ids": [...], "return_logprob": True})

From a CLI: `add_serve_arguments(parser)` then `main_serve(parser.parse_args())`.
"""

from typing import Any

from engine.server.settings import ServerSettings, add_serve_arguments, settings_from_namespace

# The rest loads torch and transformers: imported on first use, so `python -m engine --help`
# and the settings stay light.
_LAZY = {
    "build_app": "engine.server.app",
    "LMBackend": "engine.server.model",
    "SamplerParams": "engine.server.model",
    "ReplayEntry": "engine.server.replay",
    "ReplayScript": "engine.server.replay",
    "load_replay": "engine.server.replay",
    "BackgroundServer": "engine.server.runner",
    "main_serve": "engine.server.runner",
    "serve": "engine.server.runner",
    "wait_healthy": "engine.server.runner",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.server' has no attribute {name!r}")
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
