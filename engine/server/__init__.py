"""An embedded, SGLang-compatible generation server on the CPU.

It speaks SGLang's native `/generate` wire format (token ids in, ids + logprobs out, the same
finish reasons and error bodies) and the endpoints sglang-router needs, so the rollout engine,
and the real router, can run against it end to end without a GPU.

    from engine.server import BackgroundServer
    with BackgroundServer() as server:          # tiny Qwen3 on a free loopback port
        httpx.post(server.url + "/generate", json={"input_ids": [...], "return_logprob": True})

From a CLI: `add_serve_arguments(parser)` then `main_serve(parser.parse_args())`.
"""

from engine.server.app import build_app
from engine.server.model import LMBackend, SamplerParams
from engine.server.replay import ReplayEntry, ReplayScript, load_replay
from engine.server.runner import (
    BackgroundServer,
    add_serve_arguments,
    main_serve,
    serve,
    settings_from_namespace,
    wait_healthy,
)
from engine.server.settings import ServerSettings

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
