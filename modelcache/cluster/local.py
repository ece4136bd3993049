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
def ray_cluster(nodes: int = 3):
    """Yields a connected Cluster of `nodes` one-CPU nodes; after: the Serve app, the daemons and Ray stopped."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {f"{NODE_RESOURCE}0": 1}})
    try:
        for i in range(1, nodes):
            cluster.add_node(num_cpus=1, resources={f"{NODE_RESOURCE}{i}": 1})
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
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


def start_node_daemons(root: Path, remote: str = "", host_capacity: str = "64M", **settings) -> list:
    """A daemon on every node of a `ray_cluster`, node i's under root/node<i>; returns their infos."""
    root = Path(root)

    def node_settings(node: dict) -> dict:
        home = root / f"node{node_index(node)}"
        home.mkdir(parents=True, exist_ok=True)
        return {"socket": f"ipc://{home}/daemon.sock", "repository": str(home / "repo"), "remote": remote,
                "host_capacity": str(host_capacity), "workers": "1", "config": "", **settings}

    return rayserve.start_daemons(node_settings)


@contextlib.contextmanager
def local_cluster(root: Path, nodes: int = 3, remote: str = "", host_capacity: str = "64M", **settings):
    """A `ray_cluster` with a daemon per node (see start_node_daemons)."""
    with ray_cluster(nodes) as cluster:
        start_node_daemons(root, remote, host_capacity, **settings)
        yield cluster


def daemon_of(index: int) -> dict:
    """The info (node id, address, pid, restarts) of local node `index`'s daemon."""
    for node in ray.nodes():
        if node["Alive"] and node_index(node) == index:
            return ray.get(rayserve.daemon_actors()[node["NodeID"]].info.remote())
    raise LookupError(f"no node {index} in this cluster")
