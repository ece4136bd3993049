"""Requests waiting for room in a tier full of models in use (issue 29, item 4): the host tier, and each GPU.

A request whose model does not fit, because every model in the tier is in use or pinned, waits here
instead of failing at once: the model joins its tier's queue in the order its first request came, and
each request waits until its own deadline. When room appears (a lease released, a model evicted or
demoted, capacity raised, an unpin), the cache admits the queue's head first; nothing behind it, and
no pre-warm, goes before it. One promotion serves every request waiting on a model.

An entry is a model's copy in the queue's tier (registry.TierCopy): its `state` is WAITING while queued,
its `waiters` are the requests' wake callbacks (the promotion inherits them when it starts), and its
transitions say when a waiter gives up (`give_up`) or every one is told why (`leave_room_queue`).
"""

from __future__ import annotations

import heapq
from collections import deque

from ...errors import InputError, ModelCacheError
from .copy import ModelState


def deadline_of(arrival: float, deadline_ms: float | None) -> float | None:
    """A request's deadline (clock time) from its deadline_ms after `arrival`; None or 0: none given."""
    if deadline_ms is None or deadline_ms == 0:
        return None
    if not 0 < deadline_ms < float("inf"):   # (NaN fails this too)
        raise InputError(f"deadline_ms {deadline_ms}: give a positive number of milliseconds (0 or none: no deadline)")
    return arrival + deadline_ms / 1e3


class RoomQueue:
    def __init__(self):
        self.models: deque = deque()   # WAITING entries (one per model), by their first request's arrival
        self._deadlines: list = []     # (deadline, seq, entry, wake, since): one per request
        self._seq = 0
        # Whether admit() is running (a waiter it wakes may release a hold, which asks for admission again).
        self._admitting = self._admit_again = False

    def __bool__(self) -> bool:
        return bool(self.models)

    def add(self, entry, wake, deadline: float, now: float) -> None:
        """`wake` (already among `entry.waiters`, and `entry` WAITING) waits for room until `deadline`; the
        entry queues at the back with its first waiter."""
        if entry not in self.models:
            self.models.append(entry)
        self._seq += 1
        heapq.heappush(self._deadlines, (deadline, self._seq, entry, wake, now))

    def admitted(self, entry) -> None:
        """The head's promotion started (its waiters now wait on the load), or it was refused."""
        self.models.remove(entry)

    def admit(self, start) -> None:
        """Room may have appeared: start(entry) the oldest first, while it starts; nothing passes a request that
        waits. start returns whether the promotion started (False: still no room), or raises ModelCacheError
        when it never can (the entry's waiters hear why)."""
        if self._admitting:
            self._admit_again = True
            return
        self._admitting = True
        try:
            while self.models:
                entry, error = self.models[0], None
                self._admit_again = False
                try:
                    started = start(entry)
                except ModelCacheError as e:
                    started, error = True, e
                if not started:
                    if self._admit_again:
                        continue
                    return
                self.admitted(entry)
                if error is not None:
                    for wake in entry.leave_room_queue():
                        wake(error)
        finally:
            self._admitting = False

    def stop(self, error_for) -> None:
        """The daemon is stopping: answer every request still waiting (error_for(entry)), rather than leave it to
        time out."""
        for entry in list(self.models):
            self.admitted(entry)
            for wake in entry.leave_room_queue():
                wake(error_for(entry))

    def waiting(self) -> dict:
        """What waits here, for `status` and the metrics: models queued, and requests waiting for them."""
        return {"models": len(self.models), "requests": sum(len(e.waiters) for e in self.models)}

    @staticmethod
    def _waiting(entry, wake) -> bool:
        return entry.state is ModelState.WAITING and any(w is wake for w in entry.waiters)

    def next_deadline(self) -> float | None:
        """The earliest deadline of a request still waiting; None: none waits."""
        while self._deadlines and not self._waiting(self._deadlines[0][2], self._deadlines[0][3]):
            heapq.heappop(self._deadlines)   # admitted, or refused, before its deadline
        return self._deadlines[0][0] if self._deadlines else None

    def expired(self, now: float) -> list:
        """(entry, wake, seconds waited) of each request whose deadline has passed, no longer waiting; an entry
        none waits for any more leaves the queue (and the tier: give_up)."""
        out = []
        while self.next_deadline() is not None and self._deadlines[0][0] <= now:
            _, _, entry, wake, since = heapq.heappop(self._deadlines)
            entry.give_up(wake)
            if entry.state is not ModelState.WAITING:   # the last one gone: so is the entry
                self.admitted(entry)
            out.append((entry, wake, now - since))
        return out
