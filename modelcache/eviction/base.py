"""What every eviction policy is: the bookkeeping the cache feeds it, the victim choice, and the timer
interface (no timers unless a policy keeps some: `timed.py`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Entry:
    size: int
    created: float
    last_access: float
    accesses: int = 0
    priority: float = 0.0   # GreedyDual-Size-Frequency's H


@dataclass(frozen=True)
class Action:
    """What a timed policy asks of its tier when a deadline passes: "unload" a resident model (only if
    nothing holds it: the tier checks, as for any victim) or "prewarm" one (promote it, if there is room)."""
    kind: str   # "unload" | "prewarm"
    key: str


class EvictionPolicy:
    """Base: bookkeeping shared by all policies; subclasses say how victims are ordered.

    `clock` is the tier's (its residency manager's): the daemon's monotonic clock, a test's fake one, or a
    replay's virtual one, which a replay drives as fast as it likes. A policy reads it when it is told
    something; it never sleeps on it.

    The timer interface (`next_deadline`, `due`, `keep_alive_until`, `predicted_next_call`) is here so a
    tier drives every policy alike; a policy without timers answers "nothing, never".
    """

    name = "base"
    evict_on_release = False   # eager: free a model as soon as its last client closes it
    timed = False              # keeps deadlines (timed.py)

    def __init__(self, clock):
        self.clock = clock
        self.entries: dict[str, Entry] = {}

    # -- what the cache tells the policy, as it happens ----------------------------------
    def created(self, key: str, size: int) -> None:
        now = self.clock()
        self.entries[key] = Entry(size=size, created=now, last_access=now)

    def accessed(self, key: str) -> None:
        e = self.entries.get(key)
        if e is not None:
            e.accesses += 1
            e.last_access = self.clock()

    def released(self, key: str) -> None:
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

    # -- timers (none here) ----------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """When `due` will next have something to say; None: no timer pending."""
        return None

    def due(self) -> list[Action]:
        """The actions whose time has come by now, each once, in deadline order."""
        return []

    def prewarm_victims(self, key: str, bytes_needed: int, candidates: dict[str, int]) -> list[str]:
        """Victims that may make room for pre-warming `key` ([]: the pre-warm waits or is dropped)."""
        return []

    def keep_alive_until(self, key: str) -> float | None:
        """The time after which `key` may be unloaded while idle; None: no timer, it stays until needed."""
        return None

    def predicted_next_call(self, key: str) -> float | None:
        """When the policy expects `key`'s next call; None: it does not predict one."""
        return None
