"""Running the embedded server: in the foreground (`serve`, `main_serve`) or in a thread
(`BackgroundServer`, for tests and demos)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time
import urllib.error
import urllib.request
from types import TracebackType
from typing import Any

import attrs
from aiohttp import web

from engine.local.server.app import STATE, build_app
from engine.local.server.settings import ServerSettings, settings_from_namespace

log = logging.getLogger("engine.local.server")


class _DropGrpcProbe(logging.Filter):
    """sglang-router probes every worker for gRPC by sending an HTTP/2 preface ("PRI * HTTP/2.0");
    aiohttp logs each probe as an error with a traceback. The probe is expected: drop that record."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return "PRI/Upgrade" not in f"{record.getMessage()} {exc}"


_GRPC_PROBE_FILTER = _DropGrpcProbe()


async def start_site(settings: ServerSettings) -> tuple[web.AppRunner, str]:
    """Build the app (model loading runs in a thread), bind it, and return (runner, base URL)."""
    logging.getLogger("aiohttp.server").addFilter(_GRPC_PROBE_FILTER)  # idempotent: same object
    app = await asyncio.to_thread(build_app, settings)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    port = settings.port
    server = getattr(site, "_server", None)  # the only way aiohttp exposes the port bound for port 0
    if server is not None and server.sockets:
        port = server.sockets[0].getsockname()[1]
    app[STATE].port = port
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    url = f"http://{host}:{port}"
    log.info("listening on %s (model %s)", url, app[STATE].backend.served_model_name)
    return runner, url


async def serve(settings: ServerSettings) -> None:
    """Serve until cancelled (Ctrl-C under `asyncio.run`), then shut down cleanly."""
    runner, _ = await start_site(settings)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main_serve(ns: argparse.Namespace) -> int:
    """Entry point for `python -m engine serve`: serve in the foreground until Ctrl-C."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(settings_from_namespace(ns)))
    except KeyboardInterrupt:
        pass
    return 0


def wait_healthy(url: str, timeout: float = 60.0) -> None:
    """Poll `GET {url}/health` until it answers 200; raises TimeoutError otherwise."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    deadline = time.monotonic() + timeout
    while True:
        try:
            with opener.open(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/health did not answer within {timeout} s")
        time.sleep(0.05)


class BackgroundServer:
    """The server on a background thread with its own event loop; a context manager.

    `BackgroundServer()` serves the default tiny model on a free loopback port;
    keyword arguments override ServerSettings fields. `.url` is set once `/health` answers.
    """

    def __init__(self, settings: ServerSettings | None = None, **overrides: Any) -> None:
        base = settings if settings is not None else ServerSettings(port=0)
        self.settings = attrs.evolve(base, **overrides) if overrides else base
        self.url = ""
        self.state: Any = None  # the app's ServerState, for tests that inspect counters
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="embedded-sglang-http", daemon=True)

    def start(self, timeout: float = 120.0) -> BackgroundServer:
        """Start serving and wait until `/health` answers."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the embedded server did not start in time")
        if self._error is not None:
            raise RuntimeError("the embedded server failed to start") from self._error
        wait_healthy(self.url, timeout)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving (in-flight requests are aborted) and join the thread."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass  # the loop already closed
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to start(); the thread must not die silently
            self._error = exc
            self._ready.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        runner, url = await start_site(self.settings)
        self.url = url
        self.state = runner.app[STATE]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()
