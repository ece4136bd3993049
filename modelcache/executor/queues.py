"""One model's waiting serve requests, in the order its batches take them: Triton's priority queue.

A model's Triton configuration may give its dynamic batcher `priority_levels` (1 is served first) and a queue
policy per level (`priority_queue_policy`, else `default_queue_policy`): how many requests the level holds, how
long one may wait there, and what happens then: refused (REJECT), or DELAY, moved behind that level's requests
still within their time (they run later, not never). A request's `priority` picks its level; 0, or one above
the levels, takes `default_priority_level` (Triton's InferenceRequest::SetPriority). A model without levels has
one, level 0, under its default policy: the queue it always had.

Triton reads these in scheduler_utils.cc (PriorityQueue, PolicyQueue); this module keeps its order and its
per-level bounds, and is pure: the engine (executor/engine.py) hands in `now`, and answers whom it refuses.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class QueuePolicy:
    max_queue: int = 0            # requests the level holds (waiting and delayed); 0: no bound of its own
    timeout_s: float = 0.0        # how long a request may wait in the level; 0: no limit
    delay: bool = False           # past it: behind the level's others (Triton's DELAY), else refused (REJECT)

    @classmethod
    def of(cls, fields: dict) -> "QueuePolicy":
        """From a model's serving fields (calibration.check_serving): max_queue, queue_timeout_ms, queue_delay."""
        return cls(fields.get("max_queue", 0), fields.get("queue_timeout_ms", 0.0) / 1e3,
                   bool(fields.get("queue_delay", False)))


class _Level:
    __slots__ = ("waiting", "delayed")

    def __init__(self):
        self.waiting: deque = deque()   # in arrival order, each within its time (their timeouts come due in order)
        self.delayed: deque = deque()   # past it, with DELAY: served after `waiting`, in the order they came due

    def __len__(self):
        return len(self.waiting) + len(self.delayed)


class Refused(Exception):
    """The level is full: the request is not queued (Triton's words, for the engine's CapacityError)."""


class ModelQueue:
    """A model's queue by priority level. Requests are the engine's ServeRequests: this sets their `queue_level`,
    `queue_deadline` (None once delayed or without a timeout) and `delayed`.

    Iteration, `head` and `popleft` go by level (lowest number first), within a level its waiting requests before
    its delayed ones. `appendleft` puts a request taken from the front back where it was: a batch shrunk to meet
    its deadlines gives its last members back in reverse order."""

    def __init__(self, serving: dict | None):
        self._levels: dict[int, _Level] = {}
        self._order: list[int] = []   # the levels with requests, lowest first
        self._size = 0
        self.configure(serving)

    def configure(self, serving: dict | None) -> None:
        """Take the model's own fields (calibration.check_serving; None for none): its levels and policies. The
        requests queued stay where they are; the new bounds and timeouts apply to those that come after."""
        own = self.serving = serving or {}
        self.levels_count = own.get("priority_levels", 0)
        self.default_level = own.get("default_priority", 1) if self.levels_count else 0
        self._default = QueuePolicy.of(own)
        self._policies = {int(k): QueuePolicy.of(v) for k, v in (own.get("priority_queues") or {}).items()}

    def level_of(self, priority: int | None) -> int:
        """The level a request of this `priority` waits in (Triton's SetPriority)."""
        if not self.levels_count:
            return 0
        return priority if priority and priority <= self.levels_count else self.default_level

    def policy(self, level: int) -> QueuePolicy:
        return self._policies.get(level, self._default)

    # -- adding -------------------------------------------------------------------------------
    def append(self, req, priority: int | None, now: float, max_queue: int = 0) -> None:
        """Queue `req` at the back of its level; Refused where the level is full, or where its policy sets no bound,
        the model's whole queue holds `max_queue` (the daemon's `max_queue` setting; 0: no bound)."""
        level = self.level_of(priority)
        policy = self.policy(level)
        held = self._levels.get(level)
        if policy.max_queue:
            if held is not None and len(held) >= policy.max_queue:
                raise Refused(f"Exceeds maximum queue size ({policy.max_queue})" +
                              (f" of priority level {level}" if self.levels_count else ""))
        elif max_queue and self._size >= max_queue:
            raise Refused(f"Exceeds maximum queue size ({max_queue})")
        req.queue_level, req.delayed = level, False
        req.queue_deadline = now + policy.timeout_s if policy.timeout_s else None
        self._level(level).waiting.append(req)
        self._size += 1

    def _level(self, level: int) -> _Level:
        held = self._levels.get(level)
        if held is None:
            held = self._levels[level] = _Level()
            self._order = sorted(self._levels)
        return held

    # -- taking -------------------------------------------------------------------------------
    def __len__(self):
        return self._size

    def __bool__(self):
        return self._size > 0

    def __iter__(self):
        for level in self._order:
            held = self._levels[level]
            yield from held.waiting
            yield from held.delayed

    @property
    def head(self):
        """The request the next batch starts with (the queue is not empty)."""
        held = self._levels[self._order[0]]
        return held.waiting[0] if held.waiting else held.delayed[0]

    def popleft(self):
        held = self._levels[self._order[0]]
        req = held.waiting.popleft() if held.waiting else held.delayed.popleft()
        self._taken(req.queue_level, held)
        return req

    def appendleft(self, req) -> None:
        held = self._level(req.queue_level)
        (held.delayed if req.delayed else held.waiting).appendleft(req)
        self._size += 1

    def remove(self, req) -> None:
        held = self._levels[req.queue_level]
        (held.delayed if req.delayed else held.waiting).remove(req)
        self._taken(req.queue_level, held)

    def _taken(self, level: int, held: _Level) -> None:
        self._size -= 1
        if not held:
            del self._levels[level]
            self._order.remove(level)

    def depths(self) -> dict:
        """{str(level): requests waiting there}, for the levels that have any (stats, metrics)."""
        return {str(level): len(self._levels[level]) for level in self._order}

    # -- queue timeouts ---------------------------------------------------------------------------
    def expire(self, now: float) -> list:
        """The requests past their level's queue timeout with REJECT, taken out (the engine refuses them); those
        with DELAY move behind their level's others, and wait on without a timeout."""
        refused = []
        for level in list(self._order):
            held = self._levels[level]
            while held.waiting and held.waiting[0].queue_deadline is not None and now > held.waiting[0].queue_deadline:
                req = held.waiting.popleft()
                req.queue_deadline = None
                if self.policy(level).delay:
                    req.delayed = True
                    held.delayed.append(req)
                else:
                    refused.append(req)
                    self._taken(level, held)
        return refused

    def next_due(self) -> float | None:
        """When a queue timeout next comes due (each level's requests share theirs: its first waiting's)."""
        due = [h.waiting[0].queue_deadline for h in self._levels.values()
               if h.waiting and h.waiting[0].queue_deadline is not None]
        return min(due) if due else None
