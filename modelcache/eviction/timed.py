"""Policies that keep deadlines: after each call a model is kept until a time, and may be let go then
and pre-warmed again before the next call is expected. The fixed keep-alive (`keepalive`) lives here;
the learned one is hybrid.py.

The tier drives the timers (its owner loop; the policy reads the tier's clock, given at construction):

    t = policy.next_deadline()          # None: nothing pending; sleep until t (or the next message)
    for action in policy.due():          # each action once, in deadline order
        "unload"  -> free action.key if nothing holds it and it is not pinned (the tier checks)
        "prewarm" -> promote action.key if it is on disk and there is room, making room only from
                     prewarm_victims(key, bytes, candidates) (a pre-warm never displaces demand)

Calls are `accessed` (an open's lease granted, a serve request). A model in use is never unloaded: a
window that ends while it is busy ends at its `released` instead (due() then says "unload").
"""

from __future__ import annotations

import heapq
import math

from .base import Action, EvictionPolicy

MINUTE_S = 60.0


class TimedPolicy(EvictionPolicy):
    """Deadlines per model from `plan(key, now)` after each call; under pressure, the model whose next
    call is expected furthest away goes first (`time_to_next_call`)."""

    timed = True

    def __init__(self, clock):
        super().__init__(clock)
        self.last_call: dict[str, float] = {}   # survives eviction: the history is the model's, not the copy's
        self.busy: set[str] = set()             # accessed and not yet released
        self.unload_at: dict[str, float] = {}
        self.prewarm_at: dict[str, float] = {}
        self.keep_after_prewarm: dict[str, float] = {}   # the unload time once the pre-warm has happened
        self._heap: list[tuple[float, int, str, str]] = []
        self._pending: dict[tuple[str, str], tuple[float, int]] = {}   # (kind, key) -> (t, seq) of its live entry
        self._seq = 0

    # -- what a subclass decides -------------------------------------------------------------
    def plan(self, key: str, now: float) -> tuple[float | None, float]:
        """After a call at `now`: (pre-warm after this many seconds or None, keep until this many seconds
        after the call). With a pre-warm, the model goes as soon as the call is over and comes back then."""
        raise NotImplementedError

    # -- what the cache tells the policy -------------------------------------------------------
    def created(self, key, size):
        super().created(key, size)
        now = self.clock()
        if self.unload_at.get(key, -math.inf) < now:   # not a pre-warm's: a load nobody planned
            self._schedule_unload(key, now + self.idle_keep_s())

    def accessed(self, key):
        super().accessed(key)
        now = self.clock()
        self.busy.add(key)
        self.observe_call(key, now)
        self.last_call[key] = now
        self.prewarm_at.pop(key, None)               # this call answers any pending pre-warm
        self.keep_after_prewarm.pop(key, None)
        self._pending.pop(("prewarm", key), None)
        prewarm_s, keep_s = self.plan(key, now)
        if prewarm_s is None:
            self._schedule_unload(key, now + keep_s)
        else:
            self._schedule_unload(key, now)          # idle until the pre-warm: go when the call ends
            self.prewarm_at[key] = now + prewarm_s
            self.keep_after_prewarm[key] = now + keep_s
            self._push(now + prewarm_s, "prewarm", key)

    def released(self, key):
        now = self.clock()
        self.busy.discard(key)
        if self.unload_at.get(key, math.inf) <= now:   # its window ended while it was in use
            self._schedule_unload(key, now)

    def removed(self, key):
        super().removed(key)
        self.unload_at.pop(key, None)
        self._pending.pop(("unload", key), None)
        self.busy.discard(key)

    def observe_call(self, key: str, now: float) -> None:
        """A subclass learns from the call here (before `plan`); `last_call` still holds the previous one."""

    def idle_keep_s(self) -> float:
        """How long a model loaded without a plan (a load nobody called for yet) stays."""
        raise NotImplementedError

    # -- timers ------------------------------------------------------------------------------
    def _push(self, t: float, kind: str, key: str) -> None:
        """Set `key`'s `kind` timer to `t`; an earlier entry for it is dropped lazily (`_pending`), and the
        heap is rebuilt when dropped entries outnumber live ones (every call replans: a busy model would
        otherwise leave one entry per call until its old deadline came round)."""
        self._seq += 1
        self._pending[(kind, key)] = (t, self._seq)
        heapq.heappush(self._heap, (t, self._seq, kind, key))
        if len(self._heap) > 2 * len(self._pending) + 64:
            self._heap = [(t, seq, kind, key) for (kind, key), (t, seq) in self._pending.items()]
            heapq.heapify(self._heap)

    def _live(self, seq: int, kind: str, key: str) -> bool:
        return self._pending.get((kind, key), (None, None))[1] == seq

    def _schedule_unload(self, key: str, t: float) -> None:
        self.unload_at[key] = t
        self._push(t, "unload", key)

    def next_deadline(self):
        while self._heap:
            t, seq, kind, key = self._heap[0]
            if self._live(seq, kind, key):
                return t
            heapq.heappop(self._heap)   # superseded by a later plan
        return None

    def due(self):
        now = self.clock()
        actions = []
        while self._heap and self._heap[0][0] <= now:
            t, seq, kind, key = heapq.heappop(self._heap)
            if not self._live(seq, kind, key):
                continue
            del self._pending[(kind, key)]
            if kind == "prewarm":
                del self.prewarm_at[key]
                self._schedule_unload(key, self.keep_after_prewarm.pop(key))
                if key not in self.entries:           # already resident (still busy, say): nothing to load
                    actions.append(Action("prewarm", key))
            elif key in self.entries and key not in self.busy:
                actions.append(Action("unload", key))   # (busy: released() brings it back)
        return actions

    # -- the operator's view and the order under pressure ------------------------------------------
    def keep_alive_until(self, key):
        return self.unload_at.get(key) if key in self.entries else None

    def time_to_next_call(self, key: str) -> float:
        """Seconds from now to `key`'s next call as the policy expects it; here as long again as it has been
        idle (the guess that makes LRU work)."""
        last = self.last_call.get(key)
        return max(0.0, self.clock() - (last if last is not None else self.entries[key].last_access))

    def order(self, keys):
        """The furthest expected next call first (here: least recently used first)."""
        return sorted(keys, key=lambda k: (-self.time_to_next_call(k), self.entries[k].last_access, k))

    def prewarm_victims(self, key, bytes_needed, candidates):
        """Only models whose next call is expected after `key`'s: a pre-warm never displaces sooner demand."""
        mine = self.time_to_next_call(key) if key in self.last_call else 0.0
        later = {k: s for k, s in candidates.items() if k in self.entries and self.time_to_next_call(k) > mine}
        return self.choose_victims(bytes_needed, later)


class KeepAlive(TimedPolicy):
    """The platforms' fixed keep-alive (AWS Lambda's ~10 minutes): unload a model `keep_minutes` after its
    last call; never pre-warm; under pressure, those past their window first, then least recent."""

    name = "keepalive"
    keep_alive_param = "keep_minutes"   # what make_policy's keep_alive_s sets

    def __init__(self, clock, keep_minutes: float = 10.0):
        super().__init__(clock)
        self.keep_s = keep_minutes * MINUTE_S

    def plan(self, key, now):
        return None, self.keep_s

    def idle_keep_s(self):
        return self.keep_s
