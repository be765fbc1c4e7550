"""Where sandboxed code runs: on this machine (`local`, the default) or on a Ray cluster (`ray`).

The tools call `run(code, limits, ...)` instead of `run_python`, and this one switch decides.
With `ray`, a pool of sandbox workers (Ray actors, each running this package's own local
sandbox) spreads the calls over the cluster's nodes; see `engine.sandbox.ray_pool`. The
switch is process-wide, like the registered tools it serves, and set once by the engine
from its settings (`engine_sandbox_backend` and friends). Ray itself is imported only
when the `ray` backend is chosen, so the local path never needs it installed.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from typing import TYPE_CHECKING, Any


from engine.sandbox.dispatch import CallFailed, Counter, RaySettings, no_count
from engine.sandbox.runner import SandboxLimits, SandboxResult, run_python

if TYPE_CHECKING:  # pragma: no cover - typing only; importing it needs ray
    from engine.sandbox.ray_pool import RayPool

log = logging.getLogger(__name__)

__all__ = ["BACKENDS", "CallFailed", "RaySettings", "check_backend", "configure", "current", "describe", "forget",
           "pool", "run", "shutdown"]

BACKENDS = ("local", "ray")
RAY_MISSING = (
    "engine_sandbox_backend=ray needs the `ray` package, which is not installed here: "
    "pip install 'ray>=2.9' (or, in the engine's checkout, pip install -e '.[ray]'), "
    "or set engine_sandbox_backend: local"
)


def check_backend(kind: str) -> None:
    """Refuse an unknown backend, or `ray` where the `ray` package is not installed (ValueError)."""
    if kind not in BACKENDS:
        raise ValueError(f"engine_sandbox_backend must be one of {', '.join(BACKENDS)}, got {kind!r}")
    if kind == "ray" and not _ray_installed():
        raise ValueError(RAY_MISSING)


def _ray_installed() -> bool:
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as missing
        return False


_lock = threading.Lock()
_kind = "local"
_pool: RayPool | None = None


def configure(kind: str, settings: RaySettings | None = None) -> None:
    """Choose the backend. For `ray`: attach to the running cluster and start the pool's workers.

    Attaches to the cluster this process already joined (slime's) or else to the one running on
    this machine (`ray.init(address="auto")`); never starts a cluster. The pool is kept while its
    settings stay the same, so building many runtimes costs one pool. Raises ValueError on a
    refused setting and RuntimeError when the cluster cannot host the workers.
    """
    global _kind, _pool
    check_backend(kind)
    with _lock:
        if kind == "ray":
            wanted = settings or RaySettings()
            if _pool is None or _pool.closed or _pool.settings != wanted:
                try:
                    from engine.sandbox.ray_pool import RayPool
                except ImportError as exc:  # installed but unimportable: same refusal, with the cause
                    raise ValueError(f"{RAY_MISSING} ({exc})") from exc
                old, _pool = _pool, RayPool.start(wanted)
                if old is not None:
                    old.close()
        _kind = kind


def current() -> str:
    """The backend calls go to now: "local" or "ray"."""
    return _kind


def pool() -> RayPool | None:
    """The Ray pool, when one was started (it outlives a switch back to `local`)."""
    return _pool


async def run(code: str, limits: SandboxLimits, *, stdin: bytes | None = None,
              session_key: str | None = None, count: Counter = no_count) -> SandboxResult:
    """Run `code` under `limits` on the configured backend; the same contract as `run_python`.

    `session_key` keeps the calls of one stateful session on one Ray worker (ignored locally);
    `count` receives what the call's answer does not show (a wait for a worker, a retry).
    Raises `SandboxError` when the sandbox cannot run, `CallFailed` when the Ray pool could give
    the call no answer (busy, a worker lost or hung: the tool answers it as an error).
    """
    active = _pool if _kind == "ray" else None
    if active is None:
        return await run_python(code, limits, stdin=stdin)
    return await active.run(code, limits, stdin=stdin, session_key=session_key, count=count)


def forget(session_key: str) -> None:
    """A session ended: its worker no longer needs to be kept for it."""
    if _pool is not None:
        _pool.forget(session_key)


def shutdown() -> None:
    """Stop the Ray pool's workers (their sandboxes are cleaned up) and go back to `local`."""
    global _kind, _pool
    with _lock:
        old, _pool, _kind = _pool, None, "local"
    if old is not None:
        old.close()


def describe() -> dict[str, Any]:
    """What the backend is, for logs and reports."""
    return {"backend": _kind, **(_pool.describe() if _pool is not None and _kind == "ray" else {})}
