"""The cluster's locality policy (pure): node views from daemon stats, ranking by estimated open time and queue."""

from __future__ import annotations

import random

from modelcache.cluster.routing import LocalityPolicy, NodeView, OpenCosts

MiB = 1 << 20


def node(node_id, tiers=None, queue=0, service_ms=10.0, up=True, size=40 * MiB):
    tiers = tiers or {}
    return NodeView(node_id=node_id, tiers=tiers, sizes={m: size for m in tiers}, queue=queue,
                    service_ms=service_ms, up=up)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_open_costs_order_the_tiers_and_grow_with_bytes():
    c = OpenCosts()
    assert c.open_ms("host", 40 * MiB) == c.open_ms("gpu", 40 * MiB) < c.open_ms("disk", 40 * MiB) \
        < c.open_ms(None, 40 * MiB)
    assert c.open_ms("disk", 10 * MiB) < c.open_ms("disk", 100 * MiB)
    assert c.open_ms(None, 10 * MiB) < c.open_ms(None, 100 * MiB)


def test_the_warm_node_ranks_first_then_disk_then_remote():
    policy = LocalityPolicy(clock=Clock())
    nodes = [node("remote-only"), node("on-disk", {"m": "disk"}), node("warm", {"m": "host"})]
    assert policy.rank("m", nodes) == [["warm"], ["on-disk"], ["remote-only"]]


def test_equal_nodes_share_a_rank_and_take_turns_first():
    policy = LocalityPolicy(clock=Clock())
    nodes = [node("a", {"m": "host"}), node("b", {"m": "host"}), node("c")]
    assert policy.rank("m", nodes) == [["a", "b"], ["c"]]
    firsts = {policy.order("m", nodes, random.Random(seed))[0] for seed in range(20)}
    assert firsts == {"a", "b"}


def test_one_request_in_flight_does_not_outweigh_a_hit_against_a_miss():
    """Serve's queue-length cache still counts a request whose answer is out: a hit with one in flight must
    still beat a miss, or sequential requests alternate between nodes and reload the model each time."""
    policy = LocalityPolicy(clock=Clock())
    tiny = 30 << 10
    warm_just_used = NodeView(node_id="warm", tiers={"m": "host"}, sizes={"m": tiny}, queue=1, service_ms=20.0)
    on_disk = NodeView(node_id="disk", tiers={"m": "disk"}, sizes={"m": tiny})
    assert policy.rank("m", [on_disk, warm_just_used])[0] == ["warm"]


def test_a_long_queue_outweighs_warmth_only_when_it_costs_more_than_a_miss():
    policy = LocalityPolicy(clock=Clock())
    warm_busy = node("warm", {"m": "host"}, queue=3, service_ms=5.0)       # 1 + 12.5 ms
    disk_idle = node("disk", {"m": "disk"})                                  # a 40 MiB disk miss: ~41 ms
    assert policy.rank("m", [disk_idle, warm_busy])[0] == ["warm"]
    warm_swamped = node("warm", {"m": "host"}, queue=40, service_ms=5.0)   # 198.5 ms
    assert policy.rank("m", [disk_idle, warm_swamped])[0] == ["disk"]


def test_a_node_that_is_down_ranks_last():
    policy = LocalityPolicy(clock=Clock())
    down = node("down", {"m": "host"}, up=False)
    assert policy.rank("m", [down, node("cold")]) == [["cold"], ["down"]]


def test_a_miss_sent_to_a_node_is_followed_until_its_stats_catch_up_then_forgotten():
    clock = Clock()
    policy = LocalityPolicy(remember_s=5.0, clock=clock)
    a, b = node("a"), node("b")
    first = policy.rank("m", [a, b])[0]
    assert first == ["a", "b"]                          # nobody has it: any node
    policy.routed("m", b)                               # Serve chose b: b is loading it
    clock.now += 1.0
    assert policy.rank("m", [a, b])[0] == ["b"]         # the next requests follow, though b's stats lag
    clock.now += 5.0
    assert policy.rank("m", [a, b])[0] == ["a", "b"]    # stats never said warm: the memory expires
    policy.routed("n", a)
    assert ("m", "b") not in policy._warming           # old entries are dropped as new ones come


