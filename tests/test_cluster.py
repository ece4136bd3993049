"""modelcache on a Ray cluster of three nodes on this machine: real raylets, daemons, Serve replicas and router."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import onnxruntime as ort
import pytest

from conftest import wait_until

pytest.importorskip("ray.serve")
import ray  # noqa: E402

# Three raylets on this machine: slow, and alone (CI runs `-m slow` in one process). `ray.init("auto")` finds
# whichever Ray cluster is up, so two at once would meet.
pytestmark = pytest.mark.slow

from modelcache import zoo  # noqa: E402
from modelcache.cluster import local, rayserve  # noqa: E402
from modelcache.client.connection import connect  # noqa: E402
from modelcache.store.packing import pack  # noqa: E402
from modelcache.tiers.remote import publish  # noqa: E402

MODELS = ("tiny-cnn", "tiny-vit", "tiny-if")
STATS_LAG_S = 3 * rayserve.ROUTING_STATS_PERIOD_S + 1      # until the replicas' next reports reach the routers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, zoo_file):
    root = tmp_path_factory.mktemp("cluster")
    store = root / "store"
    for name in MODELS:
        pack(zoo_file(name), store, name, 1)
    publish(store)
    with local.local_cluster(root, nodes=3, remote=f"file://{store}", host_capacity="64M") as c:
        handle = rayserve.deploy()
        yield c, handle
        DAEMON_PIDS.update(local.daemon_of(i)["pid"] for i in range(3))
    # Stopped with the cluster: every daemon, and with it its host tier (a killed one's, re-adopted, too).
    for pid in DAEMON_PIDS:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        assert not os.path.exists(f"/dev/shm/modelcache.{os.getuid()}.{pid}"), f"daemon {pid} left its host tier"


DAEMON_PIDS: set = set()


def feeds(zoo_file, name):
    path = zoo_file(name)
    x = zoo.sample_inputs(path)
    return x, ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, x)


def ask(handle, name, x):
    return rayserve.infer(handle, name, x).result(timeout_s=60)


def node_of_index(i: int) -> str:
    return local.daemon_of(i)["node_id"]


def test_repeated_requests_stay_on_the_node_that_holds_the_model(cluster, zoo_file):
    _, handle = cluster
    x, expected = feeds(zoo_file, "tiny-cnn")
    answers = [ask(handle, "tiny-cnn", x) for _ in range(12)]
    assert answers[0]["tier"] == "remote"              # nobody had it: one node fetched it
    assert len({a["node"] for a in answers}) == 1, [a["node"][:8] for a in answers]
    assert all(a["warm"] for a in answers[1:]), [a["tier"] for a in answers]
    for a in answers:
        np.testing.assert_allclose(list(a["outputs"].values())[0], expected[0], rtol=1e-5, atol=1e-6)
    fetched = sum(row.get("fetched", 0) for row in rayserve.cluster_status())
    assert fetched == 1                                 # the other two nodes never fetched it


def test_a_nodes_eviction_moves_the_next_requests_to_a_node_that_still_holds_it(cluster, zoo_file):
    _, handle = cluster
    x, _ = feeds(zoo_file, "tiny-vit")
    a, b = local.daemon_of(0), local.daemon_of(1)
    for d in (a, b):
        with connect(d["address"]) as c:
            c.load("tiny-vit")
    time.sleep(STATS_LAG_S)
    answers = [ask(handle, "tiny-vit", x) for _ in range(8)]
    assert {r["node"] for r in answers} <= {a["node_id"], b["node_id"]}, [r["node"][:8] for r in answers]
    with connect(a["address"]) as c:
        c.evict("tiny-vit")
    time.sleep(STATS_LAG_S)
    answers = [ask(handle, "tiny-vit", x) for _ in range(8)]
    assert {r["node"] for r in answers} == {b["node_id"]}, [r["node"][:8] for r in answers]
    assert all(r["warm"] for r in answers)


def test_killing_a_nodes_daemon_fails_over_with_no_lost_request(cluster, zoo_file):
    _, handle = cluster
    x, expected = feeds(zoo_file, "tiny-if")
    first = ask(handle, "tiny-if", x)
    victim = next(d for d in map(local.daemon_of, range(3)) if d["node_id"] == first["node"])
    actor = rayserve.daemon_actors()[victim["node_id"]]
    ray.get(actor.set_restarts.remote(False))         # it stays down until the end of the test
    DAEMON_PIDS.add(victim["pid"])
    answers, errors = [], []

    def client():
        for _ in range(30):
            try:
                answers.append(ask(handle, "tiny-if", x))
            except Exception as e:  # a lost request: what this test is about
                errors.append(repr(e))

    t = threading.Thread(target=client)
    t.start()
    wait_until(lambda: len(answers) >= 3, timeout_s=30, what="requests to flow")
    os.kill(victim["pid"], signal.SIGKILL)
    t.join(120)
    assert errors == [] and len(answers) == 30
    for a in answers:
        np.testing.assert_allclose(list(a["outputs"].values())[0], expected[0], rtol=1e-5, atol=1e-6)
    after = answers[next(i for i, a in enumerate(answers) if a["node"] != victim["node_id"]):]
    assert all(a["node"] != victim["node_id"] for a in after)   # nothing is answered by a dead daemon
    # the request that met the dead daemon (the routers still thought its node warm) was handed on
    assert any(a["failed_over_from"] == [victim["node_id"]] for a in answers)
    assert not next(r for r in rayserve.cluster_status() if r["node_id"] == victim["node_id"])["up"]
    ray.get(actor.set_restarts.remote(True))
    wait_until(lambda: all(row["up"] for row in rayserve.cluster_status()), timeout_s=30,
               what="the node's daemon to be restarted by its actor")
    row = next(r for r in rayserve.cluster_status() if r["node_id"] == victim["node_id"])
    assert row["restarts"] == 1 and row["pid"] != victim["pid"]


def test_cluster_status_lists_each_node_with_its_models_by_tier(cluster):
    c, _ = cluster
    out = subprocess.run([sys.executable, "-m", "modelcache.cli", "cluster", "status", "--address", c.address],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("node ")]
    assert len(lines) == 3, out.stdout
    assert "tiny-cnn" in out.stdout and "host:" in out.stdout
