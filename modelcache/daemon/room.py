"""Requests waiting for room in the host tier while it is full of models in use (issue 29, item 4).

A request whose model does not fit, because every resident model is in use or pinned, waits here
instead of failing at once: its model joins the queue in the order its first request came, and
each request waits until its own deadline. When room appears (a lease released, a model evicted,
capacity raised), HostCache admits the queue's head first; nothing behind it, and no pre-warm,
goes before it. One promotion serves every request waiting on a model (`ModelRecord.waiters`).
"""

from __future__ import annotations

import heapq
from collections import deque

from ..errors import InputError
from .registry import ModelRecord, ModelState


def deadline_of(arrival: float, deadline_ms: float | None) -> float | None:
    """A request's deadline (clock time) from its deadline_ms after `arrival`; None or 0: none given."""
    if deadline_ms is None or deadline_ms == 0:
        return None
    if not 0 < deadline_ms < float("inf"):   # (NaN fails this too)
        raise InputError(f"deadline_ms {deadline_ms}: give a positive number of milliseconds (0 or none: no deadline)")
    return arrival + deadline_ms / 1e3


class RoomQueue:
    def __init__(self):
        self.models: deque[ModelRecord] = deque()   # WAITING models, by their first request's arrival
        self._deadlines: list = []                  # (deadline, seq, model, wake, since): one per request
        self._seq = 0

    def __bool__(self) -> bool:
        return bool(self.models)

    def add(self, model: ModelRecord, wake, deadline: float, now: float) -> None:
        """`wake` (already among `model.waiters`) waits for room until `deadline`; the model queues with its
        first waiter."""
        if model.state is ModelState.ON_DISK:
            model.queue_for_room()
            self.models.append(model)
        self._seq += 1
        heapq.heappush(self._deadlines, (deadline, self._seq, model, wake, now))

    def admitted(self, model: ModelRecord) -> None:
        """The head's promotion started (its waiters now wait on the load), or it was refused."""
        self.models.remove(model)

    @staticmethod
    def _waiting(model: ModelRecord, wake) -> bool:
        return model.state is ModelState.WAITING and any(w is wake for w in model.waiters)

    def next_deadline(self) -> float | None:
        """The earliest deadline of a request still waiting; None: none waits."""
        while self._deadlines and not self._waiting(self._deadlines[0][2], self._deadlines[0][3]):
            heapq.heappop(self._deadlines)   # admitted, or refused, before its deadline
        return self._deadlines[0][0] if self._deadlines else None

    def expired(self, now: float) -> list:
        """(model, wake, seconds waited) of each request whose deadline has passed, no longer waiting; a model
        none waits for any more leaves the queue (back ON_DISK)."""
        out = []
        while self.next_deadline() is not None and self._deadlines[0][0] <= now:
            _, _, model, wake, since = heapq.heappop(self._deadlines)
            model.waiters.remove(wake)
            if not model.waiters:
                model.leave_room_queue()
                self.models.remove(model)
            out.append((model, wake, now - since))
        return out
