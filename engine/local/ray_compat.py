"""Ray's private names, in one place: the switch that keeps a test cluster on loopback.

Ray picks 127.0.0.1 for every node, the driver's address included, when it is told clusters
are not enabled: the environment variable `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`, which Ray reads
once, at import, into `ray._private.ray_constants.ENABLE_RAY_CLUSTER` (read again wherever
Ray chooses a node's address). Ray has no public setting for it, so a process that imported
Ray before the switch is set also needs the constant set: that private name lives here alone.

Checked (tests/local/test_ray_compat.py) on the Ray that is installed, within the `ray`
extra's range (`ray>=2.9`); a Ray without the constant is refused with one error naming its
version, never guessed at (a cluster that might listen on the network is not started).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

SWITCH_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextmanager
def clusters_disabled() -> Iterator[None]:
    """Within the block Ray treats this machine as a single-host setup: every node on 127.0.0.1.

    Set in the environment (for the Ray processes started inside the block) and in this
    process's Ray constants; both are put back on exit.
    """
    import ray
    from ray._private import ray_constants

    if not isinstance(getattr(ray_constants, "ENABLE_RAY_CLUSTER", None), bool):
        raise RuntimeError(f"Ray {ray.__version__} has no ray_constants.ENABLE_RAY_CLUSTER switch: a test cluster "
                           "cannot be kept on loopback (engine/local/ray_compat.py was checked with Ray >= 2.9)")
    before, switch = os.environ.get(SWITCH_ENV), ray_constants.ENABLE_RAY_CLUSTER
    try:
        os.environ[SWITCH_ENV] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = switch
        if before is None:
            os.environ.pop(SWITCH_ENV, None)
        else:
            os.environ[SWITCH_ENV] = before
