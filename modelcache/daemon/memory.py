"""The machine's memory as the host tier must live in it: the memory limit (RAM or the cgroup's), the headroom
kept free under it (`memory_reserve`), and what the daemon does when that headroom runs short.

The host tier's pages are tmpfs pages: the kernel cannot reclaim them, so when the limit is reached the
OOM killer takes a process instead. The `MemoryGuard` keeps that from happening for a cache's sake:

- at start, a host_capacity larger than the limit less the reserve is refused in one line (`check_capacity`);
- a promotion that would leave less headroom than the reserve gives idle models back first, and fails with
  OutOfMemoryError when even that is not enough (as Redis answers -OOM at maxmemory), never an OOM kill;
- a thread (`PressureWatch`) reads the headroom every POLL_S and, below the reserve, has the owner loop give
  idle models back in the policy's order until the reserve is free again (`relieve`), with a log line, a
  counter and gauges; nothing a lease maps is touched (Residency.give_back);
- a restarted daemon relieves once before it serves: a dead daemon's tier it re-adopted is still charged to
  the cgroup, and promoting over it is what looped under systemd (issue 42).

Threads: the watch thread only reads the headroom and posts; everything else runs on the owner loop.
"""

from __future__ import annotations

import logging
import threading

from .. import memlimit
from ..config import MIN_CAPACITY
from ..errors import ConfigError, OutOfMemoryError
from ..memlimit import MemoryLimit
from .wording import plural, size_text

log = logging.getLogger("modelcache.daemon")
# How often the watch reads the headroom: a read costs ~56 us (0.1 % of a core at this rate); at 128 MiB/s of growth
# beside the daemon, polling every 50 ms noticed the crossing 25 ms [5-96] after it, with 251-255 of a 256 MiB reserve
# left, where PSI and memory.pressure_level fired only at the limit (benchmarks/memlimit/reaction.txt).
POLL_S = 0.05


def mib(n: int) -> str:
    """Bytes as this module's messages show them: whole MiB, KiB under one (tests' tiers are that small)."""
    return f"{n / 2**20:.0f} MiB" if abs(n) >= 2**20 else size_text(n)


def check_capacity(capacity_bytes: int, limit: MemoryLimit, reserve_bytes: int, settings) -> None:
    """Refuse (capacity_over_limit = refuse) or warn about a host tier that could fill the memory limit less the
    reserve: it would be OOM-killed, or have others killed, before it ever filled."""
    room = limit.limit_bytes - reserve_bytes
    if room < MIN_CAPACITY:   # (a reserve that leaves less than the smallest tier leaves none)
        raise ConfigError(f"memory_reserve {settings.memory_reserve} ({mib(reserve_bytes)}) leaves no room under the "
                          f"memory limit: {limit.source} is {mib(limit.limit_bytes)}; lower memory_reserve")
    if capacity_bytes <= room:
        return
    text = (f"host_capacity {settings.host_capacity} ({mib(capacity_bytes)}) is more than the memory limit allows: "
            f"{limit.source} is {mib(limit.limit_bytes)}, less memory_reserve {mib(reserve_bytes)} kept free for "
            f"the daemon, its fronts and clients, leaves {mib(room)}")
    if settings.capacity_over_limit == "warn":
        log.warning("%s; running over it as capacity_over_limit = warn says: promotions that would not fit the "
                    "memory fail with an out-of-memory error", text)
        return
    raise ConfigError(f"{text}; lower host_capacity, raise the limit, or set capacity_over_limit = \"warn\"")


