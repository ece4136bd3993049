"""The hybrid histogram policy of "Serverless in the Wild" (Shahrad et al., ATC'20), for model weights:
per model, a histogram of idle times between calls predicts the next one.

After each call, when the histogram is representative (enough idle times, most of them within its range,
and one clear pattern: the coefficient of variation of its bin counts above a threshold; fewer idle times
suffice for a concentrated pattern, `Hybrid.representative`), the model is
kept until its tail (99th percentile) plus a margin; when the idle times are also concentrated (head, the
5th percentile, and tail within two bins: a timer, whose per-minute counts put its idle times within a
minute either side of its period), it is unloaded after the call and pre-warmed at the head less a margin
instead. When the histogram is not representative, the model gets the platforms' fixed keep-alive. The
paper sends out-of-range patterns to a time-series forecast (ARIMA); here they get the fixed keep-alive
too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .timed import MINUTE_S, TimedPolicy


@dataclass
class IdleTimes:
    """Idle times between calls in bins of `unit_s`; those beyond the last bin counted apart."""
    bins: int
    unit_s: float
    counts: list[int] = field(default_factory=list)
    out_of_bounds: int = 0

    in_bounds: int = 0
    squares: int = 0      # sum of the squared counts: the CV in O(1) after each call

    def __post_init__(self):
        self.counts = self.counts or [0] * self.bins

    def add(self, idle_s: float) -> None:
        b = int(idle_s // self.unit_s)
        if b < self.bins:
            self.squares += 2 * self.counts[b] + 1
            self.counts[b] += 1
            self.in_bounds += 1
        else:
            self.out_of_bounds += 1

    def cv(self) -> float:
        """Coefficient of variation of the bin counts: high for one sharp peak, zero for a flat spread."""
        if self.in_bounds == 0:
            return 0.0
        mean = self.in_bounds / self.bins
        return math.sqrt(max(0.0, self.squares / self.bins - mean * mean)) / mean

    def percentile_s(self, pct: float, upper: bool) -> float:
        """The bin holding the `pct`th percentile, as its lower edge (a head: never late) or its upper
        edge (a tail: never early), in seconds."""
        target = pct / 100 * self.in_bounds
        seen = 0
        for b, c in enumerate(self.counts):
            seen += c
            if c and seen >= target:
                return (b + 1 if upper else b) * self.unit_s
        return self.bins * self.unit_s

    def mean_residual_s(self, age_s: float) -> float | None:
        """The expected idle time still to come once `age_s` has passed without a call: the mean of
        (idle - age) over the recorded idle times longer than `age_s`, each at its bin's middle (no earlier
        than `age_s`), those beyond the range at its end (a lower bound); None when none is longer."""
        total = weight = 0.0
        for b, c in enumerate(self.counts):
            if c and (b + 1) * self.unit_s > age_s:
                total += c * max(0.0, (b + 0.5) * self.unit_s - age_s)
                weight += c
        if self.out_of_bounds:
            total += self.out_of_bounds * max(0.0, self.bins * self.unit_s - age_s)
            weight += self.out_of_bounds
        return total / weight if weight else None

    def cheapest_keep_s(self, value_s: float) -> float:
        """The keep-alive T (0, or the upper edge of a bin holding idle times) that minimises the expected
        cost of one idle time X, E[min(X, T)] + value_s x P(X > T): memory-time per byte of the model
        while it waits, plus `value_s` (what a cold start is worth, in seconds of holding this model) for
        a call that comes after T. Idle times at their bin's middle, those beyond the range never
        reached; between two such edges the cost only grows (more waiting, no more calls caught)."""
        n = self.in_bounds + self.out_of_bounds
        if n == 0:
            return 0.0
        best_t, best_cost = 0.0, value_s   # T = 0: every next call is cold
        below = waited = 0.0               # idle times under T; their sum
        for b, c in enumerate(self.counts):
            if not c:
                continue
            below += c
            waited += c * (b + 0.5) * self.unit_s
            t = (b + 1) * self.unit_s
            cost = (waited + (n - below) * t + value_s * (n - below)) / n
            if cost < best_cost:
                best_t, best_cost = t, cost
        return best_t


class Hybrid(TimedPolicy):
    """Keep-alive and pre-warm windows learned per model from its idle times (module docstring).

    Parameters in minutes of the clock's time: bins of `unit_minutes` up to `range_minutes`
    (the paper's 1 minute and 4 hours), head and tail percentiles (5, 99), `margin` (10 %, the paper's),
    representative when at least `min_samples` idle times, at most `max_out_of_bounds` of them beyond
    the range and the CV above `cv_threshold`; otherwise `fallback_minutes` of fixed keep-alive.
    Pre-warmed (unloaded between calls) only when head and tail are at most `concentrated_bins` apart.
    """

    name = "hybrid"
    keep_alive_param = "fallback_minutes"   # what make_policy's keep_alive_s sets

    def __init__(self, clock, *, unit_minutes: float = 1.0, range_minutes: float = 240.0,
                 head_pct: float = 5.0, tail_pct: float = 99.0, margin: float = 0.10, min_samples: int = 5,
                 max_out_of_bounds: float = 0.5, cv_threshold: float = 2.0, fallback_minutes: float = 10.0,
                 concentrated_bins: int = 2, min_concentrated_samples: int = 3):
        super().__init__(clock)
        self.unit_s = unit_minutes * MINUTE_S
        self.bins = max(1, round(range_minutes / unit_minutes))
        self.head_pct, self.tail_pct, self.margin = head_pct, tail_pct, margin
        self.min_samples, self.max_out_of_bounds, self.cv_threshold = min_samples, max_out_of_bounds, cv_threshold
        self.fallback_s = fallback_minutes * MINUTE_S
        self.concentrated_s = concentrated_bins * self.unit_s
        self.min_concentrated_samples = min_concentrated_samples
        self.idle: dict[str, IdleTimes] = {}
        self._windows: dict[str, tuple[float, float] | None] = {}   # as of the last call
        self._keep_s: dict[str, float] = {}   # how long after its last call the window ends (tail or `keep_s`)
        self._sampled: dict[str, float] = {}   # when each model's last idle time was recorded
        self._first_call: dict[str, float] = {}
        self._calls: dict[str, int] = {}

    def observe_call(self, key, now):
        """Record the idle time since the previous call, at most one a bin's width while calls come closer
        together than that: the paper's histograms come from per-minute counts, where a busy minute is one
        observation, so a burst of a thousand calls must not drown the one long idle time after it."""
        self._first_call.setdefault(key, now)
        self._calls[key] = self._calls.get(key, 0) + 1
        previous = self.last_call.get(key)
        if previous is not None and (now - previous >= self.unit_s
                                     or now - self._sampled.get(key, -math.inf) >= self.unit_s):
            self.idle.setdefault(key, IdleTimes(self.bins, self.unit_s)).add(now - previous)
            self._sampled[key] = now
        self._windows[key] = self._learn(key)

    def representative(self, key: str) -> bool:
        """Enough idle times, most in range, one clear pattern. A concentrated one (a timer's) is trusted
        from `min_concentrated_samples` on, sooner than a spread one: k idle times of a pattern spread over
        m of the bins all fall within the same `concentrated_bins` with a chance of about
        m x (concentrated_bins / m)^k (under 2 % for k = 3 over 20 bins), and trusting one by mistake
        costs at most the one next call (which, early or late, spreads the pattern and ends the trust),
        while trusting a real timer at 3 rather than 5 idle times saves two of its calls' cold starts
        (a 60-minute timer was cold for its first five hours)."""
        h = self.idle.get(key)
        if h is None or h.out_of_bounds > self.max_out_of_bounds * (h.in_bounds + h.out_of_bounds):
            return False
        if h.in_bounds >= self.min_samples:
            return h.cv() > self.cv_threshold
        return h.in_bounds >= self.min_concentrated_samples and self.prewarms(self._percentiles(h))

    def windows(self, key: str) -> tuple[float, float] | None:
        """(head, tail) of `key`'s idle times in seconds, as of its last call; None while not representative."""
        return self._windows.get(key)

    def _percentiles(self, h: IdleTimes) -> tuple[float, float]:
        return h.percentile_s(self.head_pct, upper=False), h.percentile_s(self.tail_pct, upper=True)

    def _learn(self, key: str) -> tuple[float, float] | None:
        self._keep_s.pop(key, None)
        if not self.representative(key):
            return None
        w = self._percentiles(self.idle[key])
        self._keep_s[key] = w[1] if self.prewarms(w) else self.keep_s(key, w[1])
        return w

    def keep_s(self, key: str, tail: float) -> float:
        """How long a kept (not pre-warmed) model stays after its call: the paper's tail, whatever its size
        (SizedHybrid weighs it)."""
        return tail

    def prewarms(self, w: tuple[float, float]) -> bool:
        """Whether a model with windows `w` goes between calls and is pre-warmed at the head, rather than
        kept from its call until the tail: only when its idle times are concentrated. Unloading for the
        head saves head / (mean idle time) of the memory a kept model holds, at the risk of the calls
        that come before the head: for a timer nearly all of its memory for nearly no cold starts; for
        spread idle times (bursty calls) a few percent of its memory for at least the 5 % of calls below
        the 5th percentile, more while that percentile is the least of a handful of idle times (the next
        one falls below the least of n with probability 1/(n+1)). Measured: pre-warming spread patterns
        made a fifth (6-hour trace) to two fifths (24-hour) of hybrid's cold starts at full capacity: calls
        that came before the head."""
        head, tail = w
        return head > 0 and tail - head <= self.concentrated_s

    def plan(self, key, now):
        w = self.windows(key)
        if w is None:
            return None, self.fallback_s
        return (w[0] * (1 - self.margin) if self.prewarms(w) else None), self._keep_s[key] * (1 + self.margin)

    def idle_keep_s(self):
        return self.fallback_s

    def predicted_next_call(self, key):
        w, last = self.windows(key), self.last_call.get(key)
        return None if w is None or last is None else last + w[0]

    def time_to_next_call(self, key):
        """For a pre-warmed model (`prewarms`): before the pre-warm, until the head; from the pre-warm to
        the window's end, the histogram's mean idle time still to come, given how long it has been idle.
        Its call is due: ordered by how long it had been idle, a pre-warmed timer looked like a long-idle
        model and demand evicted it before its call (the commonest cold start of timers under pressure).
        Otherwise: how long it has been idle (LRU's guess), or its mean time between calls if that is
        longer (a model called every ten minutes, called a minute ago, is not expected sooner than one
        called every second, idle for two: GDSF's frequency, which is why GDSF beat LRU's order under
        pressure) — within its keep-alive window no later than the window's end. (The one-minute bins
        are too coarse for the seconds between a busy model's calls: the residual was worse there.)"""
        age, last, now = super().time_to_next_call(key), self.last_call.get(key), self.clock()
        if last is None:
            return age
        n = self._calls[key]
        expected = max(age, (last - self._first_call[key]) / (n - 1)) if n >= 2 else age
        w = self.windows(key)
        if w is None:
            return expected
        keep_until = last + self._keep_s[key] * (1 + self.margin)
        if self.prewarms(w):
            if now < last + w[0] * (1 - self.margin):
                return last + w[0] - now
            residual = self.idle[key].mean_residual_s(age) if now < keep_until else None
            return expected if residual is None else residual
        return min(keep_until - now, expected) if now < keep_until else expected

    def order(self, keys):
        """The most bytes held longest first: expected time to the next call x size (Belady's order made
        size-aware, as GDSF weighs size: FaasCache's point that keep-alive is caching)."""
        return sorted(keys, key=lambda k: (-self.time_to_next_call(k) * self.entries[k].size,
                                           self.entries[k].last_access, k))


class SizedHybrid(Hybrid):
    """`hybrid` whose kept models' windows weigh the model's size (selectable as `hybrid-sized`).

    The paper keeps every model to its 99th percentile whatever its size and however thin the tail. Here a
    kept model's window ends at the keep-alive that minimises memory-time plus cold starts
    (`IdleTimes.cheapest_keep_s`), never later than the tail, at one exchange rate for the tier: the
    fixed keep-alive's (`cold_start_value_s`). So a thin tail of a large model is let go, and the operator
    sets the rate with the same setting that sets the fixed keep-alive (`keep_alive_s`). It moves hybrid
    along the cold-start / memory-time front (fewer GiB*s, more cold starts: benchmarks/faas/README.md)
    rather than below it, which is why it is a choice and not the default.
    """

    name = "hybrid-sized"

    def __init__(self, clock, **options):
        super().__init__(clock, **options)
        self._sizes: dict[str, int] = {}       # every model's size as last loaded (the exchange rate's mean)
        self._size_total = 0

    def created(self, key, size):
        self._size_total += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        super().created(key, size)

    def cold_start_value_s(self, key: str) -> float:
        """What one cold start is worth, in seconds of holding `key`: the fixed keep-alive holds a model
        `fallback_s` for a chance at its next call, the ski-rental rule that rents until the rent equals
        the purchase; one exchange rate for the tier (the mean model's size x fallback), not one per model,
        since a cold start counts the same whichever model it is. A model twice the mean is worth keeping
        half as long for the same chance of a call; one a tenth of it, ten times as long."""
        size = self._sizes.get(key)
        if not size:
            return self.fallback_s
        return self.fallback_s * (self._size_total / len(self._sizes)) / size

    def keep_s(self, key: str, tail: float) -> float:
        return min(tail, self.idle[key].cheapest_keep_s(self.cold_start_value_s(key)))
