"""Eviction policies: pure objects that choose victims; the tier frees them.

The cache tells a policy what happens to each resident model (created, accessed,
released, removed) with the time passed in; the policy answers `choose_victims`.
No clocks, sockets or files here: tests step them by hand.

A model the cache must not evict (in use, loading, pinned) is simply not among the
candidates it passes to `choose_victims`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Entry:
    size: int
    created: float
    last_access: float
    accesses: int = 0
    priority: float = 0.0   # GreedyDual-Size-Frequency's H


class EvictionPolicy:
    """Base: bookkeeping shared by all policies; subclasses say how victims are ordered."""

    name = "base"
    evict_on_release = False   # eager: free a model as soon as its last client closes it

    def __init__(self):
        self.entries: dict[str, Entry] = {}

    # -- what the cache tells the policy ----------------------------------------------
    def created(self, key: str, size: int, now: float) -> None:
        self.entries[key] = Entry(size=size, created=now, last_access=now)

    def accessed(self, key: str, now: float) -> None:
        e = self.entries.get(key)
        if e is not None:
            e.accesses += 1
            e.last_access = now

    def released(self, key: str, now: float) -> None:
        """The last lease on `key` closed."""

    def removed(self, key: str) -> None:
        self.entries.pop(key, None)

    # -- the decision --------------------------------------------------------------------
    def order(self, keys: list[str]) -> list[str]:
        """Candidates, first victim first."""
        raise NotImplementedError

    def choose_victims(self, bytes_needed: int, candidates: dict[str, int]) -> list[str]:
        """Victims, in order, whose sizes (as given) add up to at least `bytes_needed`; [] if they cannot."""
        chosen, freed = [], 0
        for key in self.order([k for k in candidates if k in self.entries]):
            if freed >= bytes_needed:
                break
            chosen.append(key)
            freed += candidates[key]
        return chosen if freed >= bytes_needed else []


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

    def __init__(self):
        super().__init__()
        self.inflation = 0.0

    def _refresh(self, key: str) -> None:
        e = self.entries[key]
        e.priority = self.inflation + max(e.accesses, 1) / max(e.size / 2**20, 1e-6)

    def created(self, key, size, now):
        super().created(key, size, now)
        self._refresh(key)

    def accessed(self, key, now):
        super().accessed(key, now)
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


POLICIES = {cls.name: cls for cls in (LRU, LFU, FIFO, GDSF, Never, Eager)}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}") from None


__all__ = ["EvictionPolicy", "LRU", "LFU", "FIFO", "GDSF", "Never", "Eager", "POLICIES", "make_policy"]
