"""A discrete-event replay of invocations against the daemon's own residency manager
(modelcache/daemon/residency/), with its own eviction policy objects (modelcache/eviction), over a tier
that holds sizes only, virtual loader threads and a virtual clock; costs are parameters.

Nothing here decides what is resident: the manager does, as it does in the daemon. The tier is a host
tier of `capacity_bytes` above a disk that holds every model. A call opens its model as an open does
(`when_resident`, then a lease): resident, it is warm (`open_host_s`, then `run_s`); otherwise it waits
for the model's one promotion (`open_disk_s` + bytes x `promote_s_per_byte`, the virtual loaders' time),
started at once if there is room, else after the policy frees room from models nobody is using; a call
that finds no room waits, in arrival order, until a call ends and frees some (no deadline: one still
waiting when the trace ends is unserved; one whose model alone exceeds the tier is refused). A call holds
its model while it runs; calls on one model run side by side (no CPU contention is modelled). The
policy's timers run as the daemon runs them: the manager's `next_timer` / `on_timer`.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from modelcache.daemon.registry import Registry
from modelcache.daemon.residency import ModelState, Residency
from modelcache.errors import CapacityError

GIB = 2**30
REPLAY_CLIENT = SimpleNamespace(client_id="replay")   # whose leases the replay's calls hold

# Run times a call (batch 1, this repository's 2-core machine, README "Measured here": `bench serve`).
RUN_S = {"resnet50": 0.0655, "resnet50-fp16": 0.0655, "alexnet": 0.0285}


@dataclass(frozen=True)
class Costs:
    """Seconds per step. Defaults from the README's figures (ResNet-50, `modelcache bench tiers`): an open
    that hits the host tier 1.0 ms; a disk miss 53.5 ms, of which the copy at the measured 1969 MB/s
    promotion rate is 51.9 ms, leaving 1.6 ms fixed; run times from `bench serve` where measured, else
    `default_run_s`. Measure them on the real daemon before trusting absolute latencies."""
    open_host_s: float = 0.0010
    open_disk_s: float = 0.0016
    promote_s_per_byte: float = 1 / 1.969e9
    run_s: dict = field(default_factory=lambda: dict(RUN_S))
    default_run_s: float = 0.050

    def promotion_s(self, size: int) -> float:
        return self.open_disk_s + size * self.promote_s_per_byte

    def run_of(self, model: str) -> float:
        return self.run_s.get(model.split("#")[0], self.default_run_s)   # name#i: a copy of architecture name


@dataclass
class Result:
    policy: str
    capacity_bytes: int
    calls: int = 0
    host_hits: int = 0          # the weights were resident: a warm start
    disk_misses: int = 0        # they were on disk (or on their way up): a cold start
    refused: int = 0            # the model alone exceeds the tier
    unserved: int = 0           # still waiting for room when the trace ended
    waited_for_room: int = 0    # promotions that queued behind a full tier
    byte_s: float = 0.0         # host-tier bytes x seconds, promotions in flight included
    peak_bytes: int = 0
    promotions: int = 0         # pre-warms included
    prewarms: int = 0
    wasted_prewarms: int = 0    # unloaded or evicted before any call used them
    evictions: int = 0          # freed under pressure
    unloads: int = 0            # freed by the policy's timer
    ttfr_s: list = field(default_factory=list, repr=False)             # time to first result, per call

    @property
    def cold_fraction(self) -> float:
        return self.disk_misses / max(1, self.calls - self.refused)

    @property
    def gib_s(self) -> float:
        return self.byte_s / GIB

    def ttfr_ms(self, pct: float) -> float:
        if not self.ttfr_s:
            return math.nan
        s = sorted(self.ttfr_s)
        return 1000 * s[min(len(s) - 1, max(0, math.ceil(pct / 100 * len(s)) - 1))]

    def row(self) -> dict:
        return {"policy": self.policy, "capacity_gib": round(self.capacity_bytes / GIB, 3), "calls": self.calls,
                "cold_fraction": round(self.cold_fraction, 5), "host_hits": self.host_hits,
                "disk_misses": self.disk_misses, "refused": self.refused, "unserved": self.unserved,
                "ttfr_p50_ms": round(self.ttfr_ms(50), 2), "ttfr_p99_ms": round(self.ttfr_ms(99), 2),
                "gib_s": round(self.gib_s, 1), "peak_gib": round(self.peak_bytes / GIB, 3),
                "promotions": self.promotions, "prewarms": self.prewarms, "wasted_prewarms": self.wasted_prewarms,
                "evictions": self.evictions, "unloads": self.unloads, "waited_for_room": self.waited_for_room}


@dataclass
class SizePlan:
    key: str
    bytes: int


class SizesTier:
    """The Tier contract (modelcache/tiers/base.py) over sizes alone: a plan reserves the model's size, a
    write copies nothing and takes the modelled promotion time (the virtual loaders wait that long)."""

    name, id, where, capacity_setting = "host", "host", "the host tier", "host_capacity"

    def __init__(self, capacity_bytes: int, sizes: dict[str, int], costs: Costs, committed=None):
        self.capacity_bytes, self.sizes, self.costs = capacity_bytes, sizes, costs
        self.placed: dict[str, int] = {}   # key -> bytes: resident, or reserved by a plan in flight
        self.used_bytes = 0
        self.peak_bytes = 0
        self.committed = committed         # called with the key of each copy that became resident

    def bytes_freed_by(self, keys) -> int:
        return sum(self.placed.get(k, 0) for k in set(keys))

    def model_bytes(self, key: str) -> int:
        return self.placed.get(key, 0)

    def check_model(self, key: str, manifest) -> None:
        pass

    def tensors_of(self, manifest) -> list:
        return []

    def plan(self, key: str, manifest) -> SizePlan:
        size = self.placed[key] = self.sizes[key]
        self.used_bytes += size
        return SizePlan(key, size)

    def write(self, plan: SizePlan) -> float:
        # (the peak as promotions start: a plan that found no room was reserved and given back at once)
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return self.costs.promotion_s(plan.bytes)

    def commit(self, plan: SizePlan) -> None:
        if self.committed is not None:
            self.committed(plan.key)

    def abort(self, plan: SizePlan) -> None:
        self.used_bytes -= self.placed.pop(plan.key)

    def free_model(self, key: str) -> int:
        size = self.placed.pop(key)
        self.used_bytes -= size
        return size

    def export(self, key: str, manifest) -> dict:
        return {}

    def describe(self) -> dict:
        return {"tier": "host"}


class VirtualLoaders:
    """The daemon's loader threads in virtual time: a write "runs" for the seconds it returns (the sizes-only
    tier's modelled promotion), then its completion lands on the owner loop, as Loaders' does."""

    def __init__(self, replay: "Replay"):
        self.replay = replay

    def run(self, work, done) -> None:
        seconds = work()
        self.replay.at(self.replay.now + seconds, done, seconds, None)


class Replay:
    """One policy, one capacity: feed it invocations (`run`), read the `Result`. `make_policy(clock)` builds
    the policy on the replay's virtual clock; `residency` the manager's type (a subclass may observe it)."""

    def __init__(self, make_policy, capacity_bytes: int, sizes: dict[str, int], costs: Costs = Costs(),
                 residency=Residency):
        self.now = 0.0
        self.costs = costs
        self.registry = Registry()
        self.tier = SizesTier(capacity_bytes, {}, costs, committed=self._loaded)
        self.models: dict = {}
        for name, size in sizes.items():
            self.add(name, size)
        self.counters: dict = {}
        clock = lambda: self.now   # noqa: E731
        self.residency = residency(tier=self.tier, policy=make_policy(clock), registry=self.registry,
                                   loaders=VirtualLoaders(self), counters=self.counters, jobs={}, clock=clock,
                                   settings=SimpleNamespace(request_timeout_s=math.inf))
        self.result = Result(self.residency.policy.name, capacity_bytes)
        self._events: list = []
        self._seq = 0

    def add(self, name: str, size: int):
        """A model of the trace, `size` bytes in the tier: its record. Trace names ("resnet50#3") are the
        models' names, each at version 1."""
        model = self.models[name] = self.registry.add_model(Path(name), SimpleNamespace(name=name, version=1))
        self.tier.sizes[model.key] = size
        return model

    # -- the loop --------------------------------------------------------------------------------
    def run(self, invocations) -> Result:
        arrivals = iter(invocations)
        nxt = next(arrivals, None)
        while self._events or nxt is not None:   # the trace is over when its last call is answered
            t_event = self._events[0][0] if self._events else math.inf
            t_timer = self.residency.next_timer()
            t_timer = math.inf if t_timer is None else t_timer
            t_arrival = nxt.t if nxt is not None else math.inf
            self._advance(min(t_event, t_timer, t_arrival))
            if t_event <= t_timer and t_event <= t_arrival:
                _, _, handler, args = heapq.heappop(self._events)
                handler(*args)
            elif t_timer <= t_arrival:
                self.residency.on_timer(self.now)
            else:
                self._arrive(nxt)
                nxt = next(arrivals, None)
        r, c = self.result, self.counters
        r.unserved = self.residency.room.waiting()["requests"]
        r.peak_bytes = self.tier.peak_bytes
        r.promotions, r.prewarms, r.wasted_prewarms = c.get("promotions", 0), c.get("prewarms", 0), \
            c.get("wasted_prewarms", 0)
        r.evictions, r.unloads = c.get("evictions", 0), c.get("unloads", 0)
        return r

    def _advance(self, t: float) -> None:
        t = max(t, self.now)          # a deadline already past (a busy model's) runs now
        self.result.byte_s += self.tier.used_bytes * (t - self.now)
        self.now = t

    def at(self, t: float, handler, *args) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, handler, args))

    # -- calls, as opens -----------------------------------------------------------------------------
    def _arrive(self, inv) -> None:
        r, model = self.result, self.models[inv.model]
        r.calls += 1
        was = model.host.state
        try:
            hit = self.residency.when_resident(model, lambda error, _hit: self._grant(model, inv.t), math.inf)
        except CapacityError:      # the model alone exceeds the tier
            r.refused += 1
            return
        if hit:
            r.host_hits += 1
        else:
            r.disk_misses += 1
            r.waited_for_room += was is ModelState.ON_DISK and model.host.state is ModelState.WAITING

    def _grant(self, model, arrived: float) -> None:
        """The open's answer: a lease for the call's run, let go when it ends."""
        lease = self.residency.grant(REPLAY_CLIENT, model, self.now)
        done = self.now + self.costs.open_host_s + self.costs.run_of(model.name)
        self.result.ttfr_s.append(done - arrived)
        self.at(done, self.residency.end, lease)

    def _loaded(self, key: str) -> None:
        """A copy became resident (the tier's commit); a subclass may observe it."""


def replay(make_policy, capacity_bytes: int, invocations, sizes: dict[str, int], costs: Costs = Costs()) -> Result:
    """Replay `invocations` (time-ordered, each with .t, .function, .model) against one policy (make_policy(clock),
    on the replay's clock) and capacity."""
    return Replay(make_policy, capacity_bytes, sizes, costs).run(invocations)


def trace_policy(name: str, compress: float = 1.0, keep_alive_s: float | None = None):
    """make_policy(clock) for `replay`: the policy called `name` with its windows in trace time divided by
    `compress` (a trace replayed `compress` times faster than it ran; the real-daemon replay builds its
    daemons' policies the same way)."""
    from modelcache.eviction import POLICIES, make_policy
    options = {}
    if compress != 1.0 and POLICIES[name].timed:
        keep_alive_s = 600.0 if keep_alive_s is None else keep_alive_s
        if name.startswith("hybrid"):
            options = {"unit_minutes": 1.0 / compress, "range_minutes": 240.0 / compress}
    if keep_alive_s is not None:
        keep_alive_s /= compress
    return lambda clock: make_policy(name, clock, keep_alive_s=keep_alive_s, **options)
