"""A Ray test cluster on this machine that listens on loopback only, for the tests and the benchmark.

Ray's own test cluster (`ray.cluster_utils.Cluster`) binds the machine's network address, and
its raylets every interface: a test would open ports to the network it runs on. Ray picks
127.0.0.1 for every node, the driver's address included, when it is told clusters are not
enabled (the switch macOS and Windows use), which this module sets for the cluster's lifetime:
in the environment, so every Ray process started from here inherits it, and in Ray's constants,
which `import ray` in this process has already read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

LOOPBACK = "127.0.0.1"
# Read by Ray at import time (ray._private.ray_constants.ENABLE_RAY_CLUSTER): off means loopback.
_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextmanager
def loopback_cluster(nodes: int, **node_args: Any) -> Iterator[Any]:
    """Start `nodes` Ray nodes on 127.0.0.1 (each with `node_args`), join this process to them,
    yield the `Cluster`; on exit leave the cluster, stop every node and restore the switch."""
    if nodes < 1:
        raise ValueError(f"a cluster needs at least one node, not {nodes}")
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    before, switch = os.environ.get(_CLUSTER_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    node = {**node_args, "node_ip_address": LOOPBACK}
    cluster = None
    try:
        os.environ[_CLUSTER_SWITCH] = "0"  # for the Ray processes started below
        ray_constants.ENABLE_RAY_CLUSTER = False  # for this one, which read the environment at import
        cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        for _ in range(nodes - 1):
            cluster.add_node(**node)
        ray.init(address=cluster.address, log_to_driver=False, _node_ip_address=LOOPBACK)
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = switch
        if before is None:
            os.environ.pop(_CLUSTER_SWITCH, None)
        else:
            os.environ[_CLUSTER_SWITCH] = before
