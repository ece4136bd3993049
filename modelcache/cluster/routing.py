"""Where a request for a model should go: the node that opens it soonest, queue included (pure; no Ray here).

A node's view is what its daemon's stats say (`NodeView.from_stats`): which tier holds each model, and the
node's queue. The estimated cost of sending a request for model m to node n is

    open_ms(tier of m on n) + (queue(n) - 1/2) * service_ms(n) [+ reading back what a miss would evict]

where a host (or GPU) hit costs about a millisecond, a disk miss the time to read and check the weights,
and a remote miss the time to fetch them first (benchmarks/tiers: ResNet-50 1.0 / 53.5 / 508 ms).
ServerlessLLM routes the same way: by where the checkpoint is and how long each node would take to load it.

Stats arrive late (a replica reports them every `request_routing_stats_period_s`): a node that was just sent a
miss for m is remembered as warming m for `remember_s`, so the next requests for m follow it instead of
starting loads of m on every node.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

WARM_TIERS = ("gpu", "host")


@dataclass(frozen=True)
class OpenCosts:
    """What opening a model costs by the tier it is in. Defaults from `modelcache bench tiers` here."""

    warm_ms: float = 1.0                   # host (or GPU) tier: the weights are mapped
    miss_ms: float = 20.0                  # fixed part of any miss: promotion bookkeeping, the serve session
    disk_bytes_per_s: float = 2.0e9        # reading and checking a packed version from the repository
    remote_bytes_per_s: float = 2.0e8      # fetching it from the remote store first (then the disk read)
    default_bytes: int = 100 << 20         # a model no node has listed yet

    def open_ms(self, tier: str | None, size: int | None) -> float:
        size = self.default_bytes if size is None else size
        if tier in WARM_TIERS:
            return self.warm_ms
        disk_ms = self.miss_ms + 1000.0 * size / self.disk_bytes_per_s
        if tier == "disk":
            return disk_ms
        return disk_ms + 1000.0 * size / self.remote_bytes_per_s   # only the remote store has it


@dataclass
class NodeView:
    """One node as its daemon describes it: models by tier, and how busy the node is."""

    node_id: str
    up: bool = True
    tiers: dict = field(default_factory=dict)    # model name -> "gpu" | "host" | "disk" (absent: remote only)
    sizes: dict = field(default_factory=dict)    # model name -> weight bytes
    queue: int = 0                               # requests in flight on this node's replica
    service_ms: float = 10.0                     # the replica's recent mean time per request
    host_used: int = 0
    host_capacity: int = 0

    @classmethod
    def from_stats(cls, node_id: str, stats, queue: int = 0, service_ms: float = 10.0) -> "NodeView":
        """From a daemon's StatsReply (or its dict): the latest version of each model, by its fastest tier."""
        models = stats["models"] if isinstance(stats, dict) else stats.models
        tiers_list = stats["tiers"] if isinstance(stats, dict) else stats.tiers
        latest: dict = {}
        for m in models:
            if m.get("state") == "corrupt":
                continue
            if m["name"] not in latest or m["version"] > latest[m["name"]]["version"]:
                latest[m["name"]] = m
        tiers = {name: ("gpu" if any(g["state"] == "resident" for g in m.get("gpu", ())) else m["tier"])
                 for name, m in latest.items()}
        host = next((t for t in tiers_list if t["tier"] == "host"), {"used_bytes": 0, "capacity_bytes": 0})
        return cls(node_id=node_id, tiers=tiers, sizes={n: m["bytes"] for n, m in latest.items()}, queue=queue,
                   service_ms=service_ms, host_used=host["used_bytes"], host_capacity=host["capacity_bytes"])

    def to_dict(self) -> dict:
        """Plain data, for Ray Serve's routing stats (replica -> controller -> routers)."""
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> "NodeView":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def tier_of(self, model: str) -> str:
        return self.tiers.get(model, "remote")


class LocalityPolicy:
    """Ranks nodes for a model by estimated time to an answer; remembers where it just sent misses."""

    def __init__(self, costs: OpenCosts | None = None, remember_s: float = 5.0, clock=time.monotonic):
        self.costs = costs or OpenCosts()
        self.remember_s = remember_s
        self.clock = clock
        self._warming: dict = {}          # (model, node_id) -> (when a miss for it was sent there, its bytes)

    def estimate_ms(self, model: str, node: NodeView, size: int | None = None) -> float:
        if not node.up:
            return float("inf")
        tier = node.tiers.get(model)
        if tier not in WARM_TIERS and (model, node.node_id) in self._live_warming():
            tier = "host"                  # a load is under way there, or just finished: its stats are late
        # The wait behind the queue: the request being served is on average half done. (Serve's queue-length
        # cache also lags its completion callbacks: a replica that just answered still counts that request.)
        wait_ms = max(0.0, node.queue - 0.5) * node.service_ms
        size = node.sizes.get(model, size)
        cost = self.costs.open_ms(tier, size) + wait_ms
        if tier not in WARM_TIERS and node.host_capacity:
            # A load that does not fit evicts models warm there, and their next requests pay a miss: priced as
            # reading those bytes back once, so that a miss goes where there is room, not where it evicts.
            free = node.host_capacity - node.host_used - self._loading_bytes(node)
            short = (self.costs.default_bytes if size is None else size) - free
            if short > 0:
                cost += self.costs.open_ms("disk", short)
        return cost

    def _live_warming(self) -> dict:
        now = self.clock()
        return {k: v for k, v in self._warming.items() if now - v[0] < self.remember_s}

    def _loading_bytes(self, node: NodeView) -> int:
        """Bytes of the misses just sent to `node` that its stats do not show yet: its room is that much less."""
        return sum(size for (model, node_id), (_, size) in self._live_warming().items()
                   if node_id == node.node_id and node.tiers.get(model) not in WARM_TIERS)

    @staticmethod
    def _size(model: str, nodes: list) -> int | None:
        """The model's bytes as any node lists them (a node that lacks it prices its miss by them)."""
        return next((n.sizes[model] for n in nodes if model in n.sizes), None)

    def rank(self, model: str, nodes: list) -> list:
        """Node ids grouped by estimated cost, cheapest group first; nodes that are down come last."""
        size = self._size(model, nodes)
        scored: dict = {}
        for node in nodes:
            scored.setdefault(round(self.estimate_ms(model, node, size), 3), []).append(node.node_id)
        return [scored[cost] for cost in sorted(scored)]

    def order(self, model: str, nodes: list, rng: random.Random | None = None) -> list:
        """Every node id, best first (ties in random order, so equal nodes share the load); the first is taken
        to be where the request goes (`routed`): Serve moves on to the next only when it is full."""
        rng = rng or random
        ordered = []
        for group in self.rank(model, nodes):
            ordered += rng.sample(group, len(group))
        if ordered:
            self.routed(model, next(n for n in nodes if n.node_id == ordered[0]), self._size(model, nodes))
        return ordered

    def routed(self, model: str, node: NodeView, size: int | None = None) -> None:
        """A request for `model` was sent to `node`: if it was a miss there, that node is now warming it."""
        now = self.clock()
        if node.tiers.get(model) not in WARM_TIERS and (model, node.node_id) not in self._live_warming():
            size = node.sizes.get(model, size)
            self._warming[(model, node.node_id)] = (now, self.costs.default_bytes if size is None else size)
        # forget what is old, so the table stays as small as the set of models in motion
        self._warming = self._live_warming()
