"""A Ray test cluster on this machine that listens on loopback only, for the tests and the benchmark.

Ray's own test cluster (`ray.cluster_utils.Cluster`) binds the machine's network address, and
its raylets every interface: a test would open ports to the network it runs on. Ray picks
127.0.0.1 for every node, the driver's address included, when it is told clusters are not
enabled (the switch macOS and Windows use), which is set for the cluster's lifetime by
`engine.local.ray_compat` (the one place a private name of Ray is read).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from engine.local.ray_compat import clusters_disabled

LOOPBACK = "127.0.0.1"


@contextmanager
def loopback_cluster(nodes: int, **node_args: Any) -> Iterator[Any]:
    """Start `nodes` Ray nodes on 127.0.0.1 (each with `node_args`), join this process to them,
    yield the `Cluster`; on exit leave the cluster, stop every node and restore the switch."""
    if nodes < 1:
        raise ValueError(f"a cluster needs at least one node, not {nodes}")
    import ray
    from ray.cluster_utils import Cluster

    node = {**node_args, "node_ip_address": LOOPBACK}
    with clusters_disabled():
        cluster = None
        try:
            cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
            for _ in range(nodes - 1):
                cluster.add_node(**node)
            ray.init(address=cluster.address, log_to_driver=False, _node_ip_address=LOOPBACK)
            yield cluster
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
