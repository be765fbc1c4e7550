"""HTTP routes of the embedded SGLang-compatible server (aiohttp.web)."""

from __future__ import annotations

import asyncio
import collections
import datetime
import json
import logging
import time
from typing import Any

import attrs
from aiohttp import web

from engine.local.server.faults import FAULTS, FaultInjector, FaultSpec, fault_middleware
from engine.local.server.model import LMBackend
from engine.local.server.protocol import RequestError, build_response, parse_generate
from engine.local.server.replay import ReplayScript, load_replay
from engine.local.server.scheduler import Scheduler
from engine.local.server.settings import ServerSettings

log = logging.getLogger("engine.local.server")
SGLANG_VERSION = "0.5.23"  # the SGLang release whose wire format this server follows
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
_FLUSH_NOTE = "(When there are running or waiting requests, the operation will not be performed.)\n"
_FLUSHED = "Cache flushed.\nPlease check backend logs for more details. " + _FLUSH_NOTE
_NOT_FLUSHED = "Cache not flushed. Please check backend logs for more details. " + _FLUSH_NOTE


@attrs.define(eq=False)
class ServerState:
    """Everything the routes share: settings, model, scheduler and a few counters."""

    settings: ServerSettings
    backend: LMBackend
    scheduler: Scheduler
    weight_version: str
    started_at: float = attrs.Factory(time.time)
    generate_requests: int = 0
    routing_keys: collections.Counter[str] = attrs.Factory(collections.Counter)
    unpaused: asyncio.Event | None = None  # created on the serving loop, at startup
    port: int | None = None  # the bound port, known once listening (settings may say 0)


STATE = web.AppKey("embedded_sglang_state", ServerState)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


def _error(exc: RequestError) -> web.Response:
    return _json(exc.body, status=exc.status)


async def _read_json(request: web.Request) -> Any:
    """The JSON body, or RequestError in the FastAPI body-parse shape."""
    raw = await request.read()
    try:
        return json.loads(raw) if raw.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else "invalid UTF-8"
        pos = exc.pos if isinstance(exc, json.JSONDecodeError) else 0
        raise RequestError.bad_request(
            f"[{{'type': 'json_invalid', 'loc': ('body', {pos}), 'msg': 'JSON decode error', "
            f"'input': {{}}, 'ctx': {{'error': '{detail}'}}}}]") from None


async def generate(request: web.Request) -> web.Response:
    """POST/PUT /generate: SGLang's native generation endpoint (non-streaming)."""
    state = request.app[STATE]
    started = time.perf_counter()
    state.generate_requests += 1
    key = request.headers.get(ROUTING_KEY_HEADER)
    if key is not None:
        state.routing_keys[key] += 1
    try:
        body = await _read_json(request)
        assert state.unpaused is not None
        await state.unpaused.wait()  # SGLang blocks new requests while generation is paused
        specs, batch = parse_generate(body, state.backend, state.settings.context_length)
        futures = []
        try:
            for spec in specs:
                futures.append(state.scheduler.submit(spec))
        except RequestError:
            for spec in specs[: len(futures)]:
                state.scheduler.abort(spec.rid, exact=True)
            raise
    except RequestError as exc:
        return _error(exc)
    try:
        results = await asyncio.gather(*futures)
    except asyncio.CancelledError:
        for spec in specs:  # the client went away: stop spending compute on it
            state.scheduler.abort(spec.rid, exact=True)
        raise
    except Exception:
        log.exception("generate failed")
        return web.Response(status=500, text="Internal Server Error")
    latency = time.perf_counter() - started
    routed = (state.settings.routed_experts_layers, state.settings.routed_experts_topk)
    bodies = [build_response(spec, result, weight_version=state.weight_version, e2e_latency=latency,
                             routed_experts=routed, top_p_replay=state.settings.top_p_replay)
              for spec, result in zip(specs, results)]
    return _json(bodies if batch else bodies[0])


async def abort_request(request: web.Request) -> web.Response:
    """POST /abort_request {"rid": prefix, "abort_all": bool}: 200 with an empty body."""
    state = request.app[STATE]
    try:
        body = await _read_json(request)
    except RequestError as exc:
        return _error(exc)
    if not isinstance(body, dict):
        return _error(RequestError.message("abort_request expects a JSON object."))
    state.scheduler.abort(str(body.get("rid") or ""), abort_all=bool(body.get("abort_all")))
    return web.Response(status=200)


