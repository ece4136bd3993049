"""A model's copy in one memory tier, and the states it goes through: the record its residency manager
changes (manager.py), and the rule that matters most on a GPU — memory a holder maps is never freed
(`check_freeable`), which the manager asks in its one method that frees."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ...errors import CapacityError
from .holds import CLOSE_SESSIONS, UNPIN, WAIT

HOST = "host"   # the host tier's copy; a GPU's is keyed by the device's UUID


class ModelState(enum.Enum):
    ON_DISK = "on_disk"      # not in the tier (the host tier's: only in the repository)
    WAITING = "waiting"      # requests want it in a tier full of models in use: queued for room (room.py)
    LOADING = "loading"      # a loader thread is copying it into the tier
    RESIDENT = "resident"    # in the tier; clients may map it


@dataclass(eq=False)   # a record with an identity (queues find it by `is`), not a value
class TierCopy:
    """A model's copy in one memory tier: the host tier's (HOST), or one GPU's (its UUID).

    The tiers are inclusive: a GPU copy is promoted from the host copy, and holds it (a GPU lease
    holds both; the host copy is not freed while a GPU copy waits for room or is being made from it).
    `holders`: each hold on this copy (holds.py: a lease, a request in flight, a profile run, a serve-mode
    GPU worker) and how many times it holds it; `holds` their total. Memory they map is not reclaimed by
    freeing it (on a GPU, measured: shared/GPU.md), so a held copy is never freed.
    """
    model: object = field(repr=False)             # the registry's ModelRecord whose copy this is
    tier: str                                     # HOST, or the GPU's UUID
    state: ModelState = ModelState.ON_DISK
    holds: int = 0
    holders: dict = field(default_factory=dict)   # Hold -> how many times it holds this copy
    waiters: list = field(default_factory=list)   # callbacks(error) waiting for room, then on the one load
    prewarmed: bool = False   # loaded by its policy's pre-warm, and nothing has held it since
    memory_wait: bool = False   # queued for room with a serve request among its waiters (wait_for_room)

    # -- holding -----------------------------------------------------------------------------
    def hold(self, holder) -> None:
        """`holder` (a Hold: a lease, a request in flight...) uses the copy: it is not freed under it."""
        self.holders[holder] = self.holders.get(holder, 0) + 1
        self.holds += 1
        self.prewarmed = False

    def let_go(self, holder) -> None:
        n = self.holders.get(holder, 0)
        if n <= 0:
            raise AssertionError(f"{self.where}: let go by a {holder.kind.noun} that does not hold it")
        if n == 1:
            del self.holders[holder]
        else:
            self.holders[holder] = n - 1
        self.holds -= 1

    def held_by(self, ignoring=None) -> list:
        """[(kind, count)] of what holds the copy, the most first; `ignoring`: a kind left out."""
        kinds: dict = {}
        for holder, n in self.holders.items():
            if holder.kind is not ignoring:
                kinds[holder.kind] = kinds.get(holder.kind, 0) + n
        return sorted(kinds.items(), key=lambda kn: -kn[1])

    def holders_text(self, ignoring=None) -> str:
        """'1 session and 2 requests in flight': what holds the copy, as messages say it ("" for nothing)."""
        parts = [kind.count(n, not self.host) for kind, n in self.held_by(ignoring)]
        return " and ".join(filter(None, [", ".join(parts[:-1]), parts[-1]])) if parts else ""

    @property
    def idle(self) -> bool:
        """Resident with nothing holding it: the moment its tier's policy hears it was released."""
        return self.holds == 0 and self.state is ModelState.RESIDENT

    @property
    def busy_above(self) -> bool:
        """A copy in a tier above is waiting for room or being made from this one: this one must stay."""
        copies = self.model.tier_copies
        return self.tier == HOST and len(copies) > 1 and \
            any(c.state in (ModelState.WAITING, ModelState.LOADING) for t, c in copies.items() if t != HOST)

    @property
    def freeable(self) -> bool:
        return self.idle and not self.busy_above

    @property
    def evictable(self) -> bool:
        """A candidate its policy may choose: resident, unheld, unpinned, nothing above busy with it."""
        return self.freeable and not self.model.pinned

    # -- the one load ------------------------------------------------------------------------
    def wait_for_load(self, wake) -> None:
        """`wake(error)` runs once the load in flight (or the room it waits for, then that load) ends."""
        self.waiters.append(wake)

    def queue_for_room(self) -> None:
        """ON_DISK -> WAITING: its waiters wait for room in the tier (its residency's room queue)."""
        if self.state is not ModelState.ON_DISK:
            raise AssertionError(f"{self.where}: queued for room while {self.state.value}")
        self.state = ModelState.WAITING

    def wait_for_room(self, wake, memory_wait: bool = False) -> None:
        """WAITING: `wake(error)` waits for room, then on the load; `memory_wait` (a serve request's): once room
        comes, the promotion waits for memory that is coming back too, rather than be refused for it at once."""
        if self.state is not ModelState.WAITING:
            raise AssertionError(f"{self.where}: waits for room while {self.state.value}")
        self.memory_wait |= memory_wait
        self.waiters.append(wake)

    def give_up(self, wake) -> None:
        """One waiter's deadline passed: it no longer waits; the last one to go takes the copy out of the
        queue (leave_room_queue)."""
        self.waiters.remove(wake)
        if not self.waiters:
            self.leave_room_queue()

    def leave_room_queue(self) -> list:
        """WAITING -> ON_DISK: no request waits for room for it any more (the last one gave up, or it was
        refused); returns the waiters to wake, no longer waiting."""
        if self.state is not ModelState.WAITING:
            raise AssertionError(f"{self.where}: left the room queue while {self.state.value}")
        self.state = ModelState.ON_DISK
        self.memory_wait = False
        waiters, self.waiters = self.waiters, []
        return waiters

    def start_load(self, prewarm: bool = False) -> None:
        """ON_DISK or WAITING -> LOADING: a promotion (or the host copy's fetch of a damaged version) is on its
        way; `prewarm`: its policy's, which no request asked for (yet)."""
        if self.state not in (ModelState.ON_DISK, ModelState.WAITING):
            raise AssertionError(f"{self.where}: a load started while {self.state.value}")
        self.state = ModelState.LOADING
        self.memory_wait = False
        self.prewarmed = prewarm and not self.waiters

    def finish_load(self, ok: bool) -> list:
        """LOADING -> RESIDENT (ok) or ON_DISK; returns the waiters to wake, no longer waiting."""
        if self.state is not ModelState.LOADING:
            raise AssertionError(f"{self.where}: a load finished while {self.state.value}")
        self.state = ModelState.RESIDENT if ok else ModelState.ON_DISK
        if not ok:
            self.prewarmed = False
        waiters, self.waiters = self.waiters, []
        return waiters

    def refetched(self) -> None:
        """The host copy's fetch of a fresh version ended (LOADING -> ON_DISK): its promotion comes next."""
        if self.state is not ModelState.LOADING:
            raise AssertionError(f"{self.where}: fetched again while {self.state.value}")
        self.state = ModelState.ON_DISK

    # -- freeing -----------------------------------------------------------------------------
    def check_freeable(self) -> None:
        """Raise unless this copy may be freed now (an explicit evict; pins do not count): never memory a
        lease maps, nor a copy that is waiting, loading, or that a copy above is being made from."""
        host = self.host
        on = "" if host else f" on {self.tier}"
        if self.holds:
            advice = "; ".join(kind.advice for kind, _ in self.held_by() if kind.advice != CLOSE_SESSIONS)
            raise CapacityError(f"{self.model.key} is in use by {self.holders_text()}{on}; it cannot be evicted"
                                f"{'' if host else ' from that GPU'}{' now: ' + advice if advice else ''}")
        if self.state is ModelState.WAITING:
            raise CapacityError(f"{self.model.key} is waiting for room in {self.where} (requests wait for it); "
                                + ("evict it once it is resident" if host else "there is no copy there to evict yet"))
        if any(c.state is ModelState.WAITING for c in self.model.gpu_copies()) and host:
            raise CapacityError(f"{self.model.key} is waiting for room on a GPU (requests wait for it there); "
                                "evict it once they are served")
        if self.state is ModelState.LOADING or self.busy_above:
            raise CapacityError(f"{self.model.key} is loading; evict it once it is resident" if host else
                                f"{self.model.key} is being copied to GPU {self.tier}; evict it once it is there")

    def freed(self) -> bool:
        """RESIDENT -> ON_DISK, raising (so that nothing is freed) while anything holds it; returns whether it
        had been pre-warmed and no call used it."""
        self.check_freeable()
        if self.state is not ModelState.RESIDENT:
            raise AssertionError(f"{self.where}: freed while {self.state.value}")
        wasted, self.prewarmed = self.prewarmed, False
        self.state = ModelState.ON_DISK
        return wasted

    # -- what it says --------------------------------------------------------------------------
    @property
    def host(self) -> bool:
        return self.tier == HOST

    @property
    def where(self) -> str:
        return "the host tier" if self.tier == HOST else f"GPU {self.tier}"

    def why_kept(self) -> list:
        """[(reason, what to do)] that keep this copy in its tier when room is needed; [] when none does."""
        if self.state is ModelState.WAITING:
            return []                 # (no copy: it holds no room)
        if self.state is ModelState.LOADING:
            return [("loading" if self.tier == HOST else "being copied there", WAIT)]
        reasons = [(f"in use by {kind.count(n, not self.host)}", kind.advice) for kind, n in self.held_by()]
        if self.busy_above and not self.holds:     # (a GPU lease holds the host copy too)
            waiting = any(c.state is ModelState.WAITING for c in self.model.gpu_copies())
            reasons.append(("waiting for room on a GPU" if waiting else "being copied to a GPU", WAIT))
        return reasons + ([("pinned", UNPIN)] if self.model.pinned else [])
