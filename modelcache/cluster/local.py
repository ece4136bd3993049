"""A Ray cluster of several nodes on this machine, each node with its own private modelcache daemon.

For the tests, the benchmark and trying the cluster mode without a cluster: `ray.cluster_utils.Cluster`
starts one raylet per node; a custom resource `modelcache_node_<i>` tells the nodes apart, and node i's daemon
gets its own socket, repository and host tier under `root/node<i>`, all backed by one remote store.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from . import rayserve

NODE_RESOURCE = "modelcache_node_"


def node_index(node: dict) -> int:
    """Which of the local cluster's nodes an entry of `ray.nodes()` is."""
    return next(int(k[len(NODE_RESOURCE):]) for k in node["Resources"] if k.startswith(NODE_RESOURCE))


@contextlib.contextmanager
def local_cluster(root: Path, nodes: int = 3, remote: str = "", host_capacity: str = "64M", **settings):
    """Yields the Cluster, connected and with a daemon per node; stops the app, the daemons and Ray after."""
    root = Path(root)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {f"{NODE_RESOURCE}0": 1}})
    try:
        for i in range(1, nodes):
            cluster.add_node(num_cpus=1, resources={f"{NODE_RESOURCE}{i}": 1})
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()

        def node_settings(node: dict) -> dict:
            home = root / f"node{node_index(node)}"
            home.mkdir(parents=True, exist_ok=True)
            return {"socket": f"ipc://{home}/daemon.sock", "repository": str(home / "repo"), "remote": remote,
                    "host_capacity": host_capacity, "workers": "1", "config": "", **settings}

        rayserve.start_daemons(node_settings)
        yield cluster
    finally:
        try:
            if ray.is_initialized():
                from ray import serve
                try:
                    serve.shutdown()
                finally:
                    rayserve.stop_daemons()   # (a daemon whose actor dies anyway gets SIGTERM: see rayserve)
        finally:
            ray.shutdown()
            cluster.shutdown()


def daemon_of(node_index_: int) -> dict:
    """The info (node id, address, pid) of local node i's daemon."""
    for node in ray.nodes():
        if node["Alive"] and node_index(node) == node_index_:
            actor = rayserve.daemon_actors()[node["NodeID"]]
            return ray.get(actor.info.remote())
    raise LookupError(f"no node {node_index_} in this cluster")