async def health(request: web.Request) -> web.Response:
    """GET /health and /health_generate: 200 with an empty body while the worker runs."""
    return web.Response(status=200 if request.app[STATE].scheduler.alive else 503)


def model_info_body(state: ServerState) -> dict[str, Any]:
    """What GET /model_info returns; paths are local so sglang-router never reaches the hub."""
    b = state.backend
    return {
        "model_path": b.model_path, "served_model_name": b.served_model_name, "tokenizer_path": b.tokenizer_path,
        "is_generation": True, "preferred_sampling_params": None, "weight_version": state.weight_version,
        "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
        "has_image_understanding": False, "has_audio_understanding": False, "model_type": b.model_type,
        "architectures": b.architectures,
    }


async def model_info(request: web.Request) -> web.Response:
    """GET /model_info and /get_model_info."""
    return _json(model_info_body(request.app[STATE]))


async def server_info(request: web.Request) -> web.Response:
    """GET /server_info and /get_server_info: flattened server args plus counters."""
    state = request.app[STATE]
    s, b, stats = state.settings, state.backend, state.scheduler.stats
    faults = request.app.get(FAULTS)
    running, waiting = state.scheduler.loads()
    return _json({
        "model_path": b.model_path, "tokenizer_path": b.tokenizer_path, "served_model_name": b.served_model_name,
        "host": s.host, "port": state.port or s.port, "context_length": s.context_length,
        "tp_size": 1, "dp_size": 1, "pp_size": 1, "random_seed": s.seed, "skip_tokenizer_init": False,
        "max_running_requests": s.max_running_requests, "device": "cpu", "replay_path": s.replay_path,
        "weight_version": state.weight_version,
        "internal_states": [{"num_running_reqs": running, "num_waiting_reqs": waiting}],
        "version": SGLANG_VERSION, "startup_time": state.started_at, "frontend": "embedded",
        "faults": s.faults, "faults_injected": dict(faults.counts) if faults is not None else {},
        # Not SGLang: counters for tests and latency measurements.
        "embedded_stats": {
            "generate_requests": state.generate_requests, "routing_keys": dict(state.routing_keys),
            **attrs.asdict(stats),
        },
    })


async def flush_cache(request: web.Request) -> web.Response:
    """GET|POST /flush_cache: plain text; 400 while requests are in flight, as SGLang does."""
    running, waiting = request.app[STATE].scheduler.loads()
    if running or waiting:
        return web.Response(status=400, text=_NOT_FLUSHED)
    return web.Response(text=_FLUSHED)