def test_a_hit_is_not_remembered_as_warming():
    policy = LocalityPolicy(clock=Clock())
    policy.routed("m", node("a", {"m": "host"}))
    assert policy._warming == {}


def test_the_size_a_node_lists_prices_the_miss_on_nodes_that_lack_it():
    policy = LocalityPolicy(clock=Clock())
    big = NodeView(node_id="disk", tiers={"m": "disk"}, sizes={"m": 2000 * MiB})
    lacking = NodeView(node_id="none")
    # a 2000 MiB model: its disk miss (~1 s) still beats fetching it (~11 s)
    ranks = policy.rank("m", [lacking, big])
    assert ranks == [["disk"], ["none"]]
    assert policy.estimate_ms("m", lacking, 2000 * MiB) > 10_000


def test_node_view_from_daemon_stats_takes_the_latest_version_and_gpu_residency():
    stats = {"models": [
        {"name": "a", "version": 1, "bytes": 10, "tier": "host", "state": "resident", "gpu": []},
        {"name": "a", "version": 2, "bytes": 20, "tier": "disk", "state": "on_disk", "gpu": []},
        {"name": "g", "version": 1, "bytes": 30, "tier": "host", "state": "resident",
         "gpu": [{"device": "GPU-1", "state": "resident", "leases": 0}]},
        {"name": "bad", "version": 1, "bytes": 0, "tier": "disk", "state": "corrupt", "gpu": []}],
        "tiers": [{"tier": "host", "used_bytes": 40, "capacity_bytes": 100}]}
    view = NodeView.from_stats("n1", stats, queue=2, service_ms=4.0)
    assert view.tiers == {"a": "disk", "g": "gpu"} and view.sizes == {"a": 20, "g": 30}
    assert (view.queue, view.service_ms, view.host_used, view.host_capacity) == (2, 4.0, 40, 100)
    assert view.tier_of("absent") == "remote"
    assert NodeView.from_dict(view.to_dict()) == view


def test_a_miss_goes_where_the_model_fits_rather_than_where_it_evicts():
    policy = LocalityPolicy(clock=Clock())
    full = NodeView(node_id="full", host_used=100 * MiB, host_capacity=110 * MiB)
    roomy = NodeView(node_id="roomy", host_used=20 * MiB, host_capacity=110 * MiB)
    assert policy.rank("m", [full, roomy]) == [["roomy"], ["full"]]     # 100 MiB (unknown size): 10 vs 90 short
    assert policy.estimate_ms("m", roomy, 40 * MiB) == policy.estimate_ms("m", NodeView(node_id="empty"), 40 * MiB)
    # a copy on the full node's disk still beats fetching it to the roomy one
    full.tiers, full.sizes = {"m": "disk"}, {"m": 40 * MiB}
    assert policy.rank("m", [roomy, full])[0] == ["full"]
    # and a warm node pays nothing for room: it loads nothing
    full.tiers = {"m": "host"}
    assert policy.estimate_ms("m", full) == policy.costs.warm_ms


def test_misses_just_sent_to_a_node_count_against_its_room_until_its_stats_show_them():
    clock = Clock()
    policy = LocalityPolicy(clock=clock)
    a = NodeView(node_id="a", host_capacity=100 * MiB)
    b = NodeView(node_id="b", host_capacity=100 * MiB)
    policy.routed("m1", a, 60 * MiB)                  # a is loading 60 MiB its stats do not show yet
    assert policy.rank("m2", [a, b]) == [["b"], ["a"]]
    a.tiers, a.sizes, a.host_used = {"m1": "host"}, {"m1": 60 * MiB}, 60 * MiB     # the stats caught up
    assert policy._loading_bytes(a) == 0
    clock.now += 10
    assert policy._live_warming() == {}
