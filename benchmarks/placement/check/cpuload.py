"""How busy the machine was while a benchmark measured something, and how much of that was not the benchmark.

The load average cannot tell: it counts the benchmark's own daemon and client (on 2 cores a 2-thread
worker alone makes it 2), it lags by a minute, and it misses time the hypervisor steals. A reading
here is the system's busy and stolen CPU time (psutil.cpu_times) and this process's and its
children's CPU time (the daemon a benchmark starts is a child); between two readings, in cores:

  own    the benchmark and its daemon (daemon: its child processes alone);
  other  every other process (busy less own): what stretches a stage run that needs its cores;
  steal  time the hypervisor gave the cores to another machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Reading:
    wall: float
    busy: float        # CPU seconds the system spent busy (user, nice, system, irq, softirq)
    steal: float
    own: float         # CPU seconds of this process and its live descendants
    children: float    # of its live descendants alone (a benchmark's daemon)


def _own_seconds() -> tuple[float, float]:
    import psutil
    me = psutil.Process()
    mine, children = 0.0, 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if p.pid == me.pid:
            mine += t.user + t.system
        else:
            children += t.user + t.system
    return mine + children, children


def read() -> Reading:
    import psutil
    t = psutil.cpu_times()
    busy = t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    return Reading(time.monotonic(), busy, getattr(t, "steal", 0.0), *_own_seconds())


def between(a: Reading, b: Reading) -> dict:
    """Cores busy between readings a and b: {"seconds", "busy", "own", "daemon", "other", "steal"}."""
    return load(b.wall - a.wall, b.busy - a.busy, b.own - a.own, b.steal - a.steal, b.children - a.children)


def load(seconds: float, busy_s: float, own_s: float, steal_s: float, children_s: float = 0.0) -> dict:
    """CPU seconds over a span as cores; `other` is the busy time that was not the benchmark's own (never
    below 0: the system's and the processes' counters tick apart, by up to a clock tick each)."""
    if seconds <= 0:
        return {"seconds": 0.0, "busy": 0.0, "own": 0.0, "daemon": 0.0, "other": 0.0, "steal": 0.0}
    return {"seconds": seconds, "busy": busy_s / seconds, "own": own_s / seconds, "daemon": children_s / seconds,
            "other": max(0.0, busy_s - own_s) / seconds, "steal": max(0.0, steal_s) / seconds}


class Meter:
    """with Meter() as m: ...; then m.result is `between` over the block."""

    def __enter__(self):
        self.start = read()
        self.result: dict = {}
        return self

    def __exit__(self, *exc):
        self.result = between(self.start, read())
        return False