async def loads(request: web.Request) -> web.Response:
    """GET /v1/loads: slime polls num_running_reqs + num_waiting_reqs after abort_all."""
    running, waiting = request.app[STATE].scheduler.loads()
    return _json({
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": SGLANG_VERSION,
        "accelerator": "cpu", "num_accelerators": 1,
        "loads": [{"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
                   "num_total_reqs": running + waiting}],
    })


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: the OpenAI-style model list."""
    state = request.app[STATE]
    return _json({"object": "list", "data": [{
        "id": state.backend.served_model_name, "object": "model", "created": int(state.started_at),
        "owned_by": "sglang", "root": state.backend.model_path, "max_model_len": state.settings.context_length,
    }]})


async def chat_completions(request: web.Request) -> web.Response:
    """POST /v1/chat/completions (non-streaming): the messages rendered with the served tokenizer's
    chat template, then generated (or replayed) like a `/generate` text request; OpenAI's reply shape.

    Enough of OpenAI's API for a second model (a simulated user) to be served by this server.
    """
    state = request.app[STATE]
    try:
        body = await _read_json(request)
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError.message("messages must be a non-empty list of objects.")
        text = state.backend.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        params: dict[str, Any] = {"skip_special_tokens": True}
        for theirs, ours in (("temperature", "temperature"), ("top_p", "top_p"), ("max_tokens", "max_new_tokens"),
                             ("max_completion_tokens", "max_new_tokens"), ("stop", "stop"), ("seed", "sampling_seed")):
            if body.get(theirs) is not None:
                params[ours] = body[theirs]
        specs, _ = parse_generate({"text": text, "sampling_params": params}, state.backend, state.settings.context_length)
        future = state.scheduler.submit(specs[0])
    except RequestError as exc:
        return _error(exc)
    except Exception as exc:  # a template that cannot render these messages
        return _error(RequestError.message(f"cannot render the messages: {exc}"))
    state.generate_requests += 1
    try:
        result = await future
    except asyncio.CancelledError:
        state.scheduler.abort(specs[0].rid, exact=True)
        raise
    out = build_response(specs[0], result, weight_version=state.weight_version, e2e_latency=0.0)
    meta = out["meta_info"]
    finish = (meta.get("finish_reason") or {}).get("type")
    return _json({
        "id": meta.get("id"), "object": "chat.completion", "created": int(time.time()), "model": state.backend.served_model_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": out["text"]},
                     "finish_reason": "length" if finish == "length" else "abort" if finish == "abort" else "stop"}],
        "usage": {"prompt_tokens": meta.get("prompt_tokens"), "completion_tokens": meta.get("completion_tokens"),
                  "total_tokens": (meta.get("prompt_tokens") or 0) + (meta.get("completion_tokens") or 0)},
    })


async def pause_generation(request: web.Request) -> web.Response:
    """POST /pause_generation {"mode": "abort"|...}: new requests wait until continue_generation.

    Mode "abort" (the default) aborts in-flight requests; "retract" and "in_place" let them finish.
    """
    state = request.app[STATE]
    try:
        body = await _read_json(request)
    except RequestError as exc:
        return _error(exc)
    assert state.unpaused is not None
    state.unpaused.clear()
    if (body or {}).get("mode", "abort") == "abort":
        state.scheduler.abort("", abort_all=True)
    return _json({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    """POST /continue_generation: release requests held by a pause."""
    state = request.app[STATE]
    assert state.unpaused is not None
    state.unpaused.set()
    return _json({"message": "Generation continued successfully.", "status": "ok"})


async def update_weight_version(request: web.Request) -> web.Response:
    """POST /update_weight_version {"new_version": str, "abort_all_requests": bool}."""
    state = request.app[STATE]
    try:
        body = await _read_json(request)
    except RequestError as exc:
        return _error(exc)
    version = (body or {}).get("new_version")
    if not isinstance(version, str) or not version:
        return _json({"success": False, "message": "new_version must be a non-empty string"}, status=400)
    if body.get("abort_all_requests"):
        state.scheduler.abort("", abort_all=True)
    state.weight_version = version
    return _json({"success": True, "message": f"Weight version updated to {version}"})


def build_app(settings: ServerSettings) -> web.Application:
    """Load the model (and replay script) and return the aiohttp application serving it.

    Blocking (about a second for the default model). The scheduler thread starts with the app and
    stops at its cleanup.
    """
    backend = LMBackend.load(settings.model_path, settings.tokenizer_path, settings.served_model_name)
    replay: ReplayScript | None = load_replay(settings.replay_path) if settings.replay_path else None
    scheduler = Scheduler(backend, replay=replay, seed=settings.seed, max_running=settings.max_running_requests,
                          torch_threads=settings.torch_threads)
    injector = None
    if settings.faults is not None:
        injector = FaultInjector(FaultSpec.parse(settings.faults), decode=backend.decode)
    middlewares = [fault_middleware(injector)] if injector is not None else []
    app = web.Application(client_max_size=512 * 1024 * 1024, middlewares=middlewares)
    app[STATE] = ServerState(settings=settings, backend=backend, scheduler=scheduler,
                             weight_version=settings.weight_version)
    if injector is not None:
        app[FAULTS] = injector

    async def on_startup(app: web.Application) -> None:
        app[STATE].unpaused = asyncio.Event()
        app[STATE].unpaused.set()
        scheduler.start()

    async def on_shutdown(app: web.Application) -> None:
        # Runs before aiohttp waits for in-flight handlers: abort them so shutdown is quick and
        # clients get SGLang's abort response rather than a dropped connection.
        scheduler.abort("", abort_all=True)

    async def on_cleanup(app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop)

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    for method in ("POST", "PUT"):
        app.router.add_route(method, "/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/v1/chat/completions", chat_completions)
    for path, handler in (("/health", health), ("/health_generate", health), ("/model_info", model_info),
                          ("/get_model_info", model_info), ("/server_info", server_info),
                          ("/get_server_info", server_info), ("/v1/loads", loads), ("/v1/models", models)):
        app.router.add_get(path, handler)
    app.router.add_route("GET", "/flush_cache", flush_cache)
    app.router.add_route("POST", "/flush_cache", flush_cache)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/update_weight_version", update_weight_version)
    return app
