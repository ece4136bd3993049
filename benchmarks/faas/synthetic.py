"""Synthetic invocation traces with the published shape of Azure Functions' (Shahrad et al., ATC'20),
seeded, as rows of per-minute counts (trace.py writes and reads them like the real trace).

What the paper reports and this reproduces, roughly:
- popularity is heavy-tailed over orders of magnitude: ~45 % of functions are called at most once an hour
  on average and ~80 % at most once a minute, a few many times a second (here: log10 of the mean calls a
  minute ~ Normal(-1.6, 1.4), capped at `max_per_minute` to keep the replay's event count bounded);
- timers (~1 in 6 functions; here a share of the functions called often enough) fire every k minutes;
- other triggers (HTTP, queue, event) are bursty: Poisson calls in on-periods of minutes to tens of
  minutes, separated by off-periods of minutes to hours; the busiest are close to steady Poisson;
- many functions are rare: a handful of calls a day at no particular time.
So idle times run from seconds (inside a burst) to hours (between bursts, between rare calls).
"""

from __future__ import annotations

import math
import random

from benchmarks.faas.trace import FunctionCounts

PERIODS_MIN = (1, 2, 5, 10, 15, 30, 60, 120)


def _hex(rng: random.Random) -> str:
    return "%064x" % rng.getrandbits(256)


def _periodic(rng, minutes, rate):
    """A timer: one call every k minutes (k nearest the mean interval), from a random phase."""
    k = min(PERIODS_MIN, key=lambda p: abs(math.log(p * max(rate, 1e-9))))
    phase = rng.randrange(k)
    return [1 if m % k == phase else 0 for m in range(minutes)], "timer"


def _bursty(rng, minutes, rate):
    """Poisson calls in on-periods; on and off lengths exponential, their means drawn log-uniformly."""
    duty = rng.uniform(0.1, 1.0) if rate < 1 else rng.uniform(0.5, 1.0)   # the busiest are nearly steady
    on_mean = math.exp(rng.uniform(math.log(3), math.log(30)))           # minutes
    duty = min(duty, 0.99)
    off_mean = on_mean * (1 - duty) / duty                                # so that on/(on+off) = duty
    counts, on, left = [], rng.random() < duty, 0.0
    for _ in range(minutes):
        while left <= 0:
            on = not on
            left += rng.expovariate(1 / (on_mean if on else off_mean))
        counts.append(_poisson(rng, rate / duty) if on else 0)
        left -= 1
    return counts, rng.choice(("http", "http", "queue", "event"))


def _rare(rng, minutes, rate):
    """A few calls at random minutes (at least one, so every function appears)."""
    n = max(1, _poisson(rng, rate * minutes))
    counts = [0] * minutes
    for _ in range(n):
        counts[rng.randrange(minutes)] += 1
    return counts, rng.choice(("http", "queue", "storage"))


def _poisson(rng: random.Random, lam: float) -> int:
    if lam > 30:   # normal approximation: Knuth's product loop is slow and underflows for big means
        return max(0, round(rng.gauss(lam, math.sqrt(lam))))
    limit, k, p = math.exp(-lam), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def generate(functions: int = 200, hours: float = 6.0, seed: int = 0, timer_share: float = 0.3,
             max_per_minute: float = 60.0) -> list[FunctionCounts]:
    """`functions` rows of per-minute counts over `hours` (module docstring for the shape)."""
    rng = random.Random(seed)
    minutes = max(1, round(hours * 60))
    out = []
    for _ in range(functions):
        rate = min(10 ** rng.gauss(-1.6, 1.4), max_per_minute)     # mean calls a minute
        if rate * minutes < 4:
            counts, trigger = _rare(rng, minutes, rate)
        elif rate <= 1 and rng.random() < timer_share:
            counts, trigger = _periodic(rng, minutes, rate)
        else:
            counts, trigger = _bursty(rng, minutes, rate)
        out.append(FunctionCounts(_hex(rng), _hex(rng), _hex(rng), trigger, 1, tuple(counts)))
    return out
