"""A discrete-event replay of invocations against a model of the host tier, driving the same policy
objects the daemon runs (modelcache.eviction), with costs as parameters.

The model: a host tier of `capacity_bytes` above a disk that holds every model. A call whose model is
resident opens it (`open_host_s`) and runs (`run_s`); otherwise it waits for the model's one promotion
(`open_disk_s` + bytes x `promote_s_per_byte`), started at once if there is room, else after the policy
frees room from models nobody is using; a call that finds no room waits, in arrival order, until a call
ends and frees some (refused only when its model alone exceeds the tier). A call holds its model while
it runs; calls on one model run side by side (no CPU contention is modelled). The policy's timers run
as the daemon runs them (timed.py): unloads of idle models, pre-warms when there is room (a pre-warm
never displaces a waiting call, and evicts only what `prewarm_victims` offers).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

GIB = 2**30

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
    per_function: dict = field(default_factory=dict, repr=False)       # function -> [calls, cold]

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

    def function_cold_pct(self, pct: float = 75) -> float:
        """The `pct`th percentile over functions of each one's cold-start percentage (the paper's metric)."""
        rates = sorted(100 * cold / calls for calls, cold in self.per_function.values() if calls)
        return rates[min(len(rates) - 1, max(0, math.ceil(pct / 100 * len(rates)) - 1))] if rates else math.nan

    def row(self) -> dict:
        return {"policy": self.policy, "capacity_gib": round(self.capacity_bytes / GIB, 3), "calls": self.calls,
                "cold_fraction": round(self.cold_fraction, 5), "host_hits": self.host_hits,
                "disk_misses": self.disk_misses, "refused": self.refused, "unserved": self.unserved,
                "ttfr_p50_ms": round(self.ttfr_ms(50), 2), "ttfr_p99_ms": round(self.ttfr_ms(99), 2),
                "gib_s": round(self.gib_s, 1), "peak_gib": round(self.peak_bytes / GIB, 3),
                "promotions": self.promotions, "prewarms": self.prewarms, "wasted_prewarms": self.wasted_prewarms,
                "evictions": self.evictions, "unloads": self.unloads, "waited_for_room": self.waited_for_room}


DISK, WAITING, LOADING, RESIDENT = "disk", "waiting", "loading", "resident"


@dataclass
class _Model:
    key: str
    size: int
    state: str = DISK
    leases: int = 0
    waiters: list = field(default_factory=list)   # (arrival time, function) of calls waiting for the load
    prewarmed: bool = False                       # loaded by a pre-warm and not yet called


class Replay:
    """One policy, one capacity: feed it invocations (`run`), read the `Result`."""

    def __init__(self, make_policy, capacity_bytes: int, sizes: dict[str, int], costs: Costs = Costs()):
        self.now = 0.0
        self.policy, self.capacity, self.costs = make_policy(lambda: self.now), capacity_bytes, costs
        self.models = {k: _Model(k, s) for k, s in sizes.items()}
        self.result = Result(self.policy.name, capacity_bytes)
        self.used = 0
        self.queue: deque[_Model] = deque()   # promotions waiting for room, in arrival order
        self._events: list = []
        self._seq = 0

    # -- the loop --------------------------------------------------------------------------------
    def run(self, invocations) -> Result:
        arrivals = iter(invocations)
        nxt = next(arrivals, None)
        while self._events or nxt is not None:   # the trace is over when its last call is answered
            t_event = self._events[0][0] if self._events else math.inf
            t_timer = self.policy.next_deadline()
            t_timer = math.inf if t_timer is None else t_timer
            t_arrival = nxt.t if nxt is not None else math.inf
            self._advance(min(t_event, t_timer, t_arrival))
            if t_event <= t_timer and t_event <= t_arrival:
                _, _, handler, model, arg = heapq.heappop(self._events)
                handler(model, arg)
            elif t_timer <= t_arrival:
                self._timers()
            else:
                self._arrive(nxt)
                nxt = next(arrivals, None)
        self.result.unserved = sum(len(m.waiters) for m in self.queue)
        return self.result

    def _advance(self, t: float) -> None:
        t = max(t, self.now)          # a deadline already past (a busy model's) runs now
        self.result.byte_s += self.used * (t - self.now)
        self.now = t

    def _at(self, t: float, handler, model: _Model, arg=None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, handler, model, arg))

    # -- calls -----------------------------------------------------------------------------------
    def _arrive(self, inv) -> None:
        r, m = self.result, self.models[inv.model]
        r.calls += 1
        if m.size > self.capacity:
            r.refused += 1
            return
        stats = r.per_function.setdefault(inv.function, [0, 0])
        stats[0] += 1
        if m.state == RESIDENT:
            r.host_hits += 1
            self._grant(m, inv.t)
            return
        r.disk_misses += 1
        stats[1] += 1
        m.waiters.append(inv.t)
        if m.state == DISK:
            m.state = WAITING
            self.queue.append(m)
            self._admit()
            if m.state == WAITING:
                r.waited_for_room += 1

    def _grant(self, m: _Model, arrived: float) -> None:
        m.leases += 1
        m.prewarmed = False
        self.policy.accessed(m.key)
        done = self.now + self.costs.open_host_s + self.costs.run_of(m.key)
        self.result.ttfr_s.append(done - arrived)
        self._at(done, self._done, m)

    def _done(self, m: _Model, _) -> None:
        m.leases -= 1
        if m.leases == 0:
            self.policy.released(m.key)
            if self.policy.evict_on_release:
                self._free(m, "evictions")
            self._admit()

    # -- the tier --------------------------------------------------------------------------------
    def _candidates(self) -> dict[str, int]:
        """What the policy may free: resident models nobody is using (the daemon's `evictable`)."""
        return {m.key: m.size for m in self.models.values() if m.state == RESIDENT and m.leases == 0}

    def _admit(self) -> None:
        """Start the waiting promotions, oldest first, while the policy can make room for the oldest."""
        while self.queue:
            m = self.queue[0]
            need = m.size - (self.capacity - self.used)
            if need > 0:
                victims = self.policy.choose_victims(need, self._candidates())
                if not victims:
                    return
                for key in victims:
                    self._free(self.models[key], "evictions")
            self.queue.popleft()
            self._load(m, prewarm=False)

    def _load(self, m: _Model, prewarm: bool) -> None:
        m.state = LOADING
        self.used += m.size
        assert self.used <= self.capacity, "the replay overfilled the tier"
        r = self.result
        r.peak_bytes = max(r.peak_bytes, self.used)
        r.promotions += 1
        r.prewarms += prewarm
        self._at(self.now + self.costs.promotion_s(m.size), self._loaded, m, prewarm)

    def _loaded(self, m: _Model, prewarm: bool) -> None:
        m.state = RESIDENT
        self.policy.created(m.key, m.size)
        waiters, m.waiters = m.waiters, []
        m.prewarmed = prewarm and not waiters
        for arrived in waiters:
            self._grant(m, arrived)

    def _free(self, m: _Model, counter: str) -> None:
        m.state = DISK
        self.used -= m.size
        self.policy.removed(m.key)
        setattr(self.result, counter, getattr(self.result, counter) + 1)
        if m.prewarmed:
            self.result.wasted_prewarms += 1
            m.prewarmed = False

    def _timers(self) -> None:
        freed = False
        for action in self.policy.due():
            m = self.models[action.key]
            if action.kind == "unload":
                if m.state == RESIDENT and m.leases == 0:
                    self._free(m, "unloads")
                    freed = True
            elif action.kind == "prewarm" and m.state == DISK and not self.queue and m.size <= self.capacity:
                need = m.size - (self.capacity - self.used)
                victims = self.policy.prewarm_victims(m.key, need, self._candidates()) if need > 0 else []
                if need > 0 and not victims:
                    continue   # no room that a pre-warm may take: the call will find the model on disk
                for key in victims:
                    self._free(self.models[key], "evictions")
                self._load(m, prewarm=True)
        if freed:
            self._admit()


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