class MemoryGuard:
    """The headroom under the memory limit, on the owner loop; `measure` reads it (injected in tests)."""

    def __init__(self, limit: MemoryLimit, reserve_bytes: int, measure=None, counters: dict | None = None):
        self.limit = limit
        self.reserve = reserve_bytes
        self.measure = measure or (lambda: memlimit.headroom_bytes(self.limit))
        self.counters = counters if counters is not None else {}
        self.in_flight = 0            # bytes of promotions under way: reserved, not all charged yet
        # Models whose serve sessions the workers are dropping (a model given back, say): what those sessions map
        # and allocate still counts until they are gone, a run's length at most (daemon/serving.py).
        self.dropping = 0
        self.headroom = self.measure()   # the last reading, for status and metrics
        self.short = False            # in a pressure episode: said once, not at every reading
        self.host = None              # the host tier's Residency (set by the daemon): what is given back
        self.caches = []              # () -> bytes freed: what goes before any model (the response cache, ...)

    # -- promotions -------------------------------------------------------------------------------------
    def shortfall(self, nbytes: int) -> int:
        """How much more headroom a promotion of `nbytes` needs to leave the reserve free (0: it fits)."""
        self.headroom = self.measure()
        return max(0, nbytes + self.reserve - (self.headroom - self.in_flight))

    def started(self, nbytes: int) -> None:
        self.in_flight += nbytes

    def settled(self, nbytes: int) -> None:
        self.in_flight -= nbytes

    def refusal(self, key: str, nbytes: int, held: list[str]) -> OutOfMemoryError:
        """A promotion the memory cannot take even with every idle model given back."""
        free = self.headroom - self.in_flight
        return OutOfMemoryError(
            f"{key} needs {mib(nbytes)} in the host tier, and the memory limit has {mib(max(0, free))} free "
            f"({limit_text(self.limit)}; memory_reserve {mib(self.reserve)} is kept free)"
            + (f"; the models resident cannot be given back now: {', '.join(held)}" if held else "")
            + "; close sessions on other models, or raise the memory limit")

    # -- pressure -----------------------------------------------------------------------------------------
    def relieve(self) -> int:
        """Below the reserve: give idle models back, in the policy's order, until the reserve is free again
        (with a margin, so the next reading does not start again at once). Returns the bytes given back."""
        self.headroom = self.measure()
        if self.headroom >= self.reserve:
            if self.short:
                log.info("memory pressure over: %s free under the memory limit", mib(self.headroom))
            self.short = False
            return 0
        cached = sum(drop() for drop in self.caches)
        if cached:   # what can be made again goes first, and models only if that was not enough
            log.warning("memory pressure: %s free under the memory limit (%s), less than memory_reserve %s; dropped "
                        "%s of caches (cached answers, an idle packing server)", mib(self.headroom),
                        limit_text(self.limit), mib(self.reserve), mib(cached))
            self.headroom = self.measure()
            if self.headroom >= self.reserve:
                self.short = False
                return cached
        wanted = self.reserve + self.margin - self.headroom
        evicted, freed = self.host.give_back(wanted, counter="pressure_evictions")
        if evicted:
            log.warning("memory pressure: %s free under the memory limit (%s), less than memory_reserve %s; gave "
                        "back %s, %s: %s", mib(self.headroom), limit_text(self.limit), mib(self.reserve),
                        plural(len(evicted), "idle model"), mib(freed), ", ".join(evicted))
            self.counters["pressure_reliefs"] = self.counters.get("pressure_reliefs", 0) + 1
            self.headroom = self.measure()
            self.host.admit()   # (requests waiting for the tier's room: each promotion still checks the memory)
        elif not self.short:
            log.warning("memory pressure: %s free under the memory limit (%s), less than memory_reserve %s, and no "
                        "idle model to give back", mib(self.headroom), limit_text(self.limit), mib(self.reserve))
        self.short = self.headroom < self.reserve
        return freed + cached

    @property
    def margin(self) -> int:
        """Given back beyond the reserve: an eighth of it, so a steady grower costs one eviction now and then."""
        return self.reserve // 8

    def describe(self) -> dict:
        """For status and metrics."""
        return {"memory_limit_bytes": self.limit.limit_bytes, "memory_limit_source": self.limit.source,
                "memory_reserve_bytes": self.reserve, "headroom_bytes": self.headroom}


def limit_text(limit: MemoryLimit) -> str:
    return f"{mib(limit.limit_bytes)}, {limit.source}"


class PressureWatch:
    """A thread that reads the headroom every `interval_s` and, below the reserve, posts `relieve` to the owner
    loop (once: the next post waits until that one ran)."""

    def __init__(self, guard: MemoryGuard, post, interval_s: float = POLL_S):
        self.guard = guard
        self.post = post                  # loaders.post: done(result, error) runs on the owner loop
        self.interval_s = interval_s
        self.stopped = threading.Event()
        self.posted = threading.Event()
        self.thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=2)

    def _run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                reading = self.guard.measure()
            except Exception:   # a cgroup file gone (the cgroup removed under us): keep the last reading
                log.debug("memory watch: reading the headroom failed", exc_info=True)
                continue
            self.guard.headroom = reading   # (the gauge status shows between the owner's own readings)
            if (reading < self.guard.reserve or self.guard.short) and not self.posted.is_set():
                self.posted.set()
                self.post(self._on_owner, None, None)

    def _on_owner(self, _result, _error) -> None:
        try:
            self.guard.relieve()   # (reads again: the watch's reading is older than the owner's turn)
        finally:
            self.posted.clear()
