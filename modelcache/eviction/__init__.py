"""Eviction policies: pure objects that choose victims; the tier frees them.

The cache tells a policy what happens to each resident model (created, accessed,
released, removed) as it happens, and the policy reads the time from the clock it was
given; it answers `choose_victims`. No sockets or files here, and no clock of its own:
tests and replays step them with an injected one.

A model the cache must not evict (in use, loading, pinned) is simply not among the
candidates it passes to `choose_victims`.

Timed policies (`keepalive`, `hybrid`, `hybrid-sized`: timed.py, hybrid.py) also keep deadlines: the tier asks
`next_deadline()`, and when it passes, `due()` says which models to unload or pre-warm.
"""

from __future__ import annotations

from .base import Action, Entry, EvictionPolicy
from .hybrid import Hybrid, SizedHybrid
from .timed import MINUTE_S, KeepAlive, TimedPolicy


class LRU(EvictionPolicy):
    """Least recently used first."""
    name = "lru"

    def order(self, keys):
        return sorted(keys, key=lambda k: (self.entries[k].last_access, k))


class LFU(EvictionPolicy):
    """Least frequently used first (TrIMS's 'least commonly used'); ties: least recent."""
    name = "lfu"

    def order(self, keys):
        return sorted(keys, key=lambda k: (self.entries[k].accesses, self.entries[k].last_access, k))


class FIFO(EvictionPolicy):
    """First loaded, first evicted, however popular."""
    name = "fifo"

    def order(self, keys):
        return sorted(keys, key=lambda k: (self.entries[k].created, k))


class GDSF(EvictionPolicy):
    """GreedyDual-Size-Frequency (Cherkasova 1998): H = L + frequency x cost / size.

    Small, often used models stay; big, rarely used ones go first. L, the inflation
    value, rises to the H of each victim, so long-idle entries age out. Cost is 1 per
    load (every miss costs a promotion), size in MiB keeps H in a readable range.
    """
    name = "gdsf"

    def __init__(self, clock):
        super().__init__(clock)
        self.inflation = 0.0

    def _refresh(self, key: str) -> None:
        e = self.entries[key]
        e.priority = self.inflation + max(e.accesses, 1) / max(e.size / 2**20, 1e-6)

    def created(self, key, size):
        super().created(key, size)
        self._refresh(key)

    def accessed(self, key):
        super().accessed(key)
        if key in self.entries:
            self._refresh(key)

    def removed(self, key):
        e = self.entries.pop(key, None)
        if e is not None:
            self.inflation = max(self.inflation, e.priority)

    def order(self, keys):
        return sorted(keys, key=lambda k: (self.entries[k].priority, self.entries[k].last_access, k))


class Never(EvictionPolicy):
    """Nothing is ever evicted: a full tier refuses new models with CapacityError."""
    name = "never"

    def order(self, keys):
        return []


class Eager(LRU):
    """Free a model as soon as its last client closes it (TrIMS's 'eager'); LRU if still short."""
    name = "eager"
    evict_on_release = True


POLICIES = {cls.name: cls for cls in (LRU, LFU, FIFO, GDSF, Never, Eager, KeepAlive, Hybrid, SizedHybrid)}


def make_policy(name: str, clock, keep_alive_s: float | None = None, **options) -> EvictionPolicy:
    """The policy called `name`, on `clock`; a timed one's fixed keep-alive (keepalive's window, hybrid's
    fallback) is `keep_alive_s` (None: the class's default, 10 minutes), and `options` its other windows
    (hybrid's `unit_minutes`, ...: a replay that compresses trace time shrinks them with it)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    if not cls.timed:
        return cls(clock)
    if keep_alive_s is not None:
        options[cls.keep_alive_param] = keep_alive_s / MINUTE_S
    return cls(clock, **options)


__all__ = ["Action", "Entry", "EvictionPolicy", "TimedPolicy", "LRU", "LFU", "FIFO", "GDSF", "Never", "Eager",
           "KeepAlive", "Hybrid", "SizedHybrid", "POLICIES", "make_policy"]
